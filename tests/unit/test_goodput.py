"""The goodput guard (engine/goodput.py): driven with synthetic timings, and hooked into the engine.

Speculation must never make throughput worse than plain decoding at any batch size: the controller
measures both modes per batch-size bucket, switches speculation off when plain steps deliver more tokens
per second and back on when speculation pays again, with hysteresis. It never reads a clock itself, so
every decision here is a deterministic function of the timings fed to it. In the engine, greedy output
stays token-identical to the reference whatever the controller decides.
"""

from __future__ import annotations

import pytest

from tests.unit.helpers import MAX_NEW, make_engine
from engine.engine import Request
from engine.goodput import (PLAIN, SPECULATE, GoodputConfig, GoodputController, StepPlan,
                              batch_bucket)

pytestmark = pytest.mark.timeout(300)


def drive(ctrl: GoodputController, steps: int, cost, rows: int = 1) -> list[bool]:
    """Run ``steps`` steps; ``cost(speculate, i) -> (tokens, seconds)``. Returns the decisions."""
    plans = []
    for i in range(steps):
        plan = ctrl.choose(rows)
        tokens, seconds = cost(plan.speculate, i)
        ctrl.observe(plan, tokens, seconds)
        plans.append(plan.speculate)
    return plans


def fixed(spec_tokens: float, spec_seconds: float, plain_tokens: float = 1.0, plain_seconds: float = 1.0):
    return lambda spec, i: (spec_tokens, spec_seconds) if spec else (plain_tokens, plain_seconds)


def test_batch_bucket():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_speculation_that_pays_stays_on_and_probes_plain_periodically():
    cfg = GoodputConfig(probe_every=16, probe_steps=2, skip_after_switch=1)
    ctrl = GoodputController(cfg)
    plans = drive(ctrl, 200, fixed(3.0, 1.2))  # 2.5 tok/s speculative vs 1 tok/s plain
    assert ctrl.mode(1) == SPECULATE and ctrl.state(1).switches == 0
    # The first plain probe comes at step 2 (plain unmeasured); after that one probe of 3 steps (2 recorded
    # plus one warm-up) per 16 speculative steps.
    assert plans[:5] == [True, False, False, False, True]
    plain_share = plans.count(False) / len(plans)
    assert 0.1 < plain_share < 0.2
    assert ctrl.state(1).stats[PLAIN].samples > 0
    runs = "".join("s" if p else "p" for p in plans[4:])
    assert set(runs.replace("s", " ").split()) == {"ppp"}  # probes are 3 plain steps, nothing longer
    assert all(len(r) == 16 for r in runs.replace("p", " ").split()[:-1])


def test_speculation_that_costs_is_switched_off_and_probed():
    ctrl = GoodputController(GoodputConfig(probe_every=16, probe_steps=2, min_samples=2))
    plans = drive(ctrl, 200, fixed(1.5, 3.0))  # 0.5 tok/s speculative vs 1 tok/s plain
    assert ctrl.mode(1) == PLAIN and ctrl.state(1).switches == 1
    after = plans[20:]
    assert after.count(True) / len(after) < 0.2  # mostly plain, speculative probes only
    assert any(after), "speculation must still be probed while off"


def test_switches_back_when_speculation_pays_again():
    ctrl = GoodputController(GoodputConfig(probe_every=8, probe_steps=2, window=4))
    # Speculation costs during the first 100 steps, then pays (the text became predictable, say).
    cost = lambda spec, i: ((1.5, 3.0) if i < 100 else (4.0, 1.1)) if spec else (1.0, 1.0)  # noqa: E731
    plans = drive(ctrl, 200, cost)
    assert ctrl.mode(1) == SPECULATE and ctrl.state(1).switches == 2
    assert plans[60:100].count(True) < 15
    assert plans[160:].count(True) > 30


