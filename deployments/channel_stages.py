"""The engine's two stages over stage-worker actors: Ray Compiled Graph channels, or direct actor calls.

``ChannelStages`` implements ``engine.engine.Stages`` like ``deployments.stages.RemoteStages`` does over
Serve handles, but each step's frame goes straight to a ``StageWorker`` actor (``deployments.stage_workers``):

- ``compiled``: one compiled graph per worker (``InputNode → worker.call``, ``experimental_compile``);
  a call writes the frame into a shared-memory channel that the worker's loop is already reading. On this
  2-core VM a 16-row stage call through a served app's worker, msgpack included, took ~0.3–0.5 ms p50
  against ~0.9–1.0 ms for an actor call and ~3.1–3.9 ms for a Serve-handle call (docs/transport.md).
- ``actor``: ``worker.call.remote(frame)``, for workers a compiled graph cannot reach.

One graph per worker, not one graph over all of them: each micro-batch's draft goes to one worker (its
shard), and a graph only executes as a whole, so a combined graph would make every worker run every step.
It also makes a membership change local: adding a worker compiles its graph, losing one tears its graph
down; the other graphs keep running. Up to ``MAX_INFLIGHT`` executions per graph are outstanding: two
micro-batches' stage calls plus the releases not yet collected.

Membership comes from the stage replicas: each owns a worker, which the router's ``WorkerDirectory``
(``deployments.worker_directory``) finds and registers (``set_draft_workers`` / ``set_verifier_workers``).
A stage with no worker registered (before the first is found, or after the last was lost) is called
through ``fallback``, the Serve-handle ``RemoteStages``, whose replicas forward to their workers.

Shard ``s`` goes to worker ``s mod n`` of its stage, so a micro-batch stays on one worker (its draft KV
caches stay warm there) while membership is unchanged; after a change, a worker that never saw a
sequence answers ``resync`` and the router re-prefills it, as with Serve handles.

Faults, as with Serve handles (output unchanged: the verifier alone decides every emitted token):

- a draft worker that dies, times out or answers garbage turns the step into a target-only step (γ = 0)
  that asks for a resync; a dead or timed-out worker is dropped from membership and its graph torn down,
  so the next steps of its shard go to the other workers, or through ``fallback`` when there are none;
- a verifier worker that fails marks the step's rows for resync and is dropped; with no verifier worker
  left, verify calls go through ``fallback``, whose calls Serve holds while the replica that lost its
  worker is replaced (it exits when its worker dies), so a verifier restart costs re-prefills, never a
  request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from deployments.stage_workers import OP_PROPOSE, OP_RELEASE, OP_VERIFY
from deployments.stages import StageFallbacks, StageTimings
from engine.engine import Done
from runtime import wire
from runtime.protocol import ProposalBatch, ProposeItem, VerifyItem

log = logging.getLogger("specserve.channel_stages")

TRANSPORTS = ("compiled", "actor")
MAX_INFLIGHT = 8  # two micro-batches × (propose or verify) + unread releases, with room to spare
MAX_UNREAD_RELEASES = 4


class WorkerLink:
    """One worker, or every rank of a tensor-parallel group (``worker`` a list: each rank takes every frame),
    and the way to reach it. ``send`` returns a reply whose ``get(timeout)`` gives the answer (one reply per
    rank for a group); ``get`` may be called once."""

    def __init__(self, key: str, worker, transport: str):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.key, self.worker, self.transport = key, worker, transport
        self.ranks = worker if isinstance(worker, list) else None
        self._lock = threading.Lock()  # a compiled graph's execute is not safe from two threads at once
        self._releases: deque = deque()  # replies to releases not read yet, oldest first
        self.graph = None
        if transport == "compiled":
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as frame:
                dag = (MultiOutputNode([rank.call.bind(frame) for rank in self.ranks]) if self.ranks is not None
                       else worker.call.bind(frame))
            self.graph = dag.experimental_compile(_max_inflight_executions=MAX_INFLIGHT)

    def send(self, frame: bytes):
        with self._lock:
            # Releases sent before this call are answered before it (a worker answers in submission order),
            # so their replies need no reading: a compiled graph frees an execution whose ref is gone once a
            # later one is read.
            self._releases.clear()
            return self._submit(frame)

    def release(self, frame: bytes, timeout_s: float) -> None:
        """Sent at once, ordered with the stage calls. A link that gets releases and no calls (a draft worker
        no shard maps to) would run out of the graph's in-flight executions, so past ``MAX_UNREAD_RELEASES``
        the oldest reply is read, waiting for the calls queued ahead of it up to ``timeout_s`` (the stage's
        call timeout: a worker that does not answer within it is as gone as for a stage call)."""
        with self._lock:
            self._releases.append(self._submit(frame))
            while len(self._releases) > MAX_UNREAD_RELEASES:
                oldest = self._releases.popleft()
                for reply in oldest if isinstance(oldest, list) else [oldest]:
                    reply.get(timeout=timeout_s)

    def _submit(self, frame: bytes):
        if self.graph is not None:
            refs = self.graph.execute(frame)
        elif self.ranks is not None:
            arg = ray.put(frame)  # one copy in the object store, read by every rank
            refs = [rank.call.remote(arg) for rank in self.ranks]
        else:
            refs = self.worker.call.remote(frame)
        return [_Reply(ref) for ref in refs] if isinstance(refs, list) else _Reply(refs)

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


class _Reply:
    def __init__(self, ref):
        self.ref = ref

    def get(self, timeout: float | None):
        if isinstance(self.ref, ray.ObjectRef):
            return ray.get(self.ref, timeout=timeout)
        return self.ref.get(timeout=timeout)


class _Pending:
    def __init__(self, finish):
        self.finish = finish

    def result(self):
        return self.finish()


class _Membership:
    """A stage's live links, in registration order."""

    def __init__(self, name: str, transport: str):
        self.name, self.transport = name, transport
        self._lock = threading.Lock()
        self.links: list[WorkerLink] = []
        self.rebuilds = 0

    def set(self, workers: dict[str, object]) -> None:
        """Make the membership exactly ``workers`` (key → actor handle): new keys get a link (a compiled
        graph, compiled outside the lock so steps on the other links go on meanwhile), gone keys have
        theirs torn down, unchanged keys keep theirs. A worker whose graph cannot be compiled (it died in
        between) is left out."""
        with self._lock:
            current = {link.key: link for link in self.links}
        kept = [k for k in workers if k in current and current[k].worker == workers[k]]
        new = []
        for key in workers.keys() - set(kept):
            try:
                new.append(WorkerLink(key, workers[key], self.transport))
            except Exception as exc:
                log.warning("%s worker %s left out: %s: %s", self.name, key, type(exc).__name__, exc)
        with self._lock:
            old, current = self.links, {link.key: link for link in self.links}
            self.links = [current[k] for k in kept if k in current] + sorted(new, key=lambda link: link.key)
            self.rebuilds += 1
        for link in old:
            if link not in self.links:
                link.close()
        log.info("%s workers: %s", self.name, [link.key for link in self.links])

    def pick(self, shard: int) -> WorkerLink | None:
        with self._lock:
            return self.links[shard % len(self.links)] if self.links else None

    def drop(self, link: WorkerLink, reason: str) -> None:
        with self._lock:
            if link not in self.links:
                return
            self.links.remove(link)
            self.rebuilds += 1
        log.warning("%s worker %s dropped (%s); %d left", self.name, link.key, reason, len(self.links))
        link.close()

    def all(self) -> list[WorkerLink]:
        with self._lock:
            return list(self.links)

    def close(self) -> None:
        with self._lock:
            links, self.links = self.links, []
        for link in links:
            link.close()


