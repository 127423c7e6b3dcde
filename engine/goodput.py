"""Goodput guard: speculation must never make throughput worse than plain decoding, at any batch size.

The γ policy (``gamma.py``) predicts from a model (α, c); this controller *measures*. For each micro-batch
it is about to draft, the engine asks it whether to speculate (``choose`` returns a ``StepPlan``), and
hands the plan back afterwards with how many tokens the step committed and how long it took
(``observe``). Per batch-size bucket (the next power of two of the micro-batch's rows: goodput at batch 4
says little about batch 64) it keeps the last ``window`` recorded steps of each mode, speculative and
plain (γ = 0); goodput is their committed tokens over their seconds, leaving out any step that took
more than ``outlier`` times the window's median (a GC pause, another process on the core): one noisy
step cannot switch speculation off, a lasting change moves every step and is taken up.

- In the current mode it *probes* the other one: ``probe_steps`` consecutive steps every ``probe_every``
  steps (and as soon as possible when that mode has no measurement yet). The first step after any change
  of mode is not recorded: a speculative step after plain ones also catches the draft's KV cache up on
  every token committed meanwhile, a cost of switching rather than of speculating.
- It switches off speculation when plain goodput beats speculative goodput by more than ``hysteresis``
  (relative), and back on when speculative goodput beats plain by more than ``hysteresis``; each mode needs
  ``min_samples`` recorded steps first.

It is deterministic given what it is fed: it never reads a clock itself. ``clock`` is only the function the
engine uses to time steps (``time.perf_counter`` unless a test injects a fake one), and ``observe`` takes
measured seconds, so tests drive it with synthetic timings.

Greedy fidelity is untouched: plain steps are ordinary verify steps with no drafts, and the verifier's
output never depends on whether (or how much) the proposer drafted.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

SPECULATE, PLAIN = "speculate", "plain"


@dataclass(frozen=True)
class GoodputConfig:
    probe_every: int = 16  # steps in the current mode between probes of the other one
    probe_steps: int = 2  # consecutive steps of a probe (the first after a change of mode is not recorded)
    window: int = 8  # recorded steps per mode that goodput is measured over
    outlier: float = 3.0  # a step slower than this × the window's median is left out
    hysteresis: float = 0.05  # relative margin a mode must win by before the controller switches
    min_samples: int = 2  # recorded steps per mode before any switch
    skip_after_switch: int = 1  # steps after a change of mode that are not recorded

    def __post_init__(self):
        if self.probe_every < 1 or self.probe_steps < 1:
            raise ValueError("probe_every and probe_steps must be >= 1")
        if self.window < 1 or self.outlier <= 1.0:
            raise ValueError(f"need window >= 1 and outlier > 1, got {self.window}, {self.outlier}")
        if self.hysteresis < 0 or self.min_samples < 1 or self.skip_after_switch < 0:
            raise ValueError("need hysteresis >= 0, min_samples >= 1, skip_after_switch >= 0")


class ModeStats:
    """The last ``window`` recorded steps of one mode; goodput = their tokens / their seconds, without
    the steps slower than ``outlier`` × the median step."""

    def __init__(self, window: int, outlier: float):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self.outlier = outlier
        self.samples = 0  # steps ever recorded

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))
        self.samples += 1

    @property
    def goodput(self) -> float:
        if not self.steps:
            return 0.0
        limit = self.outlier * statistics.median(s for _, s in self.steps)
        kept = [(t, s) for t, s in self.steps if s <= limit]
        seconds = sum(s for _, s in kept)
        return sum(t for t, _ in kept) / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class StepPlan:
    """What ``choose`` decided for one step; hand it back to ``observe`` with the step's measurements."""

    rows: int  # sequences in the micro-batch
    speculate: bool
    record: bool  # False for the first step(s) after a change of mode: measured, but not recorded


