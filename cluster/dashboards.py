"""Grafana dashboards, Prometheus alert rules and their provisioning files, generated from ``cluster.metrics``.

Nothing here is edited by hand downstream: ``render_files`` gives every file under ``monitoring/`` and
``k8s/monitoring.yaml`` (``specserve dashboards render``), and tests/unit/test_dashboards.py re-renders and
compares. Dashboards are built with Grafana's ``grafana-foundation-sdk`` builders from the ``Panel`` specs
below, whose PromQL names series only through ``series``/``rate``/``quantile`` (the spec's name, kind and the
Ray exporter's naming): a renamed metric changes the queries with it.

Boards: *overview* (throughput, latency percentiles, errors, queue, KV), *speculation* (acceptance by
position, accepted length, γ, α, the cost ratio c, the measured speed-up of speculative over plain steps
per batch-size bucket next to the Leviathan bound 𝔼[speed-up] = (1 − α^(γ+1)) / ((1 − α)(γc + 1)) at the
measured α, γ and c, the batch bucket where speculation stops paying, fidelity), *gpu* (NVML gauges).

Torch-free and Ray-free: the CLI renders without either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import yaml

from cluster import metrics as m

EXPORT_PREFIX = "ray_"  # Ray's Prometheus exporter prefixes every metric name (cluster/metrics.py)
DATASOURCE_UID = "specserve-prometheus"  # the provisioned data source (monitoring/grafana/provisioning)
RATE_WINDOW = "$__rate_interval"  # Grafana's; the tests put a fixed window in its place
FOLDER = "specserve"
MONITORING_DIR = "monitoring"
FAILED = 'status=~"error|timeout"'
MISMATCH = 'result="mismatch"'


def series(name: str, suffix: str = "") -> str:
    """The exported series of metric ``name``: counters get ``_total``, histograms ``_bucket`` etc."""
    kind = m.METRICS[name].kind
    if kind == "counter":
        suffix = "_total"
    elif kind == "histogram" and not suffix:
        raise ValueError(f"{name} is a histogram: say which series (_bucket, _sum, _count)")
    return f"{EXPORT_PREFIX}{name}{suffix}"


def rate(name: str, selector: str = "", by: str = "", window: str = RATE_WINDOW, suffix: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    matcher = f"{{{selector}}}" if selector else ""
    return f"sum{grouping}(rate({series(name, suffix)}{matcher}[{window}]))"


def ratio(num: str, den: str) -> str:
    return f"({num}) / ({den})"


def quantile(q: float, name: str, by: str = "", window: str = RATE_WINDOW) -> str:
    return f"histogram_quantile({q}, {rate(name, by=', '.join(filter(None, ['le', by])), window=window, suffix='_bucket')})"


def or_zero(expr: str) -> str:
    """``expr``, or 0 while it has no series: Ray exports a counter only after its first event, and "no
    fallbacks yet" should read 0, not "no data"."""
    return f"{expr} or on() vector(0)"


def gauge(name: str, by: str = "", agg: str = "sum") -> str:
    return f"{agg}{f' by ({by})' if by else ''}({series(name)})"


# -- the speculation figures, shared by panels and alerts ---------------------------------------------

def acceptance_rate(window: str = RATE_WINDOW) -> str:
    return ratio(rate(m.ACCEPTED_TOKENS, window=window), rate(m.DRAFT_TOKENS, window=window))


def alpha(window: str = RATE_WINDOW) -> str:
    accepted = rate(m.ACCEPTED_TOKENS, window=window)
    return ratio(accepted, f"{accepted} + {rate(m.REJECTIONS, window=window)}")


def mean_gamma(window: str = RATE_WINDOW) -> str:
    return ratio(rate(m.DRAFT_TOKENS, window=window), rate(m.DRAFTS, window=window))


def cost_ratio(window: str = RATE_WINDOW) -> str:
    """c: one draft forward over one target forward. A step's draft seconds cover γ forwards."""
    draft, verify = (rate(m.STAGE_SECONDS, f'stage="{s}"', window=window) for s in ("draft", "verify"))
    return ratio(draft, f"{verify} * {mean_gamma(window)}")


