"""Sampling through the whole engine: the output distribution is the target's, and seeds reproduce.

The χ² test runs thousands of short sequences of one prompt (distinct seeds, batched 64 at a time) through
a target/draft pair that often disagree, and compares the joint distribution of the first two generated
tokens with the one computed exactly from the target's own logits: P(a, b) = p(a | prompt) ·
p(b | prompt, a), after temperature / top-k / top-p. With max_tokens = 3 the first step drafts two tokens,
so both positions go through accept, reject-and-recover and bonus paths.
"""

from __future__ import annotations

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from tests.unit.helpers import MAX_NEW, P_MIN, chi2_pvalue, make_engine, make_prompts
from engine.engine import Request
from runtime.models import tiny_llama
from runtime.protocol import ProposalBatch, SamplingParams
from runtime.sampling import sampling_tensors, warp_probs

pytestmark = pytest.mark.timeout(300)

V32 = 32
PROMPT = (3, 17, 9, 25, 4, 11)
NUM_SEQS = 3000


@pytest.fixture(scope="module")
def pair32():
    return tiny_llama(11, vocab_size=V32), tiny_llama(12, vocab_size=V32)


def _exact_joint(model, params: SamplingParams) -> torch.Tensor:  # [V, V]: P(first = a, second = b)
    """The target alone: p(a | prompt) · p(b | prompt + a), from HF's own forward."""
    temperature, top_k, top_p = sampling_tensors([params])
    with torch.no_grad():
        first_logits = model(torch.tensor([PROMPT])).logits[:, -1:]  # [1, 1, V]
        second_logits = model(torch.tensor([PROMPT + (a,) for a in range(V32)])).logits[:, -1:]  # [V, 1, V]
    p0 = warp_probs(first_logits, temperature, top_k, top_p)[0, 0]
    p1 = warp_probs(second_logits, temperature.expand(V32), top_k.expand(V32), top_p.expand(V32))[:, 0]
    return p0.double().unsqueeze(1) * p1.double()


def _sample_pairs(engine, params: SamplingParams, seed0: int) -> torch.Tensor:  # [NUM_SEQS] a * V + b
    reqs = [Request(PROMPT, max_tokens=3, sampling=SamplingParams(params.temperature, params.top_p, params.top_k,
                                                                   seed=seed0 + i)) for i in range(NUM_SEQS)]
    outs = engine.generate(reqs)
    assert all(len(o.tokens) == 3 for o in outs)
    return torch.tensor([o.tokens[0] * V32 + o.tokens[1] for o in outs])


CASES = [  # (name, sampling, the draft's q_top_k: None = dense q)
    ("temperature", SamplingParams(temperature=0.8), None),
    ("top-k", SamplingParams(temperature=0.8, top_k=6), None),
    ("top-p and top-k, sparse q", SamplingParams(temperature=1.0, top_k=12, top_p=0.8), 4),
]


