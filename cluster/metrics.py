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
DRAFT_NODES = "specserve_draft_nodes"
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
KV_SLOTS_CAPACITY = "specserve_kv_slots_capacity"
KV_BLOCKS_IN_USE = "specserve_kv_blocks_in_use"
KV_BLOCKS_CAPACITY = "specserve_kv_blocks_capacity"
PREFIX_CACHE_LOOKUP_TOKENS = "specserve_prefix_cache_lookup_tokens"
PREFIX_CACHE_HIT_TOKENS = "specserve_prefix_cache_hit_tokens"
PREEMPTIONS = "specserve_preemptions"
REJECTIONS = "specserve_rejections"
STAGE_SECONDS = "specserve_stage_seconds"
STEPS = "specserve_steps"
STEP_SECONDS = "specserve_step_seconds"
STEP_TOKENS = "specserve_step_tokens"
TTFT = "specserve_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "specserve_inter_token_latency_seconds"
REQUEST_LATENCY = "specserve_request_latency_seconds"
GPU_UTILIZATION = "specserve_gpu_utilization_ratio"
GPU_MEMORY_USED = "specserve_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "specserve_gpu_memory_total_bytes"
GPU_SM_CLOCK = "specserve_gpu_sm_clock_hertz"
FIDELITY_CHECKS = "specserve_fidelity_checks"
FIDELITY_FIRST_DIFFERENCE = "specserve_fidelity_first_difference_position"
STRUCTURED_REQUESTS = "specserve_structured_requests"
GRAMMAR_COMPILE_SECONDS = "specserve_grammar_compile_seconds"
MASK_SECONDS = "specserve_mask_seconds"
FORCED_TOKENS = "specserve_forced_tokens"

# Allowed tag values.
STAGES = ("draft", "verify", "transport", "schedule")
FALLBACK_REASONS = ("draft_died", "draft_down", "draft_timeout", "draft_garbage", "draft_resync")
REQUEST_STATUSES = ("ok", "error", "timeout", "rejected", "cancelled")
CANCEL_PHASES = ("queued", "running")
KV_MODELS = ("target", "draft")
# Tag values of the *_BY_POSITION counters: "0" … "15" (the γ hard cap is 16; Ray tag values are strings).
POSITIONS = tuple(str(i) for i in range(16))
# Tag values of STEPS / STEP_SECONDS / STEP_TOKENS: a step is speculative when it verified a draft token.
STEP_MODES = ("speculative", "plain")
# Batch-size buckets (runtime.runner.batch_bucket: the next power of two of the step's rows) as tag values.
BATCH_BUCKETS = tuple(str(1 << i) for i in range(17))  # 1 … 65536 (config.MAX_BATCH_CAP)
COMPUTE_STAGES = ("draft", "verify")
FIDELITY_RESULTS = ("match", "mismatch")
# Structured outputs: the grammar kinds a request can ask for (engine.grammar.KINDS), and what admission did
# with its grammar: compiled it, found it in the cache, or refused it (a 400).
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
GRAMMAR_OUTCOMES = ("compiled", "cache_hit", "error")

# Seconds. A verify step of a 6–8B target on an H200 is ~3 ms and a compiled-graph hop ~0.1 ms, so
# the buckets are dense between 50 µs and 50 ms and coarse up to the slowest CPU steps.
STEP_LATENCY_BOUNDARIES = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