def leviathan_bound(window: str = RATE_WINDOW) -> str:
    a, g, c = (f"scalar({f(window)})" for f in (alpha, mean_gamma, cost_ratio))
    return f"(1 - {a} ^ ({g} + 1)) / ((1 - {a}) * ({g} * {c} + 1))"


def goodput(mode: str, window: str = RATE_WINDOW) -> str:
    sel = f'mode="{mode}"'
    return ratio(rate(m.STEP_TOKENS, sel, "batch", window), rate(m.STEP_SECONDS, sel, "batch", window))


def error_ratio(window: str = RATE_WINDOW) -> str:
    return ratio(or_zero(rate(m.REQUESTS, FAILED, window=window)), rate(m.REQUESTS, window=window))


def speedup(window: str = RATE_WINDOW) -> str:
    """Measured goodput of speculative over plain steps, per batch-size bucket (both measured there)."""
    return ratio(goodput("speculative", window), goodput("plain", window))


# -- panels and boards ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | bargauge
    width: int = 8  # of Grafana's 24 columns
    height: int = 8
    description: str = ""
    thresholds: tuple[tuple[float | None, str], ...] = ()  # (from value, colour); the first from None


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    tags: tuple[str, ...] = field(default=("specserve",))


def _t(expr: str, legend: str = "") -> Target:
    return Target(expr, legend)


PAYS = ((None, "red"), (1.0, "green"))  # speed-up thresholds: below 1 speculation costs throughput


