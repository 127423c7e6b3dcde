"""The γ policy: Leviathan et al.'s speed-up model and the adaptive choice built on it."""

from __future__ import annotations

import pytest

from verifier.gamma import GammaPolicy, GammaState, expected_speedup, expected_tokens_per_step
from verifier.stats import SpecStats

pytestmark = pytest.mark.timeout(60)


def leviathan(alpha, gamma, c):
    """S = (1 − α^(γ+1)) / ((1 − α)(γc + 1)), Leviathan et al. 2023, Theorem 3.8."""
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


@pytest.mark.parametrize("alpha", [0.0, 0.18, 0.5, 0.62, 0.89, 0.99])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.3, 1.0])
def test_expected_speedup_is_the_leviathan_formula(alpha, gamma, c):
    assert expected_speedup(alpha, gamma, c) == pytest.approx(leviathan(alpha, gamma, c), rel=1e-12)
    # tokens per step: a geometric series 1 + α + … + α^γ
    assert expected_tokens_per_step(alpha, gamma) == pytest.approx(sum(alpha ** i for i in range(gamma + 1)))


def test_expected_speedup_edges():
    assert expected_speedup(0.7, 0, 0.1) == 1.0  # γ = 0 is plain decoding
    assert expected_speedup(1.0, 4, 0.0) == pytest.approx(5.0, rel=1e-4)  # α → 1: γ + 1 tokens per step
    assert expected_speedup(0.0, 4, 0.25) == pytest.approx(0.5)  # nothing accepted: pay γc for nothing


def _state_with_alpha(alpha: float, weight: float = 1000.0) -> GammaState:
    return GammaState(accepted=alpha * weight, rejections=(1 - alpha) * weight)


def test_fixed_policy_returns_gamma():
    policy = GammaPolicy(gamma=5)
    assert [policy.choose(_state_with_alpha(a)) for a in (0.0, 0.5, 1.0)] == [5, 5, 5]


def test_adaptive_picks_the_argmax_of_the_speedup():
    policy = GammaPolicy(adaptive=True, gamma_min=1, gamma_max=8, cost_ratio=0.05)
    for alpha in (0.3, 0.6, 0.8, 0.95):
        state = _state_with_alpha(alpha)
        a = state.alpha(policy.prior_alpha, policy.prior_weight)
        best = max(range(1, 9), key=lambda g: leviathan(a, g, 0.05))
        assert policy.choose(state) == best


def test_adaptive_prefers_longer_chains_for_higher_alpha():
    for c in (0.02, 0.1, 0.2):
        policy = GammaPolicy(adaptive=True, gamma_min=1, gamma_max=12, cost_ratio=c, allow_off=False)
        chosen = [policy.choose(_state_with_alpha(a)) for a in (0.3, 0.5, 0.7, 0.85, 0.95)]
        assert chosen == sorted(chosen), f"c = {c}: {chosen}"
        assert chosen[-1] > chosen[0]


def test_adaptive_prefers_shorter_chains_for_costlier_drafts():
    state = _state_with_alpha(0.8)
    chosen = [GammaPolicy(adaptive=True, cost_ratio=c, allow_off=False).choose(state) for c in (0.01, 0.1, 0.4)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] > chosen[-1]


def test_speculation_turns_off_when_it_cannot_pay_and_probes():
    policy = GammaPolicy(adaptive=True, cost_ratio=0.5, probe_every=4)
    state = _state_with_alpha(0.1)
    a = state.alpha(policy.prior_alpha, policy.prior_weight)
    assert max(leviathan(a, g, 0.5) for g in range(1, 9)) < 1  # S < 1 for every γ
    chosen = [policy.choose(state) for _ in range(12)]
    assert chosen == [0, 0, 0, 1] * 3  # off, with a one-token probe every probe_every steps
    # when α recovers, speculation comes back at once
    state.accepted, state.rejections = 900.0, 100.0
    assert policy.choose(state) > 1 and state.steps_off == 0
    # allow_off=False keeps drafting at γ_min
    assert GammaPolicy(adaptive=True, cost_ratio=0.5, allow_off=False).choose(_state_with_alpha(0.1)) == 1


