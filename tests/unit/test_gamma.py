"""The γ policy: Leviathan et al.'s speed-up model, the measured cost model, and the adaptive choice.

The cost model is fed synthetic step times (``drive``), so every decision here is deterministic: a
single noisy step must not switch speculation off, a lasting cost must, and probing must find out when
speculation pays again.
"""

from __future__ import annotations

import random
import time

import pytest

from draftpool.draft_model import DraftModelProposer
from engine.engine import Engine, LocalStages, Request
from engine.gamma import GammaPolicy, GammaState, Shape, WidthCosts, expected_speedup, expected_tokens_per_step
from runtime.runner import ModelRunner
from engine.stats import SpecStats
from verifier.verify import VerifyStage

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
    assert [policy.decide([_state_with_alpha(a)]).gamma for a in (0.0, 0.5, 1.0)] == [5, 5, 5]


def test_adaptive_picks_the_argmax_of_the_speedup():
    policy = GammaPolicy(adaptive=True, gamma_min=1, gamma_max=8, cost_ratio=0.05)
    for alpha in (0.3, 0.6, 0.8, 0.95):
        state = _state_with_alpha(alpha)
        a = state.alpha(policy.prior_alpha, policy.prior_weight)
        best = max(range(1, 9), key=lambda g: leviathan(a, g, 0.05))
        assert policy.decide([state]).gamma == best


def test_adaptive_prefers_longer_chains_for_higher_alpha():
    for c in (0.02, 0.1, 0.2):
        policy = GammaPolicy(adaptive=True, gamma_min=1, gamma_max=12, cost_ratio=c, allow_off=False)
        chosen = [policy.decide([_state_with_alpha(a)]).gamma for a in (0.3, 0.5, 0.7, 0.85, 0.95)]
        assert chosen == sorted(chosen), f"c = {c}: {chosen}"
        assert chosen[-1] > chosen[0]


def test_adaptive_prefers_shorter_chains_for_costlier_drafts():
    state = _state_with_alpha(0.8)
    chosen = [GammaPolicy(adaptive=True, cost_ratio=c, allow_off=False).decide([state]).gamma for c in (0.01, 0.1, 0.4)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] > chosen[-1]


def drive(policy: GammaPolicy, steps: int, *, rows: int = 1, accept=None, cost=None,
          states: list[GammaState] | None = None) -> list[int]:
    """Run ``steps`` engine steps of a micro-batch of ``rows`` sequences through the policy.

    ``accept(i, γ) -> accepted`` (default: none; the states keep whatever α they hold, nothing observed;
    a list: one function per row); ``cost(i, drafted) -> (draft_seconds, verify_seconds)`` (default: draft
    0.1 per position, verify 1); the policy is fed their sum, the step's wall time. Returns γ per step.
    """
    states = states if states is not None else [GammaState() for _ in range(rows)]
    cost = cost or (lambda i, drafted: (0.1 * drafted, 1.0))
    accepts = accept if isinstance(accept, list) else [accept] * len(states)
    chosen = []
    for i in range(steps):
        gamma = policy.decide(states).gamma
        for st, acc in zip(states, accepts):
            if acc is not None:
                policy.observe(st, gamma, acc(i, gamma))
        policy.observe_step(len(states), gamma, sum(cost(i, gamma)))
        chosen.append(gamma)
    return chosen


def test_speculation_turns_off_when_it_cannot_pay_and_probes():
    policy = GammaPolicy(adaptive=True, cost_ratio=0.5, probe_every=4, probe_share=0.5)
    state = _state_with_alpha(0.1)
    a = state.alpha(policy.prior_alpha, policy.prior_weight)
    assert max(leviathan(a, g, 0.5) for g in range(1, 9)) < 1  # S < 1 for every γ
    chosen = drive(policy, 24, states=[state], cost=lambda i, d: (0.5 * d, 1.0))
    # off; the first probe after probe_first = 2 plain steps runs until its width is measured (min_samples
    # steps), the later ones find that measurement fresh; the interval doubles up to probe_every
    assert chosen == [0, 0, 1, 1, 1] + [0, 0, 0, 0, 1] * 3 + [0, 0, 0, 0]
    # when α recovers, the probe that is due drafts; only what probes measure turns speculation back on
    state.accepted, state.rejections = 900.0, 100.0
    assert policy.decide([state]).gamma == 1
    # allow_off=False keeps drafting at γ_min
    assert GammaPolicy(adaptive=True, cost_ratio=0.5, allow_off=False).decide([_state_with_alpha(0.1)]).gamma == 1


