"""Prometheus metrics through ``ray.util.metrics``, named by ``cluster.metrics``.

The router feeds engine statistics after every step (as deltas of the engine's cumulative counters),
request timings through a ``RequestClock`` per request and fidelity checks as they finish; replicas
report their own KV-slot gauges, and every process that records metrics (router, verifier and draft
replicas) samples its node's GPUs through NVML. Ray's metrics agent exports them for Prometheus to scrape
(docs/observability.md).

Ray evicts a gauge that was not set within two export intervals, so an idle replica's queue depth or KV
slots would vanish from Prometheus instead of reading 0: ``GAUGES`` sets every gauge's last value again,
and samples the GPUs, every ``GAUGE_REFRESH_S`` on one daemon thread per process.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ray.util import metrics as ray_metrics

from cluster import metrics as names
from runtime.runner import batch_bucket
from engine.stats import SpecStats
from runtime import gpu_metrics

if TYPE_CHECKING:
    from engine.fidelity import FidelityResult

log = logging.getLogger("specserve.metrics")

GAUGE_REFRESH_S = 2.0  # under Ray's eviction age (2 x metrics_report_interval_ms, floored at 2 s)

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


class GaugeKeeper:
    """Sets gauges and remembers their last values; its thread sets them again and runs the samplers."""

    def __init__(self):
        self._last: dict[tuple[int, tuple], tuple[object, float, dict]] = {}  # (gauge, tags) → last set
        self._samplers: list = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def set(self, gauge, value: float, tags: dict | None = None) -> None:
        tags = tags or {}
        gauge.set(value, tags=tags)
        with self._lock:
            self._last[id(gauge), tuple(sorted(tags.items()))] = (gauge, value, tags)
        self._start()

    def add_sampler(self, sample) -> None:
        """``sample()`` runs on the keeper's thread every refresh."""
        with self._lock:
            self._samplers.append(sample)
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specserve-gauges", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            with self._lock:
                last, samplers = list(self._last.values()), list(self._samplers)
            for sample in samplers:
                try:
                    sample()
                except Exception:  # a GPU read failing (driver reset) must not stop the gauges
                    log.exception("metric sampler failed")
            for gauge, value, tags in last:
                gauge.set(value, tags=tags)


GAUGES = GaugeKeeper()


class RouterMetrics:
    def __init__(self):
        self.m = create(names.DRAFTS, names.DRAFT_TOKENS, names.DRAFT_NODES, names.ACCEPTED_TOKENS, names.EMITTED_TOKENS,
                        names.ACCEPTED_BY_POSITION, names.DRAFT_TOKENS_BY_POSITION, names.STEP_LATENCY, names.FALLBACKS, names.REQUESTS,
                        names.REQUESTS_CANCELLED, names.RUNNING_SEQUENCES, names.QUEUE_DEPTH,
                        names.ACCEPTANCE_RATE, names.REJECTIONS, names.STAGE_SECONDS, names.STEPS,
                        names.STEP_SECONDS, names.STEP_TOKENS, names.TTFT, names.INTER_TOKEN_LATENCY,
                        names.REQUEST_LATENCY, names.FIDELITY_CHECKS, names.FIDELITY_FIRST_DIFFERENCE,
                        names.STRUCTURED_REQUESTS, names.GRAMMAR_COMPILE_SECONDS, names.MASK_SECONDS,
                        names.FORCED_TOKENS, names.PREEMPTIONS)
        self.seen = SpecStats()
        self.preempted = 0
        watch_gpus()

    def after_step(self, totals: SpecStats, timings: list[tuple[str, float, float]], step_wall: float,
                   waited: float, running: int, queued: int, preempted: int) -> None:
        m, seen = self.m, self.seen
        if preempted > self.preempted:
            m[names.PREEMPTIONS].inc(preempted - self.preempted)
        self.preempted = preempted
        for name, now, before in ((names.DRAFTS, totals.steps, seen.steps),
                                  (names.DRAFT_TOKENS, totals.proposed, seen.proposed),
                                  (names.DRAFT_NODES, totals.nodes, seen.nodes),
                                  (names.ACCEPTED_TOKENS, totals.accepted, seen.accepted),
                                  (names.EMITTED_TOKENS, totals.emitted, seen.emitted),
                                  (names.REJECTIONS, totals.rejections, seen.rejections),
                                  (names.FORCED_TOKENS, totals.forced, seen.forced),
                                  (names.MASK_SECONDS, totals.mask_seconds, seen.mask_seconds)):
            if now > before:
                m[name].inc(now - before)
        for stage, now, before in (("draft", totals.draft_seconds, seen.draft_seconds),
                                   ("verify", totals.verify_seconds, seen.verify_seconds)):
            if now > before:
                m[names.STAGE_SECONDS].inc(now - before, tags={"stage": stage})
        rows = totals.steps - seen.steps  # sequences this step verified
        if rows > 0:
            mode = {"mode": "speculative" if totals.proposed > seen.proposed else "plain",
                    "batch": str(batch_bucket(rows))}
            m[names.STEPS].inc(1, tags=mode)
            m[names.STEP_SECONDS].inc(step_wall, tags=mode)
            if totals.emitted > seen.emitted:
                m[names.STEP_TOKENS].inc(totals.emitted - seen.emitted, tags=mode)
        for name, now, before in ((names.ACCEPTED_BY_POSITION, totals.position_accepted, seen.position_accepted),
                                  (names.DRAFT_TOKENS_BY_POSITION, totals.position_proposed, seen.position_proposed)):
            for i, value in enumerate(now[: len(names.POSITIONS)]):
                delta = value - (before[i] if i < len(before) else 0)
                if delta > 0:
                    m[name].inc(delta, tags={"position": names.POSITIONS[i]})
        window = SpecStats(proposed=totals.proposed - seen.proposed, accepted=totals.accepted - seen.accepted)
        if window.proposed:
            GAUGES.set(m[names.ACCEPTANCE_RATE], window.acceptance_rate)
        self.seen = SpecStats()
        self.seen.merge(totals)
        hist = m[names.STEP_LATENCY]
        for stage, wall, compute in timings:
            hist.observe(compute, tags={"stage": stage})
            hist.observe(max(0.0, wall - compute), tags={"stage": "transport"})
        hist.observe(max(0.0, step_wall - waited), tags={"stage": "schedule"})
        GAUGES.set(m[names.RUNNING_SEQUENCES], running)
        GAUGES.set(m[names.QUEUE_DEPTH], queued)

    def grammar(self, kind: str, outcome: str, compile_seconds: float | None = None) -> None:
        """A structured-output request's grammar at admission (``names.GRAMMAR_OUTCOMES``)."""
        self.m[names.STRUCTURED_REQUESTS].inc(1, tags={"kind": kind, "outcome": outcome})
        if compile_seconds is not None:
            self.m[names.GRAMMAR_COMPILE_SECONDS].observe(compile_seconds, tags={"kind": kind})

    def fallback(self, reason: str, n: int) -> None:
        self.m[names.FALLBACKS].inc(1, tags={"reason": reason})

    def request_done(self, status: str) -> None:
        self.m[names.REQUESTS].inc(1, tags={"status": status})

    def cancelled(self, phase: str) -> None:
        self.m[names.REQUESTS_CANCELLED].inc(1, tags={"phase": phase})

    def request_clock(self, started: float) -> "RequestClock":
        """Times one request admitted at ``started`` (``time.monotonic``)."""
        return RequestClock(self.m, started)

    def fidelity(self, result: FidelityResult) -> None:
        """One finished check of ``engine.fidelity.FidelityMonitor`` (its ``on_result``)."""
        self.m[names.FIDELITY_CHECKS].inc(1, tags={"result": "match" if result.match else "mismatch"})
        if result.first_difference is not None:
            self.m[names.FIDELITY_FIRST_DIFFERENCE].observe(result.first_difference)


