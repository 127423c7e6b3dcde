"""Threads are configuration: what ``verifier.num_threads`` / ``draft_pool.num_threads`` ask for is what a
real Serve replica's model work runs with, whatever Ray derived from ``num_cpus``.

The session cluster exports ``OMP_NUM_THREADS=1`` to every worker and each replica here reserves 0.25 CPU
(which Ray turns into one thread too), so a replica reporting more than one thread, or an
``OMP_NUM_THREADS`` other than 1, got it from the config (the verifier's count is explicit; the draft's is
'auto', which sizes the builtin tiny model's threads to one). The count is read through the replica's
``threads`` method, which runs where stage calls run (the model-work thread), not on its event loop.
"""

from __future__ import annotations

import pytest

from cluster.node import cpu_cores
from tests.ray.conftest import delete_app, deploy

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "threads"
VERIFIER_THREADS = min(2, cpu_cores())  # an explicit count; 2 where the machine has it


@pytest.fixture(scope="module")
def app(ray_cluster):
    from deployments.app import build_app

    args = {"target": {"path": "builtin:tiny", "max_model_len": 64},
            "draft": {"kind": "model", "path": "builtin:tiny"},
            "draft_pool": {"num_cpus": 0.25, "num_threads": "auto"},
            "verifier": {"num_cpus": 0.25, "num_threads": VERIFIER_THREADS},
            "router": {"max_running": 4, "max_queue": 4}}
    deploy(build_app(args), APP)
    yield APP
    delete_app(APP)


def test_configured_threads_apply_inside_the_replicas(app):
    from ray import serve

    verifier = serve.get_deployment_handle("Verifier", app_name=app).threads.remote().result()
    draft = serve.get_deployment_handle("DraftPool", app_name=app).threads.remote().result()
    assert verifier == {"torch_threads": VERIFIER_THREADS, "omp_num_threads": str(VERIFIER_THREADS)}
    assert draft == {"torch_threads": 1, "omp_num_threads": "1"}


def test_more_threads_than_cores_is_refused_before_deploying(ray_cluster):
    from cluster.config import ConfigError
    from deployments.app import build_app

    too_many = cpu_cores() + 1
    with pytest.raises(ConfigError, match=rf"verifier\.num_threads \({too_many}\) is more than the {cpu_cores()} "
                                          r"CPU cores"):
        build_app({"target": {"path": "builtin:tiny"}, "verifier": {"num_threads": too_many}})
