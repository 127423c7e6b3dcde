"""The verifier deployment: one replica per data-parallel verifier group, hosting the target.

With ``tensor_parallel`` 1 the replica runs the verify stage itself; with more, it drives a
``VerifierGroup`` of tensor-parallel rank actors as one logical verifier. With draft placement
``colocated`` the replica also hosts the draft proposer and serves ``propose``, so batch-1 latency pays
no draft hop at all. Micro-batch shard keys (Serve multiplexing) keep a sequence on one group, whose
KV cache holds it; a group that restarted answers ``resync`` and the router re-prefills it.
"""

from __future__ import annotations

import asyncio

from ray import serve

from cluster.config import ClusterConfig
from deployments.replica_process import start_replica
from deployments.settings import engine_settings, wire_limits
from deployments.stage_host import StageHost
from deployments.verifier_group import VerifierGroup
from engine.assembly import EngineSettings, make_proposer, make_verify_stage


def build_verify_stage(cfg: ClusterConfig, settings: EngineSettings | None = None):
    """The verify stage of one replica: the target itself, or a group of tensor-parallel ranks it drives.
    ``settings``: ``engine_settings(cfg)``, when the caller has them already."""
    settings = settings or engine_settings(cfg)
    if cfg.target.tensor_parallel > 1:
        return VerifierGroup.from_config(settings, cfg)
    return make_verify_stage(settings)


@serve.deployment(name="Verifier")
class Verifier(StageHost):
    def __init__(self, cfg: ClusterConfig, generation: str):
        role = "verifier" if cfg.target.tensor_parallel == 1 else "verifier (group driver)"
        start_replica(cfg, role)
        self._init_host(wire_limits(cfg))
        self.stage = None
        self.probe_timeout_s = cfg.router.probe_timeout_s
        if "verifier" in cfg.worker_stages:  # with tensor parallelism the ranks, not the worker, hold GPUs
            self._start_worker(cfg, "verifier", role, build_verify_stage, generation=generation,
                               threads=cfg.verifier.num_threads,
                               num_gpus=cfg.verifier.num_gpus if cfg.target.tensor_parallel == 1 else 0,
                               slot_gauge="target")
            return
        settings = engine_settings(cfg)
        self.stage = build_verify_stage(cfg, settings)
        colocated = cfg.draft_pool.placement == "colocated" and settings.draft is not None
        self._host("target", verifier=self.stage, **({"proposer": make_proposer(settings)} if colocated else {}))

    def __del__(self):
        shutdown = getattr(getattr(self, "stage", None), "shutdown", None)
        if shutdown is not None:
            shutdown()  # rank actors and their process group go with the replica

    async def ping(self) -> bool:
        """The router's liveness probe. A tensor-parallel group's ranks answer it too: a rank whose host is
        lost makes the verifier down within one probe, where Ray would take tens of seconds to declare the
        rank dead (and the surviving ranks' all-reduce waits that long)."""
        if isinstance(self.stage, VerifierGroup):
            await asyncio.to_thread(self.stage.health, self.probe_timeout_s)
        return True

    def check_health(self) -> None:
        if isinstance(self.stage, VerifierGroup):
            # A group raises when a rank is gone and no rebuild is under way (Serve then restarts us); the
            # router's probe (``ping``) still sees a rebuilding group as down.
            self.stage.health(rebuilding_ok=True)
