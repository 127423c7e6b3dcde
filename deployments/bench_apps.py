"""Several specserve apps side by side on one loopback cluster, for the served benchmarks.

Ray and Serve start as ``specserve serve`` starts its own (``deployments.loopback``: every socket on
loopback; each ingress replica serves HTTP itself on a port of its own, Serve's proxy idles), and every app
is deployed under its own route prefix, so one run compares configurations over real HTTP side by side.
"""

from __future__ import annotations

import os
import random
import socket
import time

from deployments.loopback import direct_ingress_env, init_local_ray

# A throwaway cluster on loopback: token auth off, as in the tests (README, Security). Ray reads these when it is
# imported, so a benchmark imports this module before anything imports Ray.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def default_app_args(port: int) -> dict:
    """The embedded default config (cluster/examples/default.yaml) as ``build_app``'s arguments, on loopback,
    with the auth mode of this process's environment (benchmarks run with Ray's token auth off)."""
    from deployments.launch import DEFAULT_CONFIG, load_launch_config

    cfg = load_launch_config(str(DEFAULT_CONFIG), host="127.0.0.1", port=port).to_serve_args()
    cfg["ray"]["auth_mode"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    return cfg


def start_apps(configs: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """Start Ray + Serve on loopback and deploy one app per config (``build_app``'s arguments); returns each
    config's key → (app name, base URL of its ingress)."""
    count = len(configs)
    # Before Ray starts (its processes read them at import): a port range with a port for every ingress.
    first = free_port_range(count)
    os.environ.update(direct_ingress_env(first, count))
    # Several apps side by side: Ray's CPU count is logical, raised so that all their replicas are placed
    # (each reserves 0.25 CPU; their threads come from the config, not from this).
    init_local_ray(num_cpus=4 * (os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
                                             "TOKENIZERS_PARALLELISM": "false"}})
    from ray import serve

    from deployments.app import build_app
    from deployments.launch import deploy

    serve.start(http_options={"host": "127.0.0.1", "port": 0})  # the proxy idles, as with specserve serve
    urls, taken = {}, set()
    for i, (key, cfg) in enumerate(configs.items()):
        name = f"bench{i}"
        deploy(build_app(cfg), name, route_prefix=f"/{name}")
        port = new_listener(range(first, first + count), taken)  # this app's ingress
        taken.add(port)
        urls[key] = (name, f"http://127.0.0.1:{port}/{name}")
    return urls


def stop_apps() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that are all free now: between Ray's worker ports (10002–19999)
    and Linux's ephemeral range (from 32768), from which any process's outgoing sockets may take one later."""
    for _ in range(100):
        first = random.randrange(20000, 32768 - n)
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free loopback ports found")


def new_listener(ports, taken: set[int], timeout_s: float = 60.0) -> int:
    """The one port of ``ports`` outside ``taken`` that accepts connections (an app's ingress just started)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = set()
        for port in set(ports) - taken:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    found.add(port)
        if len(found) == 1:
            return found.pop()
        if time.monotonic() > deadline:
            raise RuntimeError(f"expected one new ingress port in {ports}, found {sorted(found)}")
        time.sleep(0.2)
