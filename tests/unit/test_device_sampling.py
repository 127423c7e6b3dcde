"""χ² tests of the on-device sampling: counter-based noise (``runtime.rng``), the exponential race, the
warps (temperature, top-k, top-p), the draft's token choice and the whole rejection rule fed with rng
draws — each with negative controls showing the test would catch a wrong sampler. CUDA runs the same
checks in tests/gpu/test_gpu_static.py.
"""

from __future__ import annotations

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from runtime import rng
from runtime.models import tiny_llama
from runtime.sampling import race, warp_probs
from tests.unit.helpers import P_MIN, chi2_pvalue
from verifier.rejection import greedy_accept, rejection_sample

V = 48
N = 30_000
WARPS = [(0.7, 0, 1.0), (1.0, 10, 1.0), (1.0, 0, 0.8), (1.3, 12, 0.9)]  # (temperature, top_k, top_p)


def _logits(seed: int) -> torch.Tensor:  # [V]
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:  # [B, V]
    B = logits.shape[0]
    return warp_probs(logits.unsqueeze(1), torch.full((B,), temperature), torch.full((B,), top_k),
                      torch.full((B,), top_p))[:, 0]


def _keys(stream: int, n: int = N, position: int = 5) -> torch.Tensor:  # [n, 2]: one seed per row
    return rng.stream_keys(list(range(n)), [position] * n, stream)


def test_uniform_and_exponential_are_what_they_say():
    u = rng.uniform(_keys(rng.VERIFY_COIN).unsqueeze(1), torch.arange(4)).reshape(-1)
    assert (u >= 0).all() and (u < 1).all()
    assert chi2_pvalue((u * 32).long(), torch.full((32,), 1 / 32)) > P_MIN
    e = rng.exponential(_keys(rng.VERIFY_NOISE).unsqueeze(1), torch.arange(4)).reshape(-1)
    assert torch.isfinite(e).all() and (e > 0).all()
    assert abs(float(e.mean()) - 1) < 0.02 and abs(float(e.var()) - 1) < 0.05
    # Neighbouring counters and neighbouring seeds are uncorrelated.
    pairs = rng.uniform(_keys(rng.VERIFY_COIN).unsqueeze(1), torch.arange(2))
    assert abs(float(torch.corrcoef(pairs.T)[0, 1])) < 0.03
    assert abs(float(torch.corrcoef(torch.stack([pairs[:-1, 0], pairs[1:, 0]]))[0, 1])) < 0.03


def test_draws_are_batch_invariant_and_match_python_ints():
    keys = _keys(rng.DRAFT_TOKEN, n=5)
    counters = torch.arange(V)
    batch = rng.random_bits(keys.unsqueeze(1), counters)
    alone = torch.stack([rng.random_bits(keys[b].view(1, 1, 2), counters)[0] for b in range(5)])
    assert torch.equal(batch, alone)
    k1, k2 = rng.stream_key(3, 5, rng.DRAFT_TOKEN)
    assert int(batch[3, 7]) == rng.mix32(rng.mix32(7 ^ k1) ^ k2)  # the tensor hash is the integer hash


@pytest.mark.parametrize("temperature,top_k,top_p", WARPS)
def test_race_with_rng_noise_samples_the_warped_distribution(temperature, top_k, top_p):
    p = _warp(_logits(1).expand(N, V), temperature, top_k, top_p)
    draws = race(p, rng.exponential(_keys(rng.DRAFT_TOKEN).unsqueeze(1), torch.arange(V)))
    assert chi2_pvalue(draws, p[0]) > P_MIN


def test_race_negative_controls():
    """The same χ² test fails a sampler that is wrong in each of the ways that matter."""
    p = _warp(_logits(1).expand(N, V), 1.0, 0, 1.0)
    counters = torch.arange(V)
    # Uniform noise in place of exponential: the race is no longer proportional to p.
    wrong = race(p, rng.uniform(_keys(rng.DRAFT_TOKEN).unsqueeze(1), counters) + 1e-6)
    assert chi2_pvalue(wrong, p[0]) < P_MIN
    # Every row with the same seed: one draw repeated, not a sample.
    same = race(p, rng.exponential(rng.stream_keys([7] * N, [5] * N, rng.DRAFT_TOKEN).unsqueeze(1), counters))
    assert chi2_pvalue(same, p[0]) < P_MIN
    # Warped at another temperature than the one tested against.
    hot = race(_warp(_logits(1).expand(N, V), 1.6, 0, 1.0),
               rng.exponential(_keys(rng.DRAFT_TOKEN).unsqueeze(1), counters))
    assert chi2_pvalue(hot, p[0]) < P_MIN


