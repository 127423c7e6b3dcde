"""Names, kinds, tags and descriptions of every metric specserve exports.

Contract: this module is the single source of metric names. ``deployments/`` creates one
``ray.util.metrics`` object per entry of ``METRICS`` (kind → Counter / Gauge / Histogram, with the
entry's ``description``, ``tag_keys`` and, for histograms, ``boundaries``); dashboards query the same
names. Tag values must come from the tuples below (``STAGES``, ``FALLBACK_REASONS``, ...) so that series
never multiply by typo. No ray import here: the CLI and dashboard generators read it without Ray.

Export names: Ray's Prometheus exporter prefixes every name with ``ray_``, and since Ray 2.10 also
exports counters with a ``_total`` suffix — so ``specserve_drafts`` is scraped as
``ray_specserve_drafts_total``. That is why no name here ends in ``_total``.

Counting conventions (the glossary of docs/design.md): one *draft* is one sequence's proposal going through
one verify step, so ``emitted_tokens / drafts`` is the mean acceptance length and
``accepted_tokens / draft_tokens`` the acceptance rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DRAFTS = "specserve_drafts"
DRAFT_TOKENS = "specserve_draft_tokens"
ACCEPTED_TOKENS = "specserve_accepted_tokens"
EMITTED_TOKENS = "specserve_emitted_tokens"
DRAFT_TOKENS_BY_POSITION = "specserve_draft_tokens_by_position"
ACCEPTED_BY_POSITION = "specserve_accepted_tokens_by_position"
STEP_LATENCY = "specserve_step_latency_seconds"
FALLBACKS = "specserve_fallbacks"
REQUESTS = "specserve_requests"
REQUESTS_CANCELLED = "specserve_requests_cancelled"
RUNNING_SEQUENCES = "specserve_running_sequences"
QUEUE_DEPTH = "specserve_queue_depth"
ACCEPTANCE_RATE = "specserve_acceptance_rate"
KV_SLOTS_IN_USE = "specserve_kv_slots_in_use"

# Allowed tag values.
STAGES = ("draft", "verify", "transport", "schedule")
FALLBACK_REASONS = ("draft_died", "draft_down", "draft_timeout", "draft_garbage", "draft_resync")
REQUEST_STATUSES = ("ok", "error", "timeout", "rejected", "cancelled")
CANCEL_PHASES = ("queued", "running")
KV_MODELS = ("target", "draft")
# Tag values of the *_BY_POSITION counters: "0" … "15" (the γ hard cap is 16; Ray tag values are strings).
POSITIONS = tuple(str(i) for i in range(16))

# Seconds. A verify step of a 6–8B target on an H200 is ~3 ms and a compiled-graph hop ~0.1 ms, so
# the buckets are dense between 50 µs and 50 ms and coarse up to the slowest CPU steps.
STEP_LATENCY_BOUNDARIES = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()  # histograms only


METRICS: dict[str, MetricSpec] = {
    m.name: m
    for m in (
        MetricSpec(
            DRAFTS,
            "counter",
            "Proposals verified: one per sequence per verify step (the denominator of the mean "
            "acceptance length).",
        ),
        MetricSpec(DRAFT_TOKENS, "counter", "Draft tokens proposed and verified."),
        MetricSpec(ACCEPTED_TOKENS, "counter", "Draft tokens accepted by the verify step."),
        MetricSpec(
            EMITTED_TOKENS,
            "counter",
            "Tokens committed to sequences: accepted draft tokens plus one recovered or bonus token "
            "per verify step.",
        ),
        MetricSpec(
            DRAFT_TOKENS_BY_POSITION,
            "counter",
            "Draft tokens proposed at each chain position (0 = first draft token).",
            tag_keys=("position",),
        ),
        MetricSpec(
            ACCEPTED_BY_POSITION,
            "counter",
            "Draft tokens accepted at each chain position; divided by "
            f"{DRAFT_TOKENS_BY_POSITION} it gives the per-position acceptance.",
            tag_keys=("position",),
        ),
        MetricSpec(
            STEP_LATENCY,
            "histogram",
            "Wall time of one batched step's stage: draft (proposer forwards), verify (target "
            "forward + acceptance), transport (serialization and hops), schedule (router work).",
            tag_keys=("stage",),
            boundaries=STEP_LATENCY_BOUNDARIES,
        ),
        MetricSpec(
            FALLBACKS,
            "counter",
            "Batched steps that fell back because the draft pool failed: a replica died, missed its "
            "deadline or returned a proposal that did not validate (a target-only step), the pool was "
            "marked down so the step did not ask it (draft_down), or a replica had to re-prefill sequences "
            "it never saw after they moved to it (draft_resync).",
            tag_keys=("reason",),
        ),
        MetricSpec(REQUESTS, "counter", "Requests finished, by final status.", tag_keys=("status",)),
        MetricSpec(
            REQUESTS_CANCELLED,
            "counter",
            "Requests cancelled by the client, by where they were: queued (freed a queue slot) or "
            "running (freed KV slots mid-decode).",
            tag_keys=("phase",),
        ),
        MetricSpec(RUNNING_SEQUENCES, "gauge", "Sequences decoding now (holding KV slots)."),
        MetricSpec(QUEUE_DEPTH, "gauge", "Requests admitted but waiting for a running slot."),
        MetricSpec(
            ACCEPTANCE_RATE,
            "gauge",
            "Accepted / proposed draft tokens over the router's recent window (the value adaptive gamma "
            "and dynamic threshold adjustment react to).",
        ),
        MetricSpec(
            KV_SLOTS_IN_USE,
            "gauge",
            "Preallocated KV-cache slots holding a sequence, per model.",
            tag_keys=("model",),
        ),
    )
}
