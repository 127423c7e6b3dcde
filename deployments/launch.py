"""``specserve serve``: start (or join) Ray, deploy the app, block until interrupted.

Decisions made here, deliberately (README, Security): Ray's token authentication follows
``ray.auth_mode`` in the config (``disabled`` for the default single-user local cluster, whose ports
bind to this machine; ``token`` when joining or starting a shared cluster); the dashboard and job API
stay off unless ``ray.include_dashboard``; HTTP binds ``http.host`` (127.0.0.1 by default).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from cluster.config import ClusterConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "cluster" / "examples" / "default.yaml"
APP_NAME = "specserve"


def _absolute(path: str | None) -> str | None:
    """Relative model folders resolve against the working directory, then the repository root, and
    travel as absolute paths (replicas may run elsewhere, with another working directory)."""
    if path is None or path.startswith("builtin:") or os.path.isabs(path):
        return path
    for base in (Path.cwd(), REPO_ROOT):
        if (base / path).exists():
            return str((base / path).resolve())
    return path


def load_launch_config(config_path: str | None, host: str | None = None, port: int | None = None) -> ClusterConfig:
    cfg = ClusterConfig.from_yaml(config_path) if config_path else _default_config()
    args = cfg.to_serve_args()
    args["target"]["path"] = _absolute(args["target"]["path"])
    args["draft"]["path"] = _absolute(args["draft"]["path"])
    if host is not None:
        args["http"]["host"] = host
    if port is not None:
        args["http"]["port"] = port
    return ClusterConfig.from_dict(args)


def _default_config() -> ClusterConfig:
    import yaml

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    if not (REPO_ROOT / "models" / "default" / "target" / "config.json").is_file():
        print("[specserve] models/default is missing (rebuild it with scripts/build_default_pair.py); "
              "serving the builtin tiny pair instead (token ids only, no tokenizer)", file=sys.stderr)
        data["target"]["path"] = data["draft"]["path"] = "builtin:tiny"
    return ClusterConfig.from_dict(data)


def wait_running(app_name: str, timeout_s: float = 600.0, progress: bool = False) -> None:
    """Serve waits forever for an unplaceable replica; fail with its status instead."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        app = serve.status().applications.get(app_name)
        status = app.status if app else "NOT_STARTED"
        if progress and status != last:
            print(f"[specserve] application {app_name}: {status}", file=sys.stderr)
            last = status
        if status == ApplicationStatus.RUNNING:
            return
        if status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"{app_name} failed to deploy: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app_name} not running after {timeout_s:.0f} s (unplaceable replicas? "
                               f"check `serve status`): {app}")
        time.sleep(0.5)


def deploy(app, name: str, route_prefix: str | None = None, timeout_s: float = 600.0, progress: bool = False):
    """Deploy ``app`` and wait, bounded, until it runs; returns the app's handle."""
    from ray import serve

    # serve.run waits for RUNNING without a bound; _run(_blocking=False) returns at once so we can bound it.
    serve._run(app, name=name, route_prefix=route_prefix, _blocking=False)
    wait_running(name, timeout_s, progress)
    return serve.get_app_handle(name)


def start(cfg: ClusterConfig, *, timeout_s: float = 600.0) -> None:
    """Start Ray + Serve for ``cfg`` and deploy the app; returns once it is RUNNING."""
    os.environ["RAY_AUTH_MODE"] = cfg.ray.auth_mode
    import ray
    from ray import serve

    from deployments.app import build_app

    if not ray.is_initialized():
        # address="local" unless configured: never join a cluster some earlier `ray start` left behind.
        ray.init(address=cfg.ray.address or "local", include_dashboard=cfg.ray.include_dashboard,
                 log_to_driver=True,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": cfg.ray.auth_mode, "TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    deploy(build_app(cfg.to_serve_args()), APP_NAME, route_prefix="/", timeout_s=timeout_s, progress=True)


def serve_forever(config_path: str | None = None, host: str | None = None, port: int | None = None) -> int:
    cfg = load_launch_config(config_path, host, port)
    start(cfg)
    url = f"http://{cfg.http.host}:{cfg.http.port}"
    print(f"[specserve] serving {cfg.http.model_name} at {url}/v1 (health: {url}/health); Ctrl-C stops",
          file=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("[specserve] shutting down: draining in-flight requests", file=sys.stderr)
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    return 0
