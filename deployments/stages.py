"""The engine's two stages as remote Serve deployments (the router's side of the wire).

``RemoteStages`` implements ``engine.engine.Stages`` over Serve handles: one msgpack frame per stage per
micro-batch step, never a call per token or per request. Two rules keep requests alive whatever the
replicas do:

- A proposal that does not arrive in time, comes from a dead replica, or fails validation becomes an
  empty proposal (a target-only step, γ = 0) that also asks for a resync, so the next proposal — from
  this replica or another one — re-prefills the draft from the committed tokens. Output is unchanged:
  the verifier alone decides every emitted token. Each such step counts one fallback.
- A verify call that fails marks its rows for resync; the engine re-prefills them on the (restarted or
  rebuilt) verifier and ends a sequence with an explicit error only after repeated failures.

Each stage's liveness (``StageLiveness``) comes from the step's own calls and from ``StageProber``, a
thread that pings every stage a few times a second. While the draft pool is down, steps do not call
it at all (target-only, no waiting), and a step already waiting on it gives up as soon as it is marked
down instead of waiting out ``draft_pool.timeout_s``. The router's ``/health`` reads the same state.

Micro-batch ``shard`` keys route through Serve's multiplexing, which prefers the replica that already
served that key, so each micro-batch's draft KV caches stay warm on one replica.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from typing import Sequence

from ray.exceptions import RayActorError

from runtime import wire
from engine.engine import Done
from runtime.protocol import ProposalBatch, ProposeItem, VerifyItem, VerifyOutcome

log = logging.getLogger("specserve.stages")

WAIT_SLICE_S = 0.05  # how often a step waiting on the draft pool checks whether it was marked down


class StageTimings:
    """Per-stage wall time as seen by the router, split into compute (reported by the stage) and the rest."""

    def __init__(self, window: int = 4096):
        self.lock = threading.Lock()
        self.samples: deque = deque(maxlen=window)  # (stage, wall_seconds, compute_seconds)

    def add(self, stage: str, wall: float, compute: float) -> None:
        with self.lock:
            self.samples.append((stage, wall, compute))

    def drain(self) -> list[tuple[str, float, float]]:
        with self.lock:
            out = list(self.samples)
            self.samples.clear()
        return out


class StageLiveness:
    """Whether a stage (the verifier, or the draft pool) has a replica that answers, from the latest evidence.

    A call whose replica died, or a probe that no replica answered in time, marks the stage down; a later
    success — a step call or a probe — marks it up. Success from a call that *started* before the latest
    failure is ignored: it may have been answered just before the replica died. Times are monotonic.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        now = time.monotonic()
        self.up = True  # the deployment was RUNNING (every replica healthy) before the router started
        self.since = now
        self.reason: str | None = None
        self.last_ok = now
        self.last_failure = -math.inf
        self.outages = 0

    def ok(self, started: float) -> None:
        with self._lock:
            if started < self.last_failure:
                return
            self.last_ok = time.monotonic()
            if not self.up:
                log.warning("%s is back after %.2f s down", self.name, self.last_ok - self.since)
                self.up, self.since, self.reason = True, self.last_ok, None

    def failed(self, reason: str) -> None:
        with self._lock:
            self.last_failure = time.monotonic()
            if self.up:
                log.warning("%s is down: %s", self.name, reason)
                self.up, self.since, self.reason = False, self.last_failure, reason
                self.outages += 1

    def down_since(self, t: float) -> bool:
        """Marked down at or after monotonic time ``t`` (and still down)."""
        with self._lock:
            return not self.up and self.since >= t

    def snapshot(self) -> dict:
        with self._lock:
            now = time.monotonic()
            return {"up": self.up, "for_s": round(now - self.since, 3), "reason": self.reason,
                    "last_ok_s_ago": round(now - self.last_ok, 3), "outages": self.outages}


