"""Links: how one stage call reaches a stage process. ``send(call)`` returns a reply whose ``get(timeout)``
gives the answer's bytes (raising ``TimeoutError`` when it has none in time); ``release(call, timeout_s)``
sends a release, ordered with the link's calls, whose answer nobody waits for.

- ``HandleLink``: a Serve deployment's ``call``, through a handle keyed by a shard (Serve's multiplexing sends
  a key back to the replica that served it, so a micro-batch's draft KV caches stay warm on one replica).
- ``WorkerLink``: one Ray Compiled Graph to a stage worker, or to every rank of a tensor-parallel group
  (``worker`` a list: each rank takes every call, one reply per rank), whose channel the worker's loop is
  already reading. Up to ``MAX_INFLIGHT`` executions are outstanding: two micro-batches' calls plus the
  releases not yet read.
- ``RankCallLink``: every rank of a tensor-parallel group through plain actor calls (one reply per rank), for
  a group whose ranks sit on several nodes: there a compiled graph's channels stalled under pipelined calls
  (Ray 2.60 in the host lab: an execution's buffers never freed while the ranks sat idle; docs/platform.md).
  A rank runs its calls one at a time in the order one caller submitted them, as the group needs.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

log = logging.getLogger("specserve.transport")

MAX_INFLIGHT = 8  # two micro-batches × (propose or verify) + unread releases, with room to spare
MAX_UNREAD_RELEASES = 4


class HandleLink:
    kind = "handles"

    def __init__(self, handle, key: str):
        self.key = key
        self.handle = handle.options(multiplexed_model_id=key, _by_reference=False)  # gRPC, not an actor task

    def send(self, call: bytes) -> "HandleReply":
        return HandleReply(self.handle.call.remote(call))

    def release(self, call: bytes, timeout_s: float) -> None:
        self.handle.call.remote(call)


class HandleReply:
    def __init__(self, response):
        self.response = response

    def get(self, timeout: float) -> bytes:
        return self.response.result(timeout_s=timeout)  # may be asked again after a TimeoutError

    def cancel(self) -> None:
        self.response.cancel()


class RankCallLink:
    kind = "actors"

    def __init__(self, key: str, ranks: list):
        self.key, self.ranks = key, ranks

    def send(self, call: bytes) -> list["ActorReply"]:
        return [ActorReply(rank.call.remote(call)) for rank in self.ranks]

    def release(self, call: bytes, timeout_s: float) -> None:
        for rank in self.ranks:
            rank.call.remote(call)

    def close(self) -> None:
        pass  # nothing of its own: the ranks go with the group


class ActorReply:
    def __init__(self, ref):
        self.ref = ref

    def get(self, timeout: float) -> bytes:
        import ray

        return ray.get(self.ref, timeout=timeout)  # GetTimeoutError is a TimeoutError


class WorkerLink:
    kind = "compiled"

    def __init__(self, key: str, worker):
        from ray.dag import InputNode, MultiOutputNode

        self.key, self.worker = key, worker
        self._lock = threading.Lock()  # a compiled graph's execute is not safe from two threads at once
        self._releases: deque = deque()  # replies to releases not read yet, oldest first
        with InputNode() as call:
            dag = (MultiOutputNode([rank.call.bind(call) for rank in worker]) if isinstance(worker, list)
                   else worker.call.bind(call))
        self.graph = dag.experimental_compile(_max_inflight_executions=MAX_INFLIGHT)

    def send(self, call: bytes):
        with self._lock:
            # Releases sent before this call are answered before it (a worker answers in submission order),
            # so their replies need no reading: a compiled graph frees an execution whose ref is gone once a
            # later one is read.
            self._releases.clear()
            return self._submit(call)

    def release(self, call: bytes, timeout_s: float) -> None:
        """Sent at once, ordered with the stage calls. A link that gets releases and no calls (a draft worker
        no shard maps to) would run out of the graph's in-flight executions, so past ``MAX_UNREAD_RELEASES``
        the oldest reply is read, waiting for the calls queued ahead of it up to ``timeout_s`` (the stage's
        call timeout: a worker that does not answer within it is as gone as for a stage call)."""
        with self._lock:
            self._releases.append(self._submit(call))
            while len(self._releases) > MAX_UNREAD_RELEASES:
                oldest = self._releases.popleft()
                for reply in oldest if isinstance(oldest, list) else [oldest]:
                    reply.get(timeout=timeout_s)

    def _submit(self, call: bytes):
        if self.graph is None:
            raise RuntimeError(f"the graph of {self.key} is closed")
        return self.graph.execute(call)

    def close(self) -> None:
        """Tear the graph down without waiting for it: a dead worker can hold teardown for seconds."""
        self._releases.clear()
        graph, self.graph = self.graph, None
        if graph is not None:
            threading.Thread(target=_teardown, args=(graph, self.key), daemon=True,
                             name=f"specserve-teardown-{self.key}").start()


def _teardown(graph, key: str) -> None:
    try:
        graph.teardown()
    except Exception as exc:
        log.warning("tearing down the graph of %s: %s", key, exc)
