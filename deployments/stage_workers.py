"""Stage workers: plain Ray actors that run one stage (a draft proposer or a verify stage) for the router's
compiled step loop (``deployments.channel_stages``).

Ray Compiled Graphs bind actor methods, not Serve replicas, so a replica that takes part in the compiled
transport owns one worker (created in the replica's placement group, see ``start_worker``) and registers
its handle with the router; Serve stays the control plane (replicas, autoscaling, placement, health).

One method, ``call``, serves every operation so that one compiled graph per worker carries them all: the
first byte of the frame names the operation (``OP_PROPOSE``, ``OP_VERIFY``, ``OP_RELEASE``), the rest is
the ``runtime.wire`` msgpack frame, decoded with the cluster's ``WireLimits`` before any model sees it.
Replies are msgpack frames too; nothing of the project's is pickled on the way. A compiled graph runs
its method on one actor thread, one call at a time in submission order, which is what a runner's KV pool
needs (it is not re-entrant).
"""

from __future__ import annotations

import time
from typing import Callable

import ray

from runtime import wire

OP_PROPOSE, OP_VERIFY, OP_RELEASE = b"p", b"v", b"r"


class StageWorker:
    """Runs ``proposer.propose`` / ``stage.verify`` / ``release`` for frames sent by the router."""

    def __init__(self, make_stage: Callable[[], object], limits: wire.WireLimits):
        self.stage = make_stage()
        self.limits = limits
        self.calls = 0
        self.busy_seconds = 0.0

    def call(self, frame: bytes) -> bytes:
        op, body = frame[:1], frame[1:]
        start = time.perf_counter()
        try:
            if op == OP_PROPOSE:
                return wire.encode_proposal(self.stage.propose(wire.decode_propose(body, self.limits)))
            if op == OP_VERIFY:
                items, proposal = wire.decode_verify(body, self.limits)
                return wire.encode_outcome(self.stage.verify(items, proposal))
            if op == OP_RELEASE:
                self.stage.release(list(wire.decode_release(body, self.limits).seq_ids))
                return b""
            raise wire.WireError(f"unknown stage operation {op!r}")
        finally:
            self.calls += 1
            self.busy_seconds += time.perf_counter() - start

    def ping(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"calls": self.calls, "busy_seconds": self.busy_seconds}


def start_worker(make_stage: Callable[[], object], limits: wire.WireLimits, *, name: str | None = None,
                 placement_group=None, num_cpus: float = 0, num_gpus: float = 0, runtime_env: dict | None = None):
    """A ``StageWorker`` actor; inside a replica pass ``ray.util.get_current_placement_group()`` so the worker
    lands beside (and goes with) the replica that owns it. ``num_cpus=0``: the replica already holds the
    stage's share of the node; the worker does the model work in its place. It is not restarted by Ray:
    the owning replica creates a new one and registers it again."""
    options: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
    if name is not None:
        options["name"] = name
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_capture_child_tasks=True)
    return ray.remote(StageWorker).options(**options).remote(make_stage, limits)
