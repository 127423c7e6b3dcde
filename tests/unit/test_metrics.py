"""cluster.metrics: every entry is something ray.util.metrics will accept and dashboards can rely on."""

from __future__ import annotations

import re

from cluster import metrics


def test_metric_specs_are_well_formed() -> None:
    assert len(metrics.METRICS) == 39
    for name, spec in metrics.METRICS.items():
        assert name == spec.name and re.fullmatch(r"specserve_[a-z_]+", name)
        assert not name.endswith("_total"), "Ray's exporter adds _total to counters"
        assert spec.description and spec.kind in ("counter", "gauge", "histogram")
        if spec.kind == "histogram":
            bounds = spec.boundaries
            assert bounds and all(b > 0 for b in bounds) and list(bounds) == sorted(set(bounds))
        else:
            assert spec.boundaries == ()


def test_tag_keys() -> None:
    tags = {name: spec.tag_keys for name, spec in metrics.METRICS.items() if spec.tag_keys}
    assert tags == {
        metrics.DRAFT_TOKENS_BY_POSITION: ("position",),
        metrics.ACCEPTED_BY_POSITION: ("position",),
        metrics.STEP_LATENCY: ("stage",),
        metrics.FALLBACKS: ("reason",),
        metrics.REQUESTS: ("status",),
        metrics.REQUESTS_CANCELLED: ("phase",),
        metrics.KV_SLOTS_IN_USE: ("model",),
        metrics.KV_SLOTS_CAPACITY: ("model",),
        metrics.KV_BLOCKS_IN_USE: ("model",),
        metrics.KV_BLOCKS_CAPACITY: ("model",),
        metrics.PREFIX_CACHE_LOOKUP_TOKENS: ("model",),
        metrics.PREFIX_CACHE_HIT_TOKENS: ("model",),
        metrics.STAGE_SECONDS: ("stage",),
        metrics.STEPS: ("mode", "batch"),
        metrics.STEP_SECONDS: ("mode", "batch"),
        metrics.STEP_TOKENS: ("mode", "batch"),
        metrics.REQUEST_LATENCY: ("status",),
        **{name: ("gpu",) for name in metrics.GPU_METRICS},
        metrics.FIDELITY_CHECKS: ("result",),
        metrics.STRUCTURED_REQUESTS: ("kind", "outcome"),
        metrics.GRAMMAR_COMPILE_SECONDS: ("kind",),
    }


def test_batch_buckets_cover_the_batch_cap():
    from cluster.config import MAX_BATCH_CAP
    from runtime.runner import batch_bucket

    assert str(batch_bucket(MAX_BATCH_CAP)) == metrics.BATCH_BUCKETS[-1]
    assert {str(batch_bucket(n)) for n in range(1, 300)} <= set(metrics.BATCH_BUCKETS)


def test_structured_kinds_are_the_grammar_layers():
    from engine.grammar import KINDS

    assert metrics.STRUCTURED_KINDS == KINDS


def test_descriptions_are_ascii():
    # Ray's metric exporter encodes descriptions as ASCII and raises on anything else at replica start.
    for spec in metrics.METRICS.values():
        spec.description.encode("ascii")
