"""How many torch CPU threads a replica runs with: ``verifier.num_threads`` / ``draft_pool.num_threads``.

Ray exports ``OMP_NUM_THREADS = max(1, floor(num_cpus))`` to every worker it starts, so a replica that
reserves 0.25 CPU would run its model on one thread: a CPU-served target then steps about twice as slowly
as the same model in-process on two cores. Threads are therefore their own setting, resolved here and
applied inside each replica before its model loads (``deployments/replica_process.py``).

'auto' on a CPU device gives a replica the cores its models need: one thread per
``WEIGHT_BYTES_PER_THREAD`` of weights it reads per step (at least one), at most the node's cores divided
among the tensor-parallel ranks of a group that share the node. A small model's products are too short to
pay for waking other threads, a large one's gain from them (docs/measurements.md#threads). On a GPU, where
the CPU only feeds the device, 'auto' is Ray's ``floor(num_cpus)``.

The verifier defaults to 'auto' and the draft to 1: at batch 1 they take turns (draft, then verify), so a
verifier on all cores costs the draft little. With several micro-batches both compute at once and a node
whose threads outnumber its cores is oversubscribed; ``build_app`` logs that
(docs/configuration.md, CPU threads).

No torch or ray import.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cluster.config import ConfigError
from cluster.memory_plan import LOCAL_ROUTER, MiB, draft_device, target_device

if TYPE_CHECKING:
    from cluster.config import ClusterConfig
    from cluster.memory_plan import MemoryPlan

WEIGHT_BYTES_PER_THREAD = 256 * MiB
DRAFT_ROLE = "draft pool"


def resolve_threads(setting: int | str, *, cores: int, on_gpu: bool, num_cpus: float, where: str,
                    sharing: int = 1, weight_bytes: int | None = None) -> int:
    """Threads for one replica on a node with ``cores`` cores, ``sharing`` replicas of its kind sharing the
    node, holding ``weight_bytes`` of weights (None: not known, 'auto' takes the whole share)."""
    if setting == "auto":
        if on_gpu:
            return max(1, math.floor(num_cpus))
        share = max(1, cores // sharing)
        if weight_bytes is None:
            return share
        return max(1, min(share, weight_bytes // WEIGHT_BYTES_PER_THREAD))
    if setting > cores:
        raise ConfigError(
            f"{where} ({setting}) is more than the {cores} CPU cores this node offers (its affinity mask and "
            "cgroup quota); more threads than cores only makes every step wait for descheduled threads. Use "
            f"at most {cores}, or 'auto'")
    return setting


def replica_threads(cfg: "ClusterConfig", role: str, cores: int, app_plan: "MemoryPlan | None") -> int:
    """Threads of one replica of ``role`` (a memory-plan role: "verifier", "verifier rank", "draft pool", ...),
    sized by its weights in ``app_plan`` when there is one."""
    replica = next((r for r in app_plan.replicas if r.role == role), None) if app_plan is not None else None
    weight_bytes = replica.weights + replica.packed_copy if replica is not None and replica.models else None
    if role == DRAFT_ROLE:
        pool = cfg.draft_pool
        return resolve_threads(pool.num_threads, cores=cores, on_gpu=draft_device(cfg) == "cuda",
                               num_cpus=pool.num_cpus, where="draft_pool.num_threads", weight_bytes=weight_bytes)
    v, tp = cfg.verifier, cfg.target.tensor_parallel
    sharing = tp if v.placement_strategy in ("STRICT_PACK", "PACK") else 1
    return resolve_threads(v.num_threads, cores=cores, on_gpu=target_device(cfg) == "cuda", num_cpus=v.num_cpus,
                           where="verifier.num_threads", sharing=sharing, weight_bytes=weight_bytes)


def node_threads(cfg: "ClusterConfig", cores: int, app_plan: "MemoryPlan | None") -> dict[str, int]:
    """Threads each model-running replica kind would start on a single node of ``cores`` cores (the local
    case), keyed by plan role, each already checked against ``cores``."""
    if cfg.router.stages == "local":
        roles = [LOCAL_ROUTER]
    else:
        roles = ["verifier" if cfg.target.tensor_parallel == 1 else "verifier rank"]
        if cfg.draft.kind == "model" and cfg.draft_pool.placement != "colocated":
            roles.append(DRAFT_ROLE)
    return {role: replica_threads(cfg, role, cores, app_plan) for role in roles}
