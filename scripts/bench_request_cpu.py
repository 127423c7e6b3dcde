#!/usr/bin/env python3
"""Per-request CPU of the serving path: what one 1-token HTTP request costs all serving processes together.

The request path (HTTP ingress replica → router replica → step loop → back) costs CPU in every process it
touches, and more in the ones it does not (Ray's GCS, raylet, agents and Serve's controller run whether or
not requests come). This measures that cost with the cheapest real app, so a lighter path can be compared
against today's:

- the app: the built-in tiny pair (``target.path: builtin:tiny``; ``--draft none`` (default) or ``tiny``),
  ``router.stages: local``, one ingress replica (serving HTTP itself, Serve's direct ingress, as
  ``specserve serve`` runs it) and one router replica, on a fresh loopback Ray cluster of its own
  (``deployments.loopback.init_local_ray``; Ray token auth off, as in the tests); the rest is
  ``cluster/examples/default.yaml``;
- CPU per request: after a warm-up, the CPU time (user + system) of every process of this cluster — the
  descendants of this process: GCS, raylet, agents, the dashboard and monitor processes, Serve's controller
  and proxy, the replicas, idle workers — over an idle window (the background rate) and then over
  ``--requests`` one-token completions (``max_tokens: 1``, temperature 0, keep-alive connections, at most
  ``--concurrency`` in flight). Reported per process role (from the process title, e.g.
  ``ray::ServeReplica:<app>:Router``) as gross (all CPU in the window / requests) and net (less the idle
  rate over the same window). The load comes from a client process of its own, whose CPU is reported
  separately and not counted; this process (Ray's driver, idle while the client runs) is not counted either;
- throughput: closed-loop load at each concurrency of ``--levels`` for ``--seconds`` or ``--level-requests``
  requests, whichever ends first: requests/s, p50/p99 latency and gross CPU per request per level, and the
  best requests/s whose p99 is within ``--p99-limit-ms`` (and no request failed).

The issue's acceptance for "a lighter request path": CPU per 1-token request summed over all serving
processes ≤ 5 ms, and one ingress replica sustaining ≥ 3× today's requests/s at p99 ≤ 100 ms.

    python scripts/bench_request_cpu.py [--label before] [--draft none|tiny] [--requests 400 --concurrency 8]
                                        [--levels 1,2,4,8,16,32 --seconds 5] [--out bench-out/request_cpu.json]
    python scripts/bench_request_cpu.py --merge before.json after.json     # earlier runs side by side
    specserve bench request_cpu -- --requests 100 --levels 1,4,16 --seconds 3

Prints a table (``--markdown`` for markdown tables) and writes JSON (default ``bench-out/request_cpu.json``)
with the date, commit, machine and load average. Everything is bounded: requests time out, each phase ends
by count and time, the whole run by ``--max-wall-s``; the cluster is shut down at the end, also on errors.
Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from anywhere
    sys.path.insert(0, str(REPO))

from tools.loadgen import free_port, pct  # noqa: E402  (no Ray: imported by the unit test too)

DEFAULT_OUT = "bench-out/request_cpu.json"
APP = "specserve"  # as `specserve serve` names it: the replicas' titles read ray::ServeReplica:specserve:...
PROMPT = [11, 23, 5, 42, 17, 99, 3, 64]  # token ids: the builtin tiny pair has no tokenizer (vocab 256)
TARGET_CPU_MS = 5.0  # the acceptance: CPU per 1-token request, all serving processes
TARGET_RPS_FACTOR = 3.0  # ... and ≥ 3× today's requests/s at p99 ≤ 100 ms, one ingress replica

# -- process roles (pure) ----------------------------------------------------------------------------------

# Ray's processes that keep their command line, by a piece of it; workers and actors carry a title instead.
_COMMAND_ROLES = (("gcs_server", "GCS"), ("raylet/raylet", "raylet"), ("dashboard/agent.py", "dashboard agent"),
                  ("runtime_env/agent", "runtime env agent"), ("dashboard/dashboard.py", "dashboard (head)"),
                  ("log_monitor.py", "log monitor"), ("autoscaler/_private/monitor.py", "autoscaler monitor"))
_TITLE_ROLES = {"DashboardAgent": "dashboard agent", "RuntimeEnvAgent": "runtime env agent",
                "ServeController": "Serve controller", "ProxyActor": "Serve proxy", "IDLE": "idle workers"}
_DEPLOYMENT_ROLES = {"OpenAIIngress": "ingress replica", "Router": "router replica", "Verifier": "verifier replica",
                     "DraftPool": "draft pool replica"}


def role_of(title: str, name: str = "") -> str:
    """The role of a Ray process from its title or command line (``title``) and executable name (``name``):
    ``ray::ServeReplica:<app>:Router`` → "router replica", ``ray::ServeController`` → "Serve controller",
    ``.../raylet/raylet --...`` → "raylet"; an actor's title may carry the method it runs
    (``ray::ServeReplica:a:Router.handle_request()``), which is dropped."""
    title = title.strip()
    if title.startswith("ray::"):
        actor = title[len("ray::"):].split()[0] if title[len("ray::"):].strip() else ""
        actor = actor.split("(")[0]
        if actor.startswith("ServeReplica:"):
            deployment = actor.split(":")[-1].split(".")[0]
            return _DEPLOYMENT_ROLES.get(deployment, f"replica {deployment}")
        actor = actor.split(".")[0]
        return _TITLE_ROLES.get(actor, f"ray::{actor}")
    for piece, role in _COMMAND_ROLES:
        if piece in title:
            return role
    if name in ("gcs_server", "raylet"):
        return "GCS" if name == "gcs_server" else "raylet"
    exe = (title.split()[0].rsplit("/", 1)[-1] if title else "") or name or "?"
    return f"other ({exe})"


# Table order: the request path first, then Ray's and Serve's own processes.
ROLE_ORDER = ("ingress replica", "router replica", "verifier replica", "draft pool replica", "Serve proxy",
              "Serve controller", "raylet", "GCS", "dashboard agent", "runtime env agent", "dashboard (head)",
              "log monitor", "autoscaler monitor", "idle workers")


def role_key(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


# -- CPU accounting (pure parts) ---------------------------------------------------------------------------

def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, dict]:
    """CPU seconds per role between two snapshots (pid → (role, cumulative CPU s)). A process seen only in
    ``after`` started in between: all its CPU counts. One seen only in ``before`` ended in between: its last
    part is lost (counted in ``ended``)."""
    out: dict[str, dict] = {}
    for pid, (role, cpu) in after.items():
        rec = out.setdefault(role, {"cpu_s": 0.0, "processes": 0, "ended": 0})
        rec["cpu_s"] += cpu - before[pid][1] if pid in before else cpu
        rec["processes"] += 1
    for pid, (role, _) in before.items():
        if pid not in after:
            out.setdefault(role, {"cpu_s": 0.0, "processes": 0, "ended": 0})["ended"] += 1
    return out


def per_request_rows(window: dict[str, dict], idle: dict[str, dict], idle_s: float, window_s: float,
                     requests: int) -> list[dict]:
    """Per role: gross CPU ms per request (all of the window's CPU / requests), the idle rate (CPU ms per
    second of the idle window) and net CPU ms per request (gross less that rate over the window), in table
    order, then a "total" row."""
    rows = []
    for role in sorted(set(window) | set(idle), key=role_key):
        cpu = window.get(role, {}).get("cpu_s", 0.0)
        idle_rate = idle.get(role, {}).get("cpu_s", 0.0) / idle_s if idle_s > 0 else 0.0
        rows.append({"role": role, "processes": window.get(role, {}).get("processes", 0),
                     "gross_ms": 1e3 * cpu / requests, "idle_ms_per_s": 1e3 * idle_rate,
                     "net_ms": 1e3 * (cpu - idle_rate * window_s) / requests})
    rows.append({"role": "total", "processes": sum(r["processes"] for r in rows),
                 "gross_ms": sum(r["gross_ms"] for r in rows), "idle_ms_per_s": sum(r["idle_ms_per_s"] for r in rows),
                 "net_ms": sum(r["net_ms"] for r in rows)})
    return rows


def best_level(levels: Iterable[dict], p99_limit_ms: float) -> dict | None:
    """The level with the most requests/s among those whose p99 latency is within the limit and that had no
    failed request; None when none qualifies."""
    ok = [lv for lv in levels if lv["errors"] == 0 and lv["ok"] > 0 and lv["p99_ms"] <= p99_limit_ms]
    return max(ok, key=lambda lv: lv["rps"]) if ok else None


# -- tables -------------------------------------------------------------------------------------------------

def format_table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    """Columns aligned (first left, the rest right), or a markdown table."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report_tables(rep: dict, markdown: bool = False) -> str:
    """One run's tables: CPU per request by role, then the concurrency levels."""
    cpu = rep["cpu"]
    rows = [[r["role"], str(r["processes"]), _ms(r["gross_ms"]), _ms(r["net_ms"]), _ms(r["idle_ms_per_s"], 1)]
            for r in cpu["roles"]]
    rows.append(["client (load generator, not counted)", "1", _ms(cpu["client_ms"]), "", ""])
    rows.append(["driver (this process, idle; not counted)", "1", _ms(cpu["driver_ms"]), "", ""])
    out = [f"CPU per 1-token request: {cpu['requests']} requests at concurrency {cpu['concurrency']} in "
           f"{cpu['window_s']:.1f} s ({cpu['rps']:.1f} req/s, p50 {cpu['p50_ms']:.1f} ms, p99 {cpu['p99_ms']:.1f} ms, "
           f"{cpu['errors']} failed); idle window {cpu['idle_s']:.1f} s",
           format_table(["process role", "procs", "CPU ms/req (gross)", "CPU ms/req (net of idle)",
                         "idle CPU ms/s"], rows, markdown)]
    lv_rows = [[str(lv["concurrency"]), str(lv["ok"]), str(lv["errors"]), f"{lv['rps']:.1f}", _ms(lv["p50_ms"], 1),
                _ms(lv["p99_ms"], 1), _ms(lv["server_cpu_ms"]), _ms(lv["client_cpu_ms"])] for lv in rep["levels"]]
    out += ["", "Closed-loop load per concurrency:",
            format_table(["concurrency", "ok", "failed", "req/s", "p50 ms", "p99 ms", "server CPU ms/req",
                          "client CPU ms/req"], lv_rows, markdown)]
    best = rep.get("best")
    limit = rep["args"]["p99_limit_ms"]
    out.append("")
    out.append(f"best req/s with p99 ≤ {limit:g} ms: "
               + (f"{best['rps']:.1f} (concurrency {best['concurrency']}, p99 {best['p99_ms']:.1f} ms)" if best
                  else "none (no level within the limit)"))
    total = cpu["roles"][-1]
    out.append(f"target (the issue): ≤ {TARGET_CPU_MS:g} ms CPU per request over all serving processes — "
               f"today {total['gross_ms']:.1f} ms gross, {total['net_ms']:.1f} ms net of idle "
               f"({total['net_ms'] / TARGET_CPU_MS:.1f}× the target); ≥ {TARGET_RPS_FACTOR:g}× this run's best "
               f"req/s at p99 ≤ {limit:g} ms"
               + (f" (≥ {TARGET_RPS_FACTOR * best['rps']:.0f} req/s)" if best else ""))
    return "\n".join(out)