def test_fresh_sequence_uses_the_prior():
    policy = GammaPolicy(adaptive=True, cost_ratio=0.1)
    assert GammaState().alpha(0.6, 4.0) == pytest.approx(0.6)
    best = max(range(1, 9), key=lambda g: leviathan(0.6, g, 0.1))
    assert policy.decide([GammaState()]).gamma == best


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
    assert state.alpha(0.0, 0.0) < 0.05  # old evidence fades


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
    (``prior_alpha`` while nothing was seen, then the α of every row together) follows the draft instead
    of pinning it (a never-agreeing draft must be recognised as such)."""
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
        estimates.append(policy._alphas([state])[0])
    mean = sum(estimates[100:]) / 300
    assert abs(mean - true_alpha) < 0.08


def test_never_agreeing_draft_turns_speculation_off():
    policy = GammaPolicy(adaptive=True, cost_ratio=0.05, probe_every=8)
    chosen = drive(policy, 80, accept=lambda i, g: 0, cost=lambda i, d: (0.05 * d, 1.0))
    assert chosen[0] > 1  # the prior starts optimistic
    tail = chosen[-18:]  # then off, with a one-token probe after every 8 plain steps
    probes = [i for i, g in enumerate(tail) if g]
    assert set(tail) == {0, 1} and len(probes) == 2 and probes[1] - probes[0] == 9


def bursty_matches(seed: int, n: int = 48, alpha: float = 0.6, stay: float = 0.5) -> list[bool]:
    """Whether the draft's token agrees with the target's at each of ``n`` positions: ``alpha`` of them, in
    runs (the next position agrees with probability ``stay`` more like the last), as prose text does."""
    import random

    rng, out = random.Random(seed), []
    for _ in range(n):
        p = alpha if not out else stay * out[-1] + (1 - stay) * alpha
        out.append(rng.random() < p)
    return out


def decode(policy: GammaPolicy | None, texts: list[list[bool]], cost, gamma: int = 0) -> float:
    """Tokens per second of decoding ``texts`` (draft agreement per position, one sequence after another, one
    policy for all) with ``policy``'s γ, or fixed ``gamma`` where ``policy`` is None; ``cost(width)`` → seconds."""
    tokens = seconds = 0.0
    for matches in texts:
        state, pos = GammaState(), 0
        while pos < len(matches):
            g = policy.decide([state]).gamma if policy else gamma
            g = min(g, len(matches) - pos - 1)
            accepted = next((k for k in range(g) if not matches[pos + k]), g)
            if policy:
                policy.observe(state, g, accepted)
                policy.observe_step(1, g, cost(g + 1))
            pos += accepted + 1
            tokens += accepted + 1
            seconds += cost(g + 1)
    return tokens / seconds


def test_a_rows_stretch_of_rejections_does_not_turn_off_a_draft_that_pays_over_the_text():
    """Prose on the embedded pair at batch 1: the draft agrees at ~0.6 of the positions, in runs, and a verify
    of w tokens costs what the engine measured there (1, 1.4, 1.46, 1.64, … plain steps). A row's α over its
    last few steps falls to ~0.3 in a run of rejections, where no γ pays; before its prior (the α of every row
    together) kept its weight, and while a width's yield was judged by its last 5 steps (those that turned it
    off), the policy decoded a quarter of the steps plainly and reached ~0.9 of the best fixed γ."""
    texts = [bursty_matches(seed) for seed in range(36)]
    widths = {1: 7.0, 2: 9.8, 3: 10.2, 4: 11.5, 5: 13.0, 6: 14.8, 7: 16.4, 8: 18.0, 9: 19.8}

    def cost(width: int) -> float:
        return widths[width] / 1e3

    best = max(decode(None, texts, cost, g) for g in range(1, 7))
    assert best > 1.2 * decode(None, texts, cost)  # speculation pays over the text
    assert decode(GammaPolicy(adaptive=True), texts, cost) >= 0.95 * best


def test_width_costs_ignore_slow_spells_and_follow_a_lasting_change():
    costs = WidthCosts(window=5, min_samples=3, max_age=100)
    costs.add(2, 1.0)
    costs.add(2, 10.0)
    assert costs.level(2) is None and costs.predict(2) is None  # fewer than min_samples: not trusted
    costs.add(2, 1.2)
    assert costs.level(2) == pytest.approx(1.0)
    for _ in range(2):
        costs.add(2, 9.0)
    assert costs.level(2) == pytest.approx(1.2)  # three slow steps of five (10, 9, 9) never show
    costs.add(2, 9.0)
    assert costs.level(2) == pytest.approx(9.0)  # a fourth: a lasting change
    for _ in range(2):
        costs.add(2, 2.0)
    assert costs.level(2) == pytest.approx(2.0)  # cheaper again: two steps suffice
    for _ in range(100):
        costs.add(4, 2.0)
    assert costs.level(2) is None and costs.level(4) == 2.0  # not run for max_age samples: forgotten


def test_width_costs_read_a_width_measured_in_a_slow_spell_at_the_machines_current_speed():
    """Steps as measured on this VM: widths 2 and 3 (γ = 1, 2 at batch 2) cost 1.13 and 1.43 plain steps, and
    the machine ran 1.4× slower for a while. Both widths were measured in the slow spell; width 2 stayed in use
    as the machine came back. Read as measured, width 3 looks 1.77× as dear as width 2 (it is 1.27×) until its
    samples age out, and the policy keeps away from it. The plain step, the yardstick, stays as measured."""
    costs = WidthCosts(window=5, min_samples=3, max_age=100)
    for _ in range(5):
        costs.add(1, 1.4)
        costs.add(2, 1.13 * 1.4)
        costs.add(3, 1.43 * 1.4)
    for _ in range(5):
        costs.add(2, 1.13)
    assert costs.level(2) == pytest.approx(1.13)
    assert costs.level(3) / costs.level(2) == pytest.approx(1.43 / 1.13)
    assert costs.level(1) == pytest.approx(1.4)  # not re-measured since the spell: it is what it was


def test_the_pace_holds_at_a_constant_speed_with_scattered_slow_steps():
    """Widths 2 and 3 measured at the start, then width 3 in use for 400 steps at one speed, one step in five
    1.5–2× slow (as this VM runs). Measured against width 3's running level, the pace walked to 0.72–0.88 and
    width 2, not re-measured, read 8.7–10.3 ms: below a plain step, so the policy was pulled to a width it had
    no fresh word on. Against each width's base it stays put, and width 2 reads what it costs."""
    for seed in range(6):
        draws = random.Random(seed)
        costs = WidthCosts(window=5, min_samples=3, max_age=1000)
        cost = {1: 10.0, 2: 12.0, 3: 14.0}
        for i in range(400):
            width = 1 if i % 16 == 0 else 2 if i < 10 else 3
            slow = draws.uniform(1.5, 2.0) if draws.random() < 0.2 else 1.0
            costs.add(width, cost[width] * slow * draws.uniform(0.97, 1.03))
        assert costs.pace == pytest.approx(1.0, abs=0.05)
        assert costs.level(2) == pytest.approx(12.0, rel=0.05)
        assert costs.level(3) == pytest.approx(14.0, rel=0.06)