def test_hysteresis_prevents_flapping():
    ctrl = GoodputController(GoodputConfig(hysteresis=0.05))
    # The modes alternate being 3% better: inside the hysteresis band, nothing switches.
    cost = lambda spec, i: (1.03 if (i // 10) % 2 else 0.97, 1.0) if spec else (1.0, 1.0)  # noqa: E731
    drive(ctrl, 300, cost)
    assert ctrl.state(1).switches == 0


def test_buckets_are_independent():
    ctrl = GoodputController()
    for _ in range(100):
        for rows, spec_cost in ((1, (3.0, 1.0)), (64, (70.0, 2.0))):  # batch 64: 35 tok/s vs 64 tok/s plain
            plan = ctrl.choose(rows)
            ctrl.observe(plan, *(spec_cost if plan.speculate else (rows, 1.0)))
    assert ctrl.mode(1) == SPECULATE
    assert ctrl.mode(64) == PLAIN
    assert ctrl.mode(33) == PLAIN  # the same bucket as 64
    assert set(ctrl.as_dict()["buckets"]) == {1, 64}


def test_first_step_after_a_change_of_mode_is_not_recorded():
    ctrl = GoodputController(GoodputConfig(probe_every=4, probe_steps=2, skip_after_switch=1))
    seen = []
    for _ in range(12):
        plan = ctrl.choose(1)
        seen.append((plan.speculate, plan.record))
        ctrl.observe(plan, 3 if plan.speculate else 1, 1.0)
    for prev, cur in zip(seen, seen[1:]):
        if cur[0] != prev[0]:
            assert cur[1] is False
    # A step whose plan is not recorded leaves the averages alone.
    stats = ctrl.state(1).stats
    before = (stats[SPECULATE].samples, stats[PLAIN].samples)
    plan = ctrl.choose(1)
    ctrl.observe(StepPlan(plan.rows, plan.speculate, record=False), 100, 1.0)
    assert (stats[SPECULATE].samples, stats[PLAIN].samples) == before


def test_observed_mode_overrides_plan():
    """A planned speculative step in which every row got γ = 0 is recorded as plain."""
    ctrl = GoodputController()
    plan = ctrl.choose(4)
    assert plan.speculate and plan.record
    ctrl.observe(plan, 4, 1.0, speculative=False)
    assert ctrl.state(4).stats[PLAIN].samples == 1 and ctrl.state(4).stats[SPECULATE].samples == 0


def test_deterministic_given_timings():
    def cost(spec, i):
        return (2.0 + (i % 7) * 0.3, 1.0 + (i % 5) * 0.4) if spec else (1.0, 0.8 + (i % 3) * 0.1)

    a = drive(GoodputController(), 300, cost)
    b = drive(GoodputController(), 300, cost)
    assert a == b


def test_config_validation():
    with pytest.raises(ValueError):
        GoodputConfig(probe_every=0)
    with pytest.raises(ValueError):
        GoodputConfig(window=0)
    with pytest.raises(ValueError):
        GoodputConfig(outlier=1.0)
    with pytest.raises(ValueError):
        GoodputConfig(hysteresis=-0.1)


# -- in the engine -----------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ChargedStages:
    """Wraps an engine's stages and charges synthetic seconds per verify step to a fake clock."""

    def __init__(self, inner, clock: FakeClock, spec_seconds: float, plain_seconds: float):
        self.inner, self.clock = inner, clock
        self.spec_seconds, self.plain_seconds = spec_seconds, plain_seconds

    def submit_propose(self, items, shard=0):
        return self.inner.submit_propose(items, shard)

    def submit_verify(self, items, proposal, shard=0):
        drafted = int(proposal.lengths.sum()) if len(proposal.lengths) else 0
        self.clock.now += self.spec_seconds if drafted else self.plain_seconds
        return self.inner.submit_verify(items, proposal, shard)

    def release(self, seq_ids, shard=0):
        self.inner.release(seq_ids, shard)


def _engine_with_controller(target, draft, spec_seconds, plain_seconds, **cfg):
    clock = FakeClock()
    ctrl = GoodputController(GoodputConfig(**cfg), clock=clock)
    engine = make_engine(target, draft, gamma=4, goodput=ctrl)
    engine.stages = ChargedStages(engine.stages, clock, spec_seconds, plain_seconds)
    return engine, ctrl


FAST = dict(probe_every=4, probe_steps=1, min_samples=1)


def test_engine_switches_speculation_off_when_it_costs_and_output_is_identical(target, noisy_draft, prompts, refs):
    engine, ctrl = _engine_with_controller(target, noisy_draft, spec_seconds=10.0, plain_seconds=1.0, **FAST)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert [o.tokens for o in outs] == refs
    assert ctrl.mode(len(prompts)) == PLAIN
    assert ctrl.scheduled[PLAIN] > ctrl.scheduled[SPECULATE]
    always = make_engine(target, noisy_draft, gamma=4)
    assert [o.tokens for o in always.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])] == refs
    assert engine.stats.proposed < always.stats.proposed


def test_engine_keeps_speculating_when_it_pays_and_output_is_identical(target, noisy_draft, prompts, refs):
    engine, ctrl = _engine_with_controller(target, noisy_draft, spec_seconds=1.0, plain_seconds=1.0, **FAST)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert [o.tokens for o in outs] == refs
    assert ctrl.mode(len(prompts)) == SPECULATE
    assert ctrl.scheduled[SPECULATE] > ctrl.scheduled[PLAIN] > 0  # plain was probed
    assert engine.stats.proposed > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_engine_with_real_clock_is_identical_to_plain_decoding(target, noisy_draft, prompts, refs, micro_batches):
    ctrl = GoodputController(GoodputConfig(probe_every=3, probe_steps=1, min_samples=1))
    engine = make_engine(target, noisy_draft, gamma=3, adaptive=True, goodput=ctrl, micro_batches=micro_batches)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert [o.tokens for o in outs] == refs
    plain = make_engine(target, None)
    assert [o.tokens for o in plain.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])] == refs
    assert ctrl.scheduled[SPECULATE] > 0 and ctrl.scheduled[PLAIN] > 0


def test_engine_without_controller_is_unchanged(target, noisy_draft, prompts):
    engine = make_engine(target, noisy_draft, gamma=4)
    assert engine.goodput is None
    engine.generate([Request(p, max_tokens=4) for p in prompts[:2]])
    assert engine.stats.proposed > 0


def test_a_single_slow_step_does_not_switch_speculation_off():
    """One 10× step (a GC pause) among speculative steps that pay: left out, no switch. A lasting
    slowdown of speculative steps is not an outlier: it switches."""
    ctrl = GoodputController(GoodputConfig(probe_every=8, probe_steps=2))
    spike = lambda spec, i: ((3.0, 12.0 if i == 40 else 1.2) if spec else (1.0, 1.0))  # noqa: E731
    drive(ctrl, 80, spike)
    assert ctrl.mode(1) == SPECULATE and ctrl.state(1).switches == 0
    lasting = lambda spec, i: ((3.0, 12.0 if i >= 40 else 1.2) if spec else (1.0, 1.0))  # noqa: E731
    ctrl = GoodputController(GoodputConfig(probe_every=8, probe_steps=2))
    drive(ctrl, 80, lasting)
    assert ctrl.mode(1) == PLAIN and ctrl.state(1).switches == 1