def overview() -> Board:
    return Board("specserve-overview", "specserve / overview",
                 "Throughput, latency percentiles, errors, queue and KV slots of the serving cluster.", (
        Panel("Tokens emitted / s", (_t(rate(m.EMITTED_TOKENS), "tokens/s"),), "none",
              description="Tokens committed to sequences per second, all routers."),
        Panel("Requests / s by status", (_t(rate(m.REQUESTS, by="status"), "{{status}}"),), "reqps"),
        Panel("Error ratio", (_t(error_ratio(), "errors"),),
              "percentunit", description="Requests that failed or timed out over all finished requests."),
        Panel("Time to first token", tuple(_t(quantile(q, m.TTFT), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
              "s"),
        Panel("Inter-token latency", tuple(_t(quantile(q, m.INTER_TOKEN_LATENCY), f"p{int(q * 100)}")
                                           for q in (0.5, 0.9, 0.99)), "s"),
        Panel("End-to-end latency", tuple(_t(quantile(q, m.REQUEST_LATENCY), f"p{int(q * 100)}")
                                          for q in (0.5, 0.9, 0.99)), "s"),
        Panel("Queue and running", (_t(gauge(m.QUEUE_DEPTH), "queued"), _t(gauge(m.RUNNING_SEQUENCES), "running")),
              "short"),
        Panel("KV slots in use", (_t(gauge(m.KV_SLOTS_IN_USE, "model"), "{{model}} in use"),
                                  _t(gauge(m.KV_SLOTS_CAPACITY, "model"), "{{model}} capacity")), "short"),
        Panel("Cancelled / s", (_t(or_zero(rate(m.REQUESTS_CANCELLED, by="phase")), "{{phase}}"),), "reqps"),
        Panel("KV blocks in use", (_t(gauge(m.KV_BLOCKS_IN_USE, "model"), "{{model}} in use"),
                                   _t(gauge(m.KV_BLOCKS_CAPACITY, "model"), "{{model}} capacity")), "short",
              description="Blocks held by sequences; cached blocks no sequence holds count as free."),
        Panel("Prefix cache hit rate", (_t(ratio(rate(m.PREFIX_CACHE_HIT_TOKENS, by="model"),
                                                 rate(m.PREFIX_CACHE_LOOKUP_TOKENS, by="model")), "{{model}}"),),
              "percentunit", description="Prompt tokens found cached over prompt tokens looked up."),
        Panel("Preemptions / s", (_t(or_zero(rate(m.PREEMPTIONS)), "preempted"),), "ops",
              description="Sequences sent back to the queue because the KV pools could not hold them all."),
    ))


def speculation() -> Board:
    return Board("specserve-speculation", "specserve / speculation",
                 "Is speculation paying? Acceptance, draft length, cost ratio and the measured speed-up "
                 "against plain steps and against the Leviathan bound at the measured alpha, gamma and c.", (
        Panel("Acceptance by position", (_t(ratio(rate(m.ACCEPTED_BY_POSITION, by="position"),
                                                  rate(m.DRAFT_TOKENS_BY_POSITION, by="position")),
                                            "{{position}}"),),
              "percentunit", "bargauge", 12, description="P(draft position i accepted | proposed)."),
        Panel("Speed-up vs plain, by batch size", (_t(speedup(), "batch {{batch}}"),), "x", "bargauge", 12,
              description="Measured goodput (committed tokens / step second) of speculative over plain steps "
                          "per batch-size bucket; below 1 (red) speculation stops paying at that batch size.",
              thresholds=PAYS),
        Panel("Speed-up: measured vs Leviathan bound", (_t(speedup(), "measured, batch {{batch}}"),
                                                        _t(leviathan_bound(), "bound at measured alpha, gamma, c")),
              "x", width=12,
              description="(1 - a^(g+1)) / ((1 - a)(g c + 1)) with a = alpha, g = mean gamma, c = cost ratio."),
        Panel("Acceptance rate and alpha", (_t(acceptance_rate(), "acceptance rate"), _t(alpha(), "alpha"),
                                            _t(gauge(m.ACCEPTANCE_RATE, agg="avg"), "routers' recent window")),
              "percentunit", width=12),
        Panel("Accepted length and mean gamma", (_t(ratio(rate(m.EMITTED_TOKENS), rate(m.DRAFTS)),
                                                    "tokens per verify step"),
                                                 _t(mean_gamma(), "mean gamma (a tree's depth)"),
                                                 _t(ratio(rate(m.DRAFT_NODES), rate(m.DRAFTS)),
                                                    "draft tokens verified (a tree's nodes)")), "short"),
        Panel("Cost ratio c", (_t(cost_ratio(), "c"),), "short",
              description="One draft forward over one target forward, from the stages' compute seconds."),
        Panel("Goodput by mode", (_t(goodput("speculative"), "speculative, batch {{batch}}"),
                                  _t(goodput("plain"), "plain, batch {{batch}}")), "none"),
        Panel("Step time by stage", (_t(ratio(rate(m.STEP_LATENCY, by="stage", suffix="_sum"),
                                              rate(m.STEP_LATENCY, by="stage", suffix="_count")), "{{stage}}"),),
              "s", width=12, description="Mean seconds per step: draft, verify, transport, schedule."),
        Panel("Fallbacks / s", (_t(or_zero(rate(m.FALLBACKS, by="reason")), "{{reason}}"),), "ops", width=12),
        Panel("Fidelity checks / s", (_t(rate(m.FIDELITY_CHECKS, by="result"), "{{result}}"),), "ops", width=12,
              description="Sampled greedy requests re-decoded without speculation (router.fidelity_sample_rate)."),
        Panel("Fidelity: first difference", (_t(quantile(0.5, m.FIDELITY_FIRST_DIFFERENCE), "median position"),),
              "short", width=12),
        Panel("Structured requests / s", (_t(or_zero(rate(m.STRUCTURED_REQUESTS, by="kind, outcome")),
                                             "{{kind}} {{outcome}}"),), "reqps",
              description="Requests with response_format / structured_outputs, by grammar kind and whether the "
                          "grammar was compiled, found in the cache or refused (400)."),
        Panel("Grammar compile time", tuple(_t(quantile(q, m.GRAMMAR_COMPILE_SECONDS), f"p{int(q * 100)}")
                                            for q in (0.5, 0.99)), "s"),
        Panel("Structured: mask work and forced tokens", (
            _t(ratio(rate(m.MASK_SECONDS), rate(m.STEP_SECONDS)), "mask share of step time"),
            _t(ratio(rate(m.FORCED_TOKENS), rate(m.EMITTED_TOKENS)), "forced-token share of emitted")),
              "percentunit", description="Grammar masks' share of step time (draft and verify), and the share of "
                                         "tokens a grammar forced (drafted free, accepted in the same pass)."),
    ))


def gpu() -> Board:
    return Board("specserve-gpu", "specserve / GPU",
                 "NVML per device of each replica's node; empty where NVML reads no GPU (CPU nodes).", (
        Panel("GPU utilisation", (_t(gauge(m.GPU_UTILIZATION, "NodeAddress, gpu", "max"),
                                     "{{NodeAddress}} gpu {{gpu}}"),), "percentunit", width=12),
        Panel("GPU memory", (_t(gauge(m.GPU_MEMORY_USED, "NodeAddress, gpu", "max"), "{{NodeAddress}} gpu {{gpu}} used"),
                             _t(gauge(m.GPU_MEMORY_TOTAL, "NodeAddress, gpu", "max"),
                                "{{NodeAddress}} gpu {{gpu}} total")), "bytes", width=12),
        Panel("SM clock", (_t(gauge(m.GPU_SM_CLOCK, "NodeAddress, gpu", "max"), "{{NodeAddress}} gpu {{gpu}}"),),
              "hertz", width=24),
    ))


BOARDS = (overview, speculation, gpu)


def boards() -> list[Board]:
    return [make() for make in BOARDS]


def _layout(panels: tuple[Panel, ...]) -> list[tuple[Panel, int, int]]:
    """(panel, x, y): left to right, wrapping at 24 columns."""
    out, x, y, row_h = [], 0, 0, 0
    for p in panels:
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append((p, x, y))
        x += p.width
        row_h = max(row_h, p.height)
    return out


def dashboard_json(board: Board) -> dict:
    from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import (DataSourceRef, GridPos, Threshold, ThresholdsMode)

    builders = {"timeseries": timeseries.Panel, "stat": stat.Panel, "bargauge": bargauge.Panel}
    ds = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
    dash = (dashboard.Dashboard(board.title).uid(board.uid).description(board.description).tags(list(board.tags))
            .time("now-1h", "now").refresh("30s").readonly())
    for i, (p, x, y) in enumerate(_layout(board.panels)):
        panel = (builders[p.kind]().id(i + 1).title(p.title).datasource(ds).unit(p.unit)
                 .grid_pos(GridPos(h=p.height, w=p.width, x=x, y=y)))
        if p.description:
            panel = panel.description(p.description)
        if p.thresholds:
            panel = panel.thresholds(dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
                [Threshold(value=v, color=c) for v, c in p.thresholds]))
        for j, t in enumerate(p.targets):
            panel = panel.with_target(prometheus.Dataquery().expr(t.expr).legend_format(t.legend)
                                      .ref_id(chr(ord("A") + j)).datasource(ds))
        dash = dash.with_panel(panel)
    return json.loads(json.dumps(dash.build(), cls=JSONEncoder))


def queries(board: Board) -> list[str]:
    return [t.expr for p in board.panels for t in p.targets]


# -- alerts ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str


def alerts() -> list[Alert]:
    w = "10m"
    return [
        Alert("SpecserveAcceptanceCollapse", f"{acceptance_rate(w)} < 0.5 * {acceptance_rate('6h')}", "10m",
              "warning", "Draft acceptance fell below half its 6 h level: the draft no longer fits the traffic."),
        Alert("SpecserveSpeculationSlowerThanPlain", f"{goodput('speculative', '15m')} < 0.95 * "
              f"{goodput('plain', '15m')}", "15m", "warning",
              "Speculative steps commit fewer tokens per second than plain steps at batch {{ $labels.batch }}."),
        Alert("SpecserveQueueSaturated", f"{gauge(m.QUEUE_DEPTH)} > 0 and {gauge(m.RUNNING_SEQUENCES)} > 0",
              "5m", "warning", "Requests have waited for a running slot for 5 minutes: add router capacity."),
        Alert("SpecserveErrorRate", f"{error_ratio('5m')} > 0.05", "5m", "critical",
              "More than 5 % of requests fail or time out."),
        Alert("SpecserveKVExhausted", f"{ratio(gauge(m.KV_SLOTS_IN_USE, 'model'), gauge(m.KV_SLOTS_CAPACITY, 'model'))} > 0.95",
              "5m", "warning", "{{ $labels.model }} KV slots are over 95 % in use."),
        Alert("SpecserveDraftPoolDegraded",
              f"{ratio(rate(m.FALLBACKS, window='5m'), rate(m.STEPS, window='5m'))} > 0.1", "5m", "warning",
              "Over 10 % of steps fall back to target-only decoding: the draft pool is failing or down."),
        Alert("SpecserveFidelityMismatch", f"sum(increase({series(m.FIDELITY_CHECKS)}{{{MISMATCH}}}[1h])) > 0", "0m", "critical", "A sampled greedy request decoded differently without speculation."),
    ]


def prometheus_rules() -> dict:
    return {"groups": [{"name": "specserve", "rules": [
        {"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
         "annotations": {"summary": a.summary}} for a in alerts()]}]}


# -- files -----------------------------------------------------------------------------------------------

HEADER = "# Generated by `specserve dashboards render` from cluster/dashboards.py; do not edit by hand.\n"


def _yaml(doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=120)


def grafana_provisioning(dashboards_path: str) -> tuple[str, str]:
    """(dashboard provider, data source) provisioning YAML; dashboards load from ``dashboards_path``."""
    provider = {"apiVersion": 1, "providers": [{
        "name": "specserve", "folder": FOLDER, "type": "file", "disableDeletion": False, "allowUiUpdates": False,
        "options": {"path": dashboards_path}}]}
    datasource = {"apiVersion": 1, "datasources": [{
        "name": "Prometheus (specserve)", "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
        "url": "http://prometheus:9090", "isDefault": True}]}
    return HEADER + _yaml(provider), HEADER + _yaml(datasource)


def k8s_monitoring(namespace: str = "default") -> str:
    """A ConfigMap of the dashboards (Grafana's sidecar picks up ``grafana_dashboard: "1"``), a PodMonitor
    for the Ray pods' metrics port and a PrometheusRule of the alerts (prometheus-operator CRDs)."""
    labels = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/component": "monitoring"}
    docs = [
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "specserve-dashboards", "namespace": namespace,
                      "labels": {**labels, "grafana_dashboard": "1"}},
         "data": {f"{b.uid}.json": json.dumps(dashboard_json(b), indent=1, sort_keys=True) for b in boards()}},
        # KubeRay gives every Ray container the metrics port 8080, named "metrics".
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
         "metadata": {"name": "specserve-ray", "namespace": namespace, "labels": labels},
         "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "specserve"}},
                  "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
         "metadata": {"name": "specserve-alerts", "namespace": namespace, "labels": labels},
         "spec": prometheus_rules()},
    ]
    return HEADER + "---\n".join(_yaml(d) for d in docs)


def render_files() -> dict[str, str]:
    """Relative path → content of every generated monitoring file."""
    base = MONITORING_DIR
    dash_dir = f"{base}/grafana/dashboards"
    provider, datasource = grafana_provisioning("/var/lib/grafana/dashboards/specserve")
    files = {f"{dash_dir}/{b.uid}.json": json.dumps(dashboard_json(b), indent=2, sort_keys=True) + "\n"
             for b in boards()}
    files[f"{base}/grafana/provisioning/dashboards/specserve.yaml"] = provider
    files[f"{base}/grafana/provisioning/datasources/specserve.yaml"] = datasource
    files[f"{base}/prometheus/specserve-alerts.yaml"] = HEADER + _yaml(prometheus_rules())
    files["k8s/monitoring.yaml"] = k8s_monitoring()
    return files
