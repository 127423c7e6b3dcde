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


from deployments.launch import deploy, wait_running  # noqa: E402,F401  (re-exported for the tests)


def delete_app(name: str) -> None:
    """Delete an app between test modules; a slow teardown on a loaded box must not fail the tests."""
    from ray import serve

    try:
        serve.delete(name)
    except TimeoutError as exc:
        print(f"warning: {exc}")
