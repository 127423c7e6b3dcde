#!/usr/bin/env python3
"""Served vs in-process benchmark: does speculation through HTTP beat plain decoding of the same model?

For the embedded pair (models/default; ``--target/--draft`` for another), greedy, side by side in one run:

- in-process plain: the engine with no draft (what plain ``generate`` of the target costs here);
- in-process speculative: the same engine with the draft model (adaptive γ);
- served speculative: the Serve app started as ``specserve serve`` starts it (``deployments.loopback``,
  loopback; the ingress replica serves HTTP itself, on a port of its own, without Serve's proxy),
  requests through its OpenAI HTTP API, once per layout (``--placements``: ``offload`` = a
  draft-pool replica, the default config; ``compiled`` = the same, with ``router.transport: compiled``
  (every step's frames through compiled-graph channels to the stage replicas' workers); ``colocated`` =
  the draft inside the verifier replica; ``local`` = ``router.stages: local``, both models inside the
  router replica, no Serve call per step);
- served plain: the same app with ``draft.kind: none``, once for each kind of layout asked for: remote
  stages over handles (for a placement with handles), over compiled channels (for ``compiled``), and local
  stages (for ``local``).

Batch 1: every prompt goes through every row in turn (the order reversed every other prompt), each row
timing one request end to end (prefill included). ``--batch N`` (default 16) adds rows that send all
prompts N at a time (N concurrent HTTP requests; one ``generate`` of N in-process). Both run ``--rounds``
times (default 2), every row once per group of prompts and round, the order reversed every other group and
round; each row's rate over the best in-process speculative rate of the same round is reported per round
(median and range, the box's drift between rounds). Served
rows use the app's own thread settings (``verifier.num_threads`` 'auto' unless ``--served-threads N``,
``draft_pool.num_threads`` 1); the in-process rows run once per ``--threads`` count (default: 1 and all
cores), so the served rows meet the better in-process baseline. Like the replicas
(``deployments/replica_process.py``), this process's OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``
unless set): spinning, two threads collapse whenever another process wants a core. Each output is checked
identical to the in-process plain one.

It also records resident memory: every replica's against its line of ``specserve plan``, and Ray's own
processes.

    python scripts/bench_served.py [--prompts 8] [--max-tokens 64] [--batch 16] [--out bench-out/served]
    specserve bench served -- --prompts 4

Prints a table; writes DIR/served.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import deployments.bench_apps  # noqa: E402,F401  (its environment for Ray, before Ray is imported)
from evaluation.scenarios import SCENARIOS, load_prompts  # noqa: E402
from tools.loadgen import pct  # noqa: E402

PORT = 18000 + os.getpid() % 1000  # the config's http.port; the ingress replicas serve on ports of start_apps'


def served_args(args, placement: str | None, stages: str = "remote", transport: str = "handles") -> dict:
    """The app's config: cluster/examples/default.yaml with this run's pair, context and layout."""
    from deployments.bench_apps import default_app_args

    cfg = default_app_args(PORT)
    cfg["target"].update(path=args.target, max_model_len=args.max_model_len)
    cfg["router"].update(max_running=max(args.batch, 1), max_queue=2 * max(args.batch, 1), stages=stages,
                         transport=transport)
    if args.served_threads is not None:
        cfg["verifier"]["num_threads"] = args.served_threads
    if placement is None:
        cfg["draft"] = {"kind": "none"}
    else:
        cfg["draft"].update(kind="model", path=args.draft)
        if placement != "local":  # with local stages the draft runs in the router, wherever the pool would be
            cfg["draft_pool"]["placement"] = placement
    return cfg


def served_layouts(args) -> dict[str, tuple[str | None, str, str]]:
    """Served row name → (draft placement or None for plain, router.stages, router.transport). The
    placement 'compiled' is 'offload' with the stage replicas' workers reached over compiled channels."""
    rows = {}
    for p in args.placements:
        layout = {"local": ("local", "local", "handles"), "compiled": ("offload", "remote", "compiled")}
        rows[f"served speculative ({p})"] = layout.get(p, (p, "remote", "handles"))
    # A plain row per layout asked for: an idle app beside the others is not free (its router probes its
    # stages every router.probe_interval_s), so one no row needs would slow the rows being compared.
    if any(p not in ("local", "compiled") for p in args.placements):
        rows["served plain (remote)"] = (None, "remote", "handles")
    if "compiled" in args.placements:
        rows["served plain (compiled)"] = (None, "remote", "compiled")
    if "local" in args.placements:
        rows["served plain (local stages)"] = (None, "local", "handles")
    return rows