def test_a_slower_spell_while_off_does_not_make_measured_chains_look_cheap():
    """The real-shaped pair at batch 4, α ≈ 0.55 (traced in the benchmark): a chain step costs 1.8 plain steps,
    so the bucket decodes plainly. Then the machine runs 1.3× slower for a while. The plain step's level follows
    it, while the chains keep the levels they were measured at: read as measured, γ = 1 would cost 1.38 plain
    steps and pay, and speculation came on without a probe, paying the draft's catch-up and a few dear steps.
    In a plain spell the chains follow the plain step instead, so only probes speculate."""
    policy = GammaPolicy(adaptive=True)
    bucket = policy.costs.bucket(4)
    states = [GammaState() for _ in range(4)]
    draws = random.Random(7)
    unprobed = []
    for i in range(160):
        gamma = policy.decide(states).gamma
        if gamma and not bucket.probing and i >= 60:
            unprobed.append(i)
        for st in states:
            policy.observe(st, gamma, next((k for k in range(gamma) if draws.random() > 0.55), gamma))
        speed = 1.3 if i >= 60 else 1.0
        policy.observe_step(4, gamma, speed * (1.0 + 0.6 * gamma + 0.2 * (gamma > 0)))
        if i == 59:
            assert bucket.off  # γ = 1 yields ~1.55 tokens for 1.8 plain steps
    assert unprobed == []


def test_a_probe_after_a_slow_spell_is_weighed_against_plain_steps_of_its_own_time():
    """The real-shaped pair at batch 4, α ≈ 0.69 (traced in the benchmark): a γ = 1 step costs 2 plain steps for
    ~1.7 tokens a row, so the bucket decodes plainly. The machine runs 1.35× slower for a spell that ends as a
    probe begins: against the slow spell's plain level the probe's γ = 1 read 1.08–1.15× plain, and the bucket
    speculated at a loss until its plain level was refreshed. Plain steps after the probe weigh it at its own
    speed, and no step speculates except probes."""
    for seed in range(4):
        policy = GammaPolicy(adaptive=True)
        bucket = policy.costs.bucket(4)
        states = [GammaState() for _ in range(4)]
        draws = random.Random(seed)
        slow, unprobed, spells, fast_since = False, [], 0, 0
        for i in range(400):
            gamma = policy.decide(states).gamma
            probing = bucket.probing
            if i >= fast_since + 20 and bucket.off and not slow and gamma == 0 and draws.random() < 0.1:
                slow = True  # a slow spell starts while the bucket decodes plainly ...
            if slow and probing:
                slow, spells, fast_since = False, spells + 1, i  # ... and ends as a probe begins
            if gamma and not probing and i >= 40:
                unprobed.append(i)
            for st in states:
                policy.observe(st, gamma, next((k for k in range(gamma) if draws.random() > 0.69), gamma))
            speed = (1.35 if slow else 1.0) * draws.uniform(0.98, 1.04)
            policy.observe_step(4, gamma, speed * (1.0 + 0.8 * gamma + 0.2 * (gamma > 0)))
        assert spells >= 3, spells
        assert unprobed == [], (seed, unprobed)


def test_width_costs_between_and_beyond_measured_widths():
    verify = WidthCosts(window=5, min_samples=1, max_age=100)
    verify.add(3, 2.0)
    assert verify.predict(1) == verify.predict(9) == 2.0  # one width: flat (Leviathan's assumption)
    verify.add(5, 3.0)
    verify.add(9, 5.0)
    assert verify.predict(7) == pytest.approx(4.0) and verify.predict(11) == pytest.approx(6.0)  # a line
    assert verify.predict(1) == pytest.approx(1.0)
    falling = WidthCosts(window=5, min_samples=1, max_age=100)  # noise: the wider step measured cheaper
    falling.add(2, 2.0)
    falling.add(4, 1.0)
    assert falling.predict(8) == pytest.approx(1.5)  # slope clamped at 0: wider is never cheaper
    assert falling.predict(2) == 2.0 and falling.predict(1) == pytest.approx(1.5)
    stuck = WidthCosts(window=5, min_samples=1, max_age=100)  # width 2 measured in a bad spell only
    for width, seconds in ((1, 1.0), (2, 60.0), (3, 1.2), (4, 1.3), (5, 1.4)):
        stuck.add(width, seconds)
    assert stuck.predict(2) == pytest.approx(1.1) and stuck.predict(3) == 1.2  # the line replaces it
    fixed_cost = WidthCosts(window=5, min_samples=1, max_age=100)  # every draft adds 50 ms; plain is 3.5 ms
    for width, seconds in ((1, 0.0035), (2, 0.055), (3, 0.056), (4, 0.057), (5, 0.058)):
        fixed_cost.add(width, seconds)
    assert fixed_cost.predict(1) == 0.0035  # the yardstick keeps its own level, far below the line