@dataclass
class BucketState:
    mode: str = SPECULATE  # the mode the controller is in (probes run the other one)
    since_probe: int = 0  # steps in ``mode`` since the last probe ended
    probe_left: int = 0  # steps of the running probe still to hand out
    last: str | None = None  # the mode of the previous step handed out
    warm_left: int = 0  # coming steps not to record (just after a change of mode)
    switches: int = 0
    stats: dict = field(default_factory=dict)  # mode → ModeStats (``GoodputController.state`` fills it)


def batch_bucket(rows: int) -> int:
    """Next power of two ≥ rows (1, 2, 4, 8, …)."""
    return 1 << max(0, rows - 1).bit_length()


class GoodputController:
    def __init__(self, config: GoodputConfig | None = None, *, clock: Callable[[], float] = time.perf_counter):
        self.config = config or GoodputConfig()
        self.clock = clock
        self.buckets: dict[int, BucketState] = {}
        self.scheduled = {SPECULATE: 0, PLAIN: 0}  # steps handed out per mode, all buckets

    def state(self, rows: int) -> BucketState:
        key = batch_bucket(rows)
        if key not in self.buckets:
            cfg = self.config
            self.buckets[key] = BucketState(stats={m: ModeStats(cfg.window, cfg.outlier) for m in (SPECULATE, PLAIN)})
        return self.buckets[key]

    def mode(self, rows: int) -> str:
        """The mode the controller is in for this batch size (``speculate`` or ``plain``)."""
        return self.state(rows).mode

    def choose(self, rows: int) -> StepPlan:
        """Plan the next step of a micro-batch of ``rows`` sequences: speculate or not."""
        st = self.state(rows)
        cfg = self.config
        other = PLAIN if st.mode == SPECULATE else SPECULATE
        if st.probe_left == 0:
            unmeasured = st.stats[other].samples == 0 and st.since_probe >= 1
            if unmeasured or st.since_probe >= cfg.probe_every:
                st.probe_left = cfg.probe_steps + cfg.skip_after_switch
        if st.probe_left > 0:
            st.probe_left -= 1
            mode = other
            if st.probe_left == 0:
                st.since_probe = 0
        else:
            mode = st.mode
            st.since_probe += 1
        if st.last is not None and mode != st.last:
            st.warm_left = cfg.skip_after_switch
        st.last = mode
        record = st.warm_left == 0
        if not record:
            st.warm_left -= 1
        self.scheduled[mode] += 1
        return StepPlan(rows, mode == SPECULATE, record)

    def observe(self, plan: StepPlan, tokens: int, seconds: float, speculative: bool | None = None) -> None:
        """Record a finished step: ``tokens`` committed in ``seconds`` of step time.

        ``speculative`` says whether any draft token was actually verified (default: what was planned; a
        planned speculative step where every row got γ = 0 ran as a plain one).
        """
        if not plan.record or seconds <= 0:
            return
        st = self.state(plan.rows)
        cfg = self.config
        spec_ran = plan.speculate if speculative is None else speculative
        st.stats[SPECULATE if spec_ran else PLAIN].add(tokens, seconds)
        spec, plain = st.stats[SPECULATE], st.stats[PLAIN]
        if min(spec.samples, plain.samples) < cfg.min_samples:
            return
        if st.mode == SPECULATE and plain.goodput > spec.goodput * (1 + cfg.hysteresis):
            self._switch(st, PLAIN)
        elif st.mode == PLAIN and spec.goodput > plain.goodput * (1 + cfg.hysteresis):
            self._switch(st, SPECULATE)

    @staticmethod
    def _switch(st: BucketState, mode: str) -> None:
        st.mode = mode
        st.switches += 1
        st.since_probe = 0
        st.probe_left = 0

    def as_dict(self) -> dict:
        return {"scheduled": dict(self.scheduled), "buckets": {
            b: {"mode": st.mode, "switches": st.switches,
                "goodput": {m: round(s.goodput, 3) for m, s in st.stats.items()},
                "samples": {m: s.samples for m, s in st.stats.items()}}
            for b, st in sorted(self.buckets.items())}}
