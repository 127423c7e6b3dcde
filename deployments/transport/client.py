"""The engine's two stages (``engine.engine.Stages``) over the links their routes pick: one client for
Serve handles and compiled channels alike.

A step sends one call per stage per micro-batch (``runtime.wire.serve_call``'s frames; the draft's in parts
of at most ``draft_rows`` rows, on several draft replicas at once), never a call per token or per request.
Two rules keep requests alive whatever the stages do:

- A proposal that does not arrive in time, comes from a dead replica or worker, or fails validation becomes
  an empty proposal (a target-only step, γ = 0) that also asks for a resync, so the next proposal — from
  this drafter or another one — re-prefills the draft from the committed tokens. Output is unchanged: the
  verifier alone decides every emitted token. Each such step counts one fallback, by reason.
- A verify call that fails marks its rows for resync; the engine re-prefills them on the (restarted or
  rebuilt) verifier and ends a sequence with an explicit error only after repeated failures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Callable, Sequence

from deployments.transport.directory import DIRECTORY_INTERVAL_S, WorkerDirectory
from deployments.transport.routes import HandleRoute, StageDown, StageLiveness, StageProber, WorkerRoute
from engine.engine import Done
from runtime import wire
from runtime.protocol import ProposalBatch, ProposeItem, VerifyItem, VerifyOutcome

log = logging.getLogger("specserve.transport")


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


class _Pending:
    def __init__(self, finish: Callable):
        self.finish = finish

    def result(self):
        return self.finish()


class StageClient:
    """``draft`` None: no proposer (target-only decoding)."""

    def __init__(self, limits: wire.WireLimits, *, draft: HandleRoute | WorkerRoute | None,
                 verifier: HandleRoute | WorkerRoute, draft_timeout_s: float, verify_timeout_s: float,
                 on_fallback: Callable[[str, int], None] | None = None, stops: Sequence = (),
                 draft_rows: int | None = None):
        """``draft_rows``: most rows per draft call (``draft_pool.batch_size``); a micro-batch with more is
        drafted in parts on as many replicas at once. None: one call per micro-batch (stage workers)."""
        self.limits = limits
        self.draft_rows = draft_rows
        self._part: dict[int, int] = {}  # seq_id → its draft part, while it lives
        self.draft, self.verifier = draft, verifier
        self.draft_timeout_s, self.verify_timeout_s = draft_timeout_s, verify_timeout_s
        self.on_fallback = on_fallback or (lambda reason, n: None)
        self.stops = [s for s in stops if s is not None]  # threads that serve this client: a prober, a directory
        self.timings = StageTimings()
        self.fallbacks = 0
        self.fallback_reasons: Counter = Counter()
        self.calls: Counter = Counter()  # stage calls by stage and link kind, e.g. "draft compiled"

    @property
    def handle_routes(self) -> tuple[HandleRoute | None, HandleRoute | None]:
        """The (draft, verifier) Serve-handle routes, for health and debugging: a stage's own, or the one its
        workers fall back to."""
        return tuple(route.fallback if isinstance(route, WorkerRoute) else route
                     for route in (self.draft, self.verifier))

    def close(self) -> None:
        for thread in self.stops:
            thread.stop()
        for route in (self.draft, self.verifier):
            if route is not None:
                route.close()

    # -- propose -------------------------------------------------------------------------------------

    def submit_propose(self, items: Sequence[ProposeItem], shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        if self.draft is None:
            return Done(ProposalBatch.empty(seq_ids))
        parts = self._parts(items)
        if len(parts) == 1:
            return self._submit_part(items, shard, parts[0][0])
        pending = [self._submit_part(part_items, shard, part) for part, part_items in parts]
        return _Pending(lambda: ProposalBatch.concat([p.result() for p in pending]).select(seq_ids))

    def _parts(self, items: Sequence[ProposeItem]) -> list[tuple[int, list[ProposeItem]]]:
        """A micro-batch's rows by draft part, at most ``draft_rows`` rows each: a sequence keeps its part (the
        replica that holds its draft KV) while the part has room in this call; the others fill the lowest
        parts with room. So the pool's load grows with the rows in flight, not only with the micro-batches,
        and a replica Serve adds under load takes the parts no replica holds yet."""
        if self.draft_rows is None:  # one call per micro-batch: nothing to place or remember
            return [(0, list(items))]
        cap = self.draft_rows
        part_of, count, placed = {}, Counter(), []
        for it in items:
            part = self._part.get(it.sync.seq_id)
            if part is not None and count[part] < cap:
                part_of[it.sync.seq_id] = part
                count[part] += 1
            else:
                placed.append(it)
        part = 0
        for it in placed:
            while count[part] >= cap:
                part += 1
            part_of[it.sync.seq_id] = part
            count[part] += 1
        self._part.update(part_of)
        groups: dict[int, list[ProposeItem]] = {}
        for it in items:
            groups.setdefault(part_of[it.sync.seq_id], []).append(it)
        return sorted(groups.items()) or [(0, [])]

    def _submit_part(self, items: Sequence[ProposeItem], shard: int, part: int):
        seq_ids = [it.sync.seq_id for it in items]
        link = self.draft.pick(shard, items[0].branch if items else 0, part)  # branches and parts side by side
        if link is None:  # nobody to ask: decode target-only without waiting
            return Done(self._fallback(seq_ids, "draft_down"))
        self.calls[f"draft {link.kind}"] += 1
        started = time.monotonic()
        try:
            reply = link.send(wire.OP_PROPOSE + wire.encode_propose(items))
        except Exception as exc:  # refused outright (no replicas, a closed channel): as a dead drafter
            self.draft.failed(link, exc)
            return Done(self._fallback(seq_ids, "draft_died", exc))

        def finish() -> ProposalBatch:
            try:
                data = self.draft.wait(link, reply, started, self.draft_timeout_s)
            except StageDown:
                return self._fallback(seq_ids, "draft_down")
            except TimeoutError as exc:
                self.draft.failed(link, exc)
                return self._fallback(seq_ids, "draft_timeout", exc)
            except Exception as exc:  # a dead replica or worker, or its own exception
                self.draft.failed(link, exc)
                return self._fallback(seq_ids, "draft_died", exc)
            self.draft.ok(link, started)
            return self._proposal(data, items, started)

        return _Pending(finish)

    def _proposal(self, data: bytes, items: Sequence[ProposeItem], started: float) -> ProposalBatch:
        """A draft's answer checked against the rows it was asked for; garbage is a target-only step. Rows the
        drafter resynced although they had committed tokens were new to it (its predecessor died, was scaled
        down, or membership changed): counted, not failed."""
        seq_ids = [it.sync.seq_id for it in items]
        try:
            batch = wire.decode_proposal(data, self.limits)
            if batch.seq_ids != seq_ids:
                raise wire.WireError("proposal rows do not match the request")
        except wire.WireError as exc:
            return self._fallback(seq_ids, "draft_garbage", exc)
        self.timings.add("draft", time.monotonic() - started, batch.draft_seconds)
        bases = {it.sync.seq_id: it.sync.base for it in items}
        moved = [s for s in batch.resync if bases[s] > 0]
        if moved:
            self._count("draft_resync", len(moved))
        return batch

    def _fallback(self, seq_ids: list[int], reason: str, exc: BaseException | None = None) -> ProposalBatch:
        if exc is not None:  # "draft_down" steps are logged once, by the liveness transition
            log.warning("draft %s (%s): %d sequences take a target-only step", reason, exc, len(seq_ids))
        self._count(reason, len(seq_ids))
        return ProposalBatch.empty(seq_ids, resync=seq_ids)

    def _count(self, reason: str, n: int) -> None:
        self.fallbacks += 1
        self.fallback_reasons[reason] += 1
        self.on_fallback(reason, n)

    # -- verify --------------------------------------------------------------------------------------

    def submit_verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch, shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        link = self.verifier.pick(shard)
        if link is None:
            return Done(self._lost(seq_ids, RuntimeError("no verifier to call")))
        self.calls[f"verify {link.kind}"] += 1
        started = time.monotonic()
        try:
            reply = link.send(wire.OP_VERIFY + wire.encode_verify(items, proposal))
        except Exception as exc:
            self.verifier.failed(link, exc)
            return Done(self._lost(seq_ids, exc))

        def finish() -> VerifyOutcome:
            try:
                outcome = wire.decode_outcome(self.verifier.wait(link, reply, started, self.verify_timeout_s),
                                              self.limits)
            except Exception as exc:
                self.verifier.failed(link, exc)
                return self._lost(seq_ids, exc)
            self.verifier.ok(link, started)
            self.timings.add("verify", time.monotonic() - started, outcome.verify_seconds)
            return outcome

        return _Pending(finish)

    @staticmethod
    def _lost(seq_ids: list[int], exc: BaseException) -> VerifyOutcome:
        log.warning("verify failed (%s: %s); %d sequences will re-prefill", type(exc).__name__, exc, len(seq_ids))
        n = len(seq_ids)
        return VerifyOutcome(seq_ids, [[] for _ in seq_ids], [0] * n, [0] * n, resync=list(seq_ids))

    # -- release -------------------------------------------------------------------------------------

    def release(self, seq_ids: Sequence[int], shard: int = 0) -> None:
        """Fire-and-forget on every stage process that may hold the sequences: a lost release only leaves a
        slot to its LRU eviction."""
        self.verifier.release(self._release_call(seq_ids), shard, self.verify_timeout_s)
        by_part: dict[int, list[int]] = {}
        for seq_id in seq_ids:
            by_part.setdefault(self._part.pop(seq_id, 0), []).append(seq_id)
        if self.draft is not None:
            for part, ids in sorted(by_part.items()):
                self.draft.release(self._release_call(ids), shard, self.draft_timeout_s, part)

    @staticmethod
    def _release_call(seq_ids: Sequence[int]) -> bytes:
        return wire.OP_RELEASE + wire.encode_release(wire.Release(tuple(seq_ids)))


def connect_stages(limits: wire.WireLimits, draft_handle, verifier_handle, *, draft_timeout_s: float,
                   verify_timeout_s: float, shard_prefix: str, probe_interval_s: float, probe_timeout_s: float,
                   branches: int = 1, workers_of: str | None = None, draft_rows: int | None = None,
                   on_fallback: Callable[[str, int], None] | None = None) -> StageClient:
    """A ``StageClient`` over the stages' Serve handles (``draft_handle`` None: no draft; the verifier's handle:
    a colocated draft, sharing the verifier's liveness), with a prober keeping their liveness; with
    ``workers_of`` (a ``directory.app_key``) over that app's stage workers, the handles serving a stage while it
    has none; ``draft_rows``: see ``StageClient`` (pool replicas only: a worker drafts its shard whole, a
    colocated draft stays with its verifier). ``client.handle_routes`` are the (draft, verifier) handle routes,
    for health and debugging."""
    verifier_live = StageLiveness("verifier")
    targets = [(verifier_handle, verifier_live)]
    if draft_handle is None or draft_handle is verifier_handle:
        draft_live = verifier_live
    else:
        draft_live = StageLiveness("draft pool")
        targets.append((draft_handle, draft_live))
    prober = StageProber(targets, interval_s=probe_interval_s, timeout_s=probe_timeout_s).start()
    verifier = HandleRoute(verifier_handle, verifier_live, prober, shard_prefix=shard_prefix, skip_when_down=False)
    draft = None if draft_handle is None else HandleRoute(draft_handle, draft_live, prober, shard_prefix=shard_prefix,
                                                          skip_when_down=True, branches=branches)
    routes, directory = (draft, verifier), None
    if workers_of is not None:
        routes = (draft and WorkerRoute("draft", draft), WorkerRoute("verifier", verifier))
        directory = WorkerDirectory({"draft": routes[0], "verifier": routes[1]}, workers_of, DIRECTORY_INTERVAL_S)
    client = StageClient(limits, draft=routes[0], verifier=routes[1], draft_timeout_s=draft_timeout_s,
                         verify_timeout_s=verify_timeout_s, on_fallback=on_fallback, stops=(prober, directory),
                         draft_rows=draft_rows if workers_of is None and draft_live is not verifier_live else None)
    if directory is not None:
        directory.start()
    return client