def test_width_costs_compare_widths_at_the_buckets_batch_size():
    """Bucket 16 holds steps of 9 to 16 rows. A plain step measured only at 10 rows must not make a chain
    measured at 16 look dearer than it is: samples are scaled to 16 rows by how steps grow with their rows.
    Costs as measured on the embedded pair (1 thread): a step of w tokens per row at r rows takes a + b·r ms."""
    line = {1: (6.4, 0.233), 3: (10.6, 0.833)}
    cost = lambda width, rows: line[width][0] + line[width][1] * rows  # noqa: E731
    truth = cost(3, 16) / cost(1, 16)  # 2.36
    costs = WidthCosts(window=5, min_samples=3, max_age=100, rows=16)
    for rows in (16, 16, 16, 10, 10, 10):  # the chain while the group's rows finish
        costs.add(3, cost(3, rows), rows)
    for _ in range(3):
        costs.add(1, cost(1, 10), 10)  # the plain steps fell at 10 rows
    assert cost(3, 16) / cost(1, 10) > 1.15 * truth  # as measured: 16 % too dear
    assert costs.level(3) == pytest.approx(cost(3, 16))
    # The plain width's own growth is not measured: it grows as the chain's does, which errs less (8 % cheap).
    assert costs.predict(3) / costs.predict(1) == pytest.approx(truth, rel=0.1)
    costs.add(1, cost(1, 16), 16)  # one plain step at 16 rows gives the plain width its own growth
    assert costs.predict(3) / costs.predict(1) == pytest.approx(truth, rel=0.01)


def test_width_costs_keep_how_steps_grow_with_rows_once_the_steps_that_showed_it_are_old():
    """The real-shaped pair at batch 16 (docs/results.md): the warm-up measured the chain only at 9–10 rows,
    while its group's rows finished, then two rounds ran plain at 16 rows. Once those plain steps filled the
    recent window, nothing in it measured how a step grows with its rows, and the chain's 9–10-row samples
    were read as 16-row ones: γ = 1 looked 1.29× as fast as plain, and the rows entered to find a step of
    2.3 plain steps for at most 2 tokens a row."""
    plain = lambda rows: 0.36 * (rows / 16) ** 0.8  # noqa: E731  seconds, as traced
    chain = lambda rows: 0.83 * (rows / 16) ** 0.8  # noqa: E731
    costs = WidthCosts(window=5, min_samples=3, max_age=64, rows=16)
    for rows in (16, 16, 16, 11, 11):
        costs.add(1, plain(rows), rows)
    for rows in (10, 9, 10):
        costs.add(2, chain(rows), rows)
    assert costs.level(2) == pytest.approx(chain(16), rel=0.02)
    for _ in range(costs.recent.maxlen):  # plain steps at 16 rows, until they are all the recent window holds
        costs.add(1, plain(16))
    assert {rows for _, rows, _ in costs.recent} == {16}
    assert costs.level(2) == pytest.approx(chain(16), rel=0.02)
    assert costs.level(2) / costs.level(1) > 2.0  # γ = 1 emits at most 2 tokens a row: it cannot pay here


ALPHA_096 = lambda i, g: g if i % 25 else g // 2  # noqa: E731  every draft accepted but one in 25 steps


def spiked(base, at: int, factor: float):
    """``base`` cost with step ``at`` made ``factor`` times as slow."""
    return lambda i, drafted: tuple(x * (factor if i == at else 1) for x in base(i, drafted))


def steps_until_on(gammas: list[int], after: int) -> int:
    return next(k for k in range(1, len(gammas) - after) if gammas[after + k] > 0)


@pytest.mark.parametrize("factor", [10, 100])
@pytest.mark.parametrize("at", [0, 1, 30])
def test_a_single_cost_spike_does_not_switch_speculation_off(factor, at):
    """A 10× step (GC pause, another process) at c = 0.37, α ≈ 0.96: speculation on again within ≤ 3
    steps — in fact it never goes off, because the window's low quantile ignores the spike. (The old
    EWMA rule, c ← 0.8c + 0.2·c_step, made c ≈ 1.04 > α after such a step: off until the next probe.)"""
    policy = GammaPolicy(adaptive=True)
    base = lambda i, d: (0.37 * d, 1.0)  # noqa: E731
    gammas = drive(policy, 60, accept=ALPHA_096, cost=spiked(base, at, factor))
    assert steps_until_on(gammas, at) <= 3
    plain = [i for i, g in enumerate(gammas) if g == 0]
    # only the plain steps that measure T(1) (3 at first, then one per refresh_every), none for the spike
    assert len(plain) <= 3 + 60 // policy.refresh_every
    assert sum(gammas[40:]) / 20 >= 4  # long chains at α ≈ 0.96, c = 0.37 (the bound's argmax is 5)


def test_sustained_high_cost_switches_speculation_off_and_probing_brings_it_back():
    policy = GammaPolicy(adaptive=True, probe_every=16, probe_share=1.0)  # probes spaced by probe_every alone
    normal = lambda i, d: (0.37 * d, 1.0)  # noqa: E731
    cost = lambda i, d: (3.7 * d, 1.0) if 30 <= i < 90 else normal(i, d)  # noqa: E731
    gammas = drive(policy, 130, accept=ALPHA_096, cost=cost)
    off_from = next(i for i in range(30, 90) if gammas[i] == 0)
    assert off_from - 30 <= 5  # the fourth costly sample moves the estimate
    assert sum(g > 0 for g in gammas[off_from:90]) <= 6  # probes only, with a doubling interval
    on_again = next(i for i in range(90, 130) if gammas[i] > 1)
    assert on_again - 90 <= policy.probe_every + 2 * policy.costs.min_samples  # next probe, then quick ones


