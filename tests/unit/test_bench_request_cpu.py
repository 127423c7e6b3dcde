"""scripts/bench_request_cpu.py without Ray: the parts that turn processes and latencies into its figures.

- process roles from Ray's process titles and command lines (a replica's method suffix dropped, the
  autoscaler monitor not confused with the log monitor, anything else labelled, never dropped);
- CPU between two snapshots: a process that started in between counts whole, one that ended is noted;
- per-request rows: gross = window CPU / requests, net = gross less the idle rate over the window, and a
  total row that sums them;
- the best requests/s whose p99 is within the limit (the limit itself included; levels with a failed
  request excluded; none when no level qualifies);
- ``--merge``: earlier runs side by side, a column per run named by its label (else its commit), a level
  one run lacks shown as "-".
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_request_cpu", REPO / "scripts" / "bench_request_cpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SITE = "/work/.venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize("title, name, role", [
    ("ray::ServeReplica:specserve:OpenAIIngress", "ray::ServeReplica:specserve:OpenAIIngress", "ingress replica"),
    ("ray::ServeReplica:specserve:Router", "", "router replica"),
    ("ray::ServeReplica:bench0:Router.handle_request_with_rejection()", "", "router replica"),
    ("ray::ServeReplica:a:DraftPool", "", "draft pool replica"),
    ("ray::ServeReplica:a:NullVerifier", "", "replica NullVerifier"),
    ("ray::ServeController", "", "Serve controller"),
    ("ray::ServeController.listen_for_change()", "", "Serve controller"),
    ("ray::ProxyActor", "", "Serve proxy"),
    ("ray::IDLE", "", "idle workers"),
    ("ray::DashboardAgent", "", "dashboard agent"),
    ("ray::RuntimeEnvAgent", "", "runtime env agent"),
    ("ray::StageWorker.run()", "", "ray::StageWorker"),
    (f"{SITE}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/s/sockets/raylet", "raylet", "raylet"),
    (f"{SITE}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/s/logs", "gcs_server", "GCS"),
    (f"/work/.venv/bin/python -u {SITE}/_private/log_monitor.py --session-dir=/tmp/ray/s", "python", "log monitor"),
    (f"/work/.venv/bin/python -u {SITE}/autoscaler/_private/monitor.py --logs-dir=/x", "python", "autoscaler monitor"),
    (f"/work/.venv/bin/python {SITE}/dashboard/dashboard.py --host=127.0.0.1", "python", "dashboard (head)"),
    (f"/work/.venv/bin/python -u {SITE}/dashboard/agent.py --node-ip-address=127.0.0.1", "python", "dashboard agent"),
    ("", "raylet", "raylet"),
    ("/usr/bin/git status", "git", "other (git)"),
])
def test_role_of(title, name, role):
    assert bench.role_of(title, name) == role


def test_roles_order_the_request_path_first():
    roles = ["GCS", "other (x)", "router replica", "Serve controller", "ingress replica"]
    assert sorted(roles, key=bench.role_key) == ["ingress replica", "router replica", "Serve controller", "GCS",
                                                 "other (x)"]


def test_cpu_delta_counts_new_processes_whole_and_notes_ended_ones():
    before = {1: ("raylet", 10.0), 2: ("router replica", 5.0), 3: ("idle workers", 1.0)}
    after = {1: ("raylet", 10.5), 2: ("router replica", 7.0), 4: ("idle workers", 0.25)}
    d = bench.cpu_delta(before, after)
    assert d["raylet"] == {"cpu_s": pytest.approx(0.5), "processes": 1, "ended": 0}
    assert d["router replica"]["cpu_s"] == pytest.approx(2.0)
    assert d["idle workers"] == {"cpu_s": pytest.approx(0.25), "processes": 1, "ended": 1}


def test_per_request_rows_gross_net_and_total():
    window = {"router replica": {"cpu_s": 2.0, "processes": 1}, "GCS": {"cpu_s": 0.3, "processes": 1}}
    idle = {"GCS": {"cpu_s": 0.5, "processes": 1}, "Serve controller": {"cpu_s": 0.25, "processes": 1}}
    rows = bench.per_request_rows(window, idle, idle_s=5.0, window_s=2.0, requests=100)
    by = {r["role"]: r for r in rows}
    assert [r["role"] for r in rows] == ["router replica", "Serve controller", "GCS", "total"]
    assert by["router replica"]["gross_ms"] == pytest.approx(20.0)
    assert by["router replica"]["net_ms"] == pytest.approx(20.0)
    assert by["GCS"]["gross_ms"] == pytest.approx(3.0)
    assert by["GCS"]["idle_ms_per_s"] == pytest.approx(100.0)
    assert by["GCS"]["net_ms"] == pytest.approx(1.0)  # 0.3 s - 0.1 s/s × 2 s, over 100 requests
    assert by["Serve controller"]["net_ms"] == pytest.approx(-1.0)  # idle only: its background, subtracted
    assert by["total"]["gross_ms"] == pytest.approx(23.0)
    assert by["total"]["net_ms"] == pytest.approx(20.0)
    assert by["total"]["processes"] == 2


def _level(c, rps, p99, errors=0, ok=100):
    return {"concurrency": c, "rps": rps, "p99_ms": p99, "p50_ms": p99 / 2, "errors": errors, "ok": ok,
            "server_cpu_ms": 10.0, "client_cpu_ms": 2.0}


def test_best_level_within_the_p99_limit():
    levels = [_level(1, 50, 20), _level(4, 110, 100.0), _level(8, 140, 100.5), _level(16, 160, 300)]
    assert bench.best_level(levels, 100.0)["concurrency"] == 4  # the limit itself is within it
    assert bench.best_level(levels, 200.0)["concurrency"] == 8
    assert bench.best_level(levels, 10.0) is None
    # A level with a failed request does not count, however fast it was.
    assert bench.best_level([_level(1, 50, 20), _level(2, 90, 40, errors=1)], 100.0)["concurrency"] == 1
    assert bench.best_level([], 100.0) is None


def _report(label, commit, levels, router_net=5.0):
    roles = [{"role": "ingress replica", "processes": 1, "gross_ms": 5.0, "net_ms": 4.5, "idle_ms_per_s": 20.0},
             {"role": "router replica", "processes": 1, "gross_ms": router_net + 0.5, "net_ms": router_net,
              "idle_ms_per_s": 10.0}]
    roles.append({"role": "total", "processes": 2, "gross_ms": sum(r["gross_ms"] for r in roles),
                  "net_ms": sum(r["net_ms"] for r in roles), "idle_ms_per_s": 30.0})
    return {"label": label, "commit": commit, "date": "2026-12-02", "args": {"draft": "none", "p99_limit_ms": 100.0},
            "cpu": {"requests": 400, "concurrency": 8, "window_s": 3.0, "idle_s": 5.0, "rps": 130.0, "p50_ms": 60.0,
                    "p99_ms": 98.0, "errors": 0, "roles": roles, "client_ms": 1.8, "driver_ms": 0.0},
            "levels": levels, "best": bench.best_level(levels, 100.0)}


def test_merge_table_puts_runs_side_by_side(tmp_path, capsys):
    before = _report("before", "aaaaaaa", [_level(1, 60, 28), _level(8, 139, 99)])
    after = _report(None, "bbbbbbb", [_level(1, 90, 15)], router_net=1.25)
    files = []
    for i, rep in enumerate((before, after)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(rep))
    assert bench.main(["--merge", *map(str, files)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header == ["run", "before", "bbbbbbb"]  # no label: the commit names the column
    cells = {line[:33].strip(): line[33:].split() for line in lines[2:]}
    assert cells["CPU ms/req, total (net)"] == ["9.50", "5.75"]
    assert cells["router replica (net)"] == ["5.00", "1.25"]
    assert cells["best req/s within p99 limit"] == ["139.0", "(c=8)", "90.0", "(c=1)"]
    assert cells["concurrency 8: req/s / p99 ms"] == ["139.0", "/", "99", "-"]  # the second run has no level 8


def test_merge_table_markdown():
    text = bench.merge_table([_report("x", "c", [_level(1, 60, 28)])], markdown=True)
    lines = text.splitlines()
    assert lines[0] == "| run | x |" and lines[1] == "|---|---|"
    assert "| CPU ms/req, total (gross) | 10.50 |" in lines


def test_report_tables_name_every_role_and_the_target():
    rep = _report("x", "c", [_level(1, 60, 28), _level(8, 139, 99), _level(16, 158, 164)])
    text = bench.report_tables(rep)
    for role in ("ingress replica", "router replica", "total", "client (load generator, not counted)"):
        assert role in text
    assert "best req/s with p99 ≤ 100 ms: 139.0 (concurrency 8" in text
    assert "today 10.5 ms gross, 9.5 ms net of idle (1.9× the target)" in text
    assert "(≥ 417 req/s)" in text