class ChannelStages(StageFallbacks):
    draft_name = "draft worker"

    def __init__(self, limits: wire.WireLimits, *, transport: str = "compiled", draft_timeout_s: float,
                 verify_timeout_s: float, fallback=None, on_fallback=None, timings: StageTimings | None = None):
        self.limits = limits
        self.transport = transport
        self.draft_timeout_s, self.verify_timeout_s = draft_timeout_s, verify_timeout_s
        self.fallback = fallback  # RemoteStages over Serve handles: a stage's calls while it has no worker
        self.on_fallback = on_fallback or (lambda reason, n: None)
        self.timings = timings or StageTimings()
        self.drafts = _Membership("draft", transport)
        self.verifiers = _Membership("verifier", transport)
        self.fallbacks = 0
        self.fallback_reasons: Counter = Counter()
        self.calls: Counter = Counter()  # stage calls by way: "draft" / "verify" to a worker, "*_handles" not

    def set_draft_workers(self, workers: dict[str, object]) -> None:
        self.drafts.set(workers)

    def set_verifier_workers(self, workers: dict[str, object]) -> None:
        self.verifiers.set(workers)

    def close(self) -> None:
        self.drafts.close()
        self.verifiers.close()
        if self.fallback is not None:
            self.fallback.close()

    # -- propose -------------------------------------------------------------------------------------

    def submit_propose(self, items: Sequence[ProposeItem], shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        bases = {it.sync.seq_id: it.sync.base for it in items}
        # A micro-batch's branches (draft_num) go to consecutive workers: drafted side by side.
        link = self.drafts.pick(shard + (items[0].branch if items else 0))
        if link is None:  # no draft worker registered: the Serve handles, or target-only without waiting
            if self.fallback is not None:
                self.calls["draft_handles"] += 1
                return self.fallback.submit_propose(items, shard)
            return Done(self._fallback(seq_ids, "draft_down"))
        self.calls["draft"] += 1
        started = time.monotonic()
        try:
            reply = link.send(OP_PROPOSE + wire.encode_propose(items))
        except Exception as exc:
            self.drafts.drop(link, f"{type(exc).__name__}: {exc}")
            return Done(self._fallback(seq_ids, "draft_died", exc))

        def finish():
            try:
                data = reply.get(timeout=self.draft_timeout_s)
            except (TimeoutError, GetTimeoutError) as exc:
                self.drafts.drop(link, "timed out")
                return self._fallback(seq_ids, "draft_timeout", exc)
            except Exception as exc:  # a dead worker, a closed channel, or the worker's own exception
                if _worker_gone(exc):
                    self.drafts.drop(link, f"{type(exc).__name__}")
                return self._fallback(seq_ids, "draft_died", exc)
            return self._proposal(data, seq_ids, bases, started)

        return _Pending(finish)

    # -- verify --------------------------------------------------------------------------------------

    def submit_verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch, shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        link = self.verifiers.pick(shard)
        if link is None:
            if self.fallback is not None:
                self.calls["verify_handles"] += 1
                return self.fallback.submit_verify(items, proposal, shard)
            return Done(self._lost(seq_ids, RuntimeError("no verifier worker registered")))
        self.calls["verify"] += 1
        started = time.monotonic()
        try:
            reply = link.send(OP_VERIFY + wire.encode_verify(items, proposal))
        except Exception as exc:
            self.verifiers.drop(link, f"{type(exc).__name__}: {exc}")
            return Done(self._lost(seq_ids, exc))

        def finish():
            try:
                outcome = wire.decode_outcome(reply.get(timeout=self.verify_timeout_s), self.limits)
            except Exception as exc:
                if _worker_gone(exc) or isinstance(exc, (TimeoutError, GetTimeoutError)):
                    self.verifiers.drop(link, f"{type(exc).__name__}")
                return self._lost(seq_ids, exc)
            self.timings.add("verify", time.monotonic() - started, outcome.verify_seconds)
            return outcome

        return _Pending(finish)

    # -- release -------------------------------------------------------------------------------------

    def release(self, seq_ids: Sequence[int], shard: int = 0) -> None:
        """Fire-and-forget on every worker that may hold the sequences: a lost release only leaves a slot
        to the worker's LRU eviction."""
        frame = OP_RELEASE + wire.encode_release(wire.Release(tuple(seq_ids)))
        for members, timeout_s in ((self.drafts, self.draft_timeout_s), (self.verifiers, self.verify_timeout_s)):
            for link in members.all():
                try:
                    link.release(frame, timeout_s)
                except Exception as exc:  # a dead or hung worker: dropped, as a failed stage call drops it
                    members.drop(link, f"release: {type(exc).__name__}: {exc}")
        if self.fallback is not None and not (self.drafts.all() and self.verifiers.all()):
            self.fallback.release(seq_ids, shard)


def _worker_gone(exc: BaseException) -> bool:
    """The worker (or its channel) is gone, as opposed to the worker raising for this one frame."""
    from ray.exceptions import RayChannelError

    return isinstance(exc, (RayActorError, RayChannelError))