@pytest.mark.parametrize("name,params,q_top_k", CASES, ids=[c[0] for c in CASES])
def test_engine_output_distribution_is_the_targets(name, params, q_top_k, pair32):
    target, draft = pair32
    proposer = DraftModelProposer(draft, max_slots=64, max_len=32, q_top_k=q_top_k)
    engine = make_engine(target, proposer, gamma=4, max_slots=64, max_len=32)
    pairs = _sample_pairs(engine, params, seed0=1000)
    stats = engine.stats
    assert 0.05 < stats.acceptance_rate < 0.9, "both the accept and the reject paths must run"
    joint = _exact_joint(target, params)
    assert chi2_pvalue(pairs // V32, joint.sum(1)) > P_MIN  # first token
    assert chi2_pvalue(pairs % V32, joint.sum(0)) > P_MIN  # second token
    assert chi2_pvalue(pairs, joint.flatten()) > P_MIN  # the pair
    # Negative control: the same samples are far from the draft's own distribution.
    assert chi2_pvalue(pairs, _exact_joint(draft, params).flatten().clamp(min=1e-12)) < P_MIN


def test_identical_draft_accepts_everything_when_sampling(target, prompts):
    """p = q (the draft is the target) accepts every draft token at any temperature."""
    engine = make_engine(target, "same", gamma=4)
    sampling = [SamplingParams(temperature=t, top_k=k, seed=i) for i, (t, k) in
                enumerate([(1.0, 0), (0.7, 5), (1.3, 0), (0.9, 20)] * 4)]
    engine.generate([Request(p, max_tokens=MAX_NEW, sampling=s) for p, s in zip(prompts, sampling)])
    assert engine.stats.proposed > 0
    assert engine.stats.acceptance_rate == 1.0


# -- reproducibility --------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["noisy", "other", "ngram"])
def test_same_seed_same_output_alone_or_in_a_batch(draft, target, noisy_draft, other_draft, prompts):
    """A seeded request's output depends only on its own seed, never on its batch mates.

    The batch mates differ in prompt length, sampling parameters and max_tokens (so the rows' draft
    lengths, and the batch's padded γ, differ from step to step), and some are greedy.
    """
    model = {"noisy": noisy_draft, "other": other_draft, "ngram": "ngram"}[draft]
    probe = Request(prompts[3], max_tokens=20, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=77))
    alone = make_engine(target, model, gamma=4).generate([probe])[0].tokens

    mates = [Request(p, max_tokens=5 + 3 * i, sampling=SamplingParams(temperature=0.5 + 0.1 * i, top_k=i, seed=i)
                     if i % 3 else SamplingParams()) for i, p in enumerate(prompts[4:12])]
    engine = make_engine(target, model, gamma=4)
    first = [engine.add(m) for m in mates[:4]]
    engine.step()  # the probe joins a running batch
    probe_id = engine.add(probe)
    rest = [engine.add(m) for m in mates[4:]]
    while engine.has_work:
        engine.step()
    assert engine.output(probe_id).tokens == alone
    for i in first + rest:
        engine.output(i)
    # And the seed matters: another seed gives another continuation.
    other_seed = Request(probe.prompt, max_tokens=20, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=78))
    assert make_engine(target, model, gamma=4).generate([other_seed])[0].tokens != alone