def http_generate(client, url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    r = client.post(f"{url}/v1/completions", json={"model": "specserve-default", "prompt": prompt,
                                                    "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


ROLES = {"Verifier": "verifier", "DraftPool": "draft pool", "Router": "router", "OpenAIIngress": "HTTP ingress"}
LOCAL_ROLES = {"Router": "router (local stages)", "OpenAIIngress": "HTTP ingress"}
RAY_SYSTEM = ("raylet", "gcs_server", "ServeController", "ProxyActor", "dashboard", "runtime_env", "log_monitor",
              "monitor.py")


def process_memory() -> dict[str, list[dict[str, int]]]:
    """Resident and peak resident bytes of this run's Ray processes (descendants of this one), by role:
    ``app:Deployment`` for a replica, "Ray system" for Ray's own."""
    parent, info = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            info[int(pid)] = (cmd, {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")})
        except (OSError, ValueError, IndexError, KeyError):
            continue
    mine, frontier = set(), {os.getpid()}
    while frontier:
        mine |= frontier
        frontier = {p for p, pp in parent.items() if pp in frontier} - mine
    out: dict[str, list[dict[str, int]]] = {}
    for pid in mine - {os.getpid()}:
        if pid not in info:
            continue
        cmd, mem = info[pid]
        if "ServeReplica:" in cmd:
            role = cmd.split("ServeReplica:", 1)[1].split()[0].split(".")[0]
        elif any(k in cmd for k in RAY_SYSTEM):
            role = "Ray system"
        else:
            continue
        out.setdefault(role, []).append(mem)
    return out


def memory_rows(args, apps: dict[str, tuple[str, str]], measured: dict) -> list[dict]:
    """Each replica's line of ``specserve plan`` (runtime + models, worst case) beside its measured peak."""
    from cluster.config import ClusterConfig
    from cluster.memory_plan import plan

    rows, layouts = [], served_layouts(args)
    for row, (name, _) in apps.items():
        app_plan = plan(ClusterConfig.from_dict(served_args(args, *layouts[row])))
        planned = {r.role: r.runtime + r.model_bytes for r in app_plan.replicas}
        for deployment, role in (LOCAL_ROLES if layouts[row][1] == "local" else ROLES).items():
            for mem in measured.get(f"{name}:{deployment}", []):
                rows.append({"app": row, "replica": role, "plan_bytes": planned.get(role),
                             "peak_rss_bytes": mem["VmHWM"], "rss_bytes": mem["VmRSS"]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO / "models" / "default" / "target"))
    parser.add_argument("--draft", default=str(REPO / "models" / "default" / "draft"))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per scenario (json, code, prose)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="batch of the throughput rows (0: none)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of batch 1 and of the throughput rows, every row once per group of prompts "
                             "and round")
    parser.add_argument("--placements", default="offload,compiled,colocated,local",
                        help="draft placements of the served speculative rows, comma-separated ('compiled': "
                             "offload over the compiled-graph transport)")
    parser.add_argument("--threads", default=None,
                        help="torch thread counts of the in-process rows, comma-separated (default: 1 and all cores)")
    parser.add_argument("--served-threads", type=int, default=None,
                        help="verifier.num_threads of the served apps (default: the config's 'auto')")
    parser.add_argument("--out", default="bench-out/served", help="output folder")
    args = parser.parse_args()
    args.placements = [p for p in args.placements.split(",") if p]

    import httpx
    import torch

    from cluster.node import cpu_cores
    from engine.engine import Request
    from engine.assembly import EngineSettings, make_engine
    from runtime.models import load_tokenizer

    args.threads = sorted({1, cpu_cores()} if args.threads is None else {int(t) for t in args.threads.split(",")})
    tokenizer = load_tokenizer(args.target)
    prompts = [p["prompt"] for s in SCENARIOS for p in load_prompts(s, args.prompts)]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    engines, threads = {}, {}
    for name, draft in (("in-process plain", None), ("in-process speculative", args.draft)):
        engine = make_engine(EngineSettings(target=args.target, draft=draft, max_len=args.max_model_len,
                                            max_slots=max(args.batch, 1)), eos_token_ids=eos)
        for n in args.threads:
            row = f"{name} ({n} thread{'s' if n > 1 else ''})"
            engines[row], threads[row] = engine, n
    from deployments.bench_apps import start_apps, stop_apps

    layouts = served_layouts(args)
    urls = start_apps({row: served_args(args, *layout) for row, layout in layouts.items()})
    rows = [*engines, *urls]
    client = httpx.Client(timeout=600)

    def run(row: str, batch: list[str]) -> tuple[list[str], int, float]:
        t0 = time.perf_counter()
        if row in engines:
            torch.set_num_threads(threads[row])
            outs = engines[row].generate([Request(tuple(tokenizer(p)["input_ids"]), max_tokens=args.max_tokens)
                                          for p in batch])
            texts = [tokenizer.decode(o.tokens, skip_special_tokens=True) for o in outs]
            tokens = sum(len(o.tokens) for o in outs)
        else:
            with ThreadPoolExecutor(len(batch)) as pool:
                results = list(pool.map(lambda p: http_generate(client, urls[row][1], p, args.max_tokens), batch))
            texts, tokens = [t for t, _ in results], sum(n for _, n in results)
        return texts, tokens, time.perf_counter() - t0

    for row in rows:  # warm-up: first calls pay one-off costs (kernels, Serve's routing tables)
        run(row, prompts[:1])

    def measure(size: int) -> dict:
        """Every row through all prompts ``size`` at a time, ``args.rounds`` times; the order of the rows
        reversed every other group and round, so a drift of the box's speed hits every row alike."""
        recs = {row: {"tokens": 0, "seconds": 0.0, "latency": [], "texts": [], "rounds": []} for row in rows}
        for r in range(args.rounds):
            tally = {row: [0, 0.0] for row in rows}
            for g, start in enumerate(range(0, len(prompts), size)):
                for row in (rows if (g + r) % 2 == 0 else rows[::-1]):
                    texts, tokens, seconds = run(row, prompts[start:start + size])
                    rec = recs[row]
                    tally[row][0] += tokens
                    tally[row][1] += seconds
                    rec["latency"].append(seconds)
                    if r == 0:
                        rec["texts"] += texts
                    elif texts != rec["texts"][start:start + size]:
                        rec["texts"][start:start + size] = [None] * len(texts)  # not reproducible
            for row, (tokens, seconds) in tally.items():
                recs[row]["tokens"] += tokens
                recs[row]["seconds"] += seconds
                recs[row]["rounds"].append(tokens / seconds)
            print(f"[batch {size}, round {r + 1}/{args.rounds}] " + "  ".join(
                f"{row}: {recs[row]['tokens'] / recs[row]['seconds']:.1f}" for row in rows), file=sys.stderr)
        return recs

    batch1 = measure(1)
    batched = measure(args.batch) if args.batch > 1 else {}

    memory = process_memory()
    mem_rows = memory_rows(args, urls, memory)
    stop_apps()

    plain_rows = [r for r in engines if r.startswith("in-process plain")]
    best_plain = max(plain_rows, key=lambda r: batch1[r]["tokens"] / batch1[r]["seconds"])
    reference = batch1[best_plain]["texts"]
    plain_rate = batch1[best_plain]["tokens"] / batch1[best_plain]["seconds"]
    # Each round runs every row back to back, so a row's rate over the same round's best in-process speculative
    # rate is a ratio measured side by side; its spread over the rounds is the box's drift.
    spec_rows = [r for r in engines if r.startswith("in-process speculative")]

    def by_round(recs: dict, row: str) -> list[float]:
        """The row's rate in each round over the best in-process speculative rate of that round."""
        return [x / max(recs[r]["rounds"][i] for r in spec_rows) for i, x in enumerate(recs[row]["rounds"])]

    results = []
    for row in rows:
        rec = batch1[row]
        rate = rec["tokens"] / rec["seconds"]
        result = {"row": row, "batch1_tokens_per_s": rate, "batch1_vs_in_process_plain": rate / plain_rate,
                  "latency_p50_s": pct(rec["latency"], 50), "latency_p90_s": pct(rec["latency"], 90),
                  "identical_to_plain": sum(x == y for x, y in zip(rec["texts"], reference)),
                  "batch1_vs_in_process_speculative_by_round": by_round(batch1, row)}
        if row in batched:
            rb = batched[row]
            result["batch_tokens_per_s"] = rb["tokens"] / rb["seconds"]
            result["batch_identical_to_plain"] = sum(x == y for x, y in zip(rb["texts"], reference))
            result["batch_vs_in_process_speculative_by_round"] = by_round(batched, row)
        results.append(result)

    def spread(ratios: list[float]) -> str:
        return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"

    per_round = "× in-process spec. per round: median (min–max)"
    header = ["row", "batch 1 tok/s", "× best in-process plain", "p50 / p90 s per request", "identical",
              f"batch 1 {per_round}"]
    if batched:
        header += [f"batch {args.batch} tok/s", f"batch {args.batch} identical", f"batch {args.batch} {per_round}"]
    table = [header]
    for r in results:
        line = [r["row"], f"{r['batch1_tokens_per_s']:.1f}", f"{r['batch1_vs_in_process_plain']:.2f}×",
                f"{r['latency_p50_s']:.2f} / {r['latency_p90_s']:.2f}", f"{r['identical_to_plain']}/{len(prompts)}",
                spread(r["batch1_vs_in_process_speculative_by_round"])]
        if batched:
            line += [f"{r['batch_tokens_per_s']:.1f}", f"{r['batch_identical_to_plain']}/{len(prompts)}",
                     spread(r["batch_vs_in_process_speculative_by_round"])]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for j, line in enumerate(table):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print("\nmemory per replica (MiB): plan = specserve plan's worst case (runtime + models); measured = peak RSS")
    for m in mem_rows:
        plan_mib = "-" if m["plan_bytes"] is None else f"{m['plan_bytes'] / 2**20:.0f}"
        print(f"  {m['app']:30s} {m['replica']:13s} plan {plan_mib:>6s}  measured {m['peak_rss_bytes'] / 2**20:6.0f}")
    system = memory.get("Ray system", [])
    print(f"  Ray system processes: {len(system)}, peak RSS {sum(m['VmHWM'] for m in system) / 2**20:.0f} MiB")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only", "date": time.strftime("%Y-%m-%d"),
              "args": {k: v for k, v in vars(args).items()}, "prompts": len(prompts), "results": results,
              "best_in_process_plain": best_plain, "memory": mem_rows,
              "ray_system_peak_rss_bytes": [m["VmHWM"] for m in system]}
    (out / "served.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'served.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