@pytest.mark.parametrize("q_top_k", [None, 6], ids=["dense-q", "top6-q"])
@pytest.mark.parametrize("temperature,top_k,top_p", WARPS[1:3])
def test_draft_choice_samples_its_own_q(q_top_k, temperature, top_k, top_p):
    """The draft's on-device token choice draws from the q it reports (sparse q: the truncated one)."""
    proposer = DraftModelProposer(tiny_llama(0, vocab_size=V), max_slots=1, max_len=8, q_top_k=q_top_k)
    logits = _logits(2).expand(N, V)
    token, ids, ps = proposer._choose(logits, _keys(rng.DRAFT_TOKEN), torch.full((N,), temperature),
                                      torch.full((N,), top_k), torch.full((N,), top_p), q_top_k or V, True)
    q = torch.zeros(V).scatter_add_(0, ids[0], ps[0])
    assert torch.equal(ids, ids[:1].expand_as(ids)) and torch.allclose(ps, ps[:1].expand_as(ps))
    assert chi2_pvalue(token, q) > P_MIN
    if q_top_k:
        assert int((q > 0).sum()) <= q_top_k


def test_rejection_rule_with_rng_draws_emits_p():
    """The whole sampled step as verify runs it: drafts from q by the race, coins and noise from the
    verify streams; the first emitted token follows p, the second (after an acceptance) p_1."""
    p = _warp(torch.stack([_logits(3), _logits(4), _logits(5)]), 1.0, 0, 1.0)  # [3, V]
    q = _warp(torch.stack([_logits(3) + _logits(6), _logits(4) + _logits(7)]), 1.0, 0, 1.0)  # [2, V]
    counters = torch.arange(V)
    drafts = torch.stack([race(q[i].expand(N, V), rng.exponential(_keys(rng.DRAFT_TOKEN, position=5 + i)
                                                                  .unsqueeze(1), counters)) for i in range(2)], 1)
    coins = rng.uniform(_keys(rng.VERIFY_COIN).unsqueeze(1), torch.arange(2))
    noise = rng.exponential(_keys(rng.VERIFY_NOISE).unsqueeze(1), counters)
    out, acc, _ = rejection_sample(drafts, torch.full((N,), 2), p.expand(N, 3, V), q.expand(N, 2, V), coins, noise)
    assert chi2_pvalue(out[:, 0], p[0]) > P_MIN
    assert chi2_pvalue(out[acc >= 1, 1], p[1]) > P_MIN
    # Negative control: coins from the draft's own noise stream are correlated with the drafts.
    bad_coins = rng.uniform(_keys(rng.DRAFT_TOKEN).unsqueeze(1), drafts[:, :1]).expand(N, 2)
    bad, _, _ = rejection_sample(drafts, torch.full((N,), 2), p.expand(N, 3, V), q.expand(N, 2, V), bad_coins, noise)
    assert chi2_pvalue(bad[:, 0], p[0]) < P_MIN


def test_greedy_accept_is_rejection_sample_on_one_hot():
    gen = torch.Generator().manual_seed(8)
    B, G = 256, 5
    logits = torch.randn(B, G + 1, V, generator=gen)
    argmax = logits.argmax(-1)
    num_draft = torch.randint(0, G + 1, (B,), generator=gen)
    # Drafts that agree with the argmax for a random prefix, then anything.
    agree = torch.arange(G) < torch.randint(0, G + 1, (B,), generator=gen).unsqueeze(1)
    drafts = torch.where(agree, argmax[:, :G], torch.randint(0, V, (B, G), generator=gen))
    zeros = torch.zeros(B)
    p = warp_probs(logits, zeros, zeros.long(), zeros + 1)
    expected = rejection_sample(drafts, num_draft, p, None, torch.rand(B, G, generator=gen),
                                rng.exponential(_keys(rng.VERIFY_NOISE, n=B).unsqueeze(1), torch.arange(V)))
    got = greedy_accept(drafts, num_draft, argmax)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