def test_a_probes_catch_up_prices_the_probe_not_its_width():
    """Back from a plain spell, a probe's draft first processes every token its rows decoded plainly (here 40,
    costing 30 plain steps). That step is what the probe costs, so it spaces the next probe, but it says nothing
    about what a step of its width costs once the draft keeps up: it is no sample of the width, and the probe
    goes on to measure steady steps."""
    policy = GammaPolicy(adaptive=True, probe_every=8)
    states = [GammaState()]
    drive(policy, 40, states=states, accept=lambda i, g: 0, cost=lambda i, d: (0.05 * d, 1.0))  # off, probing
    bucket = policy.costs.bucket(1)
    while policy.decide(states).gamma == 0:
        policy.observe_step(1, 0, 1.0)
    before = list(bucket.seconds.samples[2])
    policy.observe_step(1, 1, 30.0, caught_up=40)
    assert list(bucket.seconds.samples[2]) == before and bucket.seconds.level(2) < 2.0
    gammas = []
    while bucket.probing:
        gammas.append(policy.decide(states).gamma)
        policy.observe_step(1, gammas[-1], 1.05, caught_up=2)
    assert gammas == [1]  # the width's fresh samples (earlier probes') leave one steady step to measure
    assert bucket.next_probe == policy.probe_max  # 29 + 0.05 extra seconds against 2 % of a plain step each


def test_rows_the_draft_must_catch_up_on_speculate_only_if_their_remaining_tokens_repay_it():
    """Speculating pays here in steady state (about 1.4× at α = 1), but eight new rows of 32 tokens would first
    cost the draft 10 s to take in (its measured seconds per token), against 1 s per plain step: 24 tokens each
    would save less than that, 100 each more. Rows the draft keeps up with speculate whatever is left."""
    policy = GammaPolicy(adaptive=True)
    states = [GammaState() for _ in range(8)]
    gammas = drive(policy, 60, states=states, accept=lambda i, g: g, cost=lambda i, d: (0.1 * d, 1.0 + 0.6 * d))
    assert gammas[-1] > 0
    policy.observe_catch_up(8, 256, 10.0)
    policy.observe_catch_up(8, 12, 99.0)  # keeping up (a step's tokens), not an entry: not a price
    new = [GammaState() for _ in range(8)]
    assert policy.decide(new, behind=[32] * 8, remaining=[24] * 8).gamma == 0
    assert policy.decide(new, behind=[32] * 8, remaining=[100] * 8).gamma > 0
    assert policy.decide(states, behind=[3] * 8, remaining=[2] * 8).gamma > 0


def test_rows_kept_plain_by_their_entry_do_not_later_take_a_width_the_bucket_no_longer_measures():
    """New rows the draft would first have to take in are kept plain by their entry price for 70 steps; the
    bucket's chain widths age out meanwhile (64 samples). Rows whose entry would repay then still decode
    plainly until a probe measures a width, instead of taking the γ the prior's model likes best (on a
    real-shaped pair at batch 8, a 9-token verify that cost seven plain steps)."""
    policy = GammaPolicy(adaptive=True)
    states = [GammaState() for _ in range(8)]
    drive(policy, 60, states=states, accept=lambda i, g: g, cost=lambda i, d: (0.1 * d, 1.0 + 0.6 * d))
    policy.observe_catch_up(8, 256, 10.0)
    new = [GammaState() for _ in range(8)]
    for _ in range(70):
        assert policy.decide(new, behind=[32] * 8, remaining=[24] * 8).gamma == 0
        policy.observe_step(8, 0, 1.0)
    assert policy.costs.bucket(8).seconds.levels().keys() == {1}
    assert policy.decide(new, behind=[32] * 8, remaining=[1000] * 8).gamma == 0


def test_a_probe_waits_until_the_plain_steps_cover_its_entry():
    """Off, with a probe due: rows the draft is 3 tokens behind are probed at once; rows it is 32 tokens
    behind (new rows: their prompts) would cost the draft 256 × 0.01 s = 2.56 s to take in, which at 2 % of a
    1 s plain step waits for 128 plain steps."""
    policy = GammaPolicy(adaptive=True, probe_every=4)
    states = [GammaState() for _ in range(8)]
    drive(policy, 40, states=states, accept=lambda i, g: 0, cost=lambda i, d: (0.5 * d, 1.0))  # off
    policy.observe_catch_up(8, 256, 2.56)
    bucket = policy.costs.bucket(8)
    while policy.decide(states, behind=[3] * 8).gamma == 0:
        policy.observe_step(8, 0, 1.0)
    policy.observe_step(8, 1, 1.5)
    while bucket.probing:
        policy.observe_step(8, policy.decide(states).gamma, 1.5)
    waited = 0
    while policy.decide(states, behind=[32] * 8).gamma == 0:
        policy.observe_step(8, 0, 1.0)
        waited += 1
    assert 128 <= waited <= 130, waited


def test_probes_that_must_catch_the_draft_up_are_spaced_to_a_share_of_the_time():
    """A probe's draft first processes every token its rows decoded plainly (here 8 rows, each token 5 % of a
    plain step): after a plain spell a probe costs several plain steps. Probing every ``probe_every`` steps
    would cost ~40 % of plain decoding's time; spaced by ``probe_share`` it costs a few per cent."""
    def trace(policy, steps=3000):
        last_draft, extra = 0, 0.0
        def cost(i, d):
            nonlocal last_draft, extra
            if not d:
                return 0.0, 1.0
            # rows live 40 steps: a probe catches up on at most 40 tokens of each
            catch_up, last_draft = 8 * 0.05 * min(i - last_draft, 40), i
            if i >= 200:
                extra += catch_up + 0.5 + 1.5 * d
            return catch_up + 0.5, 1.0 + 1.5 * d  # a verify of width 2 costs 2.5 plain steps: never pays
        gammas = drive(policy, steps, rows=8, accept=lambda i, g: g, cost=cost)
        return gammas, extra / (steps - 200)  # the probes' extra seconds over plain decoding's

    gammas, share = trace(GammaPolicy(adaptive=True))
    _, share_every = trace(GammaPolicy(adaptive=True, probe_share=1e9))  # every probe_every steps
    assert set(gammas[200:]) == {0, 1} and share_every > 0.3 and share < 0.05


