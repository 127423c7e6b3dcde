"""``router.stages: local``: the target and the draft run inside the router replica.

With remote stages every step is one Serve call to the draft pool and one to the verifier. On this
project's 2-core CPU VM such a call cost ~5 ms against ~8 ms for the embedded target's whole step, so the
served path decoded at half the speed of the same engine in-process, speculation or not
(scripts/bench_served.py). With local stages the router's step loop drives the engine the CLI and the
benchmarks use (``engine.assembly.make_engine``: both models and their KV caches in this process), and the
only hops left are per request (HTTP → ingress → router).

The router replica is set up as a verifier replica would be (``deployments.replica_process``: memory
check, ``verifier.num_threads``), before the models load; its step thread, started afterwards, inherits the
thread count.
"""

from __future__ import annotations

import functools

from cluster.config import ClusterConfig
from cluster.memory_plan import LOCAL_ROUTER
from deployments.replica_process import start_replica
from engine.engine import Engine
from engine.assembly import EngineSettings, make_engine
from runtime.models import has_tokenizer, load_tokenizer


def local_engine_factory(args: dict):
    """The ``engine_factory`` the router calls with its ``EngineSettings`` (picklable for Serve's bind)."""
    return functools.partial(_local_engine, args)


def _local_engine(args: dict, settings: EngineSettings) -> Engine:
    cfg = ClusterConfig.from_dict(args)
    start_replica(cfg, LOCAL_ROUTER)
    tokenizer = load_tokenizer(cfg.target.path) if has_tokenizer(cfg.target.path) else None
    eos = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []

    def detokenize(ids) -> str:  # as the router's own: no tokenizer, no text
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

    return make_engine(settings, eos_token_ids=eos, detokenize=detokenize)