def run_name(rep: dict) -> str:
    return rep.get("label") or rep.get("commit") or "?"


def merge_table(reports: list[dict], markdown: bool = False) -> str:
    """Several runs side by side (a column per run, named by its label, else its commit): per-role net and
    gross CPU per request, the best req/s within the p99 limit, and each level's req/s and p99."""
    names = [run_name(r) for r in reports]
    rows: list[list[str]] = [["commit", *(r.get("commit", "?") for r in reports)],
                             ["date", *(r.get("date", "?") for r in reports)],
                             ["draft", *(r.get("args", {}).get("draft", "?") for r in reports)]]

    def by_role(rep: dict) -> dict[str, dict]:
        return {x["role"]: x for x in rep["cpu"]["roles"]}

    roles = sorted({role for r in reports for role in by_role(r)} - {"total"}, key=role_key)
    for key, what in (("net_ms", "net"), ("gross_ms", "gross")):
        rows.append([f"CPU ms/req, total ({what})", *(_ms(by_role(r)["total"][key]) for r in reports)])
    for role in roles:
        rows.append([f"  {role} (net)", *(_ms(by_role(r).get(role, {}).get("net_ms")) for r in reports)])
    rows.append(["idle CPU ms/s, total (background)",
                 *(_ms(by_role(r)["total"]["idle_ms_per_s"], 1) for r in reports)])
    rows.append(["client CPU ms/req (not counted)", *(_ms(r["cpu"]["client_ms"]) for r in reports)])
    rows.append(["CPU phase: req/s / p99 ms",
                 *(f"{r['cpu']['rps']:.1f} / {r['cpu']['p99_ms']:.0f}" for r in reports)])
    rows.append(["best req/s within p99 limit",
                 *((f"{r['best']['rps']:.1f} (c={r['best']['concurrency']})" if r.get("best") else "none")
                   for r in reports)])
    levels = sorted({lv["concurrency"] for r in reports for lv in r["levels"]})
    for c in levels:
        cells = []
        for r in reports:
            lv = next((x for x in r["levels"] if x["concurrency"] == c), None)
            cells.append("-" if lv is None else f"{lv['rps']:.1f} / {lv['p99_ms']:.0f}")
        rows.append([f"concurrency {c}: req/s / p99 ms", *cells])
    return format_table(["run", *names], rows, markdown)


