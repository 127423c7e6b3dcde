"""The acceptance rule as a pure function (docs/design.md#acceptance).

- Table tests in the style of vLLM's ``test_rejection_sampler.py``: ±100 logits make p and q one-hot, so
  every outcome is deterministic.
- χ² tests per output position (vocab 32, 60k rows, fixed seeds): for random p ≠ q — after temperature,
  top-k and top-p are applied to both — the emitted tokens are distributed as the target's p. Negative
  controls (an always-accept rule, a q that is not the one the drafts came from) must fail the same test.
- Identity: identical p and q accept every draft token.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.helpers import P_MIN, chi2_pvalue
from verifier.rejection import PAD, adjust_threshold, rejection_sample, threshold_accept
from runtime.sampling import warp_probs

pytestmark = pytest.mark.timeout(120)

V = 32


def _one_hot_probs(rows: list[list[int]], vocab: int = V) -> torch.Tensor:
    """[B, T, V] probabilities from ±100 logits: 1.0 on the listed token (0.0 elsewhere in fp32)."""
    logits = torch.full((len(rows), len(rows[0]), vocab), -100.0)
    for b, row in enumerate(rows):
        for t, tok in enumerate(row):
            logits[b, t, tok] = 100.0
    return logits.softmax(-1)


def _run(draft: list[list[int]], num_draft: list[int], target_argmax: list[list[int]], sampled_q: bool = False,
         seed: int = 0):
    draft_tokens = torch.tensor(draft, dtype=torch.long).reshape(len(draft), -1)
    B, G = draft_tokens.shape
    p = _one_hot_probs(target_argmax)
    q = _one_hot_probs([row[:G] for row in draft]) if sampled_q and G else None
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(B, G, generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen)
    return rejection_sample(draft_tokens, torch.tensor(num_draft), p, q, uniform, noise)


TABLE = [
    # (name, draft tokens, num_draft, target argmax per position (G+1), expected output, accepted)
    ("perfect match + bonus", [[1, 2, 3]], [3], [[1, 2, 3, 4]], [[1, 2, 3, 4]], [3]),
    ("first token mismatch", [[1, 2, 3]], [3], [[5, 2, 3, 4]], [[5, PAD, PAD, PAD]], [0]),
    ("mismatch in the middle", [[1, 2, 3]], [3], [[1, 5, 3, 4]], [[1, 5, PAD, PAD]], [1]),
    ("mismatch at the last draft", [[1, 2, 3]], [3], [[1, 2, 6, 4]], [[1, 2, 6, PAD]], [2]),
    ("single draft accepted", [[7]], [1], [[7, 9]], [[7, 9]], [1]),
    ("single draft rejected", [[7]], [1], [[8, 9]], [[8, PAD]], [0]),
    ("no draft: just the bonus", [[]], [0], [[9]], [[9]], [0]),
    ("mixed batch, ragged num_draft (padding holds garbage)",
     [[1, 2, 3], [4, 5, 31], [6, 31, 31], [7, 8, 31], [9, 31, 31]],
     [3, 2, 0, 2, 1],
     [[1, 2, 3, 10], [4, 5, 11, 0], [12, 0, 0, 0], [7, 13, 0, 0], [14, 0, 0, 0]],
     [[1, 2, 3, 10], [4, 5, 11, PAD], [12, PAD, PAD, PAD], [7, 13, PAD, PAD], [14, PAD, PAD, PAD]],
     [3, 2, 0, 1, 0]),
]


@pytest.mark.parametrize("sampled_q", [False, True], ids=["greedy-q-None", "dense-one-hot-q"])
@pytest.mark.parametrize("name,draft,num_draft,target,expected,accepted", TABLE, ids=[t[0] for t in TABLE])
def test_table(name, draft, num_draft, target, expected, accepted, sampled_q):
    G = len(draft[0])
    for seed in range(3):  # the coins and the noise cannot change a one-hot outcome
        output, num_accepted, path = _run(draft, num_draft, target, sampled_q=sampled_q, seed=seed)
        assert output.tolist() == expected
        assert num_accepted.tolist() == accepted
        assert path.tolist() == [[i if i < n else PAD for i in range(G)] for n in accepted]  # a chain's path
        assert output.dtype == num_accepted.dtype == path.dtype == torch.long


def test_recovered_token_excludes_the_rejected_draft():
    """p = ½ on tokens 3 and 4, q one-hot on 3: a rejection (coin ≥ ½) must recover token 4, never 3."""
    p = torch.zeros(1, 2, V)
    p[0, 0, 3] = p[0, 0, 4] = 0.5
    p[0, 1, 5] = 1.0
    draft = torch.tensor([[3]])
    for coin, expected in [(0.49, [3, 5]), (0.51, [4, PAD]), (0.99, [4, PAD])]:
        for q in (None, _one_hot_probs([[3]])):
            noise = torch.empty(1, V).exponential_(generator=torch.Generator().manual_seed(1))
            out, _, _ = rejection_sample(draft, torch.tensor([1]), p, q, torch.tensor([[coin]]), noise)
            assert out.tolist() == [expected]


def test_draft_outside_its_own_support_is_rejected():
    """q(d) = 0 means a broken proposer; the rule must not accept d even with the smallest coin."""
    p = torch.full((1, 2, V), 1.0 / V)
    q = torch.zeros(1, 1, V)
    q[0, 0, 0] = 1.0  # the draft token 7 has q = 0
    out, acc, _ = rejection_sample(torch.tensor([[7]]), torch.tensor([1]), p, q, torch.zeros(1, 1), torch.ones(1, V))
    assert acc.tolist() == [0]
    assert out[0, 0].item() != 7


def test_pure_function():
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(4, 3, V, generator=gen).softmax(-1)
    q = torch.rand(4, 2, V, generator=gen).softmax(-1)
    args = (torch.randint(0, V, (4, 2), generator=gen), torch.tensor([2, 1, 0, 2]), p, q,
            torch.rand(4, 2, generator=gen), torch.empty(4, V).exponential_(generator=gen))
    a, b = rejection_sample(*args), rejection_sample(*args)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- identity: p == q accepts everything ------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 8, 1.0), (1.3, 0, 0.8)])
def test_identical_p_and_q_accept_everything(temperature, top_k, top_p):
    B, G = 4096, 5
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, G + 1, V, generator=gen) * 2
    probs = _warp(logits, temperature, top_k, top_p)
    drafts = torch.multinomial(probs[:, :G].reshape(-1, V), 1, generator=gen).view(B, G)
    num_draft = torch.randint(0, G + 1, (B,), generator=gen)
    out, acc, _ = rejection_sample(drafts, num_draft, probs, probs[:, :G], torch.rand(B, G, generator=gen),
                                   torch.empty(B, V).exponential_(generator=gen))
    assert torch.equal(acc, num_draft)  # acceptance exactly 1.0
    positions = torch.arange(G).unsqueeze(0)
    assert torch.equal(torch.where(positions < num_draft.unsqueeze(1), out[:, :G], drafts),
                       drafts)


def test_greedy_identity_one_hot():
    """Greedy: drafts equal to the target's argmax are all accepted, and the bonus is the next argmax."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 5, V, generator=gen)
    zeros = torch.zeros(64)
    probs = warp_probs(logits, zeros, zeros.long(), zeros + 1)
    argmax = logits.argmax(-1)
    out, acc, _ = rejection_sample(argmax[:, :4], torch.full((64,), 4), probs, None,
                                   torch.rand(64, 4, generator=gen), torch.ones(64, V))
    assert acc.tolist() == [4] * 64
    assert torch.equal(out, argmax)


