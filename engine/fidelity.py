"""Live fidelity monitor: does speculative output still equal plain output, in production?

Exact speculative decoding promises that a greedy request's tokens are those plain greedy decoding gives.
At an opt-in ``sample_rate`` (``router.fidelity_sample_rate``; 0 = off), ``offer`` picks finished greedy requests
and queues them; each is re-decoded without speculation by ``redecode`` (an engine with no draft:
``plain_redecoder``) off the hot path — on a worker thread at the lowest CPU priority, or by ``run_pending``
— and compared token by token with what was served. A mismatch records the generated-token index of the
first difference (a shorter output differs at its end). The queue is bounded: a sample that arrives while
``max_pending`` wait is dropped and counted in ``dropped``, so a slow re-decode never grows memory.

Only requests that finished by themselves (``stop`` / ``length``) are compared: a cancelled or failed one
has no complete output to compare.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.engine import Engine, Request

log = logging.getLogger("specserve.engine.fidelity")

LOWEST_PRIORITY = 19  # Linux nice value of the worker thread: runs when nothing else wants the core


@dataclass(frozen=True)
class FidelityResult:
    request: Request
    match: bool
    first_difference: int | None  # generated-token index of the first difference; None when they match
    served: int  # tokens served
    plain: int  # tokens plain decoding gave


def first_difference(served: Sequence[int], plain: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(served, plain)):
        if a != b:
            return i
    return None if len(served) == len(plain) else min(len(served), len(plain))


def plain_redecoder(engine: Engine, first_seq_id: int = 0) -> Callable[[Request], tuple[int, ...]]:
    """Re-decode on ``engine`` (built without a draft), one request at a time. The engine is the
    monitor's alone (``Engine`` is not thread-safe); on stages it shares with a serving engine (a remote
    verifier), ``first_seq_id`` starts a range of sequence ids the serving engine never reaches."""
    ids = itertools.count(first_seq_id)

    def redecode(request: Request) -> tuple[int, ...]:
        seq_id = engine.add(request, seq_id=next(ids))
        while seq_id not in engine.finished:
            engine.step()
        return engine.output(seq_id).tokens

    return redecode


class FidelityMonitor:
    def __init__(self, sample_rate: float, redecode: Callable[[Request], Sequence[int]], *,
                 on_result: Callable[[FidelityResult], None] | None = None, seed: int | None = None,
                 max_pending: int = 64):
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.redecode = redecode
        self.on_result = on_result
        self.rng = random.Random(seed)
        self.pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self.matches = self.mismatches = self.dropped = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def offer(self, request: Request, served: Sequence[int], finish_reason: str) -> bool:
        """Queue a finished request for a check with probability ``sample_rate``; True when queued."""
        if not request.sampling.greedy or finish_reason not in ("stop", "length") or self.sample_rate <= 0.0:
            return False
        if self.rng.random() >= self.sample_rate:
            return False
        try:
            self.pending.put_nowait((request, tuple(served)))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def check(self, request: Request, served: Sequence[int]) -> FidelityResult:
        plain = tuple(self.redecode(request))
        diff = first_difference(served, plain)
        result = FidelityResult(request, diff is None, diff, len(served), len(plain))
        if result.match:
            self.matches += 1
        else:
            self.mismatches += 1
            log.warning("fidelity mismatch at generated token %d (served %d tokens, plain %d)",
                        diff, len(served), len(plain))
        if self.on_result is not None:
            self.on_result(result)
        return result

    def run_pending(self) -> list[FidelityResult]:
        """Check every queued request now, on the caller's thread."""
        out = []
        while True:
            try:
                request, served = self.pending.get_nowait()
            except queue.Empty:
                return out
            out.append(self.check(request, served))

    # -- the worker thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="specserve-fidelity", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _work(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)  # this thread only
        except (AttributeError, OSError) as exc:  # not Linux, or not permitted: run at normal priority
            log.info("fidelity monitor at normal priority: %s", exc)
        while not self._stop.is_set():
            try:
                request, served = self.pending.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.check(request, served)
            except Exception:  # a failed re-decode is no verdict on fidelity; the server keeps serving
                log.exception("fidelity re-decode failed")
