"""Setting up a model-running replica process before its model loads: memory check, threads, allocator.

``start_replica`` is the first thing the verifier, draft-pool and tensor-parallel rank processes do:

1. Its share of the memory plan (``cluster.memory_plan``) is checked against this node — host memory it
   can still get, or its fraction of the GPU — and a replica that cannot fit refuses to start, with the
   plan in the message, instead of failing late in an allocation. (``build_app`` has checked the whole
   app against a local node already; on a multi-node cluster this is the check.)
2. Its thread count (``cluster.threads``) is checked against this node's cores and applied: torch's
   intra-op threads, one inter-op thread (nothing here runs inter-op parallel work), and
   ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` for anything that reads them later.
3. glibc's mmap threshold is fixed at 1 MiB. By default glibc raises it after every large free (up to
   32 MiB), after which the large temporaries of a prefill step come from the heap and stay resident after
   the step, beyond the plan. Fixed, blocks of 1 MiB and more are returned to the system when freed and the
   process's memory follows the plan (within 11 % in tests/unit/test_memory_plan.py). 1 MiB: lower
   thresholds fault in decode activations page by page (docs/measurements.md#replica-process).
4. The process runs at ``MODEL_NICENESS``: model work saturates the cores by design, and on a node it shares
   with the HTTP ingress, health checks and Ray's own processes, those must still answer at once
   (docs/measurements.md#replica-process). With idle cores it changes nothing.

No ray import: the in-process memory test sets a process up the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

from cluster.config import ClusterConfig
from cluster.memory_plan import GiB, PlanError, draft_device, plan, target_device
from cluster.node import cpu_cores, memory_available
from cluster.threads import replica_threads


MMAP_THRESHOLD = 1 << 20
MODEL_NICENESS = 5
_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
_configured_threads: int | None = None  # set by configure_process
_local = threading.local()  # the thread count this OS thread last applied


def start_replica(cfg: ClusterConfig, role: str) -> int:
    """Check and set up this process for a replica of ``role`` (a memory-plan role: "verifier", "draft pool",
    "router (local stages)", ...); returns its thread count. Raises ``ConfigError`` (threads) or
    ``PlanError`` (memory)."""
    full = plan(cfg)
    threads = replica_threads(cfg, role, cpu_cores(), full)
    replica = next((r for r in full.replicas if r.role == role), None)
    if replica is not None:
        on_gpu = (draft_device(cfg) if role == "draft pool" else target_device(cfg)) == "cuda"
        check_memory(role, replica.model_bytes, replica.gpu_share, on_gpu, full.report())
    configure_process(threads)
    lower_priority(MODEL_NICENESS)
    return threads


def lower_priority(niceness: int) -> None:
    """Raise every thread of this process to at least ``niceness`` (Linux nices threads, not processes; a
    thread started later inherits its creator's)."""
    for tid in (int(t) for t in os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else ():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def check_memory(role: str, needed: int, gpu_share: float, on_gpu: bool, report: str) -> None:
    """Raise ``PlanError`` when ``needed`` bytes do not fit this node's free memory or the GPU share."""
    if on_gpu:
        if not torch.cuda.is_available():
            return  # building the model will say that there is no GPU
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        room, what = int(gpu_share * total), f"its share ({gpu_share:g}) of the GPU holds"
    else:
        room, what = memory_available(), "this node has available"
    if room is not None and needed > room:
        raise PlanError(f"this {role} replica needs {needed / GiB:.2f} GiB for its model and {what} "
                        f"{room / GiB:.2f} GiB.\n\n{report}")


def configure_process(threads: int) -> None:
    """Threads and allocator for model work in this process (see the module docstring)."""
    global _configured_threads
    fix_mmap_threshold()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op work; nothing here uses that pool
        pass
    _configured_threads = threads
    _local.threads = threads


def use_threads() -> None:
    """Call in a thread about to run model work: torch's thread count is per OS thread once it has run
    parallel work, so a worker thread that did so before ``configure_process`` would keep the old one."""
    if _configured_threads is not None and getattr(_local, "threads", None) != _configured_threads:
        torch.set_num_threads(_configured_threads)
        _local.threads = _configured_threads


def model_process_env(threads: int | str) -> dict[str, str]:
    """Environment variables a model-running process must start with: OpenMP reads them once, when torch
    loads it, so they go into the replica's (or rank's) Ray runtime_env rather than being set here later.

    - ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads that finish early sleep instead of spinning. A spinning
      thread holds a core another process needs (the draft, the router, anything else on the node), and the
      thread it waits for cannot run, and decoding collapses (docs/measurements.md#replica-process).
    - ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``: Ray exports floor(num_cpus) to a worker it starts; a
      configured integer replaces it from the start ('auto' depends on the node: ``configure_process``).
    """
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    if threads != "auto":
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def thread_info() -> dict:
    return {"torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold (no-op, False, without glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
