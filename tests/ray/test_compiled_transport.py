"""The compiled step loop (``deployments.channel_stages``) over stage-worker actors, without Serve.

Greedy outputs through compiled channels and through direct actor calls equal the in-process engine's,
with two micro-batches in flight and three draft workers (one that no micro-batch maps to); a draft worker killed mid-run turns its steps
into target-only steps and leaves membership; a verifier worker killed between steps costs re-prefills
on its replacement; a draft worker added under load joins. No request is lost or truncated in any case.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ARGS = {"target": {"path": "builtin:tiny", "max_model_len": 128},
        "draft": {"kind": "model", "path": "builtin:tiny"},
        "speculation": {"gamma": 4, "adaptive": False, "goodput_guard": False},
        "router": {"max_running": 8, "micro_batches": 2},
        "defaults": {"temperature": 0.0}}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def parts(ray_cluster):
    from cluster.config import ClusterConfig
    from deployments.settings import engine_settings, wire_limits
    from engine.assembly import make_engine
    from engine.engine import Request

    cfg = ClusterConfig.from_dict(ARGS)
    settings = engine_settings(cfg)
    gen = torch.Generator().manual_seed(11)
    requests = [Request(tuple(torch.randint(3, 256, (int(n),), generator=gen).tolist()), max_tokens=MAX_TOKENS)
                for n in (5, 17, 30, 9, 12, 3)]
    expected = [list(o.tokens) for o in make_engine(settings).generate(requests)]
    return settings, wire_limits(cfg), requests, expected


def _workers(settings, limits, n_drafts: int):
    from deployments.stage_workers import start_worker
    from engine.assembly import make_proposer, make_verify_stage

    drafts = {f"draft-{i}": start_worker(functools.partial(make_proposer, settings), limits) for i in range(n_drafts)}
    verifier = start_worker(functools.partial(make_verify_stage, settings), limits)
    return drafts, verifier


def _engine(settings, limits, transport: str, n_drafts: int = 2):
    from deployments.channel_stages import ChannelStages
    from engine.assembly import make_engine

    drafts, verifier = _workers(settings, limits, n_drafts)
    # Generous: on the shared 2-core box a loaded step can take seconds, and a timed-out draft would be a
    # (correct) target-only step that the equality test would count as a fallback.
    stages = ChannelStages(limits, transport=transport, draft_timeout_s=120.0, verify_timeout_s=120.0)
    stages.set_draft_workers(drafts)
    stages.set_verifier_workers({"verifier-0": verifier})
    engine = make_engine(settings, stages=stages)
    assert engine.micro_batches == 2
    return engine, stages, drafts, verifier


def _close(stages) -> None:
    """Tear the graphs down and end the members' workers: the driver owns them, so they would live (each
    holding its models) until the session's end."""
    import ray

    workers = [link.worker for link in stages.drafts.all() + stages.verifiers.all()]
    stages.close()
    for worker in workers:
        ray.kill(worker)


def _run(engine, requests, on_step=None) -> list[list[int]]:
    ids = [engine.add(r) for r in requests]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
    return [list(engine.output(i).tokens) for i in ids]


@pytest.mark.parametrize("transport", ["compiled", "actor"])
def test_outputs_equal_the_in_process_engine(parts, transport):
    """Three draft workers for two micro-batches: the third drafts nothing and still gets every release.
    A second batch whose rows finish at different steps sends it more releases than a compiled graph holds
    in flight, unless the link reads them (``WorkerLink.release``)."""
    import dataclasses

    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, transport, n_drafts=3)
    try:
        assert _run(engine, requests) == expected
        staggered = [dataclasses.replace(r, max_tokens=4 * (i + 1)) for i, r in enumerate(requests)]
        assert _run(engine, staggered) == [e[:4 * (i + 1)] for i, e in enumerate(expected)]
        assert stages.fallbacks == 0
        assert any(stage == "draft" for stage, _, _ in stages.timings.drain())  # it drafted remotely
        assert len(stages.drafts.all()) == 3 and stages.drafts.rebuilds == 1  # none dropped
    finally:
        _close(stages)


def test_dead_draft_worker_means_target_only_steps_and_leaves_membership(parts):
    import ray

    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, "compiled")
    victim = drafts["draft-0"]

    def kill(step):
        if step == 3:
            ray.kill(victim)

    try:
        assert _run(engine, requests, kill) == expected
        assert [link.key for link in stages.drafts.all()] == ["draft-1"]
        assert stages.fallback_reasons["draft_died"] + stages.fallback_reasons["draft_timeout"] >= 1
    finally:
        _close(stages)


def test_dead_verifier_worker_resyncs_on_its_replacement(parts):
    import ray

    from deployments.stage_workers import start_worker
    from engine.assembly import make_verify_stage

    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, "compiled")

    def replace(step):
        if step == 4:
            ray.kill(verifier)
            engine.step()  # the step that finds it dead: its rows are marked for re-prefill
            stages.set_verifier_workers(
                {"verifier-1": start_worker(functools.partial(make_verify_stage, settings), limits)})

    try:
        assert _run(engine, requests, replace) == expected
        assert engine.verifier_resyncs > 0
    finally:
        _close(stages)


def test_draft_worker_added_under_load_joins(parts):
    from deployments.stage_workers import start_worker
    from engine.assembly import make_proposer

    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, "compiled", n_drafts=1)

    def grow(step):
        if step == 3:
            stages.set_draft_workers(
                {**drafts, "draft-new": start_worker(functools.partial(make_proposer, settings), limits)})

    try:
        assert _run(engine, requests, grow) == expected
        assert [link.key for link in stages.drafts.all()] == ["draft-0", "draft-new"]
    finally:
        _close(stages)
