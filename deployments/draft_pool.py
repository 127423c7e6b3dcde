"""The draft pool: N replicas, each a draft model (or n-gram table) with per-sequence draft KV caches.

Replicas are interchangeable caches: a sequence is drafted wherever its micro-batch's shard key routes
(Serve multiplexing keeps a key on one replica while it lives), and a replica that has never seen a
sequence, or lost it, answers ``resync`` and is sent the whole history. So scaling down or losing a
replica drops no request; its sequences are re-prefilled elsewhere. Placement (GPU fraction,
``accelerator_type``, custom resources) comes from ``draft_pool`` in the config via ``ray_actor_options``.
"""

from __future__ import annotations

from ray import serve

from cluster.config import ClusterConfig
from cluster.memory_plan import draft_slots
from deployments.replica_process import start_replica
from deployments.settings import engine_settings, wire_limits
from deployments.stage_host import StageHost
from engine.assembly import make_proposer

ROLE = "draft pool"


def build_proposer(cfg: ClusterConfig):
    return make_proposer(engine_settings(cfg, max_slots=draft_slots(cfg)))


@serve.deployment(name="DraftPool")
class DraftPool(StageHost):
    def __init__(self, cfg: ClusterConfig, generation: str):
        start_replica(cfg, ROLE)
        self._init_host(wire_limits(cfg))
        if "draft" in cfg.worker_stages:
            self._start_worker(cfg, "draft", ROLE, build_proposer, generation=generation,
                               threads=cfg.draft_pool.num_threads,
                               num_gpus=cfg.draft_pool.num_gpus, slot_gauge="draft")
        else:
            self._host("draft", proposer=build_proposer(cfg))
