"""What the draft-pool and verifier replicas share: frame decoding, one stage call at a time, busy log.

Frames are decoded with the cluster's ``WireLimits`` before anything touches a model; a malformed,
oversized or out-of-range frame raises ``WireError`` to the caller and the replica carries on. Model
work runs on one dedicated thread (never on the replica's event loop, so health checks and releases stay
responsive), one call at a time in submission order, since a runner's KV pool is not re-entrant. One
thread also means one OpenMP team: torch's intra-op threads belong to the thread that starts parallel
work, and with a pool of threads taking turns each would keep its own team spinning beside the others.

In worker mode (``ClusterConfig.worker_stages``: ``router.transport`` 'compiled') the replica
holds no model: it starts a ``StageWorker`` on its own node, under the name the router's
``WorkerDirectory`` finds it by, waits until the worker's model is loaded, and forwards the frames of
Serve-handle calls (the router's fallback, the fidelity monitor) to it as they came. The worker dies with
the replica (Ray ends an actor with its owner), and the replica exits when its worker dies, so Serve
replaces both together and handle calls wait for the replacement instead of failing on a dead worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import ray
from ray import serve
from ray.exceptions import RayActorError

from cluster.config import ClusterConfig
from runtime import wire
from deployments.metrics import KVGauges
from deployments.replica_process import model_process_env, start_replica, thread_info, use_threads
from deployments.stage_workers import BusyLog, stage_stats, start_worker
from deployments.transport.directory import app_key, worker_name

log = logging.getLogger("specserve.stage_host")

WATCH_INTERVAL_S = 0.5  # how often a replica in worker mode checks that its worker is alive


def _worker_stage(cfg: ClusterConfig, role: str, build: Callable[[ClusterConfig], object]):
    """Runs in the worker's process: set it up as the replica would be, then build the stage."""
    start_replica(cfg, role)
    return build(cfg)


class StageHost:
    def _init_host(self, limits: wire.WireLimits):
        self.limits = limits
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-model")
        self.busy = BusyLog()
        self.worker = None
        self.serves: dict = {}  # runtime.wire.serve_call's stages, when this replica runs them itself
        self._slots: tuple | None = None  # (KVGauges, runner) of the model whose KV slots this replica reports

    def _host(self, slot_gauge: str, **serves) -> None:
        """Run ``serves`` (``proposer=`` / ``verifier=``) in this replica, reporting the first model's slots."""
        self.serves = serves
        runner = next((getattr(s, "runner", None) for s in serves.values() if getattr(s, "runner", None)), None)
        self._slots = (KVGauges(slot_gauge), runner) if runner is not None else None

    async def call(self, frame: bytes) -> bytes:
        """One stage call (``runtime.wire.serve_call``), run by this replica's model thread or passed to its
        worker as it came."""
        await self._affinity()
        if self.worker is not None:
            return await self.worker.call.remote(frame)
        return await self._run(self._serve, frame)

    def _serve(self, frame: bytes) -> bytes:
        try:
            return wire.serve_call(frame, self.limits, **self.serves)
        finally:
            if self._slots is not None:
                gauge, runner = self._slots
                gauge.update(runner)

    def _start_worker(self, cfg: ClusterConfig, stage: str, role: str, build: Callable[[ClusterConfig], object],
                      *, generation: str, threads: int | str, num_gpus: float, slot_gauge: str) -> None:
        """Worker mode: ``build(cfg)`` runs in a ``StageWorker`` beside this replica (see the module doc),
        named for this app's ``generation`` (``deployments.transport.directory.app_key``)."""
        ctx, here = serve.get_replica_context(), ray.get_runtime_context()
        self.worker = start_worker(
            functools.partial(_worker_stage, cfg, role, build), self.limits,
            name=worker_name(app_key(ctx.app_name, generation), stage, ctx.replica_id.unique_id),
            namespace=here.namespace,
            node_id=here.get_node_id(), num_gpus=num_gpus, runtime_env={"env_vars": model_process_env(threads)},
            slot_gauge=slot_gauge)
        ray.get(self.worker.ping.remote())  # its model is loaded before this replica counts as started
        threading.Thread(target=self._watch_worker, name="specserve-worker-watch", daemon=True).start()

    def _watch_worker(self) -> None:
        while True:
            try:
                ray.get(self.worker.ping.remote())
            except RayActorError as exc:
                log.error("the stage worker died (%s); this replica exits so Serve replaces both", exc)
                os._exit(1)
            time.sleep(WATCH_INTERVAL_S)

    async def stats(self) -> dict:
        name = ray.get_runtime_context().get_actor_name()
        if self.worker is not None:
            return {"actor_name": name, **await self.worker.stats.remote()}
        stage = self.serves.get("verifier", self.serves.get("proposer"))
        return {"actor_name": name, **await asyncio.to_thread(stage_stats, stage, self.busy.calls)}

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, self._timed, fn, *args)

    def _timed(self, fn, *args):
        use_threads()
        start = time.time()
        try:
            return fn(*args)
        finally:
            self.busy.add(start, time.time())

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

    async def busy_intervals(self, since: float = 0.0) -> list[tuple[float, float]]:
        """Wall-clock intervals this replica (or its worker) spent in stage calls (the overlap benchmark)."""
        if self.worker is not None:
            return await self.worker.busy_intervals.remote(since)
        return self.busy.since(since)
