"""Stage workers: plain Ray actors that run one stage (a draft proposer or a verify stage) for the router's
compiled step loop (``deployments.transport``).

Ray Compiled Graphs bind actor methods, not Serve replicas, so a replica that takes part in the compiled
transport owns one worker (pinned to the replica's node, see ``start_worker``) under a name the router
discovers (``deployments.transport.directory``); Serve stays the control plane (replicas, autoscaling,
placement, health).

One method, ``call``, serves every operation (``runtime.wire.serve_call``: its first byte names it) so that
one compiled graph per worker carries them all; nothing of the project's is pickled on the way. A compiled
graph runs its method on a background thread of the actor, one call at a time in submission order; calls
its owning replica forwards (Serve-handle callers) run on the actor's main thread, so one lock keeps the
stage to one call at a time, which is what a runner's KV pool needs (it is not re-entrant).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Callable

import ray

from deployments.metrics import KVGauges
from deployments.replica_process import use_threads
from runtime import wire


class BusyLog:
    """The stage calls a process ran: how many, for how long, and their latest (start, end) wall-clock
    intervals (for the overlap benchmark)."""

    def __init__(self, keep: int = 20000):
        self.calls = 0
        self.seconds = 0.0
        self._intervals: deque = deque(maxlen=keep)

    def add(self, start: float, end: float) -> None:
        self.calls += 1
        self.seconds += end - start
        self._intervals.append((start, end))

    def since(self, t: float) -> list[tuple[float, float]]:
        return [iv for iv in list(self._intervals) if iv[1] >= t]


def stage_roles(stage) -> dict:
    """``runtime.wire.serve_call``'s keywords for a stage: what it can do, it serves."""
    return {role: stage for role, method in (("proposer", "propose"), ("verifier", "verify")) if hasattr(stage, method)}


class StageWorker:
    """Runs ``proposer.propose`` / ``stage.verify`` / ``release`` for frames sent by the router."""

    def __init__(self, make_stage: Callable[[], object], limits: wire.WireLimits, slot_gauge: str | None = None):
        self.stage = make_stage()
        self.serves = stage_roles(self.stage)
        self.limits = limits
        self.busy = BusyLog()
        self._lock = threading.Lock()
        self._runner = getattr(self.stage, "runner", None)
        self._slots = KVGauges(slot_gauge) if slot_gauge is not None and self._runner is not None else None

    def call(self, frame: bytes) -> bytes:
        with self._lock:
            use_threads()  # a compiled graph calls from a thread of its own, with torch's default thread count
            start = time.time()
            try:
                return wire.serve_call(frame, self.limits, **self.serves)
            finally:
                self.busy.add(start, time.time())
                if self._slots is not None:
                    self._slots.update(self._runner)

    def ping(self) -> bool:
        return True

    def busy_intervals(self, since: float = 0.0) -> list[tuple[float, float]]:
        return self.busy.since(since)

    def stats(self) -> dict:
        return stage_stats(self.stage, self.busy.calls)


def stage_stats(stage, calls: int) -> dict:
    """What a stage process reports to ``/debug/kv``: its calls, KV slots and sequences, and a tensor-parallel
    group's ranks (``health`` asks them, so this may block; a group being rebuilt says so instead)."""
    runner = getattr(stage, "runner", None)
    health = getattr(stage, "health", None)
    return {"pid": os.getpid(), "calls": calls, "slots_in_use": runner.slots_in_use if runner is not None else 0,
            "sequences": len(runner.seqs) if runner is not None else len(getattr(stage, "histories", {})),
            "group": health(rebuilding_ok=True) if health is not None else None}


def start_worker(make_stage: Callable[[], object], limits: wire.WireLimits, *, name: str | None = None,
                 namespace: str | None = None, node_id: str | None = None, num_gpus: float = 0,
                 runtime_env: dict | None = None, slot_gauge: str | None = None):
    """A ``StageWorker`` actor. A replica passes its own ``node_id`` (the worker is pinned there, beside it)
    and a ``name`` the router discovers it by (``deployments.transport.directory``). ``num_cpus=0``: the
    replica already holds the stage's share of the node and the worker does the model work in its place.
    It is not restarted by Ray and dies with its owner: the replica's replacement starts a new one."""
    options: dict = {"num_cpus": 0, "num_gpus": num_gpus, "max_restarts": 0}
    if name is not None:
        options.update(name=name, namespace=namespace)
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return ray.remote(StageWorker).options(**options).remote(make_stage, limits, slot_gauge)
