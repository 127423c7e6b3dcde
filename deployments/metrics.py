"""Prometheus metrics through ``ray.util.metrics``, named by ``cluster.metrics``.

The router feeds engine statistics after every step (as deltas of the engine's cumulative counters);
replicas report their own KV-slot gauges. Ray's metrics agent exports them for Prometheus to scrape.
"""

from __future__ import annotations

from ray.util import metrics as ray_metrics

from cluster import metrics as names
from engine.stats import SpecStats

_KINDS = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge, "histogram": ray_metrics.Histogram}


def create(*wanted: str) -> dict:
    out = {}
    for name in wanted:
        spec = names.METRICS[name]
        kwargs = {"description": spec.description, "tag_keys": spec.tag_keys}
        if spec.kind == "histogram":
            kwargs["boundaries"] = list(spec.boundaries)
        out[name] = _KINDS[spec.kind](name, **kwargs)
    return out


class RouterMetrics:
    def __init__(self):
        self.m = create(names.DRAFTS, names.DRAFT_TOKENS, names.ACCEPTED_TOKENS, names.EMITTED_TOKENS,
                        names.ACCEPTED_BY_POSITION, names.DRAFT_TOKENS_BY_POSITION, names.STEP_LATENCY, names.FALLBACKS, names.REQUESTS,
                        names.REQUESTS_CANCELLED, names.RUNNING_SEQUENCES, names.QUEUE_DEPTH,
                        names.ACCEPTANCE_RATE)
        self.seen = SpecStats()

    def after_step(self, totals: SpecStats, timings: list[tuple[str, float, float]], step_wall: float,
                   waited: float, running: int, queued: int) -> None:
        m, seen = self.m, self.seen
        for name, now, before in ((names.DRAFTS, totals.steps, seen.steps),
                                  (names.DRAFT_TOKENS, totals.proposed, seen.proposed),
                                  (names.ACCEPTED_TOKENS, totals.accepted, seen.accepted),
                                  (names.EMITTED_TOKENS, totals.emitted, seen.emitted)):
            if now > before:
                m[name].inc(now - before)
        for name, now, before in ((names.ACCEPTED_BY_POSITION, totals.position_accepted, seen.position_accepted),
                                  (names.DRAFT_TOKENS_BY_POSITION, totals.position_proposed, seen.position_proposed)):
            for i, value in enumerate(now[: len(names.POSITIONS)]):
                delta = value - (before[i] if i < len(before) else 0)
                if delta > 0:
                    m[name].inc(delta, tags={"position": names.POSITIONS[i]})
        window = SpecStats(proposed=totals.proposed - seen.proposed, accepted=totals.accepted - seen.accepted)
        if window.proposed:
            m[names.ACCEPTANCE_RATE].set(window.acceptance_rate)
        self.seen = SpecStats()
        self.seen.merge(totals)
        hist = m[names.STEP_LATENCY]
        for stage, wall, compute in timings:
            hist.observe(compute, tags={"stage": stage})
            hist.observe(max(0.0, wall - compute), tags={"stage": "transport"})
        hist.observe(max(0.0, step_wall - waited), tags={"stage": "schedule"})
        m[names.RUNNING_SEQUENCES].set(running)
        m[names.QUEUE_DEPTH].set(queued)

    def fallback(self, reason: str, n: int) -> None:
        self.m[names.FALLBACKS].inc(1, tags={"reason": reason})

    def request_done(self, status: str) -> None:
        self.m[names.REQUESTS].inc(1, tags={"status": status})

    def cancelled(self, phase: str) -> None:
        self.m[names.REQUESTS_CANCELLED].inc(1, tags={"phase": phase})


class SlotGauge:
    def __init__(self, model: str):
        self.gauge = create(names.KV_SLOTS_IN_USE)[names.KV_SLOTS_IN_USE]
        self.model = model

    def set(self, value: int) -> None:
        self.gauge.set(value, tags={"model": self.model})
