"""Exactness of constrained speculative sampling: the law of the output is the target's, masked by the grammar
and renormalised, then warped (temperature, top-k, top-p) — the law of target-only constrained decoding.

Thousands of short sequences of one prompt (distinct seeds) go through a target/draft pair that often disagree,
constrained to a regex whose first two tokens range over a few dozen pairs; the joint law of the first two
tokens is compared with the one computed from the target's own logits and the grammar's masks. With
max_tokens = 3 the first step drafts two tokens, so both positions see accept, reject-and-recover and bonus
paths. The negative control keeps everything but puts the draft's *unmasked* q in the ratio (and the residual),
as a draft cut at the grammar's first refusal would: the test must reject it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from engine.engine import Request
from engine.grammar import GrammarSpec
from runtime.grammar import allow_all, apply_mask, unpack
from runtime.models import tiny_llama
from runtime.protocol import SamplingParams
from runtime.sampling import sampling_tensors, warp_probs
from tests.fixtures_tokenizer import tokenizer
from tests.unit.grammar_fixtures import compiler
from tests.unit.helpers import P_MIN, chi2_pvalue, make_engine

pytestmark = pytest.mark.timeout(300)

V = 384
NUM_SEQS = 2000
SLOTS = 128
REGEX = GrammarSpec("regex", "[xqzjvkw]{3}")  # single-letter tokens only in this vocabulary: 7 × 7 pairs


@functools.lru_cache(maxsize=None)
def pair():
    return tiny_llama(11, vocab_size=V), tiny_llama(12, vocab_size=V)


@functools.lru_cache(maxsize=None)
def prompt() -> tuple[int, ...]:
    return tuple(tokenizer()("The record:")["input_ids"])


def _masked_law(model, logits: torch.Tensor,  # [R, V]
                masks: torch.Tensor,  # [R, W]
                params: SamplingParams) -> torch.Tensor:  # [R, V]
    t, k, p = sampling_tensors([params] * logits.shape[0])
    return warp_probs(apply_mask(logits, masks).unsqueeze(1), t, k, p)[:, 0].double()


def exact_joint(model, params: SamplingParams, spec: GrammarSpec = REGEX, lead: tuple[int, ...] = ()
                ) -> torch.Tensor:  # [V, V]: P(first = a, second = b) after the prompt and ``lead``
    """The target alone, constrained: p(a | prompt) · p(b | prompt + a), each masked by the grammar then warped
    (after ``lead``, the tokens the grammar forces first, when given)."""
    matcher = compiler().compile(spec).matcher()
    assert matcher.consume(lead)
    context = prompt() + lead
    first_mask = allow_all(1, V)
    matcher.fill_mask(first_mask)
    second_masks = allow_all(V, V)  # rows of refused first tokens are never weighted: p0 is 0 there
    for a in unpack(first_mask, V)[0].nonzero().flatten().tolist():
        assert matcher.consume([a])
        matcher.fill_mask(second_masks[a : a + 1])
        matcher.rollback(1)
    with torch.no_grad():
        first = model(torch.tensor([context])).logits[:, -1]
        second = model(torch.tensor([context + (a,) for a in range(V)])).logits[:, -1]
    p0 = _masked_law(model, first, first_mask, params)[0]
    p1 = _masked_law(model, second, second_masks, params)
    return p0.unsqueeze(1) * p1


class UnmaskedRatio:
    """The negative control's proposer: the real masked draft, whose first proposal of each sequence reports
    the draft's unmasked (warped) q at its drafted positions instead of the masked q it drew from."""

    def __init__(self, proposer: DraftModelProposer, draft_model):
        self.proposer, self.model = proposer, draft_model

    def propose(self, items):
        batch = self.proposer.propose(items)
        groups: dict[int, list[int]] = {}  # drafts → first-proposal rows (one prompt: one forward per group)
        for b, it in enumerate(items):
            if not it.sync.base and int(batch.lengths[b]):
                groups.setdefault(int(batch.lengths[b]), []).append(b)
        for n, rows in groups.items():
            contexts = torch.tensor([list(items[b].sync.tokens) + batch.row_tokens(b) for b in rows])
            with torch.no_grad():
                logits = self.model(contexts).logits[:, len(prompt()) - 1 : -1]  # [R, n, V]
            t, k, p = sampling_tensors([items[b].sampling for b in rows])
            batch.q_probs[rows, :n] = warp_probs(logits, t, k, p)  # dense q: the ids are 0..V-1
        return batch

    def release(self, seq_ids):
        self.proposer.release(seq_ids)


