"""What this machine offers a replica: CPU cores and memory, as a container limits them.

``os.cpu_count()`` and ``/proc/meminfo`` describe the host, not a container: a pod limited to 2 CPUs on a
64-core node must not start 64 threads, and one limited to 8 GiB must not plan for the node's 512 GiB. So
both read the process's CPU affinity and its cgroup (v2, else v1) limits as well and take the smaller.

No torch or ray import: the CLI and config tooling call this.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def cpu_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def _cgroup_cpu_quota() -> float | None:
    """CPUs a cgroup's quota allows (``cpu.max`` in v2, ``cfs_quota_us / cfs_period_us`` in v1), or None."""
    try:
        quota, period = (_CGROUP / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((_CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((_CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def memory_available() -> int | None:
    """Bytes a new allocation can still get: ``MemAvailable``, capped by the cgroup's limit minus its usage.

    None where neither can be read (not Linux).
    """
    available = _meminfo_available()
    limit, usage = _cgroup_memory()
    if limit is not None and usage is not None:
        room = max(0, limit - usage)
        available = room if available is None else min(available, room)
    return available


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, working set) of this process's memory cgroup; (None, None) when unlimited or unreadable.

    The working set leaves out inactive page cache, which the kernel reclaims before it would kill anything
    (the figure the kubelet evicts by)."""
    for limit_file, usage_file, stat_file, inactive_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        try:
            raw = (_CGROUP / limit_file).read_text().strip()
            usage = int((_CGROUP / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 1 << 60:  # v1 writes "unlimited" as a huge number
            return None, None
        try:
            stat = dict(line.split() for line in (_CGROUP / stat_file).read_text().splitlines())
            usage -= int(stat.get(inactive_key, 0))
        except (OSError, ValueError):
            pass
        return int(raw), max(0, usage)
    return None, None
