#!/usr/bin/env python3
"""scripts/bench_kv.py: evaluation/kv_bench.py's benchmark; this script serves the pair for ``prefix_http``."""

import contextlib

import deployments.bench_apps  # noqa: F401  (its environment for Ray, before Ray is imported)
from evaluation.kv_bench import SPEED_GAMMA, HttpClient, main

PORT = 18500  # the config's http.port; each ingress replica serves on a port of start_apps' own


@contextlib.contextmanager
def serve_pair(args):
    """The embedded default config with this run's pair and context, served twice: the cache off and on."""
    from deployments.bench_apps import default_app_args, start_apps, stop_apps  # noqa: F811

    configs = {}
    for mode in ("off", "on"):
        cfg = default_app_args(PORT)
        cfg["target"].update(path=args.target, max_model_len=args.max_len)
        cfg["draft"].update(path=args.draft)
        cfg["kv"] = {**cfg.get("kv", {}), "prefix_cache": mode == "on"}
        cfg["speculation"].update(gamma=SPEED_GAMMA, adaptive=False)  # as in process: the cache's effect alone
        configs[mode] = cfg
    try:
        apps = start_apps(configs)
        yield {mode: HttpClient(url, configs[mode]["http"]["model_name"]) for mode, (_, url) in apps.items()}
    finally:
        stop_apps()


if __name__ == "__main__":
    raise SystemExit(main(serve=serve_pair))