def test_seeded_runs_are_deterministic(target, noisy_draft, prompts):
    """Two runs of a seeded batch agree exactly (determinism given seeds)."""
    reqs = [Request(p, max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    a = [o.tokens for o in make_engine(target, noisy_draft, gamma=3).generate(reqs)]
    b = [o.tokens for o in make_engine(target, noisy_draft, gamma=3).generate(reqs)]
    assert a == b


def test_unseeded_requests_are_not_all_alike(target, noisy_draft):
    """Without a seed, identical sampled requests must still be independent samples."""
    engine = make_engine(target, noisy_draft, gamma=3)
    prompt = make_prompts(9, n=2)[1]
    outs = engine.generate([Request(prompt, max_tokens=8, sampling=SamplingParams(temperature=1.0))] * 12)
    assert len({o.tokens for o in outs}) > 6


def test_seeded_sample_does_not_depend_on_measured_costs(target, noisy_draft, prompts):
    """The emitted sample depends on the draft length, and the adaptive γ follows measured step times; a
    request with the caller's seed must give the same sample however the timings came out."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    outs = []
    for spec_cost in (0.5, 50.0):  # speculation looks cheap, then hopeless
        engine = make_engine(target, noisy_draft, gamma=3, adaptive=True)
        for _ in range(5):
            engine.policy.observe_step(1, 0, 1.0)
            engine.policy.observe_step(1, 3, spec_cost)
        outs.append(engine.generate([Request(prompts[3], max_tokens=MAX_NEW, sampling=params)])[0].tokens)
    assert outs[0] == outs[1]


def test_seeded_sample_survives_a_draft_that_lost_the_sequence(target, noisy_draft, prompts):
    """A draft replica that does not hold a sequence answers resync (Serve routed its part elsewhere, or a new
    replica took it). The engine drafts that seeded row again with its whole history before verifying, so its
    sample is the one it would have been; an unseeded request is not held back for it."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=4321)
    request = Request(prompts[3], max_tokens=MAX_NEW, sampling=params)
    reference = make_engine(target, noisy_draft, gamma=3).generate([request])[0].tokens
    engine = make_engine(target, noisy_draft, gamma=3)
    seq_id = engine.add(request)
    losses = 0
    while engine.has_work:
        engine.step()
        if seq_id in engine.running and engine.running[seq_id].generated and losses < 3:
            engine.stages.proposer.release([seq_id])  # the draft forgets it between steps
            losses += 1
    assert losses == 3 and engine.seeded_redrafts == 3
    assert engine.output(seq_id).tokens == reference


class _Losing:
    """A draft pool that answers resync for some rows of its next calls: ``losses`` holds, per call, the seq ids
    it lost (it never held them: Serve sent their part to another replica), or None for every row (a call
    that failed, or a pool marked down)."""

    def __init__(self, proposer):
        self.proposer, self.losses = proposer, []

    def propose(self, items):
        ids = [it.sync.seq_id for it in items]
        loss = self.losses.pop(0) if self.losses else set()
        gone = set(ids) if loss is None else loss
        held = [it for it in items if it.sync.seq_id not in gone]
        lost = [i for i in ids if i in gone]
        if not lost:
            return self.proposer.propose(items)
        parts = [self.proposer.propose(held)] if held else []
        return ProposalBatch.concat(parts + [ProposalBatch.empty(lost, lost)]).select(ids)

    def release(self, seq_ids):
        self.proposer.release(seq_ids)


def _seeded_run_with_failing_draft(target, noisy_draft, prompts, fail: int, wait_s: float | None = None):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=4321)
    request = Request(prompts[3], max_tokens=MAX_NEW, sampling=params)
    reference = make_engine(target, noisy_draft, gamma=3).generate([request])[0].tokens
    engine = make_engine(target, noisy_draft, gamma=3)
    if wait_s is not None:
        engine.seeded_draft_wait_s = wait_s
    draft = engine.stages.proposer = _Losing(engine.stages.proposer)
    seq_id = engine.add(request)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:
            draft.losses.extend([None] * fail)
    assert engine.seeded_redrafts >= 1
    return engine.output(seq_id).tokens, reference, len(draft.losses)


@pytest.mark.parametrize("fail", [2, 12])
def test_seeded_sample_waits_for_a_draft_that_keeps_losing_the_sequence(target, noisy_draft, prompts, fail):
    """The draft loses the sequence and then the redraft too (2 calls), or fails every call for six turns
    (12), as a pool marked down does, at once: the seeded row waits for its group's next turns instead of
    being verified without drafts, so its sample is still the one it would have been."""
    tokens, reference, unused = _seeded_run_with_failing_draft(target, noisy_draft, prompts, fail)
    assert unused == 0 and tokens == reference


def test_seeded_rows_survive_a_redraft_that_loses_a_row_the_first_draft_held(target, noisy_draft, prompts):
    """Two seeded rows in one micro-batch. The draft loses the first; the redraft goes to a replica that holds
    neither and loses the second (Serve moved the part to another replica between the calls). Both still
    wait for their drafts, so both samples are the ones they would have been."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=seed) for seed in (4321, 99)]
    requests = [Request(prompts[i], max_tokens=MAX_NEW, sampling=p) for i, p in zip((3, 5), params)]
    reference = [o.tokens for o in make_engine(target, noisy_draft, gamma=3).generate(requests)]
    engine = make_engine(target, noisy_draft, gamma=3)
    draft = engine.stages.proposer = _Losing(engine.stages.proposer)
    ids = [engine.add(r) for r in requests]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:
            draft.losses.extend([{ids[0]}, {ids[1]}])
    assert not draft.losses and engine.seeded_redrafts >= 1
    assert [engine.output(i).tokens for i in ids] == reference


def test_a_seeded_row_stops_waiting_for_a_draft_that_never_answers(target, noisy_draft, prompts):
    """Waiting for the draft is bounded in time: past ``seeded_draft_wait_s`` the row decodes target-only
    (its sample may change) rather than hang."""
    tokens, _, unused = _seeded_run_with_failing_draft(target, noisy_draft, prompts, fail=1000, wait_s=0.05)
    assert unused > 0 and len(tokens) == MAX_NEW