def test_fresh_sequence_uses_the_prior():
    policy = GammaPolicy(adaptive=True, cost_ratio=0.1)
    assert GammaState().alpha(0.6, 4.0) == pytest.approx(0.6)
    best = max(range(1, 9), key=lambda g: leviathan(0.6, g, 0.1))
    assert policy.choose(GammaState()) == best


def test_observe_tracks_alpha_with_forgetting():
    policy = GammaPolicy(adaptive=True, decay=0.5)
    state = GammaState()
    policy.observe(state, proposed=4, accepted=4)  # fully accepted: no rejection
    assert (state.accepted, state.rejections) == (4.0, 0.0)
    policy.observe(state, proposed=4, accepted=1)  # ended in a rejection
    assert (state.accepted, state.rejections) == (3.0, 1.0)
    policy.observe(state, proposed=0, accepted=0)  # nothing proposed: nothing learned
    assert (state.accepted, state.rejections) == (3.0, 1.0)
    for _ in range(30):
        policy.observe(state, proposed=4, accepted=0)
    assert state.alpha(0.6, 4.0) < 0.05  # old evidence fades


def test_alpha_matches_the_stats_definition():
    """GammaState's α and SpecStats' α are the same quantity: accepted / (accepted + rejections)."""
    policy = GammaPolicy(adaptive=True, decay=1.0)
    state, stats = GammaState(), SpecStats()
    for proposed, accepted in [(4, 4), (4, 2), (3, 0), (2, 2), (4, 1)]:
        policy.observe(state, proposed, accepted)
        stats.record(proposed, accepted, accepted + 1)
    assert state.alpha(0.0, 0.0) == pytest.approx(stats.alpha)
    assert stats.acceptance_rate == pytest.approx(9 / 17)
    assert stats.acceptance_length == pytest.approx(14 / 5)
    assert stats.per_position() == pytest.approx([4 / 5, 3 / 5, 1 / 4, 1 / 3])


@pytest.mark.parametrize("true_alpha", [0.0, 0.05, 0.3, 0.6, 0.9])
def test_alpha_estimate_follows_the_draft(true_alpha):
    """Fed steps from a draft with per-position acceptance α, the estimate converges to α — the prior
    fades instead of pinning it (a never-agreeing draft must be recognised as such)."""
    import random

    rng = random.Random(0)
    policy = GammaPolicy(adaptive=True)
    state = GammaState()
    estimates = []
    for _ in range(400):
        accepted = 0
        while accepted < 4 and rng.random() < true_alpha:
            accepted += 1
        policy.observe(state, 4, accepted)
        estimates.append(state.alpha(policy.prior_alpha, policy.prior_weight))
    mean = sum(estimates[100:]) / 300
    assert abs(mean - true_alpha) < 0.08


def test_never_agreeing_draft_turns_speculation_off():
    policy = GammaPolicy(adaptive=True, cost_ratio=0.05, probe_every=8)
    state = GammaState()
    chosen = []
    for _ in range(80):
        gamma = policy.choose(state)
        chosen.append(gamma)
        policy.observe(state, gamma, 0)
    assert chosen[0] > 1  # the prior starts optimistic
    tail = chosen[-16:]  # then off, with a one-token probe every 8 steps
    probes = [i for i, g in enumerate(tail) if g]
    assert set(tail) == {0, 1} and len(probes) == 2 and probes[1] - probes[0] == 8


def test_bounds_are_validated():
    with pytest.raises(ValueError):
        GammaPolicy(gamma=9, gamma_max=8)
    with pytest.raises(ValueError):
        GammaPolicy(gamma=1, gamma_min=2)
