"""``router.stages: local``: the router replica runs the target and the draft itself (no Serve call per step).

Served greedy outputs equal the in-process engine's (the same engine, built from the same config), the
router reports healthy with no stage deployments behind it, and the app has no Verifier or DraftPool.
"""

from __future__ import annotations

import pytest
import torch

from tests.ray.conftest import delete_app, deploy

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "local-stages"
ARGS = {"target": {"path": "builtin:tiny", "max_model_len": 128},
        "draft": {"kind": "model", "path": "builtin:tiny"},
        "speculation": {"gamma": 4, "adaptive": False},
        "router": {"stages": "local", "max_running": 8, "max_queue": 8},
        "defaults": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def router(ray_cluster):
    from ray import serve

    from deployments.app import build_app

    deploy(build_app(ARGS), APP)
    yield serve.get_deployment_handle("Router", app_name=APP)
    delete_app(APP)


def test_local_stages_serve_what_the_in_process_engine_decodes(router):
    from ray import serve

    from cluster.config import ClusterConfig
    from deployments.api import GenerateRequest
    from deployments.settings import engine_settings
    from engine.engine import Request
    from engine.assembly import make_engine

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (5, 17, 30, 9)]
    served = [router.generate.remote(GenerateRequest(prompt_token_ids=p, max_tokens=16)).result() for p in prompts]
    local = make_engine(engine_settings(ClusterConfig.from_dict(ARGS))).generate(
        [Request(tuple(p), max_tokens=16) for p in prompts])
    assert [r.token_ids for r in served] == [list(o.tokens) for o in local]
    assert sum(r.stats["proposed"] for r in served) > 0  # it speculated
    health = router.health.remote().result()
    assert health["status"] == "ok" and health["verifier"] is None
    deployments = serve.status().applications[APP].deployments
    assert set(deployments) == {"Router", "OpenAIIngress"}


def test_local_stages_refuse_tensor_parallelism():
    from cluster.config import ClusterConfig

    with pytest.raises(ValueError, match=r"router\.stages: 'local'.*tensor_parallel 1"):
        ClusterConfig.from_dict({**ARGS, "target": {"path": "builtin:tiny", "tensor_parallel": 2}})