def sample_pairs(engine, params: SamplingParams, seed0: int, spec: GrammarSpec = REGEX, lead: tuple[int, ...] = ()
                 ) -> torch.Tensor:  # [NUM_SEQS] a * V + b: the two tokens after ``lead``
    grammar = compiler().compile(spec)
    n = len(lead)
    reqs = [Request(prompt(), max_tokens=n + 3, grammar=grammar,
                    sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed0 + i))
            for i in range(NUM_SEQS)]
    outs = engine.generate(reqs)
    assert all(len(o.tokens) == n + 3 and o.tokens[:n] == lead for o in outs)
    return torch.tensor([o.tokens[n] * V + o.tokens[n + 1] for o in outs])


CASES = [  # (name, sampling, the draft's q_top_k: None = dense q)
    ("T=1", SamplingParams(temperature=1.0), None),
    ("T=0.7 top-k top-p, sparse q", SamplingParams(temperature=0.7, top_k=5, top_p=0.995), 4),
]


@pytest.mark.parametrize("name,params,q_top_k", CASES, ids=[c[0] for c in CASES])
def test_constrained_speculative_sampling_is_the_masked_targets_law(name, params, q_top_k):
    target, draft = pair()
    proposer = DraftModelProposer(draft, max_slots=SLOTS, max_len=32, q_top_k=q_top_k)
    engine = make_engine(target, proposer, gamma=4, max_slots=SLOTS, max_len=32)
    pairs = sample_pairs(engine, params, seed0=1000)
    assert 0.1 < engine.stats.acceptance_rate < 0.9, "both the accept and the reject paths must run"
    joint = exact_joint(target, params)
    assert int((joint > 0).sum()) >= 9, "the grammar must leave several pairs"
    assert chi2_pvalue(pairs // V, joint.sum(1)) > P_MIN  # first token
    assert chi2_pvalue(pairs % V, joint.sum(0)) > P_MIN  # second token
    assert chi2_pvalue(pairs, joint.flatten()) > P_MIN  # the pair


def test_a_forced_run_and_the_drafts_after_it_keep_the_law():
    """The grammar forces "x" first: the engine proposes it (one-hot q) and the draft drafts two tokens after it,
    all verified in one pass; the two tokens after the forced one follow the masked target's law."""
    target, draft = pair()
    spec, lead = GrammarSpec("regex", "x[xqzjvkw]{3}"), (tokenizer().convert_tokens_to_ids("x"),)
    assert compiler().compile(spec).matcher().forced_tokens() == list(lead)
    params = CASES[0][1]
    engine = make_engine(target, DraftModelProposer(draft, max_slots=SLOTS, max_len=32), gamma=4, max_slots=SLOTS,
                         max_len=32)
    pairs = sample_pairs(engine, params, seed0=3000, spec=spec, lead=lead)
    assert engine.stats.forced == NUM_SEQS and 0.1 < engine.stats.acceptance_rate < 0.9
    assert chi2_pvalue(pairs, exact_joint(target, params, spec, lead).flatten()) > P_MIN


def test_unmasked_q_in_the_ratio_is_rejected():
    """At T = 1 the draft's unmasked q gives the allowed tokens a little mass, the masked q much more: the ratio
    p / q_unmasked accepts far too often. (Under a tight top-k the unmasked q is often 0 on every allowed token;
    such drafts are rejected outright and the recovered token comes from p itself, which is why the control
    runs where the bias shows.)"""
    target, draft = pair()
    params = CASES[0][1]
    proposer = UnmaskedRatio(DraftModelProposer(draft, max_slots=SLOTS, max_len=32), draft)
    engine = make_engine(target, proposer, gamma=4, max_slots=SLOTS, max_len=32)
    pairs = sample_pairs(engine, params, seed0=1000)
    assert chi2_pvalue(pairs, exact_joint(target, params).flatten()) < P_MIN
