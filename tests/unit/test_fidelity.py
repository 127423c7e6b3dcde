"""engine.fidelity: the live monitor agrees with plain greedy decoding, and catches a corrupted accept."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engine.engine import Request
from engine.fidelity import FidelityMonitor, first_difference, plain_redecoder
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import SamplingParams
from tests.unit.helpers import MAX_NEW, NOISE, VOCAB, make_engine, make_prompts, run_to_end

N_REQUESTS = 100


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, noisy_copy(target, NOISE, seed=1)


class FlipAccepted:
    """Test-only corruption: a verify stage that changes the first accepted draft token of the first row
    that accepted one in each step (what a broken acceptance rule would commit)."""

    def __init__(self, stage):
        self.stage = stage

    def verify(self, items, proposal):
        outcome = self.stage.verify(items, proposal)
        for row, accepted in enumerate(outcome.num_accepted):
            if accepted > 0:
                outcome.emitted[row][0] = (outcome.emitted[row][0] + 1) % VOCAB
                break
        return outcome

    def __getattr__(self, name):
        return getattr(self.stage, name)


def serve_and_check(engine, target, *, rate: float = 1.0):
    """Serve N_REQUESTS greedy requests on ``engine``, offer each to a monitor re-decoding on a plain engine."""
    monitor = FidelityMonitor(rate, plain_redecoder(make_engine(target, draft=None)), seed=0,
                              max_pending=N_REQUESTS)
    requests = [Request(p, max_tokens=MAX_NEW) for p in make_prompts(seed=5, n=N_REQUESTS)]
    ids = [engine.add(r) for r in requests]
    run_to_end(engine)
    offered = sum(monitor.offer(r, out.tokens, out.finish_reason)
                  for r, out in zip(requests, (engine.output(i) for i in ids)))
    return monitor, offered, monitor.run_pending()


def test_100_greedy_requests_all_match(pair) -> None:
    target, draft = pair
    engine = make_engine(target, draft, gamma=4)
    monitor, offered, results = serve_and_check(engine, target)
    assert engine.stats.accepted > 0 and engine.stats.rejections > 0  # speculation really ran, both ways
    assert offered == N_REQUESTS and len(results) == N_REQUESTS
    assert (monitor.matches, monitor.mismatches) == (N_REQUESTS, 0)
    assert all(r.first_difference is None and r.served == r.plain == MAX_NEW for r in results)


def test_corrupted_acceptance_reports_mismatches(pair) -> None:
    target, draft = pair
    engine = make_engine(target, draft, gamma=4)
    engine.stages.verifier = FlipAccepted(engine.stages.verifier)
    monitor, _, results = serve_and_check(engine, target)
    assert monitor.mismatches > 0
    assert monitor.matches + monitor.mismatches == N_REQUESTS
    for r in results:
        if not r.match:
            assert 0 <= r.first_difference < MAX_NEW


def test_sampling_rate_and_eligibility() -> None:
    seen = []
    monitor = FidelityMonitor(0.25, lambda r: (), seed=3, max_pending=10_000, on_result=seen.append)
    req = Request((5, 6), max_tokens=4)
    taken = sum(monitor.offer(req, (1,), "length") for _ in range(4000))
    assert abs(taken / 4000 - 0.25) < 0.03  # binomial sd 0.007: > 4 sd
    sampled = dataclasses.replace(req, sampling=SamplingParams(temperature=0.7, seed=1))
    assert not FidelityMonitor(1.0, lambda r: ()).offer(sampled, (1,), "stop")  # not greedy
    assert not FidelityMonitor(1.0, lambda r: ()).offer(req, (1,), "cancelled")  # no complete output
    assert not FidelityMonitor(0.0, lambda r: ()).offer(req, (1,), "stop")  # off
    full = FidelityMonitor(1.0, lambda r: (), max_pending=1)
    assert full.offer(req, (1,), "stop") and not full.offer(req, (1,), "stop") and full.dropped == 1
    with pytest.raises(ValueError):
        FidelityMonitor(1.5, lambda r: ())


def test_first_difference() -> None:
    assert first_difference((1, 2, 3), (1, 2, 3)) is None
    assert first_difference((1, 2, 3), (1, 9, 3)) == 1
    assert first_difference((1, 2), (1, 2, 3)) == 2
    assert first_difference((), (4,)) == 0


def test_worker_thread_checks_off_the_caller(pair) -> None:
    target, _ = pair
    done = []
    # Ids far above a serving engine's, as a router re-decoding on its shared remote verifier uses them.
    monitor = FidelityMonitor(1.0, plain_redecoder(make_engine(target, draft=None), first_seq_id=1 << 62),
                              on_result=done.append)
    plain = make_engine(target, draft=None).generate([Request((7, 8, 9), max_tokens=8)])[0].tokens
    monitor.start()
    try:
        assert monitor.offer(Request((7, 8, 9), max_tokens=8), plain, "length")
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        monitor.stop()
    assert [r.match for r in done] == [True]