def test_verify_width_cost_is_priced_per_batch_size():
    """A verify of γ + 1 tokens per row that costs γ + 1 times a plain step (compute-bound, large batch)
    cannot pay; the same draft where verify width is free (small batch) does. The large batch stays
    plain, probing rarely."""
    def cost(rows):
        return lambda i, d: (0.1 * d, 1.0 + (1.0 * d if rows > 8 else 0.0))

    accept = lambda i, g: g if i % 5 else 0  # noqa: E731  α ≈ 0.8
    small = drive(GammaPolicy(adaptive=True), 100, rows=1, accept=accept, cost=cost(1))
    assert sum(g >= 2 for g in small[50:]) >= 45
    large = drive(GammaPolicy(adaptive=True, probe_every=16), 200, rows=16, accept=accept, cost=cost(16))
    assert set(large[100:]) == {0, 1} and large[100:].count(1) <= 100 // 16 + 1  # one-token probes


def test_one_gamma_for_the_batch_weighs_every_row():
    """The verify is as wide as the longest chain, so the batch gets one γ, chosen on all rows' α. Where
    the width is cheap, a row that never agrees does not stop its neighbour's long chains; where the width
    costs (a compute-bound target), one agreeable row cannot carry fifteen that disagree."""
    flat = lambda i, d: (0.1 * d, 1.0)  # noqa: E731
    mixed = drive(GammaPolicy(adaptive=True), 60, rows=2, accept=[lambda i, g: g, lambda i, g: 0], cost=flat)
    assert sum(g >= 4 for g in mixed[30:]) >= 29
    steep = lambda i, d: (0.1 * d, 1.0 + 0.5 * d)  # noqa: E731
    alone = drive(GammaPolicy(adaptive=True), 60, rows=1, accept=lambda i, g: g, cost=steep)
    crowd = drive(GammaPolicy(adaptive=True), 60, rows=16, accept=[lambda i, g: g] + [lambda i, g: 0] * 15,
                  cost=steep)
    assert sum(g >= 2 for g in alone[30:]) >= 29 and crowd[30:].count(0) >= 25


def overrated(policy: GammaPolicy, steps: int, emitted, cost, alpha: float = 0.9) -> tuple[list[int], float]:
    """Steps of one row whose α the model holds at ``alpha`` (a heavy prior that nothing moves: the model's
    estimate is wrong) while a step of γ drafts really emits ``emitted(γ)`` tokens in ``cost(γ)`` seconds.
    Returns γ per step and the trace's tokens per second over plain decoding's (1 token per ``cost(0)``)."""
    state, gammas, tokens, seconds = _state_with_alpha(alpha, weight=1e9), [], 0, 0.0
    for _ in range(steps):
        gamma = policy.decide([state]).gamma
        policy.observe(GammaState(), gamma, emitted(gamma) - 1)  # the row's yield, not its α
        policy.observe_step(1, gamma, cost(gamma))
        gammas.append(gamma)
        tokens, seconds = tokens + emitted(gamma), seconds + cost(gamma)
    return gammas, tokens / seconds * cost(0)


def test_measured_loss_switches_speculation_off_where_the_model_overrates_the_draft():
    """The model says γ ≈ 4 pays 1.8×; every step really emits about one token and costs more than a plain one.
    The measured yield switches speculation off within a few steps and keeps it off, re-probing rarely: the
    trace runs within 12 % of plain decoding (the best fixed choice here). What it gives up is re-measuring
    the model's choice once its measurement is ``max_age`` steps old: 3 steps at γ = 5 every 64 or so."""
    policy = GammaPolicy(adaptive=True)
    gammas, over_plain = overrated(policy, 300, emitted=lambda g: 1, cost=lambda g: 1.0 + 0.3 * g)
    assert next(i for i, g in enumerate(gammas) if i > 3 and g == 0) <= 12
    assert sum(g > 0 for g in gammas[100:]) <= 25, gammas[100:]
    assert over_plain >= 0.88


def test_measured_loss_of_long_chains_falls_back_to_the_chain_that_pays():
    """The draft gets the first token right and never the second; the model, believing α = 0.9, wants long
    chains, which measure slower than plain. γ = 1, measured by the probes, pays (2 tokens for 1.4× a plain
    step): the policy settles there, at ≥ 0.9 of fixed γ = 1 (the best fixed choice), far above plain."""
    policy = GammaPolicy(adaptive=True)
    cost = lambda g: 1.0 + 0.4 * g  # noqa: E731
    gammas, over_plain = overrated(policy, 300, emitted=lambda g: min(g, 1) + 1, cost=cost)
    assert gammas[100:].count(1) >= 80, gammas[100:]
    assert over_plain >= 0.9 * (2 / cost(1))


def test_measured_chains_that_pay_keep_the_model_choice():
    """Where the model is right, the measurement agrees and changes nothing: long chains at α ≈ 0.96."""
    policy = GammaPolicy(adaptive=True)
    gammas = drive(policy, 100, accept=ALPHA_096, cost=lambda i, d: (0.37 * d, 1.0))
    assert sum(gammas[50:]) / 50 >= 4 and gammas[50:].count(0) <= 2


