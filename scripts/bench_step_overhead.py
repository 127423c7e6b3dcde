#!/usr/bin/env python3
"""Step-overhead benchmark of the running Serve app: where a step's time goes, and does overlap happen.

For two router settings side by side in one run — ``micro_batches=2`` (drafting one micro-batch while
the other is verified) and ``micro_batches=1`` (no overlap) — and for each ``router.transport`` in
``--transports`` (default: Serve handles and compiled-graph channels), it drives the app through the
Serve handle with Poisson arrivals of streaming requests and reports:

- time per step split into draft compute, verify compute, transport (the rest of each stage call:
  msgpack, Serve hops, queueing) and scheduling (the router's own work), also as shares of step time,
  and the p50/p99 of one stage call's transport (draft hop, verify hop);
- the busy fraction of the draft pool and of the verifier over the run, and the fraction of time both
  were busy at once (overlap);
- time-to-first-token and inter-token latency percentiles.

    python scripts/bench_step_overhead.py [--target DIR --draft DIR] [--requests 48 --rate 6] [--tp 2]

With ``--tp 2`` the target is a tensor-parallel group of two ranks (gloo on CPU), fed through a compiled
graph of its own by the verifier replica (over handles) or by its stage worker (over compiled channels;
docs/transport.md).

Prints a table and writes JSON (default bench-out/step_overhead.json).

``--null-model`` isolates transport instead: stages that answer at once (no model) in Serve stage deployments
built as the served app's are, reached through Serve handles and, in worker mode, through their stage workers over
Ray Compiled Graph channels (``deployments.transport.client.connect_stages``, as the router connects), in one run; it reports p50/p99 round trip per stage call (msgpack encode/decode
included), one call in flight and two micro-batches in flight (default bench-out/step_overhead_null.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from tools.loadgen import pct

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def union_length(intervals, lo, hi) -> float:
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def merged(intervals, lo, hi):
    out = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersection_length(xs, ys) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


async def drive(router, prompts, rate: float, max_tokens: int, seed: int):
    from deployments.api import GenerateRequest

    rng = random.Random(seed)
    ttft, itl, tokens = [], [], 0

    async def one(prompt):
        nonlocal tokens
        t0 = time.perf_counter()
        last = None
        async for chunk in router.options(stream=True).generate_stream.remote(
                GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0)):
            now = time.perf_counter()
            if not chunk.token_ids:
                continue
            if last is None:
                ttft.append(now - t0)
            else:
                # A chunk carries every token of one step: spread the gap over them.
                itl.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
            tokens += len(chunk.token_ids)
            last = now

    tasks = []
    for p in prompts:
        tasks.append(asyncio.ensure_future(one(p)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return ttft, itl, tokens


def wait_for_workers(router, drafts: int, verifiers: int, timeout_s: float = 120.0) -> None:
    """Until the router's directory has registered the stage replicas' workers (compiled transport)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = router.info.remote().result()["workers"]
        if len(workers["draft"]) >= drafts and len(workers["verifier"]) >= verifiers:
            return
        time.sleep(0.2)
    raise TimeoutError(f"stage workers not registered within {timeout_s:g} s: {workers}")


