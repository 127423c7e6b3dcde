"""One local Ray cluster per pytest session; apps are (re)deployed per test module.

A cluster start costs 5-10 s here, so it is shared. Token auth is off (a throwaway single-user cluster on
loopback, see README Security), the dashboard is off (it costs ~1 GiB), and the logical CPU count is
raised so that several fractional-CPU replicas fit on this 2-core box.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    if not ray.is_initialized():
        # address="local": always a fresh cluster, never one a `ray start` left behind on this machine.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def wait_running(app_name: str, timeout_s: float = 180.0) -> None:
    """Serve waits forever for an unplaceable replica; fail with its status instead."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == ApplicationStatus.RUNNING:
            return
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"{app_name} failed to deploy: {app.message}")
        time.sleep(0.5)
    raise TimeoutError(f"{app_name} not RUNNING after {timeout_s} s: {serve.status().applications.get(app_name)}")


def deploy(app, name: str, route_prefix: str | None = None, timeout_s: float = 180.0):
    from ray import serve

    # serve.run waits for RUNNING without a bound; _run(_blocking=False) returns at once so we can bound it.
    serve._run(app, name=name, route_prefix=route_prefix, _blocking=False)
    wait_running(name, timeout_s)
    return serve.get_app_handle(name)