def test_forced_runs_widen_the_verify_only_where_their_tokens_pay_for_it():
    """A grammar's forced run is nearly free to propose but widens the verify of every row. With one cost per
    width, a lone constrained row takes its whole run of 6; the same row among 15 unconstrained
    ones is cut to the batch's own chain, since the width would cost all 16 rows; 16 constrained rows take
    their runs again."""

    def decide(rows: int, forced: list[int]):
        policy = GammaPolicy(adaptive=True)
        for _ in range(5):
            for drafted in (0, 1, 2, 3, 5, 8):
                policy.costs.record(rows, drafted, 0.010 + 0.004 * (drafted + 1))
        return policy.decide([GammaState(accepted=6, rejections=4) for _ in range(rows)], forced=forced)

    alone = decide(1, [6])
    assert 1 <= alone.gamma < 6 and alone.room >= 6
    among = decide(16, [6] + [0] * 15)
    assert among.gamma >= 1 and among.room == among.gamma
    assert decide(16, [6] * 16).room >= 6
    # No forced run, or fixed γ: the room is γ_max (a run, if any, goes in whole).
    assert decide(16, []).room == GammaPolicy().gamma_max
    assert GammaPolicy(gamma=2).decide([GammaState()], forced=[6]).room == GammaPolicy().gamma_max


def test_decide_gives_the_chain_and_the_tree_of_one_step():
    fixed = GammaPolicy(gamma=4, tree_nodes=6)
    assert fixed.decide([GammaState()]) == Shape(4, 6, room=8)
    adaptive = GammaPolicy(adaptive=True, tree_nodes=64)
    shape = adaptive.decide([GammaState()], sampled=True)
    assert shape.gamma >= 1 and shape.nodes == 0  # sampled batches keep chains


def test_bounds_are_validated():
    with pytest.raises(ValueError):
        GammaPolicy(gamma=9, gamma_max=8)
    with pytest.raises(ValueError):
        GammaPolicy(gamma=1, gamma_min=2)
    with pytest.raises(ValueError):
        GammaPolicy(probe_first=0)


class SlowStages(LocalStages):
    """The real stages, with a 0.2 s sleep in every verify that prefills and in one chosen step. ``gammas``: the
    drafts per row of each verified step (a plain step does not call the proposer at all); ``caught_up``: the
    tokens of all rows the proposer took in before drafting."""

    def __init__(self, verifier, proposer, slow_step: int):
        super().__init__(verifier, proposer)
        self.slow_step = slow_step
        self.gammas: list[int] = []
        self.caught_up: list[int] = []
        self._synced = 0

    def submit_propose(self, items, shard=0):
        self._synced = sum(len(it.sync.tokens) for it in items)
        return super().submit_propose(items, shard)

    def submit_verify(self, items, proposal, shard=0):
        self.gammas.append(int(proposal.lengths.max()))
        self.caught_up.append(self._synced if self.gammas[-1] else 0)
        self._synced = 0
        if any(it.sync.base == 0 for it in items) or len(self.gammas) - 1 == self.slow_step:
            time.sleep(0.2)
        return super().submit_verify(items, proposal, shard)


def test_engine_feeds_every_decode_step_to_the_cost_model(target):
    """Through the engine: each decode step's wall time reaches the cost model at its verify width (not the
    prefill's, nor a step whose draft first caught up on a plain spell), and a step slowed to 0.2 s leaves no
    trace in the estimates."""
    stages = SlowStages(VerifyStage(ModelRunner(target, max_slots=1, max_len=128)),
                        DraftModelProposer(target, max_slots=1, max_len=128), slow_step=12)
    policy = GammaPolicy(adaptive=True, gamma=2, gamma_max=3)
    engine = Engine(stages, policy=policy, max_len=128)
    out = engine.generate([Request((5, 6, 7, 8), max_tokens=60)])[0]
    assert len(out.tokens) == 60
    bucket = policy.costs.bucket(1)
    assert bucket.steps == len(stages.gammas) - 1  # every step but the prefill
    recorded = sorted({w for w, samples in bucket.seconds.samples.items() if samples})
    steady = [g for g, lag in zip(stages.gammas[1:], stages.caught_up[1:]) if lag <= policy.gamma_max + 2]
    assert recorded == sorted({g + 1 for g in steady})
    slow = [x for samples in bucket.seconds.samples.values() for _, x, _ in samples if x >= 0.2]
    assert len(slow) <= 1  # the prefill never; the slowed step once, if still in its window
    assert all(m < 0.2 for m in bucket.seconds.levels().values())


