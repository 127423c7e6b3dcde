"""``engine.service.EngineService``: the router's step thread, live requests and event delivery, without Ray.

- Events delivered to an asyncio caller carry the tokens the same engine decodes in-process.
- A step wakes each event loop once, for all its requests; a request that is not streamed gets all its
  events with its last one, each with the time it was produced.
- Admission stops at ``capacity`` live requests; a finished request frees its place.
- A caller that goes away, or a request past its deadline, is cancelled in the engine (KV slots freed).
- A step that raises fails the running requests with an ``error`` event and the loop keeps serving.
- ``TextStream`` never emits half a character or the start of a stop string.
"""

from __future__ import annotations

import asyncio

import pytest

import time

from engine.engine import Request, StepEvent
from engine.service import EngineService, Live, StepProfile, TextStream
from tests.fixtures_tokenizer import tokenizer
from tests.unit.helpers import MAX_NEW, make_engine, make_prompts, target_runner


async def _collect(service: EngineService, admitted) -> list:
    return [ev async for ev, *_ in service.events(*admitted)]


def _service(engine, **kw) -> EngineService:
    return EngineService(engine, **{"capacity": 16, "request_timeout_s": 60.0, **kw})


def test_events_carry_what_the_engine_decodes(target, noisy_draft):
    prompts = make_prompts(3, n=4)
    expected = [o.tokens for o in make_engine(target, noisy_draft).generate(
        [Request(p, max_tokens=MAX_NEW) for p in prompts])]
    service = _service(make_engine(target, noisy_draft))

    async def run():
        admitted = [service.submit(Request(p, max_tokens=MAX_NEW)) for p in prompts]
        return await asyncio.gather(*(_collect(service, a) for a in admitted))

    try:
        per_request = asyncio.run(run())
    finally:
        service.stop()
    for events, want in zip(per_request, expected):
        assert tuple(t for ev in events for t in ev.new_tokens) == tuple(want)
        assert events[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in events[:-1])
    assert not service.live and service.cancelled_total == 0


def test_a_request_not_streamed_gets_its_events_with_its_last(target, noisy_draft):
    prompt = make_prompts(8, n=2)[1]
    want = make_engine(target, noisy_draft).generate([Request(prompt, max_tokens=MAX_NEW)])[0].tokens
    service = _service(make_engine(target, noisy_draft))

    async def run():
        seq_id, live = service.submit(Request(prompt, max_tokens=MAX_NEW), stream=False)
        return [(ev, output, produced, time.monotonic()) async for ev, output, produced in service.events(seq_id, live)]

    try:
        got = asyncio.run(run())
    finally:
        service.stop()
    assert tuple(t for ev, *_ in got for t in ev.new_tokens) == tuple(want)
    assert [output is not None for _, output, _, _ in got] == [False] * (len(got) - 1) + [True]
    produced = [at for _, _, at, _ in got]
    assert len(got) > 1 and produced == sorted(produced)
    assert produced[0] < produced[-1]  # each event keeps the time of its own step, not of the hand-over
    assert min(seen for *_, seen in got) >= produced[-1]  # none reached the caller before the last was produced


class _Loop:
    """Stands in for an event loop: records what the step thread hands over."""

    def __init__(self):
        self.handovers = []

    def call_soon_threadsafe(self, callback, items):
        self.handovers.append(items)


def test_a_step_wakes_each_event_loop_once(target):
    service = _service(make_engine(target, "same"))
    service.stop()
    loop_a, loop_b = _Loop(), _Loop()
    service.live = {1: Live(loop_a, "queue 1", 3), 2: Live(loop_a, "queue 2", 3, stream=False),
                    3: Live(loop_a, "queue 3", 3), 4: Live(loop_b, "queue 4", 3)}
    service._deliver([StepEvent(i, (i,), None) for i in (1, 2, 3, 4)])
    assert [[(q, [ev.seq_id for ev, _ in d]) for q, d, _ in items] for items in loop_a.handovers] == \
        [[("queue 1", [1]), ("queue 3", [3])]]
    assert len(loop_b.handovers) == 1
    service._deliver([StepEvent(2, (5,), "cancelled")])
    assert [(q, [(ev.new_tokens, ev.finish_reason) for ev, _ in d]) for q, d, _ in loop_a.handovers[1]] == \
        [("queue 2", [((2,), None), ((5,), "cancelled")])]


def test_capacity_and_release(target):
    service = _service(make_engine(target, "same"), capacity=1)
    prompt = make_prompts(4, n=2)[0]

    async def run():
        first = service.submit(Request(prompt, max_tokens=4))
        assert first is not None
        refused = service.submit(Request(prompt, max_tokens=4))
        await _collect(service, first)
        again = service.submit(Request(prompt, max_tokens=4))
        await _collect(service, again)
        return refused

    try:
        assert asyncio.run(run()) is None
    finally:
        service.stop()


def test_closed_or_late_requests_are_cancelled(target):
    engine = make_engine(target, "same")
    service = _service(engine)
    prompt = make_prompts(5, n=2)[0]

    async def leave_after_first_event():
        events = service.events(*service.submit(Request(prompt, max_tokens=MAX_NEW)))
        await events.__anext__()
        await events.aclose()

    async def time_out():
        late = service.events(*service.submit(Request(prompt, max_tokens=MAX_NEW)))
        service.request_timeout_s = 0.0
        with pytest.raises(asyncio.TimeoutError):
            await late.__anext__()

    try:
        asyncio.run(leave_after_first_event())
        asyncio.run(time_out())
        for _ in range(200):  # the step thread finishes the cancellation
            if not engine.has_work:
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        service.stop()
    assert service.cancelled_total == 2 and not service.live
    assert target_runner(engine).slots_in_use == 0


class _FailingProposer:
    def propose(self, items):
        raise RuntimeError("a bug in the proposer")

    def release(self, seq_ids):
        pass


def test_a_failing_step_fails_the_running_requests(target):
    service = _service(make_engine(target, _FailingProposer()))

    async def run():
        return await _collect(service, service.submit(Request(make_prompts(6, n=2)[0], max_tokens=4)))

    try:
        assert [ev.finish_reason for ev in asyncio.run(run())] == ["error"]
        assert service.alive and service.steps >= 1
    finally:
        service.stop()


def test_text_stream_holds_back_partial_stop_strings():
    tok = tokenizer()
    ids = tok("the cat", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, ["cat nap"])
    sent = "".join(stream.push([t]) for t in ids)
    assert sent == "the "  # "cat" may be the start of the stop string
    assert stream.push([], final_text="the cat", final=True) == "cat"
    assert TextStream(None, []).push(ids) == ""


def test_step_profile_reports_transport_percentiles_per_stage_call():
    profile = StepProfile()
    # 100 steps; each calls the draft (compute 1 ms, transport i/10 ms) and the verifier (transport 0.5 ms).
    for i in range(100):
        profile.add([("draft", 1e-3 + i * 1e-4, 1e-3), ("verify", 3.5e-3, 3e-3)], wall=5e-3, waited=4e-3)
    out = profile.summary()
    assert out["calls"] == {"draft": 100, "verify": 100}
    assert out["transport_draft_p50_ms"] == pytest.approx(5.0, abs=1e-6)
    assert out["transport_draft_p99_ms"] == pytest.approx(9.9, abs=1e-6)
    assert out["transport_verify_p50_ms"] == pytest.approx(0.5, abs=1e-6)
    assert out["transport_draft_ms"] == pytest.approx(4.95, abs=1e-6)  # the mean per step
    assert out["schedule_ms"] == pytest.approx(1.0, abs=1e-6)
