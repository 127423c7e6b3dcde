"""Reliability under faults, over HTTP on loopback: steady arrivals above capacity, replica kills, disconnects.

One app (builtin:tiny target and draft, one draft replica so that killing it takes the whole pool down) is
driven with ``tools.loadgen`` — the same generators ``scripts/soak.py`` runs for longer. Every
completed output is compared with the reference: plain greedy decoding of the target alone, in process
(``tests/ray/test_serve_cluster.py`` checks that against Hugging Face ``generate``).
The tests run in file order: the no-fault checks first, then the kills (Serve restarts each victim).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import pytest
import torch

from tests.ray.openai_app import assert_stages_refuse_malformed_frames, delete_app, deploy_app
from tools.loadgen import (HealthWatch, Ledger, Target, burst, get_json, hang_ups, replica_pid, request,
                           steady)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

MAX_TOKENS = 16
N_PROMPTS = 48  # distinct prompts; the 500 steady requests cycle through them
ARGS = {
    "target": {"path": "builtin:tiny", "max_model_len": 256},
    "draft": {"kind": "model", "path": "builtin:tiny"},
    "speculation": {"gamma": 4, "adaptive": False},  # adaptive γ would stop drafting with this weak pair
    "draft_pool": {"num_replicas": 1, "num_cpus": 0.25},
    "verifier": {"num_cpus": 0.25},
    # The queue holds the whole backlog of the steady run (arrivals well above the completion rate).
    "router": {"max_running": 32, "max_queue": 512, "micro_batches": 2, "request_timeout_s": 120, "num_cpus": 0.25},
    "http": {"model_name": "tiny"},
    "defaults": {"temperature": 0.0},
}
HEALTH_DEADLINE_S = 2.0  # acceptance: /health reports a dead stage within this long
STALL_BOUND_S = 3.0  # no stream waits longer than this for its next event when the draft pool dies
SEEDED = 24  # seeded sampled streams beside the greedy ones in the draft-kill test
RECOVERY_S = 90.0  # Serve notices a dead replica by its health check (every 10 s) and starts another

ledger = Ledger()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(12)
    lengths = torch.randint(1, 40, (N_PROMPTS,), generator=gen)
    return [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def references(prompts):
    """Greedy continuations of 3 × MAX_TOKENS (shorter requests compare with a prefix)."""
    from engine.engine import Request
    from engine.assembly import EngineSettings, make_engine
    from runtime.models import resolve_spec

    plain = make_engine(EngineSettings(target=resolve_spec("builtin:tiny", "target"), draft=None, device="cpu",
                                       max_len=ARGS["target"]["max_model_len"], max_slots=N_PROMPTS))
    return [list(o.tokens) for o in plain.generate([Request(tuple(p), max_tokens=3 * MAX_TOKENS) for p in prompts])]


@pytest.fixture(scope="module")
def app(ray_cluster):
    app = deploy_app("reliability-faults", "/rf", ARGS)
    yield app
    print("\n" + ledger.table())
    delete_app(app.name)


@pytest.fixture(scope="module")
def target(app) -> Target:
    return Target.parse(app.base)


def _body(prompt: list[int], *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "return_token_ids": True}


def _stats(target: Target) -> dict:
    status, body = asyncio.run(get_json(target, "/debug/stats"))
    assert status == 200, body
    return body


def _kv(target: Target) -> dict:
    status, body = asyncio.run(get_json(target, "/debug/kv"))
    assert status == 200, body
    return body


def _replica_pid(app_name: str, deployment: str) -> int:
    return replica_pid(os.getpid(), app_name, deployment)  # this session started the Ray cluster


def _across(results, killed: float) -> tuple[list, float]:
    """The streams under way at ``killed``, and the longest any of them waited for its next event."""
    spanning = [r for r in results if r.started < killed < r.started + r.latency_s]
    return spanning, max((r.max_gap_s for r in spanning), default=0.0)


def _mismatched(results, expected) -> list[int]:
    return [i for i, (r, want) in enumerate(zip(results, expected)) if r.kind == "ok" and r.token_ids != want]


def test_steady_arrivals_at_twice_capacity_complete_identical_without_resyncs(target, prompts, references):
    """500 requests arriving faster than 1.5× the rate the server completes them: all complete, all identical, and
    neither the verifier re-prefilled a sequence nor a step fell back (nothing failed, so neither may)."""
    want = [r[:MAX_TOKENS] for r in references]
    before = _stats(target)
    t0 = time.monotonic()
    warm = asyncio.run(burst(target, [_body(p) for p in prompts]))
    capacity = len(warm) / (time.monotonic() - t0)
    assert [r.kind for r in warm] == ["ok"] * len(warm) and not _mismatched(warm, want)

    # A full backlog completes faster than the burst (whose tail runs part-empty batches): 2.5× its rate.
    n, rate = 500, 2.5 * capacity
    t0 = time.monotonic()
    results = asyncio.run(steady(target, [_body(prompts[i % N_PROMPTS]) for i in range(n)], rate))
    served = n / (max(r.started + r.latency_s for r in results) - t0)
    after = _stats(target)
    kinds = Counter(r.kind for r in results)
    row = ledger.add("steady", results, [want[i % N_PROMPTS] for i in range(n)], arrivals_per_s=round(rate, 1),
                     completed_per_s=round(served, 1),
                     verifier_resyncs=after["verifier_resyncs"] - before["verifier_resyncs"],
                     fallbacks=after["fallbacks"] - before["fallbacks"])
    print(f"steady: {n} requests at {rate:.1f}/s, served {served:.1f}/s (burst capacity {capacity:.1f}/s): {row}")
    assert kinds == {"ok": n}, kinds
    assert row["mismatched"] == 0 and row["identical"] == n
    assert rate >= 1.5 * served, "arrivals did not outpace completions: the run tested no backlog"
    assert after["verifier_resyncs"] == before["verifier_resyncs"], (before, after)
    assert after["fallbacks"] == before["fallbacks"], (before, after)
    assert after["stats"]["proposed"] > before["stats"]["proposed"]  # speculation really ran


def test_clients_that_hang_up_free_their_kv_slots(target, prompts):
    before = _kv(target)
    long = [_body(p, stream=True, max_tokens=200) for p in prompts[:16]]

    results = asyncio.run(hang_ups(target, long, after_events=2))
    left = time.monotonic()
    assert all(r.hung_up and r.status == 200 for r in results), [(r.status, r.error) for r in results]
    while True:
        kv = _kv(target)
        idle = kv["in_flight"] == 0 and kv["running"] == 0 and not any(kv["slots_in_use"].values())
        if idle and kv["cancelled"] - before["cancelled"] == len(long):
            break
        assert time.monotonic() - left < 10, f"caches not freed after the clients left: before {before}, now {kv}"
        time.sleep(0.05)
    freed = time.monotonic() - left
    ledger.add("disconnects", results, freed_within_s=round(freed, 2))
    print(f"disconnects: {len(long)} streams hung up after 2 events; every KV slot free after {freed:.2f} s")


def test_malformed_frames_get_typed_errors_and_the_app_keeps_serving(app, target, prompts, references):
    """Frames no router sends, straight to the draft pool and to a single-process verifier (the cluster suite
    sends them to a TP = 2 group): each is refused with ``WireError``, and every output stays right."""
    assert_stages_refuse_malformed_frames(app.name)
    results = asyncio.run(burst(target, [_body(p) for p in prompts[:8]]))
    assert [r.kind for r in results] == ["ok"] * 8 and not _mismatched(results, [r[:MAX_TOKENS] for r in references])


def test_draft_replica_sigkill_loses_nothing_and_health_degrades_then_recovers(app, target, prompts, references):
    """SIGKILL the only draft replica under streaming load: every request completes identical, no stream
    stalls for the draft timeout (nor a seeded sampled one, which waits a little for its drafts), /health
    says "degraded" (still 200) within 2 s and "ok" once Serve has replaced the replica; meanwhile
    /debug/kv answers 503 at once instead of waiting on the dead replica."""
    want = [r[: 2 * MAX_TOKENS] for r in references]
    before = _stats(target)
    victim = _replica_pid(app.name, "DraftPool")
    n = 120

    async def scenario():
        async with HealthWatch(target, interval_s=0.1) as watch:
            load = asyncio.create_task(steady(target, [_body(prompts[i % N_PROMPTS], stream=True,
                                                             max_tokens=2 * MAX_TOKENS) for i in range(n)], 15.0))
            # Seeded sampled streams wait a little for drafts the pool lost (their sample depends on them),
            # but never for a pool that died: bounded by the engine's seeded_draft_wait_s.
            seeded = asyncio.create_task(steady(target, [
                {**_body(prompts[i], stream=True, max_tokens=2 * MAX_TOKENS), "temperature": 1.0, "seed": 100 + i}
                for i in range(SEEDED)], 15.0))
            await asyncio.sleep(2.0)  # well under way
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            degraded = await watch.wait_for("degraded", killed, 10.0)
            kv = await request(target, "GET", "/debug/kv", timeout=10)
            results, seeded_results = await load, await seeded
            recovered = await watch.wait_for("ok", killed + (degraded or 0.0), RECOVERY_S)
            codes = Counter(code for t, code, _, _ in watch.samples if t >= killed)
        return results, seeded_results, killed, degraded, kv, recovered, codes

    results, seeded_results, killed, degraded, kv, recovered, codes = asyncio.run(scenario())
    after = _stats(target)
    spanning, stall = _across(results, killed)
    seeded_spanning, seeded_stall = _across(seeded_results, killed)
    row = ledger.add("draft_kill", results, [want[i % N_PROMPTS] for i in range(n)], degraded_after_s=degraded,
                     ok_again_after_s=recovered, longest_stream_stall_s=round(stall, 3),
                     seeded_streams_spanning=len(seeded_spanning), longest_seeded_stall_s=round(seeded_stall, 3),
                     debug_kv=f"{kv.status} in {kv.latency_s:.3f} s", fallbacks=after["fallback_reasons"])
    print(f"draft kill: {row}; /health codes after the kill {dict(codes)}")
    assert Counter(r.kind for r in results) == {"ok": n}, Counter(r.kind for r in results)
    assert row["mismatched"] == 0
    assert degraded is not None and degraded <= HEALTH_DEADLINE_S, degraded
    assert set(codes) == {200}, codes  # degraded is still 200: decoding continues
    assert kv.status == 503 and kv.latency_s < 1.0 and kv.headers.get("retry-after"), (kv.status, kv.body)
    assert kv.error_body["code"] == "unavailable" and "draft pool" in kv.error_body["message"], kv.body
    assert recovered is not None, "the draft pool never came back"
    assert spanning and stall < STALL_BOUND_S, (len(spanning), stall)
    assert Counter(r.kind for r in seeded_results) == {"ok": SEEDED}, Counter(r.kind for r in seeded_results)
    assert seeded_spanning and seeded_stall < STALL_BOUND_S, (len(seeded_spanning), seeded_stall)
    assert after["verifier_resyncs"] == before["verifier_resyncs"]  # the draft's death never touches the verifier
    assert sum(after["fallback_reasons"].get(k, 0) - before["fallback_reasons"].get(k, 0)
               for k in ("draft_died", "draft_down")) > 0

    # Speculation resumes on the new replica, and outputs stay identical.
    resumed = asyncio.run(burst(target, [_body(p) for p in prompts[:8]]))
    assert not _mismatched(resumed, [r[:MAX_TOKENS] for r in references[:8]])
    assert _stats(target)["stats"]["proposed"] > after["stats"]["proposed"]


def test_verifier_sigkill_ends_every_stream_explicitly_and_health_is_503_meanwhile(app, target, prompts, references):
    """SIGKILL the verifier replica mid-stream: each stream ends complete and identical or with an explicit
    error, never silently cut; /health answers 503 within 2 s and "ok" again once Serve has replaced it."""
    want = [r[: 3 * MAX_TOKENS] for r in references]
    victim = _replica_pid(app.name, "Verifier")
    bodies = [_body(p, stream=True, max_tokens=3 * MAX_TOKENS) for p in prompts[:32]]

    async def scenario():
        async with HealthWatch(target, interval_s=0.1) as watch:
            load = asyncio.create_task(burst(target, bodies, timeout=RECOVERY_S + 60))
            deadline = time.monotonic() + 60
            while (await get_json(target, "/health"))[1]["running"] < len(bodies) // 2:
                assert time.monotonic() < deadline and not load.done(), "the streams never got under way"
                await asyncio.sleep(0.02)
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            unhealthy = await watch.wait_for("unhealthy", killed, 10.0)
            kv = await request(target, "GET", "/debug/kv", timeout=10)
            results = await load
            recovered = await watch.wait_for("ok", killed + (unhealthy or 0.0), RECOVERY_S)
            codes = Counter((code, status) for t, code, status, _ in watch.samples if t >= killed)
        return results, killed, unhealthy, kv, recovered, codes

    results, killed, unhealthy, kv, recovered, codes = asyncio.run(scenario())
    kinds = Counter(r.kind for r in results)
    spanning = sum(1 for r in results if r.started + r.latency_s > killed)
    row = ledger.add("verifier_kill", results, want[:len(bodies)], unhealthy_after_s=unhealthy,
                     ok_again_after_s=recovered, streams_spanning_kill=spanning,
                     debug_kv=f"{kv.status} in {kv.latency_s:.3f} s")
    print(f"verifier kill: {row}; /health after the kill {dict(codes)}")
    assert spanning > 0, "every stream finished before the kill: the test tested nothing"
    assert set(kinds) <= {"ok", "stream_error", "server_error", "rejected"}, kinds  # never truncated or dropped
    assert all(r.error_body and r.error_body.get("message") for r in results if r.kind != "ok")
    assert row["mismatched"] == 0
    assert unhealthy is not None and unhealthy <= HEALTH_DEADLINE_S, unhealthy
    assert all(code == 503 for (code, status) in codes if status == "unhealthy"), codes
    assert kv.status == 503 and kv.latency_s < 1.0, (kv.status, kv.latency_s, kv.body)
    assert recovered is not None, "the verifier never came back"
    later = asyncio.run(burst(target, [_body(p) for p in prompts[:8]]))
    assert [r.kind for r in later] == ["ok"] * 8 and not _mismatched(later, [r[:MAX_TOKENS] for r in references[:8]])