class CostlyDrafts(LocalStages):
    """The real stages, with ``seconds`` of sleep in every verify that holds drafts: speculation that costs."""

    def __init__(self, verifier, proposer, seconds: float):
        super().__init__(verifier, proposer)
        self.seconds = seconds
        self.drafted: list[int] = []

    def submit_verify(self, items, proposal, shard=0):
        self.drafted.append(int(proposal.lengths.max()) if len(proposal.lengths) else 0)
        if self.drafted[-1]:
            time.sleep(self.seconds)
        return super().submit_verify(items, proposal, shard)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_engine_decodes_plainly_where_speculation_costs_and_output_is_identical(target, noisy_draft, prompts,
                                                                               micro_batches):
    slots, tokens = len(prompts), 40
    plain = Engine(LocalStages(VerifyStage(ModelRunner(target, max_slots=slots, max_len=128)), None),
                   max_len=128, max_running=slots, speculate=False)
    refs = [o.tokens for o in plain.generate([Request(p, max_tokens=tokens) for p in prompts])]
    stages = CostlyDrafts(VerifyStage(ModelRunner(target, max_slots=slots, max_len=128)),
                          DraftModelProposer(noisy_draft, max_slots=slots, max_len=128), seconds=0.05)
    engine = Engine(stages, policy=GammaPolicy(adaptive=True), max_len=128, max_running=slots,
                    micro_batches=micro_batches)
    outs = engine.generate([Request(p, max_tokens=tokens) for p in prompts])
    assert [o.tokens for o in outs] == refs
    later = stages.drafted[len(stages.drafted) // 2:]
    assert later.count(0) >= 0.7 * len(later), stages.drafted


# -- token-tree shape (issue 15) -----------------------------------------------------------------------------


def _tree_step(policy: GammaPolicy, rows: int, gamma: int, tokens: dict[int, int], seconds: dict[int, float]
               ) -> int:
    """One synthetic decode step: the policy's shape, the rows' emitted tokens and the step's wall time at that
    shape (by node count: 0 = the chain of γ). Returns the node budget it chose. A bucket's first call
    measures plain steps first (at 0.8× the chain's time), as the adaptive policy's own schedule does: the
    chain's cost line needs a slope before it can price an unmeasured tree."""
    if policy.costs.bucket(rows).steps == 0:
        for _ in range(policy.costs.min_samples):
            policy.observe_step(rows, 0, 0.8 * seconds[0])
    nodes = policy._tree(rows, gamma, sampled=False)
    width = (nodes or gamma) + 1
    state = GammaState()
    for _ in range(rows):
        policy.observe(state, gamma, tokens[nodes] - 1)
    policy.observe_step(rows, width - 1, seconds[nodes])
    return nodes


def test_tree_ladder_and_validation():
    assert GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=64).tree_sizes() == [16, 32, 64]
    assert GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=48).tree_sizes() == [16, 32, 48]
    assert GammaPolicy(adaptive=True, gamma_max=4, tree_nodes=12).tree_sizes() == [8, 12]
    assert GammaPolicy(adaptive=True).tree_sizes() == []
    with pytest.raises(ValueError, match="above gamma_max"):
        GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=8)
    fixed = GammaPolicy(gamma=4, tree_nodes=6)  # a fixed γ drafts its tree every step, any size
    assert fixed._tree(1, 4, sampled=True) == 6 and fixed._tree(1, 1, sampled=False) == 0
    adaptive = GammaPolicy(adaptive=True, tree_nodes=64)
    assert adaptive._tree(1, 4, sampled=True) == 0  # sampled batches keep chains (true q, seeds)
    assert adaptive._tree(1, 4, sampled=False) == 0  # nothing measured yet: the chain first


@pytest.mark.parametrize("case,expected", [
    ("trees pay up to 32 nodes", 32),  # 64 costs too much for what it adds
    ("verify cost steep (large batch)", 0),  # no tree beats the chain: it stays a chain
    ("every size pays", 64),
])
def test_tree_budget_climbs_while_it_pays(case, expected):
    tokens = {0: 2, 16: 3, 32: 4, 64: 5}
    seconds = {"trees pay up to 32 nodes": {0: 1.0, 16: 1.1, 32: 1.2, 64: 1.8},
               "verify cost steep (large batch)": {0: 1.0, 16: 1.6, 32: 2.5, 64: 4.0},
               "every size pays": {0: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}}[case]
    policy = GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=64)
    chosen = [_tree_step(policy, 1, 4, tokens, seconds) for _ in range(40)]
    assert chosen[-10:] == [expected] * 10, chosen
    # Sizes above the first one that does not pay are never tried.
    tried = set(chosen)
    assert tried == {0, 16, 32, 64} if expected == 64 else tried <= {0, 16, 32, 64}
    if expected == 0:
        assert tried == {0, 16}


def test_tree_budget_remeasures_the_chain_and_follows_a_change():
    """Measurements age out: the chain is re-measured now and then, and a tree that stops paying is dropped."""
    tokens = {0: 2, 16: 4, 32: 4, 64: 5}
    cheap = {0: 1.0, 16: 1.05, 32: 1.5, 64: 2.0}
    policy = GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=64)
    chosen = [_tree_step(policy, 1, 4, tokens, cheap) for _ in range(200)]
    assert chosen[-50:].count(16) > 40 and 0 in chosen[-100:]
    dear = {0: 1.0, 16: 2.0, 32: 3.0, 64: 4.0}
    chosen = [_tree_step(policy, 1, 4, tokens, dear) for _ in range(200)]
    assert chosen[-50:].count(0) > 45


def test_tree_budget_is_per_batch_bucket():
    tokens = {0: 2, 16: 4, 32: 4, 64: 5}
    policy = GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=64)
    for _ in range(40):
        _tree_step(policy, 1, 4, tokens, {0: 1.0, 16: 1.1, 32: 1.5, 64: 2.0})
        _tree_step(policy, 16, 4, tokens, {0: 1.0, 16: 3.0, 32: 5.0, 64: 9.0})
    assert policy._tree(1, 4, sampled=False) == 16
    assert policy._tree(16, 4, sampled=False) == 0


def test_several_candidates_still_move_alpha():
    """A draft_num step verifies more than γ_max nodes without a tree ladder (tree_nodes 0): its acceptance
    is the only evidence the policy gets, so α must follow it; a ladder tree step's must not."""
    merged = GammaPolicy(adaptive=True, gamma_max=8)
    state = GammaState()
    merged.observe(state, proposed=4, accepted=0, nodes=24)
    assert state.rejections > 0
    ladder = GammaPolicy(adaptive=True, gamma_max=8, tree_nodes=64)
    state = GammaState()
    ladder.observe(state, proposed=4, accepted=0, nodes=24)
    assert state.rejections == 0 and state.accepted == 0
