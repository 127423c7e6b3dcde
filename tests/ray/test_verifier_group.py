"""The tensor-parallel verifier group on a real local Ray cluster: TP = 2 over gloo against TP = 1, and a
rank killed mid-generation (the group is rebuilt as a unit and the sequences resync). The group feeds its
ranks through a compiled graph here; the cluster suite's TP = 2 app over Serve handles uses actor calls.

Both tests share one TP = 2 group (its start costs two worker processes that import torch, transformers
and deepspeed: ~30 s on a 2-core box); the second test kills one of its ranks, so it runs last.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from engine.engine import Done, Engine, LocalStages, Request
from engine.gamma import GammaPolicy
from runtime import wire
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import ProposalBatch, SyncItem, VerifyItem
from runtime.runner import ModelRunner
from verifier.verify import VerifyStage

pytestmark = pytest.mark.ray

SPEC = {"tiny": {"seed": 0}}
MAX_LEN = 96
MAX_NEW = 16
SLOTS = 8
NOISE = 0.03  # the draft: a noisy copy of the target, acceptance in between


def ragged_prompts(n: int = 6, seed: int = 3) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 30] + torch.randint(2, 30, (n - 2,), generator=gen).tolist()
    return [tuple(torch.randint(3, 96, (k,), generator=gen).tolist()) for k in lengths]


def proposer() -> DraftModelProposer:
    return DraftModelProposer(noisy_copy(tiny_llama(0), NOISE, 1), max_slots=SLOTS, max_len=MAX_LEN)


def make_engine(stages) -> Engine:
    return Engine(stages, policy=GammaPolicy(gamma=4, gamma_max=8, adaptive=True), max_len=MAX_LEN)


class _RetryingVerify:
    """The router's side of a failed verify: retry once on the rebuilt group (whose answer resyncs)."""

    def __init__(self, stages: "GroupStages", items, proposal):
        from deployments.verifier_group import VerifierGroupError

        self.stages, self.items, self.proposal = stages, items, proposal
        try:
            self.pending = stages.group.submit_relay(wire.encode_verify(items, proposal))
        except VerifierGroupError as exc:  # a compiled graph's channels close with a rank: rebuilt on sending
            self.pending = exc

    def result(self):
        from deployments.verifier_group import VerifierGroupError

        try:
            if isinstance(self.pending, VerifierGroupError):
                raise self.pending
            outcome = self.pending.result()
        except VerifierGroupError:
            self.stages.failures += 1
            outcome = self.stages.group.verify(self.items, self.proposal)
        self.stages.resynced += len(outcome.resync)
        return outcome


class GroupStages:
    """``engine.engine.Stages`` with the draft in this process and the verify stage on the group."""

    def __init__(self, group, draft):
        self.group, self.draft = group, draft
        self.failures = 0
        self.resynced = 0

    def submit_propose(self, items, shard=0):
        return Done(self.draft.propose(items))

    def submit_verify(self, items, proposal, shard=0):
        return _RetryingVerify(self, items, proposal)

    def release(self, seq_ids, shard=0):
        self.group.release(seq_ids)
        self.draft.release(seq_ids)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


@pytest.fixture(scope="module")
def reference(prompts):
    """TP = 1, in process: the same engine, proposer and steps."""
    stage = VerifyStage(ModelRunner(tiny_llama(0), max_slots=SLOTS, max_len=MAX_LEN))
    outputs = make_engine(LocalStages(stage, proposer())).generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    return [o.tokens for o in outputs]


@pytest.fixture(scope="module")
def group(ray_cluster):
    from deployments.verifier_group import GroupSpec, VerifierGroup

    t0 = time.perf_counter()
    g = VerifierGroup(GroupSpec(SPEC, tp_size=2, device="cpu", dtype="float32", max_slots=SLOTS, max_len=MAX_LEN,
                                num_cpus=1, verify_timeout_s=120, dist_timeout_s=120))
    print(f"TP=2 verifier group started in {time.perf_counter() - t0:.1f} s")
    yield g
    g.shutdown()


def test_tp2_group_matches_tp1(group, prompts, reference):
    info = group.info()
    full = tiny_llama(0)
    assert [i["local_kv_heads"] for i in info] == [full.config.num_key_value_heads // 2] * 2
    assert all(not i["shm_allreduce"] and i["backend"] == "gloo" and i["torch_threads"] == 1 for i in info)
    ranks = group.health()["ranks"]
    assert [(r["rank"], r["ready"]) for r in ranks] == [(0, True), (1, True)]
    assert len({r["pid"] for r in ranks}) == 2  # one process per rank
    assert group.master[0] != "0.0.0.0"

    stages = GroupStages(group, proposer())
    outputs = make_engine(stages).generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert [o.tokens for o in outputs] == reference
    assert stages.failures == 0 and group.disagreements == 0
    assert sum(o.stats.accepted for o in outputs) > 0  # the draft did get tokens accepted


def test_rank_death_rebuilds_group_and_generation_completes_via_resync(group, prompts, reference):
    from deployments.verifier_group import VerifierGroupError

    stages = GroupStages(group, proposer())
    engine = make_engine(stages)
    ids = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert any(engine.running[i].generated for i in ids)  # mid-generation
    import ray

    ray.kill(group.actors[1], no_restart=True)
    with pytest.raises(VerifierGroupError):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the kill is asynchronous
            group.health(timeout_s=5)
            time.sleep(0.2)
    # Serve's health check (rebuilding_ok) polled from another thread while the engine's next step rebuilds
    # the group: from the moment the rebuild starts it must never fail (a failure would restart the replica).
    answers: list = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                answers.append(group.health(timeout_s=2, rebuilding_ok=True).get("rebuilding_s", "ok"))
            except VerifierGroupError:
                answers.append("error")
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    while any(i not in engine.finished for i in ids):
        engine.step()
    stop.set()
    poller.join(timeout=10)
    print(f"rebuild + finish: {time.perf_counter() - t0:.1f} s")
    during = [a for a in answers if a != "error"]
    assert during and any(isinstance(a, float) for a in during), answers  # it answered "rebuilding"
    first = next(i for i, a in enumerate(answers) if isinstance(a, float))
    assert "error" not in answers[first:], answers
    assert [engine.output(i).tokens for i in ids] == reference
    assert group.rebuilds == 1 and group.generation == 1 and stages.failures == 1
    assert stages.resynced >= 1  # the rebuilt group answered resync and the engine re-prefilled
    assert group.health()["generation"] == 1

    # After a rebuild the group holds nothing: a sequence it never saw (base > 0) comes back as resync.
    outcome = group.verify([VerifyItem(SyncItem(999, 5, (7,)))], ProposalBatch.empty([999]))
    assert outcome.resync == [999] and outcome.emitted == [[]]
