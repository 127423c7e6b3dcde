"""``specserve serve``: start (or join) Ray, deploy the app, block until interrupted.

Decisions made here, deliberately (README, Security):

- A local cluster (``ray.address`` unset) is started by ``deployments.loopback.init_local_ray``: every socket
  of it — GCS, raylet, object manager, each worker's and replica's gRPC servers, the dashboard and
  runtime-env agents, the metrics exporters — listens on loopback only (``tests/ray/test_sockets.py``
  lists them). Nothing on another machine can reach it; nor can it take worker nodes.
- Ray's token authentication follows ``ray.auth_mode`` (``token`` by default). For a local cluster the token
  is ``cluster.secret_files.ray_token_path()`` (generated once, 0600, reused) unless ``RAY_AUTH_TOKEN`` /
  ``RAY_AUTH_TOKEN_PATH`` name another; it guards GCS, the raylet and the dashboard agent's job API, which
  runs even without the dashboard. Joining a cluster (``ray.address``) uses the token Ray finds itself.
- The dashboard stays off unless ``ray.include_dashboard`` (then on 127.0.0.1, behind the token).
- HTTP binds ``http.host`` (127.0.0.1 by default). On a local cluster the API key, however configured,
  reaches the ingress as a private file (``http.api_key_file``): not in Serve's config, not in the
  environment every Ray process inherits.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, HttpSpec, RaySpec
from cluster.secret_files import ensure_token_file, private_copy, ray_token_path
from deployments.loopback import LOCAL_ONLY_ENV, direct_ingress_env, init_local_ray

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
    """The config ``specserve serve`` deploys: validated here, once. What the launcher changes afterwards
    (absolute model folders and key file, the command line's host and port) is checked by the section it
    belongs to, so the model folders and tokenizers are not read again."""
    cfg = ClusterConfig.from_yaml(config_path) if config_path else _default_config()
    http: dict[str, Any] = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    key_file = cfg.http.api_key_file
    if key_file is not None and not key_file.startswith("~"):
        http["api_key_file"] = os.path.abspath(key_file)  # the ingress runs in another directory
    return cfg.model_copy(update={
        "target": cfg.target.model_copy(update={"path": _absolute(cfg.target.path)}),
        "draft": cfg.draft.model_copy(update={"path": _absolute(cfg.draft.path)}),
        "http": with_http(cfg.http, **http)})


def with_http(http: HttpSpec, **changes: Any) -> HttpSpec:
    """``http`` with ``changes``, validated as an http section."""
    return HttpSpec.model_validate({**http.model_dump(), **changes}) if changes else http


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


def ray_auth_env(ray_cfg: RaySpec) -> dict[str, str]:
    """The ``RAY_AUTH_*`` variables ``ray.init`` needs under ``ray_cfg``: the mode, and for a local cluster
    with token auth the state directory's token file unless the environment names a token already."""
    env = {"RAY_AUTH_MODE": ray_cfg.auth_mode}
    if (ray_cfg.auth_mode == "token" and ray_cfg.starts_local_cluster
            and not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH")):
        env["RAY_AUTH_TOKEN_PATH"] = str(ensure_token_file(ray_token_path()))
    return env


def key_to_private_file(http: HttpSpec) -> tuple[HttpSpec, Path | None]:
    """``http`` with its API key moved into a fresh private file (``api_key_file``), and that file (None
    without a key or with a key file already, which is checked). An inline key would sit in Serve's config;
    a key in this process's environment would be inherited by every Ray process, so it leaves the
    environment here."""
    key = http.resolve_api_key()  # a missing variable or file fails here, before Ray starts
    if http.api_key is None and http.api_key_env is None:
        return http, None
    if http.api_key_env is not None:
        del os.environ[http.api_key_env]
    file = private_copy(key, "api_key")
    return with_http(http, api_key=None, api_key_env=None, api_key_file=str(file)), file


def start(cfg: ClusterConfig, *, timeout_s: float = 600.0) -> Path | None:
    """Start Ray + Serve for ``cfg`` and deploy the app; returns once it is RUNNING, with the private API
    key file it made (the caller removes its folder at shutdown) or None."""
    env = ray_auth_env(cfg.ray)
    proxy_port = cfg.http.port
    if cfg.ray.starts_local_cluster:
        env[LOCAL_ONLY_ENV] = "0"  # before ray is imported (init_local_ray)
        env.update(direct_ingress_env(cfg.http.port))
        proxy_port = 0  # the ingress replica holds cfg.http.port; the proxy idles on a free loopback port
    os.environ.update(env)
    import ray
    from ray import serve

    from deployments.app import build_app

    key_file = None
    try:
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(
                include_dashboard=cfg.ray.include_dashboard, log_to_driver=True,
                runtime_env={"env_vars": {"RAY_AUTH_MODE": cfg.ray.auth_mode, "TOKENIZERS_PARALLELISM": "false"}})
            if cfg.ray.starts_local_cluster:
                http, key_file = key_to_private_file(cfg.http)  # before Ray starts: it inherits the env
                cfg = cfg.model_copy(update={"http": http})
                init_local_ray(**kwargs)
                token = f" RAY_AUTH_TOKEN_PATH={env['RAY_AUTH_TOKEN_PATH']}" if "RAY_AUTH_TOKEN_PATH" in env else ""
                print(f"[specserve] Ray listens on 127.0.0.1 only (GCS {ray.get_runtime_context().gcs_address}); "
                      f"a Ray client of it needs {LOCAL_ONLY_ENV}=0 RAY_AUTH_MODE={cfg.ray.auth_mode}{token}",
                      file=sys.stderr)
            else:
                ray.init(address=cfg.ray.address, **kwargs)
        serve.start(http_options={"host": cfg.http.host, "port": proxy_port})
        deploy(build_app(cfg), APP_NAME, route_prefix="/", timeout_s=timeout_s, progress=True)
    except BaseException:
        if key_file is not None:
            shutil.rmtree(key_file.parent, ignore_errors=True)
        raise
    return key_file


def serve_forever(config_path: str | None = None, host: str | None = None, port: int | None = None) -> int:
    cfg = load_launch_config(config_path, host, port)
    key_file = None
    try:
        try:
            key_file = start(cfg)
        except KeyboardInterrupt:  # Ctrl-C while models load: a message, not a traceback
            print("[specserve] interrupted while starting; shutting down", file=sys.stderr)
            import ray

            ray.shutdown()
            return 130
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
    finally:
        if key_file is not None:
            shutil.rmtree(key_file.parent, ignore_errors=True)
    return 0
