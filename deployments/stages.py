"""The engine's two stages as remote Serve deployments (the router's side of the wire).

``RemoteStages`` implements ``verifier.engine.Stages`` over Serve handles: one msgpack frame per stage per
micro-batch step, never a call per token or per request. Two rules keep requests alive whatever the
replicas do:

- A proposal that does not arrive in time, comes from a dead replica, or fails validation becomes an
  empty proposal (a target-only step, γ = 0) that also asks for a resync, so the next proposal — from
  this replica or another one — re-prefills the draft from the committed tokens. Output is unchanged:
  the verifier alone decides every emitted token. Each such step counts one fallback.
- A verify call that fails marks its rows for resync; the engine re-prefills them on the (restarted or
  rebuilt) verifier and ends a sequence with an explicit error only after repeated failures.

Micro-batch ``shard`` keys route through Serve's multiplexing, which prefers the replica that already
served that key, so each micro-batch's draft KV caches stay warm on one replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Sequence

from cluster import wire
from verifier.engine import Done
from verifier.protocol import ProposalBatch, ProposeItem, VerifyItem, VerifyOutcome

log = logging.getLogger("specserve.stages")


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
    def __init__(self, response, finish, started: float):
        self.response, self.finish, self.started = response, finish, started

    def result(self):
        return self.finish(self.response, self.started)


class RemoteStages:
    def __init__(self, draft_handle, verifier_handle, limits: wire.WireLimits, *, draft_timeout_s: float,
                 verify_timeout_s: float, on_fallback=None, timings: StageTimings | None = None,
                 shard_prefix: str = "mb"):
        self.draft = draft_handle  # None: no proposer (target-only decoding)
        self.verifier = verifier_handle
        self.limits = limits
        self.draft_timeout_s = draft_timeout_s
        self.verify_timeout_s = verify_timeout_s
        self.on_fallback = on_fallback or (lambda reason, n: None)
        self.timings = timings or StageTimings()
        self.shard_prefix = shard_prefix
        self.fallbacks = 0

    def _keyed(self, handle, shard: int):
        return handle.options(multiplexed_model_id=f"{self.shard_prefix}-{shard}")

    # -- propose -------------------------------------------------------------------------------------

    def submit_propose(self, items: Sequence[ProposeItem], shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        bases = {it.sync.seq_id: it.sync.base for it in items}
        if self.draft is None:
            return Done(ProposalBatch.empty(seq_ids))
        frame = wire.encode_propose(items)
        handle = self._keyed(self.draft, shard)
        started = time.perf_counter()
        try:
            response = handle.propose.remote(frame)
        except Exception as exc:  # the handle itself refused (no replicas): same as a dead replica
            return Done(self._fallback(seq_ids, "draft_died", exc))

        def finish(resp, t0):
            try:
                data = resp.result(timeout_s=self.draft_timeout_s)
            except TimeoutError as exc:
                resp.cancel()
                return self._fallback(seq_ids, "draft_timeout", exc)
            except Exception as exc:  # RayActorError, ActorDiedError, replica-side exceptions
                return self._fallback(seq_ids, "draft_died", exc)
            try:
                batch = wire.decode_proposal(data, self.limits)
                if batch.seq_ids != seq_ids:
                    raise wire.WireError("proposal rows do not match the request")
            except wire.WireError as exc:
                return self._fallback(seq_ids, "draft_garbage", exc)
            self.timings.add("draft", time.perf_counter() - t0, batch.draft_seconds)
            moved = [s for s in batch.resync if bases[s] > 0]
            if moved:  # a replica that never saw these sequences (the old one died or was scaled down)
                self.fallbacks += 1
                self.on_fallback("draft_resync", len(moved))
            return batch

        return _Pending(response, finish, started)

    def _fallback(self, seq_ids: list[int], reason: str, exc: BaseException) -> ProposalBatch:
        self.fallbacks += 1
        log.warning("draft pool %s (%s): %d sequences take a target-only step", reason, exc, len(seq_ids))
        self.on_fallback(reason, len(seq_ids))
        return ProposalBatch.empty(seq_ids, resync=seq_ids)

    # -- verify --------------------------------------------------------------------------------------

    def submit_verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch, shard: int = 0):
        seq_ids = [it.sync.seq_id for it in items]
        frame = wire.encode_verify(items, proposal)
        started = time.perf_counter()
        try:
            response = self._keyed(self.verifier, shard).verify.remote(frame)
        except Exception as exc:
            return Done(self._lost(seq_ids, exc))

        def finish(resp, t0):
            try:
                data = resp.result(timeout_s=self.verify_timeout_s)
                outcome = wire.decode_outcome(data, self.limits)
            except TimeoutError as exc:
                resp.cancel()
                return self._lost(seq_ids, exc)
            except Exception as exc:
                return self._lost(seq_ids, exc)
            self.timings.add("verify", time.perf_counter() - t0, outcome.verify_seconds)
            return outcome

        return _Pending(response, finish, started)

    def _lost(self, seq_ids: list[int], exc: BaseException) -> VerifyOutcome:
        log.warning("verify failed (%s: %s); %d sequences will re-prefill", type(exc).__name__, exc, len(seq_ids))
        n = len(seq_ids)
        return VerifyOutcome(seq_ids, [[] for _ in seq_ids], [0] * n, [0] * n, resync=list(seq_ids))

    # -- release -------------------------------------------------------------------------------------

    def release(self, seq_ids: Sequence[int], shard: int = 0) -> None:
        """Fire-and-forget: a lost release only leaves a slot to the replica's LRU eviction."""
        frame = wire.encode_release(wire.Release(tuple(seq_ids)))
        for handle in (self.draft, self.verifier):
            if handle is None:
                continue
            handle = self._keyed(handle, shard)
            try:
                handle.release.remote(frame)
            except Exception as exc:
                log.warning("release failed: %s", exc)
