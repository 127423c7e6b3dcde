"""cluster.dashboards and the dashboards CLI: generated files match the committed ones, cover every metric,
lay out on Grafana's grid; alert rules pass promtool; push speaks Grafana's HTTP API; NVML absent → no GPU
series; ``specserve top`` computes its figures from two scrapes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from cluster import dashboards, metrics as m
from runtime import gpu_metrics
from specserve import cli, top

REPO = Path(__file__).resolve().parents[2]


def test_committed_files_are_the_rendered_ones(tmp_path) -> None:
    assert cli.main(["dashboards", "render", str(tmp_path)]) == 0
    rendered = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert rendered == dashboards.render_files()
    stale = [rel for rel, text in rendered.items() if (REPO / rel).read_text() != text]
    assert not stale, f"re-run `specserve dashboards render .`: {stale} differ"


def test_every_metric_is_on_a_board_or_in_an_alert() -> None:
    exprs = [e for b in dashboards.boards() for e in dashboards.queries(b)] + [a.expr for a in dashboards.alerts()]
    unused = [n for n in m.METRICS if not any(dashboards.EXPORT_PREFIX + n + tail in e for e in exprs
                                              for tail in ("_total", "_bucket", "_sum", "_count", "{", ")", "["))]
    assert not unused


def test_panels_tile_the_grid() -> None:
    for board in dashboards.boards():
        doc = dashboards.dashboard_json(board)
        assert doc["uid"] == board.uid and len(doc["panels"]) == len(board.panels)
        cells = set()
        for p in doc["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{board.uid}: {p['title']} overlaps"
            cells |= mine
            assert p["datasource"]["uid"] == dashboards.DATASOURCE_UID and p["targets"]
            assert all(t["expr"] and t["refId"] for t in p["targets"])


def test_speculation_board_shows_position_acceptance_and_speedup_against_the_bound() -> None:
    spec = dashboards.speculation()
    titles = {p.title: p for p in spec.panels}
    assert "position" in titles["Acceptance by position"].targets[0].expr
    exprs = [t.expr for t in titles["Speed-up: measured vs Leviathan bound"].targets]
    assert exprs == [dashboards.speedup(), dashboards.leviathan_bound()]


def test_leviathan_bound_expression_is_the_formula() -> None:
    # Evaluate the generated PromQL arithmetic with Python numbers in place of the three scalar() figures.
    a, g, c = 0.7, 4.0, 0.1
    expr = dashboards.leviathan_bound("5m")
    for f, v in ((dashboards.alpha, a), (dashboards.mean_gamma, g), (dashboards.cost_ratio, c)):
        expr = expr.replace(f"scalar({f('5m')})", repr(v))
    value = eval(expr.replace("^", "**"), {})  # only numbers and operators remain
    assert value == pytest.approx((1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)), rel=1e-12)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (scripts/setup_env.sh installs it as root)")
def test_alert_rules_pass_promtool() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(REPO / "monitoring/prometheus/specserve-alerts.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(dashboards.alerts())} rules found" in out.stdout


def test_k8s_monitoring_objects() -> None:
    docs = list(yaml.safe_load_all((REPO / "k8s/monitoring.yaml").read_text()))
    kinds = {(d["apiVersion"], d["kind"]): d for d in docs}
    assert set(kinds) == {("v1", "ConfigMap"), ("monitoring.coreos.com/v1", "PodMonitor"),
                          ("monitoring.coreos.com/v1", "PrometheusRule")}
    cm = kinds["v1", "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in cm["data"].items()} == {
        f"{b.uid}.json": dashboards.dashboard_json(b) for b in dashboards.boards()}
    pm = kinds["monitoring.coreos.com/v1", "PodMonitor"]["spec"]
    assert set(pm) == {"selector", "podMetricsEndpoints"}
    assert pm["podMetricsEndpoints"][0]["port"] == "metrics"
    rayservice = yaml.safe_load((REPO / "k8s/rayservice.yaml").read_text())
    head_labels = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert pm["selector"]["matchLabels"].items() <= head_labels.items()  # selects the Ray pods
    assert kinds["monitoring.coreos.com/v1", "PrometheusRule"]["spec"] == dashboards.prometheus_rules()


# -- NVML ------------------------------------------------------------------------------------------------


def test_nvml_absent_exports_no_gpu_series(monkeypatch) -> None:
    from deployments.metrics import GpuGauges

    monkeypatch.setitem(sys.modules, "pynvml", None)  # the package is not installed
    reader = gpu_metrics.NvmlReader()
    assert reader.read() == [] and gpu_metrics.series(reader.read()) == []
    gauges = GpuGauges(reader)
    gauges.sample()
    assert gauges.gauges is None  # no Ray gauge was even registered


def test_nvml_without_driver_reads_nothing() -> None:
    pytest.importorskip("pynvml")
    if shutil.which("nvidia-smi"):
        pytest.skip("a driver is present: the GPU path is exercised instead")
    assert gpu_metrics.NvmlReader().read() == []  # nvmlInit fails: library or driver not found


def test_nvml_readings_become_the_gpu_series(monkeypatch) -> None:
    # No GPU here: a stand-in module with NVML's call shapes (values as NVML reports them: %, bytes, MHz).
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) << 30, total=141 << 30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h),
        nvmlDeviceGetClockInfo=lambda h, clock: 1980)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    out = gpu_metrics.series(gpu_metrics.NvmlReader().read())
    assert {(name, tags["gpu"]) for name, _, tags in out} == {(n, g) for n in m.GPU_METRICS for g in ("0", "1")}
    values = {(name, tags["gpu"]): v for name, v, tags in out}
    assert values[m.GPU_UTILIZATION, "1"] == pytest.approx(0.41)
    assert values[m.GPU_MEMORY_USED, "1"] == 2 << 30 and values[m.GPU_SM_CLOCK, "0"] == pytest.approx(1.98e9)


# -- push ------------------------------------------------------------------------------------------------


class FakeGrafana(BaseHTTPRequestHandler):
    """Grafana's folder and dashboard endpoints, recording every call (Grafana itself cannot run here)."""

    calls: list = []

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.calls.append((self.command, self.path, self.headers.get("Authorization"), body))
        return body

    def do_GET(self):
        self._record()
        self._reply(404, {"message": "folder not found"})

    def do_POST(self):
        body = self._record()
        if self.path == "/api/folders":
            self._reply(200, {"uid": body["uid"], "title": body["title"]})
        else:
            self._reply(200, {"status": "success", "uid": body["dashboard"]["uid"]})

    def log_message(self, *args):
        pass