# Seconds per request: first tokens arrive within ~10 ms on a GPU and within seconds on this CPU box;
# whole requests take up to the request timeout (default 120 s).
REQUEST_LATENCY_BOUNDARIES = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# Seconds between consecutive token deliveries of one request (one step, or a step's several tokens).
INTER_TOKEN_BOUNDARIES = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
# Seconds to compile one grammar: a regex or a small schema takes milliseconds, the limit is seconds.
COMPILE_BOUNDARIES = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Generated-token index of the first difference; position 0 falls in the first bucket (le 1).
FIRST_DIFFERENCE_BOUNDARIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


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
        MetricSpec(DRAFT_TOKENS, "counter", "Draft positions proposed: a chain's draft tokens, a token tree's depth."),
        MetricSpec(
            DRAFT_NODES,
            "counter",
            "Draft tokens verified: a chain's draft tokens, every node of a token tree. Over "
            f"{DRAFTS} it is the mean tree size; over {DRAFT_TOKENS}, the mean tree width.",
        ),
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
        MetricSpec(
            KV_SLOTS_CAPACITY,
            "gauge",
            "Preallocated KV-cache slots in all, per model (the denominator of KV occupancy).",
            tag_keys=("model",),
        ),
        MetricSpec(
            KV_BLOCKS_IN_USE,
            "gauge",
            "KV blocks held by sequences, per model (blocks of the prefix cache no sequence holds are free).",
            tag_keys=("model",),
        ),
        MetricSpec(
            KV_BLOCKS_CAPACITY,
            "gauge",
            "KV blocks in each pool, per model (kv.num_blocks).",
            tag_keys=("model",),
        ),
        MetricSpec(
            PREFIX_CACHE_LOOKUP_TOKENS,
            "counter",
            "Prompt tokens looked up in the prefix cache (whole blocks, at most the prompt length - 1), per "
            "model; hit / lookup tokens is the cache's hit rate.",
            tag_keys=("model",),
        ),
        MetricSpec(
            PREFIX_CACHE_HIT_TOKENS,
            "counter",
            "Prompt tokens found in the prefix cache, so not computed again, per model.",
            tag_keys=("model",),
        ),
        MetricSpec(
            PREEMPTIONS,
            "counter",
            "Running sequences sent back to the queue because the KV pools could not hold them all; each is "
            "re-prefilled when it runs again (its output is unchanged).",
        ),
        MetricSpec(
            REJECTIONS,
            "counter",
            "Drafts whose verify step ended at a rejected draft token; alpha = accepted / (accepted + "
            "rejections), the per-token acceptance of the Leviathan model.",
        ),
        MetricSpec(
            STAGE_SECONDS,
            "counter",
            "Compute seconds the stages report for the router's steps: draft (all proposer forwards of "
            "a step) and verify (one target forward + acceptance). draft / (verify * mean gamma) is the "
            "cost ratio c of one draft forward to one target forward.",
            tag_keys=("stage",),
        ),
        MetricSpec(
            STEPS,
            "counter",
            "Batched verify steps by mode: speculative (verified at least one draft token) or plain "
            "(target-only: the gamma policy's plain or off steps, a fallback), by batch-size bucket.",
            tag_keys=("mode", "batch"),
        ),
        MetricSpec(
            STEP_SECONDS,
            "counter",
            "Wall seconds of batched steps by mode and batch-size bucket; with the step tokens it gives "
            "the measured goodput of speculative and of plain steps.",
            tag_keys=("mode", "batch"),
        ),
        MetricSpec(
            STEP_TOKENS,
            "counter",
            "Tokens committed by batched steps by mode and batch-size bucket.",
            tag_keys=("mode", "batch"),
        ),
        MetricSpec(
            TTFT,
            "histogram",
            "Seconds from admission to the first generated token of a request.",
            boundaries=REQUEST_LATENCY_BOUNDARIES,
        ),
        MetricSpec(
            INTER_TOKEN_LATENCY,
            "histogram",
            "Seconds between consecutive token deliveries of one request, one observation per token "
            "(a step that delivers k tokens counts its gap once and k - 1 zero gaps).",
            boundaries=INTER_TOKEN_BOUNDARIES,
        ),
        MetricSpec(
            REQUEST_LATENCY,
            "histogram",
            "Seconds from admission to the last event of a request, by final status.",
            tag_keys=("status",),
            boundaries=REQUEST_LATENCY_BOUNDARIES,
        ),
        MetricSpec(
            GPU_UTILIZATION,
            "gauge",
            "NVML GPU utilisation (0-1) over its last sample period, per device of the replica's node. "
            "Not exported where NVML or a GPU is absent.",
            tag_keys=("gpu",),
        ),
        MetricSpec(GPU_MEMORY_USED, "gauge", "NVML device memory in use, bytes.", tag_keys=("gpu",)),
        MetricSpec(GPU_MEMORY_TOTAL, "gauge", "NVML device memory in all, bytes.", tag_keys=("gpu",)),
        MetricSpec(GPU_SM_CLOCK, "gauge", "NVML SM clock, hertz.", tag_keys=("gpu",)),
        MetricSpec(
            FIDELITY_CHECKS,
            "counter",
            "Sampled finished greedy requests re-decoded without speculation, by whether the plain "
            "output matched the served one (router.fidelity_sample_rate).",
            tag_keys=("result",),
        ),
        MetricSpec(
            FIDELITY_FIRST_DIFFERENCE,
            "histogram",
            "Generated-token index of the first difference of a fidelity mismatch.",
            boundaries=FIRST_DIFFERENCE_BOUNDARIES,
        ),
        MetricSpec(
            STRUCTURED_REQUESTS,
            "counter",
            "Requests with structured outputs (response_format / structured_outputs), by grammar kind and what "
            "admission did with the grammar: compiled, served from the compiled-grammar cache, or refused (400).",
            tag_keys=("kind", "outcome"),
        ),
        MetricSpec(
            GRAMMAR_COMPILE_SECONDS,
            "histogram",
            "Seconds to compile one grammar (cache misses only), by kind.",
            tag_keys=("kind",),
            boundaries=COMPILE_BOUNDARIES,
        ),
        MetricSpec(
            MASK_SECONDS,
            "counter",
            f"Seconds the router's steps spent filling and applying grammar masks (draft and verify); over "
            f"{STEP_SECONDS} it is the mask work's share of step time.",
        ),
        MetricSpec(
            FORCED_TOKENS,
            "counter",
            f"Tokens a grammar forced, proposed without the draft model and verified in the same pass; over "
            f"{EMITTED_TOKENS} it is the forced-token share. Not counted in {DRAFT_TOKENS} or {ACCEPTED_TOKENS}.",
        ),
    )
}

GPU_METRICS = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_SM_CLOCK)
