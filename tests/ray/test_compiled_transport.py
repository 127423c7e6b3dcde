"""The stage client over compiled links (``deployments.transport``) to stage-worker actors, without Serve.

Greedy outputs through compiled channels equal the in-process engine's,
with two micro-batches in flight and three draft workers (one that no micro-batch maps to); a draft worker killed mid-run turns its steps
into target-only steps and leaves membership; a verifier worker killed between steps costs re-prefills
on its replacement; a draft worker added under load joins. No request is lost or truncated in any case.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ARGS = {"target": {"path": "builtin:tiny", "max_model_len": 128},
        "draft": {"kind": "model", "path": "builtin:tiny"},
        "speculation": {"gamma": 4, "adaptive": False},
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


class WorkerPool:
    """Stage workers the module's tests share: each start is a process that imports torch and builds its
    model (~8 s of CPU here), and the five tests would otherwise start eighteen. A test takes the workers it
    needs (missing ones are started); one it kills leaves the pool. Each test's engine numbers its sequences
    from a block of its own (``random_first_seq_id``), so no test's sync can meet another's cache."""

    def __init__(self, settings, limits):
        self.settings, self.limits = settings, limits
        self.drafts: list = []
        self.verifiers: list = []

    def start_draft(self):
        """A new draft worker, in the pool."""
        from deployments.stage_workers import start_worker
        from engine.assembly import make_proposer

        self.drafts.append(start_worker(functools.partial(make_proposer, self.settings), self.limits))
        return self.drafts[-1]

    def start_verifier(self):
        """A new verifier worker, in the pool."""
        from deployments.stage_workers import start_worker
        from engine.assembly import make_verify_stage

        self.verifiers.append(start_worker(functools.partial(make_verify_stage, self.settings), self.limits))
        return self.verifiers[-1]

    def take(self, n_drafts: int):
        while len(self.drafts) < n_drafts:
            self.start_draft()
        if not self.verifiers:
            self.start_verifier()
        return {f"draft-{i}": w for i, w in enumerate(self.drafts[:n_drafts])}, self.verifiers[0]

    def killed(self, worker) -> None:
        import ray

        ray.kill(worker)
        for members in (self.drafts, self.verifiers):
            if worker in members:
                members.remove(worker)

    def close(self) -> None:
        import ray

        for worker in self.drafts + self.verifiers:
            ray.kill(worker)


@pytest.fixture(scope="module")
def pool(parts):
    settings, limits, _, _ = parts
    pool = WorkerPool(settings, limits)
    yield pool
    pool.close()


def _engine(settings, limits, pool: WorkerPool, n_drafts: int = 2):
    from deployments.transport.client import StageClient
    from deployments.transport.routes import WorkerRoute
    from engine.assembly import make_engine
    from engine.engine import random_first_seq_id

    drafts, verifier = pool.take(n_drafts)
    # Generous: on the shared 2-core box a loaded step can take seconds, and a timed-out draft would be a
    # (correct) target-only step that the equality test would count as a fallback.
    stages = StageClient(limits, draft=WorkerRoute("draft"), verifier=WorkerRoute("verifier"), draft_timeout_s=120.0,
                         verify_timeout_s=120.0)
    stages.draft.set(drafts)
    stages.verifier.set({"verifier-0": verifier})
    engine = make_engine(settings, stages=stages, first_seq_id=random_first_seq_id())
    assert engine.micro_batches == 2
    return engine, stages, drafts, verifier


def _close(stages) -> None:
    """Tear the graphs down and wait for it: the pool's next test compiles new graphs on the same workers."""
    stages.close()
    for thread in threading.enumerate():
        if thread.name.startswith("specserve-teardown-"):
            thread.join(timeout=60)


def _run(engine, requests, on_step=None) -> list[list[int]]:
    ids = [engine.add(r) for r in requests]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
    return [list(engine.output(i).tokens) for i in ids]


def test_outputs_equal_the_in_process_engine(parts, pool):
    """Three draft workers for two micro-batches: the third drafts nothing and still gets every release.
    A second batch whose rows finish at different steps sends it more releases than a compiled graph holds
    in flight, unless the link reads them (``WorkerLink.release``)."""
    import dataclasses

    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, pool, n_drafts=3)
    try:
        assert _run(engine, requests) == expected
        staggered = [dataclasses.replace(r, max_tokens=4 * (i + 1)) for i, r in enumerate(requests)]
        assert _run(engine, staggered) == [e[:4 * (i + 1)] for i, e in enumerate(expected)]
        assert stages.fallbacks == 0
        assert any(stage == "draft" for stage, _, _ in stages.timings.drain())  # it drafted remotely
        assert len(stages.draft.all()) == 3 and stages.draft.rebuilds == 1  # none dropped
    finally:
        _close(stages)


def test_dead_draft_worker_means_target_only_steps_and_leaves_membership(parts, pool):
    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, pool)
    victim = drafts["draft-0"]

    def kill(step):
        if step == 3:
            pool.killed(victim)

    try:
        assert _run(engine, requests, kill) == expected
        assert [link.key for link in stages.draft.all()] == ["draft-1"]
        assert stages.fallback_reasons["draft_died"] + stages.fallback_reasons["draft_timeout"] >= 1
    finally:
        _close(stages)


def test_dead_verifier_worker_resyncs_on_its_replacement(parts, pool):
    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, pool)

    def replace(step):
        if step == 4:
            pool.killed(verifier)
            engine.step()  # the step that finds it dead: its rows are marked for re-prefill
            stages.verifier.set({"verifier-1": pool.start_verifier()})

    try:
        assert _run(engine, requests, replace) == expected
        assert engine.verifier_resyncs > 0
    finally:
        _close(stages)


def test_draft_worker_added_under_load_joins(parts, pool):
    settings, limits, requests, expected = parts
    engine, stages, drafts, verifier = _engine(settings, limits, pool, n_drafts=1)
    spare = pool.take(2)[0]["draft-1"]  # a worker of the pool that the engine's graphs do not reach yet

    def grow(step):
        if step == 3:
            stages.draft.set({**drafts, "draft-new": spare})

    try:
        assert _run(engine, requests, grow) == expected
        assert [link.key for link in stages.draft.all()] == ["draft-0", "draft-new"]
    finally:
        _close(stages)
