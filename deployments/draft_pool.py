"""The draft pool: N replicas, each a draft model (or n-gram table) with per-sequence draft KV caches.

Replicas are interchangeable caches: a sequence is drafted wherever its micro-batch's shard key routes
(Serve multiplexing keeps a key on one replica while it lives), and a replica that has never seen a
sequence, or lost it, answers ``resync`` and is sent the whole history. So scaling down or losing a
replica drops no request; its sequences are re-prefilled elsewhere. Placement (GPU fraction,
``accelerator_type``, custom resources) comes from ``draft_pool`` in the config via ``ray_actor_options``.
"""

from __future__ import annotations

import ray
from ray import serve

from runtime import wire
from cluster.config import ClusterConfig
from cluster.memory_plan import draft_slots
from deployments.metrics import SlotGauge
from deployments.replica_process import start_replica
from deployments.settings import engine_settings, wire_limits
from deployments.stage_host import StageHost
from deployments.stage_workers import OP_PROPOSE, OP_RELEASE
from engine.assembly import make_proposer

ROLE = "draft pool"


def build_proposer(cfg: ClusterConfig):
    return make_proposer(engine_settings(cfg, max_slots=draft_slots(cfg)))


@serve.deployment(name="DraftPool")
class DraftPool(StageHost):
    def __init__(self, cfg: ClusterConfig, generation: str):
        start_replica(cfg, ROLE)
        self._init_host(wire_limits(cfg))
        self.proposer = self._slots = None
        if "draft" in cfg.worker_stages:
            self._start_worker(cfg, "draft", ROLE, build_proposer, generation=generation,
                               threads=cfg.draft_pool.num_threads,
                               num_gpus=cfg.draft_pool.num_gpus, slot_gauge="draft")
            return
        self.proposer = build_proposer(cfg)
        if getattr(self.proposer, "runner", None) is not None:
            self._slots = SlotGauge("draft")

    async def propose(self, frame: bytes) -> bytes:
        await self._affinity()
        if self.worker is not None:
            return await self._forward(OP_PROPOSE, frame)
        items = wire.decode_propose(frame, self.limits)
        batch = await self._run(self.proposer.propose, items)
        if self._slots is not None:
            self._slots.set(self.proposer.runner.pool.slots_in_use, self.proposer.runner.pool.num_slots)
        return wire.encode_proposal(batch)

    async def release(self, frame: bytes) -> None:
        if self.worker is not None:
            await self._forward(OP_RELEASE, frame)
            return
        release = wire.decode_release(frame, self.limits)
        await self._run(self.proposer.release, list(release.seq_ids))

    async def stats(self) -> dict:
        if self.worker is not None:
            return await self._worker_stats()
        runner = getattr(self.proposer, "runner", None)
        return {"actor_name": ray.get_runtime_context().get_actor_name(), "calls": self.busy.calls,
                "slots_in_use": runner.pool.slots_in_use if runner else 0,
                "sequences": len(runner.seqs) if runner else len(getattr(self.proposer, "histories", {}))}