def test_push_uploads_every_dashboard(tmp_path) -> None:
    FakeGrafana.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("glsa_test_token\n")
    try:
        rc = cli.main(["dashboards", "push", "--url", f"http://127.0.0.1:{server.server_port}",
                       "--token-file", str(token)])
    finally:
        server.shutdown()
    assert rc == 0
    calls = FakeGrafana.calls
    assert [(c[0], c[1]) for c in calls[:2]] == [("GET", f"/api/folders/{dashboards.FOLDER}"), ("POST", "/api/folders")]
    assert all(c[2] == "Bearer glsa_test_token" for c in calls)
    uploads = [c[3] for c in calls if c[1] == "/api/dashboards/db"]
    assert [u["dashboard"] for u in uploads] == [dashboards.dashboard_json(b) for b in dashboards.boards()]
    assert all(u["overwrite"] and u["folderUid"] == dashboards.FOLDER for u in uploads)


# -- top -------------------------------------------------------------------------------------------------

def _scrape(drafts, proposed, accepted, rejections, emitted, pos0, queued) -> str:
    lines = [f"{dashboards.EXPORT_PREFIX}{name}_total{{WorkerId=\"w{w}\"{tag}}} {value / 2}"
             for w in (1, 2) for name, tag, value in (
                 (m.DRAFTS, "", drafts), (m.DRAFT_TOKENS, "", proposed), (m.ACCEPTED_TOKENS, "", accepted),
                 (m.REJECTIONS, "", rejections), (m.EMITTED_TOKENS, "", emitted),
                 (m.DRAFT_TOKENS_BY_POSITION, ',position="0"', drafts),
                 (m.ACCEPTED_BY_POSITION, ',position="0"', pos0),
                 (m.REQUESTS, ',status="ok"', drafts / 10))]
    lines.append(f"{dashboards.EXPORT_PREFIX}{m.QUEUE_DEPTH}{{WorkerId=\"w1\"}} {queued}")
    return "\n".join(lines) + "\n"


def test_top_figures_from_two_scrapes() -> None:
    before = top.parse(_scrape(100, 400, 200, 80, 300, 90, 0))
    after = top.parse(_scrape(200, 800, 500, 140, 700, 170, 3))
    fig = top.figures(before, after, 2.0)
    assert fig["tokens_per_s"] == pytest.approx(200.0)  # (700 - 300) / 2 s
    assert fig["acceptance_rate"] == pytest.approx(300 / 400)
    assert fig["alpha"] == pytest.approx(300 / 360)
    assert fig["mean_gamma"] == pytest.approx(4.0) and fig["accepted_length"] == pytest.approx(4.0)
    assert fig["by_position"] == {"0": pytest.approx(0.8)} and fig["queued"] == 3
    assert fig["requests_per_s"] == {"ok": pytest.approx(5.0)} and fig["gpu"] == {}
    top.view(fig, "http://x/metrics")  # renders without error


def test_top_shows_kv_blocks_prefix_hits_and_preemptions() -> None:
    def scrape(lookups, hits, preempted, blocks):
        p = dashboards.EXPORT_PREFIX
        return (f'{p}{m.PREFIX_CACHE_LOOKUP_TOKENS}_total{{model="target"}} {lookups}\n'
                f'{p}{m.PREFIX_CACHE_HIT_TOKENS}_total{{model="target"}} {hits}\n'
                f'{p}{m.PREEMPTIONS}_total {preempted}\n'
                f'{p}{m.KV_BLOCKS_IN_USE}{{model="target"}} {blocks}\n'
                f'{p}{m.KV_BLOCKS_CAPACITY}{{model="target"}} 1024\n')

    fig = top.figures(top.parse(scrape(100, 50, 0, 10)), top.parse(scrape(300, 200, 4, 700)), 2.0)
    assert fig["prefix_hit_rate"] == {"target": pytest.approx(0.75)}
    assert fig["preemptions_per_s"] == pytest.approx(2.0)
    assert fig["blocks_in_use"] == {"target": 700} and fig["blocks_capacity"] == {"target": 1024}
    top.view(fig, "http://x/metrics")