class StageProber:
    """A daemon thread that pings every stage each ``interval_s`` (``ping`` is answered on the replica's
    event loop, never behind model work, so a busy replica answers in milliseconds), and at once when
    ``probe_now`` is called (a step call just failed). A probe unanswered after ``timeout_s`` marks its stage
    down: a replica killed outright can take Ray seconds to report, and Serve queues calls to a deployment
    with no live replica instead of failing them."""

    def __init__(self, targets: list[tuple[object, StageLiveness]], *, interval_s: float, timeout_s: float):
        self.targets = targets
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specserve-stage-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def probe_now(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._probe(self.targets)
            except Exception:  # a probe must never take the prober down with it
                log.exception("stage probe failed")

    def _probe(self, targets: list[tuple[object, StageLiveness]]) -> None:
        started = time.monotonic()
        calls = []
        for handle, live in targets:
            try:
                calls.append((handle.ping.remote(), live))
            except Exception as exc:  # the handle refused outright
                live.failed(f"probe refused: {type(exc).__name__}: {exc}")
        deadline = started + self.timeout_s
        for resp, live in calls:
            try:
                resp.result(timeout_s=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                resp.cancel()
                live.failed(f"no replica answered a probe within {self.timeout_s:g} s")
            except RayActorError as exc:
                live.failed(f"replica died ({type(exc).__name__})")
            except Exception as exc:
                live.failed(f"probe failed: {type(exc).__name__}: {exc}")
            else:
                live.ok(started)


class _Pending:
    def __init__(self, response, finish, started: float):
        self.response, self.finish, self.started = response, finish, started

    def result(self):
        return self.finish(self.response, self.started)


class _DraftDown(Exception):
    """The draft pool was marked down while a step waited on its proposal."""


class StageFallbacks:
    """What the stage transports share when a stage call fails: a proposal frame checked, target-only steps
    taken in place of a draft (counted by reason and reported to ``on_fallback``), and a lost verify turned
    into resyncs (the subclass sets ``fallbacks``, ``fallback_reasons``, ``on_fallback``, ``limits`` and
    ``timings``)."""

    draft_name = "draft pool"

    def _fallback(self, seq_ids: list[int], reason: str, exc: BaseException | None = None) -> ProposalBatch:
        if exc is not None:  # "draft_down" steps are logged once, by the liveness transition
            log.warning("%s %s (%s): %d sequences take a target-only step", self.draft_name, reason, exc,
                        len(seq_ids))
        self._count(reason, len(seq_ids))
        return ProposalBatch.empty(seq_ids, resync=seq_ids)

    def _count(self, reason: str, n: int) -> None:
        self.fallbacks += 1
        self.fallback_reasons[reason] += 1
        self.on_fallback(reason, n)

    def _lost(self, seq_ids: list[int], exc: BaseException) -> VerifyOutcome:
        log.warning("verify failed (%s: %s); %d sequences will re-prefill", type(exc).__name__, exc, len(seq_ids))
        n = len(seq_ids)
        return VerifyOutcome(seq_ids, [[] for _ in seq_ids], [0] * n, [0] * n, resync=list(seq_ids))

    def _proposal(self, data: bytes, seq_ids: list[int], bases: dict[int, int], started: float) -> ProposalBatch:
        """A draft's answer frame checked against the rows it was asked for; garbage is a target-only step.
        Rows the drafter resynced although they had committed tokens were new to it (its predecessor died,
        was scaled down, or membership changed): counted, not failed."""
        try:
            batch = wire.decode_proposal(data, self.limits)
            if batch.seq_ids != seq_ids:
                raise wire.WireError("proposal rows do not match the request")
        except wire.WireError as exc:
            return self._fallback(seq_ids, "draft_garbage", exc)
        self.timings.add("draft", time.monotonic() - started, batch.draft_seconds)
        moved = [s for s in batch.resync if bases[s] > 0]
        if moved:
            self._count("draft_resync", len(moved))
        return batch


class RemoteStages(StageFallbacks):
    def __init__(self, draft_handle, verifier_handle, limits: wire.WireLimits, *, draft_timeout_s: float,
                 verify_timeout_s: float, probe_interval_s: float, probe_timeout_s: float, on_fallback=None,
                 timings: StageTimings | None = None, shard_prefix: str = "mb", branches: int = 1):
        self.draft = draft_handle  # None: no proposer (target-only decoding)
        self.verifier = verifier_handle
        self.limits = limits
        self.draft_timeout_s = draft_timeout_s
        self.verify_timeout_s = verify_timeout_s
        self.on_fallback = on_fallback or (lambda reason, n: None)
        self.timings = timings or StageTimings()
        self.shard_prefix = shard_prefix
        self.branches = branches  # candidate chains per micro-batch (draft_num): each has its own routing key
        self.fallbacks = 0
        self.fallback_reasons: Counter = Counter()
        self.verifier_live = StageLiveness("verifier")
        targets = [(verifier_handle, self.verifier_live)]
        if draft_handle is None:
            self.draft_live = None
        elif draft_handle is verifier_handle:  # colocated: the verifier replicas draft too
            self.draft_live = self.verifier_live
        else:
            self.draft_live = StageLiveness("draft pool")
            targets.append((draft_handle, self.draft_live))
        self.prober = StageProber(targets, interval_s=probe_interval_s, timeout_s=probe_timeout_s)
        self.prober.start()

    def close(self) -> None:
        self.prober.stop()

    def _keyed(self, handle, shard: int, branch: int = 0):
        """The handle routed by the micro-batch's key — its branch's key for the candidates beyond the first
        (``draft_num``), so Serve spreads a micro-batch's branches over the draft replicas."""
        key = f"{self.shard_prefix}-{shard}" + (f"-{branch}" if branch else "")
        return handle.options(multiplexed_model_id=key)

    def _call_failed(self, live: StageLiveness, exc: BaseException) -> None:
        """A step call failed: a dead replica marks its stage down at once; any failure asks for a probe,
        which marks the stage up again within milliseconds if another replica answers."""
        if isinstance(exc, RayActorError):
            live.failed(f"replica died ({type(exc).__name__})")
        self.prober.probe_now()

    # -- propose -------------------------------------------------------------------------------------

    def submit_propose(self, items: Sequence[ProposeItem], shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        bases = {it.sync.seq_id: it.sync.base for it in items}
        if self.draft is None:
            return Done(ProposalBatch.empty(seq_ids))
        if not self.draft_live.up:  # nobody to ask: decode target-only without waiting
            return Done(self._fallback(seq_ids, "draft_down"))
        frame = wire.encode_propose(items)
        handle = self._keyed(self.draft, shard, items[0].branch if items else 0)
        started = time.monotonic()
        try:
            response = handle.propose.remote(frame)
        except Exception as exc:  # the handle itself refused (no replicas): same as a dead replica
            self._call_failed(self.draft_live, exc)
            return Done(self._fallback(seq_ids, "draft_died", exc))

        def finish(resp, t0):
            try:
                data = self._await_proposal(resp, t0)
            except _DraftDown:
                resp.cancel()
                return self._fallback(seq_ids, "draft_down")
            except TimeoutError as exc:
                resp.cancel()
                self._call_failed(self.draft_live, exc)
                return self._fallback(seq_ids, "draft_timeout", exc)
            except Exception as exc:  # RayActorError, ActorDiedError, replica-side exceptions
                self._call_failed(self.draft_live, exc)
                return self._fallback(seq_ids, "draft_died", exc)
            self.draft_live.ok(t0)
            return self._proposal(data, seq_ids, bases, t0)

        return _Pending(response, finish, started)

    def _await_proposal(self, resp, started: float):
        """The proposal's frame, waiting at most ``draft_timeout_s`` — and no longer than it takes the
        prober (or another call) to mark the draft pool down."""
        deadline = started + self.draft_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                return resp.result(timeout_s=max(0.0, min(WAIT_SLICE_S, remaining)))
            except TimeoutError:
                if self.draft_live.down_since(started):
                    raise _DraftDown from None
                if time.monotonic() >= deadline:
                    raise

    # -- verify --------------------------------------------------------------------------------------

    def submit_verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch, shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        frame = wire.encode_verify(items, proposal)
        started = time.monotonic()
        try:
            response = self._keyed(self.verifier, shard).verify.remote(frame)
        except Exception as exc:
            self._call_failed(self.verifier_live, exc)
            return Done(self._lost(seq_ids, exc))

        def finish(resp, t0):
            try:
                data = resp.result(timeout_s=self.verify_timeout_s)
                outcome = wire.decode_outcome(data, self.limits)
            except TimeoutError as exc:
                resp.cancel()
                self._call_failed(self.verifier_live, exc)
                return self._lost(seq_ids, exc)
            except Exception as exc:
                self._call_failed(self.verifier_live, exc)
                return self._lost(seq_ids, exc)
            self.verifier_live.ok(t0)
            self.timings.add("verify", time.monotonic() - t0, outcome.verify_seconds)
            return outcome

        return _Pending(response, finish, started)

    # -- release -------------------------------------------------------------------------------------

    def release(self, seq_ids: Sequence[int], shard: int = 0) -> None:
        """Fire-and-forget: a lost release only leaves a slot to the replica's LRU eviction."""
        frame = wire.encode_release(wire.Release(tuple(seq_ids)))
        keyed = [self._keyed(self.verifier, shard)]
        if self.draft is not None:
            keyed += [self._keyed(self.draft, shard, b) for b in range(self.branches)]
        for handle in keyed:
            try:
                handle.release.remote(frame)
            except Exception as exc:
                log.warning("release failed: %s", exc)
