"""The router's side of the stage calls: how a step's frames reach the draft pool and the verifier.

``StageClient`` (``client``) is the engine's ``Stages``: one call per stage per micro-batch, over the link
each stage's route picks (``routes``): a Serve handle keyed by the micro-batch's shard (``HandleLink``), or
a compiled-graph channel to a stage replica's worker (``WorkerLink``), with the handles as the fallback of a
stage that has no worker. ``directory`` keeps the workers' membership. The replica side (``stage_host``,
``stage_workers``, ``verifier_group``) answers the same calls with ``runtime.wire.serve_call``.

This package imports nothing else of ``deployments`` (``pyproject.toml``'s import contracts): the replica side
may use its links, never the other way round.
"""