# -- the load client (a process of its own, so that its CPU is its own) --------------------------------------

def client_main(url: str, model: str) -> int:
    """Read JSON commands from stdin, one a line ({"requests", "concurrency", "seconds"}), run each as
    closed-loop load against ``url`` and answer one JSON line: latencies of the completed requests, failures,
    wall time and this process's CPU seconds over the load."""
    import asyncio

    import httpx
    import psutil

    me = psutil.Process()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}

    async def load(client, requests: int, concurrency: int, seconds: float) -> dict:
        latencies, errors, sent = [], {}, 0
        deadline = time.monotonic() + seconds

        async def worker():
            nonlocal sent
            while sent < requests and time.monotonic() < deadline:
                sent += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post(url, json=body)
                    ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
                    key = "ok" if ok else f"HTTP {r.status_code}"
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                    key = type(exc).__name__
                if key == "ok":
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors[key] = errors.get(key, 0) + 1

        t = me.cpu_times()
        w0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - w0
        t2 = me.cpu_times()
        return {"latencies_s": latencies, "errors": errors, "wall_s": wall,
                "cpu_s": (t2.user + t2.system) - (t.user + t.system)}

    async def serve_commands():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
            loop = asyncio.get_running_loop()
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line.strip():
                    return
                cmd = json.loads(line)
                res = await load(client, cmd["requests"], cmd["concurrency"], cmd["seconds"])
                sys.stdout.write(json.dumps(res) + "\n")
                sys.stdout.flush()

    asyncio.run(serve_commands())
    return 0