# -- χ²: the emitted tokens follow p ----------------------------------------------------------------------

N = 60_000
WARPS = [  # (temperature, top_k, top_p): each applied to both p and q
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.5, 0, 1.0),
    (1.0, 10, 1.0),
    (1.0, 0, 0.8),
    (0.8, 12, 0.9),
]


def _warp(logits, temperature, top_k, top_p):
    B = logits.shape[0]
    return warp_probs(logits, torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.long),
                      torch.full((B,), float(top_p)))


def _chain(seed: int, temperature: float, top_k: int, top_p: float):
    """Random p ≠ q over a γ = 2 chain, the same for every row; drafts sampled from warped q.

    p at each position does not depend on the prefix (every row shares it), so position i's emitted token,
    given that the step reached it, must be distributed as p_i.
    """
    gen = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(1, 3, V, generator=gen) * 1.5
    q_logits = p_logits[:, :2] + torch.randn(1, 2, V, generator=gen) * 1.5  # related but different
    p = _warp(p_logits, temperature, top_k, top_p)[0]  # [3, V]
    q = _warp(q_logits, temperature, top_k, top_p)[0]  # [2, V]
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(2)], 1)
    uniform = torch.rand(N, 2, generator=gen)
    noise = torch.empty(N, V).exponential_(generator=gen)
    return p, q, drafts, uniform, noise


