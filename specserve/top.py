"""``specserve top --url URL``: the dashboards' main figures in the terminal, for operators without Grafana.

Reads the Prometheus text a Ray node's metrics agent serves (``http://HOST:PORT/metrics``; the port is the
node's ``MetricsExportPort`` in ``ray.nodes()``, 8080 on KubeRay pods) every ``--interval`` seconds and shows
rates between the last two scrapes: throughput, requests by status, acceptance (overall and by position),
α, mean γ, accepted length, queue, running, KV slots, fallbacks, fidelity checks and GPU gauges. Sums over
Ray's own labels (worker, node), like the dashboards do.
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections import defaultdict

from cluster import metrics as m
from cluster.dashboards import EXPORT_PREFIX

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]  # series → our tag values → summed value


def parse(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(EXPORT_PREFIX + "specserve_"):
                continue
            base = s.name[len(EXPORT_PREFIX):].removesuffix("_total")
            spec = m.METRICS.get(base)
            keys = spec.tag_keys if spec is not None else ()
            out[s.name][tuple((k, s.labels[k]) for k in keys if k in s.labels)] += s.value
    return out


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse(resp.read().decode("utf-8"))


def _name(metric: str) -> str:
    kind = m.METRICS[metric].kind
    return f"{EXPORT_PREFIX}{metric}" + ("_total" if kind == "counter" else "")


def figures(prev: Samples, cur: Samples, seconds: float) -> dict:
    """Rates over the ``seconds`` between two scrapes and the current gauges."""

    def delta(metric: str, **tags) -> float:
        name = _name(metric)
        pick = lambda samples: sum(v for key, v in samples.get(name, {}).items()
                                   if all(dict(key).get(k) == w for k, w in tags.items()))
        return max(0.0, pick(cur) - pick(prev))

    def by(metric: str, tag: str, source: Samples | None = None) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for key, v in (source or cur).get(_name(metric), {}).items():
            out[dict(key).get(tag, "")] += v
        return dict(out)

    def div(a: float, b: float) -> float | None:
        return a / b if b else None

    accepted, rejections = delta(m.ACCEPTED_TOKENS), delta(m.REJECTIONS)
    positions = {}
    for p in m.POSITIONS:
        positions[p] = div(delta(m.ACCEPTED_BY_POSITION, position=p), delta(m.DRAFT_TOKENS_BY_POSITION, position=p))
    requests = {s: delta(m.REQUESTS, status=s) / seconds for s in m.REQUEST_STATUSES}
    return {
        "tokens_per_s": delta(m.EMITTED_TOKENS) / seconds,
        "requests_per_s": {s: r for s, r in requests.items() if r},
        "acceptance_rate": div(accepted, delta(m.DRAFT_TOKENS)),
        "alpha": div(accepted, accepted + rejections),
        "mean_gamma": div(delta(m.DRAFT_TOKENS), delta(m.DRAFTS)),
        "accepted_length": div(delta(m.EMITTED_TOKENS), delta(m.DRAFTS)),
        "by_position": {p: v for p, v in positions.items() if v is not None},
        "queued": sum(by(m.QUEUE_DEPTH, "").values()), "running": sum(by(m.RUNNING_SEQUENCES, "").values()),
        "kv_in_use": by(m.KV_SLOTS_IN_USE, "model"), "kv_capacity": by(m.KV_SLOTS_CAPACITY, "model"),
        "blocks_in_use": by(m.KV_BLOCKS_IN_USE, "model"), "blocks_capacity": by(m.KV_BLOCKS_CAPACITY, "model"),
        "prefix_hit_rate": {model: div(delta(m.PREFIX_CACHE_HIT_TOKENS, model=model),
                                       delta(m.PREFIX_CACHE_LOOKUP_TOKENS, model=model))
                            for model in by(m.PREFIX_CACHE_LOOKUP_TOKENS, "model")},
        "preemptions_per_s": delta(m.PREEMPTIONS) / seconds,
        "fallbacks_per_s": {r: delta(m.FALLBACKS, reason=r) / seconds for r in m.FALLBACK_REASONS
                            if delta(m.FALLBACKS, reason=r)},
        "fidelity": {r: delta(m.FIDELITY_CHECKS, result=r) for r in m.FIDELITY_RESULTS},
        "gpu": {g: {"util": by(m.GPU_UTILIZATION, "gpu").get(g), "mem_used": by(m.GPU_MEMORY_USED, "gpu").get(g),
                    "mem_total": by(m.GPU_MEMORY_TOTAL, "gpu").get(g), "sm_hz": by(m.GPU_SM_CLOCK, "gpu").get(g)}
                for g in by(m.GPU_UTILIZATION, "gpu")},
    }


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def view(fig: dict, url: str):
    from rich.console import Group
    from rich.table import Table

    main = Table(title=f"specserve top — {url}", show_header=False)
    for label, value in (
            ("tokens/s", _fmt(fig["tokens_per_s"], ".1f")),
            ("requests/s", ", ".join(f"{s} {r:.2f}" for s, r in fig["requests_per_s"].items()) or "-"),
            ("acceptance rate", _fmt(fig["acceptance_rate"])), ("alpha", _fmt(fig["alpha"])),
            ("mean gamma", _fmt(fig["mean_gamma"], ".2f")), ("accepted length", _fmt(fig["accepted_length"], ".2f")),
            ("queued / running", f"{fig['queued']:.0f} / {fig['running']:.0f}"),
            ("KV slots", ", ".join(f"{k} {v:.0f}/{_fmt(fig['kv_capacity'].get(k), '.0f')}"
                                   for k, v in fig["kv_in_use"].items()) or "-"),
            ("KV blocks", ", ".join(f"{k} {v:.0f}/{_fmt(fig['blocks_capacity'].get(k), '.0f')}"
                                    for k, v in fig["blocks_in_use"].items()) or "-"),
            ("prefix cache hits", ", ".join(f"{k} {_fmt(v, '.0%')}" for k, v in fig["prefix_hit_rate"].items()) or "-"),
            ("preemptions/s", _fmt(fig["preemptions_per_s"], ".2f")),
            ("fallbacks/s", ", ".join(f"{r} {v:.2f}" for r, v in fig["fallbacks_per_s"].items()) or "0"),
            ("fidelity", f"{fig['fidelity']['match']:.0f} match, {fig['fidelity']['mismatch']:.0f} mismatch")):
        main.add_row(label, value)
    parts = [main]
    if fig["by_position"]:
        pos = Table(title="acceptance by position")
        for p in fig["by_position"]:
            pos.add_column(p, justify="right")
        pos.add_row(*(f"{v:.2f}" for v in fig["by_position"].values()))
        parts.append(pos)
    if fig["gpu"]:
        gpus = Table("gpu", "util", "memory GiB", "SM MHz", title="GPU (NVML)")
        for g, r in sorted(fig["gpu"].items()):
            gpus.add_row(g, _fmt(r["util"], ".0%"), f"{_fmt((r['mem_used'] or 0) / 2**30, '.1f')} / "
                         f"{_fmt((r['mem_total'] or 0) / 2**30, '.1f')}", _fmt((r["sm_hz"] or 0) / 1e6, ".0f"))
        parts.append(gpus)
    return Group(*parts)


def cmd_top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    prev, t_prev = scrape(args.url), time.monotonic()
    if args.once:
        time.sleep(args.interval)
        cur = scrape(args.url)
        Console().print(view(figures(prev, cur, time.monotonic() - t_prev), args.url))
        return 0
    with Live(refresh_per_second=1, screen=False) as live:
        while True:
            time.sleep(args.interval)
            cur, now = scrape(args.url), time.monotonic()
            live.update(view(figures(prev, cur, now - t_prev), args.url))
            prev, t_prev = cur, now


def add_parser(sub) -> None:
    top = sub.add_parser("top", help="terminal view of the serving figures, read from a Ray metrics endpoint")
    top.add_argument("--url", required=True, help="a node's metrics endpoint, e.g. http://127.0.0.1:8080/metrics")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    top.add_argument("--once", action="store_true", help="print one view (two scrapes apart) and exit")
    top.set_defaults(func=cmd_top)
