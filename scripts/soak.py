#!/usr/bin/env python3
"""Soak test: the reliability ledger of ``tests/ray/test_reliability_faults.py``, run for as long as you like.

Repeats, until ``--duration`` seconds have passed, one cycle of:

- steady: ``--steady`` requests arriving open-loop at ``--rate`` per second (default: 1.5× the rate a
  burst of ``--burst`` requests measured at start completed) — every complete output must equal the
  reference; the verifier's re-prefills and the draft fallbacks over the phase are recorded;
- overload: ``--overload`` requests at once (only 200 and 503/429 expected; rejection latency p99 noted);
- slow clients: ``--slow`` connections that send half a body and stall, while a burst of well-behaved
  requests runs and ``/health`` is timed;
- disconnects: 16 streams whose clients hang up after two events; the time until every KV slot is free;
- kills (a server this script started, unless ``--no-kills``): the draft replica, then the verifier
  replica, SIGKILLed under load; seconds until ``/health`` says degraded / unhealthy and ok again.

Once, for a server this script started: the listening sockets of its process tree (all must be on
loopback). The traffic comes from ``tools.loadgen``, the generators the test suite uses.

The reference for each prompt is plain greedy decoding of ``builtin:tiny`` in process when this script
starts the server (its model), else the server's own answer to that prompt alone, before any load.

    python scripts/soak.py --duration 600 --out soak.json      # starts `specserve serve` (builtin:tiny)
    python scripts/soak.py --url http://127.0.0.1:8000 --duration 300 [--api-key KEY]

Prints the ledger as a table (one row per scenario, totals over all cycles) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.loadgen import (HealthWatch, Ledger, Target, burst, get_json, hang_ups, listening_sockets,
                           off_loopback, replica_pid, stalled_bodies, steady, stop_server)
from tools.loadgen import start_server as launch_server

REPO = Path(__file__).resolve().parents[1]
APP_NAME = "specserve"  # deployments.launch.APP_NAME: the app `specserve serve` deploys
MAX_TOKENS = 16
N_PROMPTS = 48
SERVER_CONFIG = """\
target: {path: "builtin:tiny", max_model_len: 256}
draft: {kind: model, path: "builtin:tiny"}
speculation: {gamma: 4, adaptive: false}
draft_pool: {num_replicas: 1}
router: {max_running: 32, max_queue: 256, request_timeout_s: 120}
defaults: {temperature: 0.0}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds to keep cycling (default 300)")
    ap.add_argument("--url", help="an already running server (default: start `specserve serve` here)")
    ap.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"))
    ap.add_argument("--out", type=Path, default=Path("soak.json"))
    ap.add_argument("--rate", type=float, help="steady arrivals per second (default: 1.5× measured capacity)")
    ap.add_argument("--steady", type=int, default=300)
    ap.add_argument("--burst", type=int, default=N_PROMPTS)
    ap.add_argument("--overload", type=int, default=640)
    ap.add_argument("--slow", type=int, default=300)
    ap.add_argument("--no-kills", action="store_true")
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()

    server = None
    try:
        if args.url:
            target = Target.parse(args.url, args.api_key)
        else:
            server, target = start_server()
        ledger = asyncio.run(soak(target, server, args))
    finally:
        if server is not None:
            stop_server(server)
    print(ledger.table())
    args.out.write_text(json.dumps({"duration_s": args.duration, "url": args.url, "ledger": ledger.as_dict()},
                                   indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    failed = {name: row for name, row in ledger.as_dict().items()
              if row["truncated"] or row["mismatched"] or (row["server_error"] and name != "verifier_kill")}
    return 1 if failed else 0


async def soak(target: Target, server: subprocess.Popen | None, args) -> Ledger:
    ledger = Ledger()
    status, info = await get_json(target, "/debug/stats")
    if status != 200:
        raise SystemExit(f"GET /debug/stats answered {status}: {info}")
    rng = random.Random(args.seed)
    vocab = min(int(info["vocab_size"]), 256)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(N_PROMPTS)]
    refs = plain_decoding(prompts) if server is not None else await quiet_answers(target, prompts)
    if server is not None:
        sockets = listening_sockets(server.pid)
        ledger.note("sockets", listening=len(sockets), not_loopback=len(off_loopback(sockets)))

    t0 = time.monotonic()
    warm = await burst(target, [body(p) for p in prompts[: args.burst]])
    capacity = len(warm) / (time.monotonic() - t0)
    ledger.add("capacity", warm, refs[: len(warm)], completed_per_s=capacity)
    rate = args.rate or 1.5 * capacity
    end = time.monotonic() + args.duration
    cycle = 0
    while time.monotonic() < end:
        cycle += 1
        print(f"[soak] cycle {cycle}, {end - time.monotonic():.0f} s left", file=sys.stderr)
        await steady_phase(target, ledger, prompts, refs, rate, args.steady)
        if time.monotonic() < end:
            await overload_phase(target, ledger, prompts, refs, args.overload)
        if time.monotonic() < end:
            await slow_phase(target, ledger, prompts, refs, args.slow, args.burst)
        if time.monotonic() < end:
            await disconnect_phase(target, ledger, prompts)
        if server is not None and not args.no_kills and time.monotonic() < end:
            await kill_phase(target, ledger, server, "DraftPool", "draft_kill", "degraded", prompts, refs, rate)
            await kill_phase(target, ledger, server, "Verifier", "verifier_kill", "unhealthy", prompts, refs, rate)
    ledger.note("capacity", cycles=cycle)
    return ledger


def body(prompt: list[int], stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, "return_token_ids": True}


def expected(refs: list[list[int]], n: int) -> list[list[int]]:
    return [refs[i % len(refs)] for i in range(n)]


async def counters(target: Target) -> dict:
    _, info = await get_json(target, "/debug/stats")
    return info if isinstance(info, dict) else {}


async def steady_phase(target, ledger, prompts, refs, rate, n) -> None:
    before = await counters(target)
    t0 = time.monotonic()
    results = await steady(target, [body(prompts[i % len(prompts)]) for i in range(n)], rate)
    served = sum(r.kind == "ok" for r in results) / max(1e-9, max(r.started + r.latency_s for r in results) - t0)
    after = await counters(target)
    row = ledger.rows.get("steady", {}).get("notes", {})
    ledger.add("steady", results, expected(refs, n), arrivals_per_s=rate, completed_per_s=served,
               verifier_resyncs=row.get("verifier_resyncs", 0) + delta(before, after, "verifier_resyncs"),
               fallbacks=row.get("fallbacks", 0) + delta(before, after, "fallbacks"))


def delta(before: dict, after: dict, key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


async def overload_phase(target, ledger, prompts, refs, n) -> None:
    results = await burst(target, [body(prompts[i % len(prompts)]) for i in range(n)])
    rejections = sorted(r.latency_s for r in results if r.kind == "rejected")
    p99 = rejections[min(len(rejections) - 1, int(0.99 * len(rejections)))] if rejections else None
    ledger.add("overload", results, expected(refs, n), rejection_p99_s=p99)


async def slow_phase(target, ledger, prompts, refs, n_slow, n) -> None:
    async with stalled_bodies(target, n_slow) as held:
        async with HealthWatch(target, interval_s=0.2) as watch:
            results = await burst(target, [body(p) for p in prompts[:n]])
    health = [latency for _, code, _, latency in watch.samples]
    ledger.add("slow_clients", results, refs[:n], stalled_connections=held,
               health_max_s=max(health) if health else None)


async def disconnect_phase(target, ledger, prompts) -> None:
    _, before = await get_json(target, "/debug/kv")
    long = [{**body(p, stream=True), "max_tokens": 200} for p in prompts[:16]]
    results = await hang_ups(target, long, after_events=2)
    left = time.monotonic()
    freed = None
    while time.monotonic() - left < 30:
        status, kv = await get_json(target, "/debug/kv")
        if status == 200 and kv["in_flight"] == 0 and not any(kv.get("slots_in_use", {}).values()):
            freed = time.monotonic() - left
            break
        await asyncio.sleep(0.05)
    cancelled = kv.get("cancelled", 0) - (before or {}).get("cancelled", 0) if status == 200 else None
    ledger.add("disconnects", results, freed_within_s=freed, cancelled=cancelled)


async def kill_phase(target, ledger, server, deployment, scenario, bad, prompts, refs, rate) -> None:
    """SIGKILL ``deployment``'s replica 2 s into 8 s of steady streaming load; ``bad`` is what /health
    should say until Serve has replaced it."""
    n = max(8, int(8 * rate))
    victim = replica_pid(server.pid, APP_NAME, deployment)
    async with HealthWatch(target, interval_s=0.1) as watch:
        load = asyncio.create_task(steady(target, [body(prompts[i % len(prompts)], stream=True) for i in range(n)],
                                          rate, timeout=240))
        await asyncio.sleep(2.0)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        flagged = await watch.wait_for(bad, killed, 10.0)
        results = await load
        back = await watch.wait_for("ok", killed + (flagged or 0.0), 120.0)
    stall = max((r.max_gap_s for r in results if r.started < killed < r.started + r.latency_s), default=0.0)
    ledger.add(scenario, results, expected(refs, n), **{f"{bad}_after_s": flagged, "ok_again_after_s": back,
                                                        "longest_stream_stall_s": stall})


def plain_decoding(prompts: list[list[int]]) -> list[list[int]]:
    from engine.engine import Request
    from engine.assembly import EngineSettings, make_engine
    from runtime.models import resolve_spec

    engine = make_engine(EngineSettings(target=resolve_spec("builtin:tiny", "target"), draft=None, device="cpu",
                                        max_len=256, max_slots=len(prompts)))
    return [list(o.tokens) for o in engine.generate([Request(tuple(p), max_tokens=MAX_TOKENS) for p in prompts])]


async def quiet_answers(target: Target, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        (r,) = await burst(target, [body(p)])
        if r.kind != "ok":
            raise SystemExit(f"the reference request failed: {r.status} {r.error or r.body[:200]!r}")
        out.append(r.token_ids)
    return out


def start_server() -> tuple[subprocess.Popen, Target]:
    """``specserve serve`` with the builtin tiny pair on a free loopback port, in its own process group."""
    folder = Path(tempfile.mkdtemp(prefix="specserve-soak-"))
    config = folder / "soak.yaml"
    config.write_text(SERVER_CONFIG)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    server, target = launch_server(config, folder, env)
    print(f"[soak] server up on port {target.port} (logs in {folder})", file=sys.stderr)
    return server, target


if __name__ == "__main__":
    sys.exit(main())
