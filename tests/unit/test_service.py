"""``engine.service.EngineService``: the router's step thread, live requests and event delivery, without Ray.

- Events delivered to an asyncio caller carry the tokens the same engine decodes in-process.
- Admission stops at ``capacity`` live requests; a finished request frees its place.
- A caller that goes away, or a request past its deadline, is cancelled in the engine (KV slots freed).
- A step that raises fails the running requests with an ``error`` event and the loop keeps serving.
- ``TextStream`` never emits half a character or the start of a stop string.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.engine import Request
from engine.service import EngineService, StepProfile, TextStream
from tests.fixtures_tokenizer import tokenizer
from tests.unit.helpers import MAX_NEW, make_engine, make_prompts, target_runner


async def _collect(service: EngineService, admitted) -> list:
    return [ev async for ev, _ in service.events(*admitted)]


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
    assert target_runner(engine).pool.slots_in_use == 0


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
