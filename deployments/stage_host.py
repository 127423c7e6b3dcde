"""What the draft-pool and verifier replicas share: frame decoding, one stage call at a time, busy log.

Frames are decoded with the cluster's ``WireLimits`` before anything touches a model; a malformed,
oversized or out-of-range frame raises ``WireError`` to the caller and the replica carries on. Model
work runs on one dedicated thread (never on the replica's event loop, so health checks and releases stay
responsive), one call at a time in submission order, since a runner's KV pool is not re-entrant. One
thread also means one OpenMP team: torch's intra-op threads belong to the thread that starts parallel
work, and with a pool of threads taking turns each would keep its own team spinning beside the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from runtime import wire
from deployments.replica_process import thread_info, use_threads


class StageHost:
    def _init_host(self, limits: wire.WireLimits):
        self.limits = limits
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-model")
        self._busy: deque = deque(maxlen=20000)  # (start, end) wall-clock seconds of each stage call
        self.calls = 0

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, self._timed, fn, *args)

    def _timed(self, fn, *args):
        use_threads()
        start = time.time()
        try:
            return fn(*args)
        finally:
            self._busy.append((start, time.time()))
            self.calls += 1

    @serve.multiplexed(max_num_models_per_replica=1024)
    async def _shard(self, shard: str) -> str:
        return shard  # nothing to load: the key only makes Serve route the micro-batch back here

    async def _affinity(self) -> None:
        """Register the caller's shard key with Serve's multiplexing (a keyless call is just served)."""
        shard = serve.get_multiplexed_model_id()
        if shard:
            await self._shard(shard)

    async def threads(self) -> dict:
        """torch's thread count where model work runs, and OMP_NUM_THREADS (what the config asked for)."""
        return await self._run(thread_info)

    async def ping(self) -> bool:
        """The router's liveness probe: answered on the event loop, so never queued behind model work."""
        return True

    def busy_intervals(self, since: float = 0.0) -> list[tuple[float, float]]:
        """Wall-clock intervals this replica spent in stage calls (for the overlap benchmark)."""
        return [iv for iv in list(self._busy) if iv[1] >= since]
