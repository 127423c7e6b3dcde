"""A real Prometheus scrapes the Ray metrics agent while the app serves; every dashboard query has data.

Prometheus (Debian's ``prometheus``, installed by scripts/setup_env.sh) runs on loopback with a scrape config
generated here that points at every Ray node's ``MetricsExportPort``, and loads the committed alert rules.
After greedy traffic through a router (its adaptive γ policy measures plain steps next to speculative ones), each PromQL query of each generated board is sent to Prometheus' query API: it must parse,
and return at least one finite value — except

- the GPU board's series, which must be absent where NVML reads no device (this CPU box), and
- ``MAY_BE_EMPTY``: series that healthy traffic rightly leaves without samples (the fidelity monitor's
  first-difference position exists only after a mismatch); their queries must still parse.

The alert rules must load and evaluate without error.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster import dashboards, metrics as m
from runtime.gpu_metrics import NvmlReader
from tests.ray.conftest import delete_app, deploy
from tests.ray.openai_app import app_args
from tools.loadgen import free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("prometheus") is None,
                                 reason="no prometheus binary (scripts/setup_env.sh installs Debian's as root)")]

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "monitoring" / "prometheus" / "specserve-alerts.yaml"
APP = "prometheus"
WINDOW = "2m"  # in place of Grafana's $__rate_interval
MAY_BE_EMPTY = {  # metric → why it can rightly have no samples after healthy traffic
    m.FIDELITY_FIRST_DIFFERENCE: "observed only when a fidelity check finds a mismatch",
}


def metric_of(expr: str) -> set[str]:
    """The specserve metrics an expression reads."""
    return {name for name in m.METRICS if dashboards.EXPORT_PREFIX + name + "_" in expr
            or f"{dashboards.EXPORT_PREFIX}{name}{{" in expr or f"{dashboards.EXPORT_PREFIX}{name})" in expr}


@pytest.fixture(scope="module")
def prometheus(ray_cluster, tmp_path_factory):
    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray_cluster.nodes() if n["Alive"]]
    assert targets and all(t.startswith("127.0.0.1:") for t in targets), targets
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=(tmp / "log").open("w"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "log").read_text()[-3000:]
            try:
                if httpx.get(base + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def served(ray_cluster):
    from ray import serve

    from deployments.api import GenerateRequest
    from deployments.app import build_app

    deploy(build_app(app_args(speculation={"gamma": 4, "gamma_max": 8},
                              router={"fidelity_sample_rate": 1.0})), APP, route_prefix="/prom")
    router = serve.get_deployment_handle("Router", app_name=APP)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rounds: list[int] = []

    def traffic(sizes=(1, 4, 8), repeats=1) -> None:
        """Batches of 1, 4 and 8 concurrent requests: several batch-size buckets."""
        for size in sizes:
            for _ in range(repeats):
                calls = [router.generate.remote(GenerateRequest(prompt=" ".join(words[i % 10:] + words[:i % 10]),
                                                                max_tokens=32)) for i in range(size)]
                assert all(c.result().completion_tokens > 0 for c in calls)
        # Structured requests too (the grammar compile, mask and forced-token panels): a schema whose key names
        # the grammar forces, new each round (a cached grammar is not compiled again, and a compile-time rate
        # needs compiles after Prometheus' first scrape).
        rounds.append(len(rounds))
        schema = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, ' \
                 f'"required": ["name", "age"], "description": "round {rounds[-1]}"}}'
        calls = [router.generate.remote(GenerateRequest(prompt=f"{words[i]}: ", max_tokens=32,
                                                        structured_outputs={"json": schema})) for i in range(2)]
        assert all(c.result().completion_tokens > 0 for c in calls)

    traffic()
    yield traffic
    delete_app(APP)


def query(base: str, expr: str) -> dict:
    r = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", f"{expr}\n{r}"
    return r["data"]


def finite(data: dict) -> bool:
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    return any(math.isfinite(float(s["value"][1])) for s in data["result"])


def test_every_dashboard_query_has_data(prometheus, served) -> None:
    gpu_present = bool(NvmlReader().read())
    checks = [(b.uid, expr.replace(dashboards.RATE_WINDOW, WINDOW)) for b in dashboards.boards()
              for expr in dashboards.queries(b)]
    expect = {}
    for uid, expr in checks:
        reads = metric_of(expr)
        assert reads, f"no specserve metric recognised in {expr}"
        if reads & set(m.GPU_METRICS) and not gpu_present:
            expect[expr] = "empty"
        elif reads & set(MAY_BE_EMPTY):
            expect[expr] = "parses"
        else:
            expect[expr] = "data"
    deadline = time.monotonic() + 240  # the session cluster exports every 2 s (conftest); rate() needs two scrapes
    while True:
        missing = [e for e, want in expect.items() if want == "data" and not finite(query(prometheus, e))]
        if not missing or time.monotonic() > deadline:
            break
        # Keep serving while waiting: on a loaded box Ray's export of the first traffic can lag past the
        # rate window, and a series with no fresh samples reads as no data.
        served(sizes=(1, 4), repeats=1)
        time.sleep(3)
    assert not missing, "queries without data:\n" + "\n".join(missing)
    for expr, want in expect.items():
        data = query(prometheus, expr)  # parses (the query API rejects bad PromQL with status "error")
        if want == "empty":
            assert data["result"] == [] or (data["resultType"] == "scalar" and not finite(data)), expr
    speculation = [e for b in dashboards.boards() if b.uid == "specserve-speculation" for e in dashboards.queries(b)]
    assert any("position" in e for e in speculation) and any("scalar(" in e for e in speculation)


def test_alert_rules_load_and_evaluate(prometheus, served) -> None:
    deadline = time.monotonic() + 30
    while True:
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") and r["health"] != "unknown" for r in rules) \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {r["name"] for r in rules} == {a.name for a in dashboards.alerts()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    for alert in dashboards.alerts():
        query(prometheus, alert.expr)