@pytest.mark.parametrize("temperature,top_k,top_p", WARPS)
def test_chi2_per_position(temperature, top_k, top_p):
    p, q, drafts, uniform, noise = _chain(11, temperature, top_k, top_p)
    assert (p[:2] - q).abs().sum(-1).min() > 0.2  # p and q really differ
    out, acc, _ = rejection_sample(drafts, torch.full((N,), 2), p.expand(N, 3, V), q.expand(N, 2, V), uniform, noise)

    # Position 0: always emitted.
    assert chi2_pvalue(out[:, 0], p[0]) > P_MIN
    # Position 1, given the first draft was accepted (so position 1 was reached within this step).
    reached = acc >= 1
    assert chi2_pvalue(out[reached, 1], p[1]) > P_MIN
    # ... and given in addition that the first emitted token is one specific value.
    first = int(torch.bincount(out[reached, 0], minlength=V).argmax())
    both = reached & (out[:, 0] == first)
    assert both.sum() > 2000
    assert chi2_pvalue(out[both, 1], p[1]) > P_MIN
    # Position 2: the bonus token after a fully accepted chain.
    assert chi2_pvalue(out[acc == 2, 2], p[2]) > P_MIN

    # The acceptance probability at a position is Σ_v min(p, q) (Leviathan et al., Theorem 3.5).
    for i, cond in [(0, torch.ones(N, dtype=torch.bool)), (1, reached)]:
        beta = float(torch.minimum(p[i], q[i]).sum())
        n = int(cond.sum())
        rate = float((acc[cond] > i).float().mean())
        assert abs(rate - beta) < 5 * (beta * (1 - beta) / n) ** 0.5 + 1e-6


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 12, 0.9)])
def test_chi2_ragged_num_draft(temperature, top_k, top_p):
    """Rows with 0, 1 and 2 drafts in one batch: every row's first emitted token still follows p_0."""
    p, q, drafts, uniform, noise = _chain(12, temperature, top_k, top_p)
    num_draft = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(0))
    drafts = torch.where(torch.arange(2) < num_draft.unsqueeze(1), drafts, V - 1)  # garbage beyond num_draft
    out, acc, _ = rejection_sample(drafts, num_draft, p.expand(N, 3, V), q.expand(N, 2, V), uniform, noise)
    assert (acc <= num_draft).all()
    for k in range(3):
        assert chi2_pvalue(out[num_draft == k, 0], p[0]) > P_MIN
    two = (num_draft == 2) & (acc >= 1)
    assert chi2_pvalue(out[two, 1], p[1]) > P_MIN


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 12, 0.9)])
def test_chi2_deterministic_draft(temperature, top_k, top_p):
    """A deterministic proposal (n-gram: q one-hot, ``draft_probs=None``) is exact for sampled p too."""
    p, _, _, uniform, noise = _chain(13, temperature, top_k, top_p)
    drafts = torch.tensor([[int(p[0].argmax()), 5]]).expand(N, 2)  # one likely and one arbitrary draft
    out, acc, _ = rejection_sample(drafts, torch.full((N,), 2), p.expand(N, 3, V), None, uniform, noise)
    assert chi2_pvalue(out[:, 0], p[0]) > P_MIN
    assert chi2_pvalue(out[acc >= 1, 1], p[1]) > P_MIN


def test_chi2_negative_controls():
    """The χ² test has power: wrong acceptance rules fail it on the same data."""
    p, q, drafts, uniform, noise = _chain(11, 1.0, 0, 1.0)
    pb, qb = p.expand(N, 3, V), q.expand(N, 2, V)
    # Always accept: coins of 0 and a one-hot q make every draft with p > 0 accepted → x_0 ~ q_0.
    out, acc, _ = rejection_sample(drafts, torch.full((N,), 2), pb, None, torch.zeros(N, 2), noise)
    assert bool((acc == 2).all())
    assert chi2_pvalue(out[:, 0], p[0]) < P_MIN
    # Verify against a q the drafts were not drawn from (uniform): acceptance and residual are both wrong.
    out, _, _ = rejection_sample(drafts, torch.full((N,), 2), pb, torch.full((N, 2, V), 1.0 / V), uniform, noise)
    assert chi2_pvalue(out[:, 0], p[0]) < P_MIN
    # Sanity: the correct rule on the same data passes.
    out, _, _ = rejection_sample(drafts, torch.full((N,), 2), pb, qb, uniform, noise)
    assert chi2_pvalue(out[:, 0], p[0]) > P_MIN


# -- the lossy rule ---------------------------------------------------------------------------------------


def test_threshold_accept_table():
    p = torch.zeros(3, 3, V)
    p[:, :, 0] = 0.2
    p[:, :, 1] = 0.8  # every position: token 1 has p 0.8, token 0 has 0.2
    drafts = torch.tensor([[1, 1], [1, 0], [0, 1]])
    out, acc, _ = threshold_accept(drafts, torch.tensor([2, 2, 1]), p, torch.full((3,), 0.5), torch.ones(3, V))
    assert acc.tolist() == [2, 1, 0]
    assert out.tolist() == [[1, 1, 1], [1, 1, PAD], [1, PAD, PAD]]


def test_adjust_threshold():
    assert adjust_threshold(0.5, 0.95) == pytest.approx(0.525)  # accepting too much: stricter
    assert adjust_threshold(0.5, 0.3) == pytest.approx(0.475)  # accepting too little: looser
    assert adjust_threshold(0.5, 0.7) == 0.5
    assert adjust_threshold(0.99, 1.0) == 1.0  # capped