class Client:
    """The load client's process: ``run`` sends one command and waits for its answer (bounded)."""

    def __init__(self, url: str, model: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--client", url, "--client-model", model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)

    def run(self, requests: int, concurrency: int, seconds: float) -> dict:
        self.proc.stdin.write(json.dumps({"requests": requests, "concurrency": concurrency, "seconds": seconds}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # bounded: the command ends by time, each request times out (30 s)
        if not line:
            raise RuntimeError(f"the load client exited (status {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


# -- the cluster ---------------------------------------------------------------------------------------------

def app_config(draft: str, port: int) -> dict:
    """cluster/examples/default.yaml with the builtin tiny pair, local stages, token auth off."""
    import yaml

    cfg = yaml.safe_load((REPO / "cluster" / "examples" / "default.yaml").read_text())
    cfg["target"] = {**cfg["target"], "path": "builtin:tiny", "max_model_len": 256}
    cfg["draft"] = {"kind": "none"} if draft == "none" else {"kind": "model", "path": "builtin:tiny"}
    cfg["router"] = {**cfg["router"], "stages": "local"}
    cfg["http"] = {**cfg["http"], "host": "127.0.0.1", "port": port}
    cfg["ray"] = {**cfg["ray"], "auth_mode": "disabled"}
    return cfg


def start_cluster(cfg: dict, port: int, deploy_timeout_s: float) -> None:
    """A fresh loopback cluster (never one that exists already), Serve's proxy idle on a free port, the app
    deployed under ``/`` with its ingress serving HTTP on ``port`` (as ``specserve serve`` starts it)."""
    from deployments.loopback import direct_ingress_env, init_local_ray

    os.environ.update(direct_ingress_env(port, 1))  # before Ray starts: its processes read it at import
    init_local_ray(include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})
    from ray import serve

    from deployments.app import build_app
    from deployments.launch import deploy

    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    deploy(build_app(cfg), APP, route_prefix="/", timeout_s=deploy_timeout_s)


def wait_listening(port: int, timeout_s: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ingress did not listen on 127.0.0.1:{port} within {timeout_s:g} s")
        time.sleep(0.2)


def snapshot(exclude: set[int]) -> dict[int, tuple[str, float]]:
    """pid → (role, cumulative user + system CPU s) of every descendant of this process but ``exclude``."""
    import psutil

    out = {}
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in exclude:
            continue
        try:
            with proc.oneshot():
                title = " ".join(proc.cmdline()) or proc.name()
                t = proc.cpu_times()
                out[proc.pid] = (role_of(title, proc.name()), t.user + t.system)
        except psutil.Error:
            continue
    return out


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def level_stats(res: dict, concurrency: int, server_cpu_s: float) -> dict:
    lat = res["latencies_s"]
    ok, errors = len(lat), sum(res["errors"].values())
    return {"concurrency": concurrency, "ok": ok, "errors": errors, "error_kinds": res["errors"],
            "wall_s": res["wall_s"], "rps": ok / res["wall_s"] if res["wall_s"] > 0 else 0.0,
            "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99), "max_ms": 1e3 * max(lat, default=float("nan")),
            "server_cpu_ms": 1e3 * server_cpu_s / max(ok + errors, 1),
            "client_cpu_ms": 1e3 * res["cpu_s"] / max(ok + errors, 1)}


def measure(args, client: Client, client_pid: int) -> dict:
    exclude = {client_pid}
    sent = lambda res: len(res["latencies_s"]) + sum(res["errors"].values())  # noqa: E731
    warm = client.run(args.warmup, args.concurrency, 60.0)
    if sent(warm) < args.warmup or warm["errors"]:
        raise RuntimeError(f"warm-up: {len(warm['latencies_s'])} of {args.warmup} requests answered, "
                           f"failures {warm['errors']}")
    print(f"[request_cpu] warm-up done: {args.warmup} requests, p50 {1e3 * pct(warm['latencies_s'], 50):.1f} ms",
          file=sys.stderr)
    # Background: the same processes with no request at all, for as long as asked.
    s0, t0 = snapshot(exclude), time.perf_counter()
    time.sleep(args.idle_seconds)
    s1, t1 = snapshot(exclude), time.perf_counter()
    idle, idle_s = cpu_delta(s0, s1), t1 - t0
    d0 = self_cpu()
    res = client.run(args.requests, args.concurrency, args.max_phase_s)
    s2, t2 = snapshot(exclude), time.perf_counter()
    window_s = t2 - t1
    driver_s = self_cpu() - d0
    window = cpu_delta(s1, s2)
    stats = level_stats(res, args.concurrency, sum(r["cpu_s"] for r in window.values()))
    n = stats["ok"] + stats["errors"]
    if n == 0:
        raise RuntimeError(f"no request answered in the CPU phase: {res['errors']}")
    cpu = {"requests": n, "concurrency": args.concurrency, "window_s": window_s, "idle_s": idle_s,
           "rps": stats["rps"], "p50_ms": stats["p50_ms"], "p99_ms": stats["p99_ms"], "errors": stats["errors"],
           "error_kinds": stats["error_kinds"], "roles": per_request_rows(window, idle, idle_s, window_s, n),
           "client_ms": stats["client_cpu_ms"], "driver_ms": 1e3 * driver_s / n,
           "processes_ended": sum(r["ended"] for r in window.values())}
    print(f"[request_cpu] CPU phase: {n} requests in {window_s:.1f} s, "
          f"{cpu['roles'][-1]['gross_ms']:.2f} ms CPU per request (gross)", file=sys.stderr)
    levels = []
    for c in args.levels:
        client.run(c, c, 30.0)  # opens this level's connections, not timed
        a = snapshot(exclude)
        res = client.run(args.level_requests, c, args.seconds)
        b = snapshot(exclude)
        lv = level_stats(res, c, sum(r["cpu_s"] for r in cpu_delta(a, b).values()))
        levels.append(lv)
        print(f"[request_cpu] concurrency {c}: {lv['rps']:.1f} req/s, p50 {lv['p50_ms']:.1f} ms, "
              f"p99 {lv['p99_ms']:.1f} ms, {lv['errors']} failed", file=sys.stderr)
    return {"cpu": cpu, "levels": levels, "best": best_level(levels, args.p99_limit_ms)}


def git(*argv: str) -> str:
    try:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class WallTimeout(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default=None, help="this run's name in --merge tables (default: the commit)")
    parser.add_argument("--draft", choices=("none", "tiny"), default="none",
                        help="draft of the app: none (plain decoding) or the builtin tiny draft")
    parser.add_argument("--requests", type=int, default=400, help="one-token requests of the CPU phase")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight in the CPU phase")
    parser.add_argument("--warmup", type=int, default=50, help="requests before anything is measured")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle window for the background CPU rate")
    parser.add_argument("--levels", default="1,2,4,8,16,32", help="concurrency levels of the closed-loop load")
    parser.add_argument("--seconds", type=float, default=5.0, help="longest duration of a level")
    parser.add_argument("--level-requests", type=int, default=1000, help="most requests of a level")
    parser.add_argument("--p99-limit-ms", type=float, default=100.0)
    parser.add_argument("--max-phase-s", type=float, default=180.0, help="longest duration of the CPU phase")
    parser.add_argument("--max-wall-s", type=float, default=1200.0, help="the whole run's bound; then it stops")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--merge", nargs="+", metavar="FILE", help="print earlier runs' JSON side by side; no run")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: the load client's process
    parser.add_argument("--client-model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args.client, args.client_model)
    if args.merge:
        reports = [json.loads(Path(f).read_text()) for f in args.merge]
        print(merge_table(reports, args.markdown))
        return 0
    args.levels = [int(x) for x in args.levels.split(",") if x]

    # A throwaway cluster on loopback (deployments.loopback): token auth off, as in the tests.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load_start = os.getloadavg()
    # What is measured is the working tree as the replicas import it now: the commit, and files changed since.
    commit = git("rev-parse", "--short", "HEAD")
    uncommitted = [x.split(None, 1)[1] for x in git("status", "--porcelain", "--untracked-files=no").splitlines()
                   if x.strip()]
    port = free_port()
    cfg = app_config(args.draft, port)
    started = time.time()

    def on_alarm(*_):
        raise WallTimeout(f"run exceeded --max-wall-s {args.max_wall_s:g}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(args.max_wall_s)))
    client = None
    try:
        start_cluster(cfg, port, deploy_timeout_s=min(600.0, args.max_wall_s))
        wait_listening(port)
        print(f"[request_cpu] app running after {time.time() - started:.0f} s; ingress on 127.0.0.1:{port}",
              file=sys.stderr)
        client = Client(f"http://127.0.0.1:{port}/v1/completions", cfg["http"]["model_name"])
        result = measure(args, client, client.proc.pid)
    finally:
        signal.alarm(0)
        if client is not None:
            client.close()
        if "ray" in sys.modules:
            import ray

            try:
                from ray import serve

                if ray.is_initialized():
                    serve.shutdown()
            finally:
                ray.shutdown()
    import ray

    report = {"label": args.label, "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S %Z"),
              "commit": commit, "uncommitted_files": uncommitted,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "node": platform.node(),
                          "python": platform.python_version(), "ray": ray.__version__},
              "load_average_start": load_start, "load_average_end": os.getloadavg(),
              "wall_s": time.time() - started, "args": vars(args), "app_config": cfg, **result}
    print(report_tables(report, args.markdown))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