def run_mode(name: str, args, micro_batches: int, prompts, transport: str = "handles") -> dict:
    from ray import serve

    from deployments.app import build_app
    from deployments.launch import deploy

    app_args = {"target": {"path": args.target, "max_model_len": 512, "tensor_parallel": args.tp},
                "draft": {"kind": "model", "path": args.draft},
                "speculation": {"gamma": args.gamma, "adaptive": False},
                "draft_pool": {"num_replicas": 1},
                "router": {"micro_batches": micro_batches, "max_running": 64, "transport": transport},
                "defaults": {"temperature": 0.0}}
    app = f"bench-{name.replace(' ', '-')}"
    deploy(build_app(app_args), app, timeout_s=600)
    router = serve.get_deployment_handle("Router", app_name=app)
    if transport != "handles":
        wait_for_workers(router, drafts=1, verifiers=1)
    pool = serve.get_deployment_handle("DraftPool", app_name=app)
    verifier = serve.get_deployment_handle("Verifier", app_name=app)
    asyncio.run(drive(router, prompts[:4], 50.0, 8, 0))  # warm-up: first calls pay one-off costs
    router.step_profile.remote(reset=True).result()
    t_start = time.time()
    w0 = time.perf_counter()
    ttft, itl, tokens = asyncio.run(drive(router, prompts, args.rate, args.max_tokens, args.seed))
    wall = time.perf_counter() - w0
    t_end = time.time()
    profile = router.step_profile.remote().result()
    draft_busy = merged(pool.busy_intervals.remote(t_start).result(), t_start, t_end)
    verify_busy = merged(verifier.busy_intervals.remote(t_start).result(), t_start, t_end)
    window = t_end - t_start
    serve.delete(app)
    step = profile["step_ms"] or float("nan")
    transport = profile["transport_draft_ms"] + profile["transport_verify_ms"]
    return {
        "mode": name, "transport": transport, "micro_batches": micro_batches, "requests": len(prompts),
        "tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall, "profile": profile,
        "share_of_step": {"draft": profile["draft_ms"] / step, "verify": profile["verify_ms"] / step,
                          "transport": transport / step, "schedule": profile["schedule_ms"] / step},
        "busy": {"draft": union_length(draft_busy, t_start, t_end) / window,
                 "verify": union_length(verify_busy, t_start, t_end) / window,
                 "both": intersection_length(draft_busy, verify_busy) / window},
        "ttft_ms": {q: 1e3 * pct(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {q: 1e3 * pct(itl, q) for q in (50, 90, 99)},
    }


class NullProposer:
    """Drafts ``gamma`` zeros per row at once: a frame of the real shape, no model."""

    def propose(self, items):
        import torch

        from runtime.protocol import ProposalBatch

        n, g = len(items), max(it.gamma for it in items)
        return ProposalBatch(seq_ids=[it.sync.seq_id for it in items], tokens=torch.zeros((n, g), dtype=torch.long),
                             lengths=torch.full((n,), g, dtype=torch.long))

    def verify(self, items, proposal):
        from runtime.protocol import VerifyOutcome

        lengths = proposal.lengths.tolist()
        return VerifyOutcome([it.sync.seq_id for it in items], [[0] * (g + 1) for g in lengths], lengths, lengths)

    def release(self, seq_ids):
        pass


class CodecStages:
    """The frames of a stage call encoded and decoded in this process, around a ``NullProposer``: the msgpack
    share of every transport's round trip, with no hop at all."""

    def __init__(self, limits):
        self.limits, self.stage = limits, NullProposer()

    def submit_propose(self, items, shard=0):
        from engine.engine import Done
        from runtime import wire

        batch = self.stage.propose(wire.decode_propose(wire.encode_propose(items), self.limits))
        return Done(wire.decode_proposal(wire.encode_proposal(batch), self.limits))

    def submit_verify(self, items, proposal, shard=0):
        from engine.engine import Done
        from runtime import wire

        outcome = self.stage.verify(*wire.decode_verify(wire.encode_verify(items, proposal), self.limits))
        return Done(wire.decode_outcome(wire.encode_outcome(outcome), self.limits))

    def close(self):
        pass


def null_stage(cfg) -> NullProposer:
    """The stage a null replica's worker builds (``StageHost._start_worker``'s ``build``)."""
    return NullProposer()


NULL_GENERATION = "null"  # the null app is built once per run: one generation of workers


def null_app(cfg):
    """A Serve app of two stage deployments built as DraftPool and Verifier are (``StageHost``: frames decoded
    with the wire limits, handle calls routed by shard key), around a ``NullProposer``. Under a worker transport
    (``cfg.worker_stages``) each replica holds no stage: it starts its ``StageWorker`` on its node under the name
    the router's ``WorkerDirectory`` finds it by, waits for it, and forwards handle calls to it — the served
    path's worker mode, with a stage that answers at once."""
    from ray import serve

    from deployments.app import QUIET
    from deployments.settings import wire_limits
    from deployments.stage_host import StageHost

    @serve.deployment(ray_actor_options={"num_cpus": 0.5})
    class NullStage(StageHost):
        def __init__(self, cfg, stage: str, peer=None):
            # ``peer`` (the verifier, bound into the draft) only makes one app of both, as in the served app:
            # a worker's name carries its app, and a directory lists one app's workers.
            self._init_host(wire_limits(cfg))
            if stage in cfg.worker_stages:
                role = "draft pool" if stage == "draft" else "verifier"
                self._start_worker(cfg, stage, role, null_stage, generation=NULL_GENERATION, threads=1, num_gpus=0,
                                   slot_gauge="draft" if stage == "draft" else "target")
            else:
                self._host("draft" if stage == "draft" else "target",
                           **{"proposer" if stage == "draft" else "verifier": NullProposer()})

    verifier = NullStage.options(name="NullVerifier", **QUIET).bind(cfg, "verifier")
    return NullStage.options(name="NullDraft", **QUIET).bind(cfg, "draft", verifier)


def time_stages(stages, batch: int, gamma: int, steps: int, inflight: int) -> dict:
    """Per-stage round trips (ms) of ``steps`` steps of ``inflight`` micro-batches of ``batch`` rows."""
    from runtime.protocol import ProposeItem, SyncItem, VerifyItem

    groups = [[SyncItem(seq_id=m * batch + b, base=40, tokens=(7,)) for b in range(batch)] for m in range(inflight)]
    samples = {"draft": [], "verify": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        pending = [stages.submit_propose([ProposeItem(s, gamma) for s in g], m) for m, g in enumerate(groups)]
        proposals = [p.result() for p in pending]
        t1 = time.perf_counter()
        pending = [stages.submit_verify([VerifyItem(s) for s in g], p, m)
                   for m, (g, p) in enumerate(zip(groups, proposals))]
        for p in pending:
            p.result()
        t2 = time.perf_counter()
        samples["draft"].append((t1 - t0) * 1e3 / inflight)
        samples["verify"].append((t2 - t1) * 1e3 / inflight)
    return {stage: {"p50": pct(xs, 50), "p99": pct(xs, 99)} for stage, xs in samples.items()}


def run_null_model(args) -> list[dict]:
    """Handles: a handles-transport app. Compiled: a worker-mode app (router.transport 'compiled'), its
    workers found and reached as the router does; every timed call must reach a worker (checked)."""
    import ray
    from ray import serve

    from cluster.config import ClusterConfig
    from deployments.launch import deploy
    from deployments.settings import wire_limits
    from deployments.transport.client import connect_stages
    from deployments.transport.directory import app_key

    app_args = {"target": {"path": args.target, "max_model_len": 512}, "draft": {"kind": "model", "path": args.draft},
                "speculation": {"gamma": args.gamma, "adaptive": False}, "router": {"max_running": 64}}
    cfgs = {app: ClusterConfig.from_dict({**app_args, "router": {"max_running": 64, "transport": transport}})
            for app, transport in (("null-handles", "handles"), ("null-workers", "compiled"))}
    limits = wire_limits(cfgs["null-handles"])
    for app, cfg in cfgs.items():
        deploy(null_app(cfg), app, timeout_s=300)

    def connect(app: str, workers_of: str | None = None):  # probed as the router probes its stages
        router = cfgs[app].router
        return connect_stages(limits, serve.get_deployment_handle("NullDraft", app_name=app),
                              serve.get_deployment_handle("NullVerifier", app_name=app), draft_timeout_s=30,
                              verify_timeout_s=30, shard_prefix="null", probe_interval_s=router.probe_interval_s,
                              probe_timeout_s=router.probe_timeout_s, workers_of=workers_of)

    transports = {"codec only": CodecStages(limits), "handle": connect("null-handles")}
    compiled = connect("null-workers", workers_of=app_key("null-workers", NULL_GENERATION))
    deadline = time.monotonic() + 60
    while not (compiled.draft.all() and compiled.verifier.all()):
        if time.monotonic() > deadline:
            raise TimeoutError("the null app's stage workers were not registered within 60 s")
        time.sleep(0.2)
    transports["compiled"] = compiled
    results = []
    for repeat in range(args.repeats):  # interleaved, so load from other processes hits every transport alike
        for kind, stages in transports.items():
            time_stages(stages, args.null_batch, args.gamma, 20, 1)  # warm-up
            for inflight in (1, 2):
                r = time_stages(stages, args.null_batch, args.gamma, args.null_steps, inflight)
                results.append({"transport": kind, "inflight": inflight, "repeat": repeat,
                                "load_average_1min": os.getloadavg()[0], **r})
    by_handles = {way: n for way, n in compiled.calls.items() if way.endswith(" handles")}
    if by_handles:
        raise RuntimeError(f"compiled: calls went through the Serve handles, not the workers: {by_handles}")
    for stages in transports.values():
        stages.close()
    for app in cfgs:
        serve.delete(app)
    ray.shutdown()
    return results


def report_null_model(args, results: list[dict], load: dict) -> int:
    header = ("transport", "in flight", "draft p50 ms", "draft p99 ms", "verify p50 ms", "verify p99 ms")
    rows = []
    for kind in ("codec only", "handle", "compiled"):
        for inflight in (1, 2):
            rs = [r for r in results if r["transport"] == kind and r["inflight"] == inflight]
            med = {f"{st}_{q}": statistics.median(r[st][q] for r in rs) for st in ("draft", "verify") for q in ("p50", "p99")}
            rows.append((kind, str(inflight), *(f"{med[k]:.3f}" for k in ("draft_p50", "draft_p99", "verify_p50",
                                                                              "verify_p99"))))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    print(f"(median over {args.repeats} interleaved repeats of {args.null_steps} steps; {args.null_batch} rows, "
          f"gamma {args.gamma}; per stage call, per micro-batch; "
          f"'codec only': msgpack encode/decode and the null stage in this process, no hop)")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
        *load["before"], *load["after"]))
    out = Path(args.out if args.out != DEFAULT_OUT else "bench-out/step_overhead_null.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{platform.node()} ({os.cpu_count()} CPUs, CPU only)",
                               "date": time.strftime("%Y-%m-%d"), "load_average": load, "args": vars(args),
                               "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


DEFAULT_OUT = "bench-out/step_overhead.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="builtin:tiny")
    parser.add_argument("--draft", default="builtin:tiny")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=6.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1, help="target.tensor_parallel of the served apps (gloo on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--transports", default="handles,compiled",
                        help="router.transport of the served modes, comma-separated (handles, compiled)")
    parser.add_argument("--null-model", action="store_true", help="stages that answer at once: transport only")
    parser.add_argument("--null-batch", type=int, default=16, help="rows per micro-batch (--null-model)")
    parser.add_argument("--null-steps", type=int, default=1000, help="timed steps per repeat (--null-model)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (--null-model)")
    args = parser.parse_args()
    args.transports = [t for t in args.transports.split(",") if t]
    if args.null_model:
        import ray

        load_before = os.getloadavg()
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        results = run_null_model(args)
        return report_null_model(args, results, {"before": load_before, "after": os.getloadavg()})

    import ray
    import torch

    from runtime.models import resolve_spec, spec_vocab_size

    vocab = spec_vocab_size(resolve_spec(args.target, "target"))
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 64, (args.requests,), generator=gen)]
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    results = [run_mode(f"{mode} ({transport})", args, mb, prompts, transport)
               for transport in args.transports for mode, mb in (("overlap", 2), ("serial", 1))]
    ray.shutdown()

    header = ("mode", "tok/s", "step ms", "draft", "verify", "transport", "schedule", "busy draft", "busy verify",
              "busy both", "draft hop p50/p99 ms", "verify hop p50/p99 ms", "TTFT p50/p99 ms", "ITL p50/p99 ms")
    rows = []
    for r in results:
        s, b, p = r["share_of_step"], r["busy"], r["profile"]
        rows.append((r["mode"], f"{r['tokens_per_s']:.1f}", f"{p['step_ms']:.2f}", f"{s['draft']:.0%}",
                     f"{s['verify']:.0%}", f"{s['transport']:.0%}", f"{s['schedule']:.0%}", f"{b['draft']:.0%}",
                     f"{b['verify']:.0%}", f"{b['both']:.0%}",
                     f"{p['transport_draft_p50_ms']:.2f}/{p['transport_draft_p99_ms']:.2f}",
                     f"{p['transport_verify_p50_ms']:.2f}/{p['transport_verify_p99_ms']:.2f}",
                     f"{r['ttft_ms'][50]:.0f}/{r['ttft_ms'][99]:.0f}", f"{r['itl_ms'][50]:.1f}/{r['itl_ms'][99]:.1f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    ratio = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
    print(f"throughput overlap / serial ({args.transports[0]}): {ratio:.2f}x")
    if len(args.transports) > 1:
        print(f"throughput {args.transports[1]} / {args.transports[0]} (overlap): "
              f"{results[2]['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{platform.node()} ({os.cpu_count()} CPUs, CPU only)",
                               "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                               "overlap_over_serial_throughput": ratio, "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