class RequestClock:
    """TTFT, inter-token gaps and end-to-end latency of one request, fed with its token deliveries."""

    def __init__(self, m: dict, started: float):
        self.m, self.started = m, started
        self.last: float | None = None  # time of the previous delivery

    def delivered(self, tokens: int, now: float) -> None:
        """``tokens`` produced at ``now`` (``time.monotonic``)."""
        if tokens <= 0:
            return
        if self.last is None:
            self.m[names.TTFT].observe(now - self.started)
        else:
            self.m[names.INTER_TOKEN_LATENCY].observe(now - self.last)
        for _ in range(tokens - 1):  # the step's further tokens arrived with no gap of their own
            self.m[names.INTER_TOKEN_LATENCY].observe(0.0)
        self.last = now

    def finished(self, status: str) -> None:
        self.m[names.REQUEST_LATENCY].observe(time.monotonic() - self.started, tags={"status": status})


class GpuGauges:
    """NVML readings of this process's node as the GPU gauges; none at all where NVML reads no device."""

    def __init__(self, reader: gpu_metrics.NvmlReader | None = None):
        self.reader = reader or gpu_metrics.NvmlReader()
        self.gauges: dict | None = None  # created on the first reading, so a CPU node registers none

    def sample(self) -> None:
        samples = gpu_metrics.series(self.reader.read())
        if samples and self.gauges is None:
            self.gauges = create(*names.GPU_METRICS)
        for name, value, tags in samples:
            self.gauges[name].set(value, tags=tags)


_gpus: GpuGauges | None = None


def watch_gpus() -> None:
    """Sample this node's GPUs every gauge refresh, once per process however many metric sets it has."""
    global _gpus
    if _gpus is None:
        _gpus = GpuGauges()
        GAUGES.add_sampler(_gpus.sample)


class KVGauges:
    """A replica's KV pool of one model — slots, blocks, prefix-cache lookups — and its node's GPUs."""

    def __init__(self, model: str):
        self.m = create(names.KV_SLOTS_IN_USE, names.KV_SLOTS_CAPACITY, names.KV_BLOCKS_IN_USE,
                        names.KV_BLOCKS_CAPACITY, names.PREFIX_CACHE_LOOKUP_TOKENS, names.PREFIX_CACHE_HIT_TOKENS)
        self.tags = {"model": model}
        self.counted = (0, 0)  # lookup and hit tokens already exported
        watch_gpus()

    def update(self, runner) -> None:
        """From a ``runtime.runner.ModelRunner`` after a stage call."""
        pool, m, tags = runner.pool, self.m, self.tags
        GAUGES.set(m[names.KV_SLOTS_IN_USE], runner.slots_in_use, tags)
        GAUGES.set(m[names.KV_SLOTS_CAPACITY], runner.max_slots, tags)
        GAUGES.set(m[names.KV_BLOCKS_IN_USE], pool.blocks_in_use, tags)
        GAUGES.set(m[names.KV_BLOCKS_CAPACITY], pool.num_blocks, tags)
        for name, now, before in ((names.PREFIX_CACHE_LOOKUP_TOKENS, pool.lookup_tokens, self.counted[0]),
                                  (names.PREFIX_CACHE_HIT_TOKENS, pool.hit_tokens, self.counted[1])):
            if now > before:
                m[name].inc(now - before, tags=tags)
        self.counted = (pool.lookup_tokens, pool.hit_tokens)
