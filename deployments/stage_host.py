"""What the draft-pool and verifier replicas share: frame decoding, one stage call at a time, busy log.

Frames are decoded with the cluster's ``WireLimits`` before anything touches a model; a malformed,
oversized or out-of-range frame raises ``WireError`` to the caller and the replica carries on. Model
work runs in a worker thread (never on the replica's event loop, so health checks and releases stay
responsive) under one lock, since a runner's KV pool is not re-entrant.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from ray import serve

from cluster import wire


class StageHost:
    def _init_host(self, limits: wire.WireLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self._busy: deque = deque(maxlen=20000)  # (start, end) wall-clock seconds of each stage call
        self.calls = 0

    async def _run(self, fn, *args):
        return await asyncio.to_thread(self._locked, fn, *args)

    def _locked(self, fn, *args):
        with self._lock:
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

    def busy_intervals(self, since: float = 0.0) -> list[tuple[float, float]]:
        """Wall-clock intervals this replica spent in stage calls (for the overlap benchmark)."""
        return [iv for iv in list(self._busy) if iv[1] >= since]
