"""Adding and removing a draft replica under load, over the compiled transport (issue 18's acceptance 3).

An operator changes ``draft_pool.num_replicas`` and deploys again (``specserve serve`` / ``serve deploy``
with the new args) while requests run. The config is every deployment's init argument, so Serve rolls the
whole app: a new router, ingress and stage replicas start while the old ones drain their requests. The old
router must finish its requests on the workers of its own build, and the new one use the new build's,
never each other's (``deployments.worker_directory.app_key``): before that, the draining router compiled
graphs onto the new workers, every stage call of both routers waited out its timeout, and the old router's
requests failed at ``request_timeout_s``.

Tiny models built from config; the reference is the target alone, greedy, with Hugging Face ``generate``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.ray.conftest import delete_app, deploy, random_prompts, tiny_greedy

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

APP = "redeploy-compiled"
MAX_TOKENS = 64  # long enough that the old router still runs when the new build's workers come up
ARGS = {
    "target": {"path": "builtin:tiny", "max_model_len": 256},
    "draft": {"kind": "model", "path": "builtin:tiny"},
    "speculation": {"gamma": 4, "adaptive": False},
    "draft_pool": {"num_replicas": 1, "num_cpus": 0.25},
    # A request that waits out stage timeouts (the failure this guards against) fails within the test.
    "router": {"micro_batches": 2, "max_running": 64, "max_queue": 64, "transport": "compiled",
               "request_timeout_s": 120},
    "defaults": {"temperature": 0.0},
}


def _args(draft_replicas: int) -> dict:
    return {**ARGS, "draft_pool": {**ARGS["draft_pool"], "num_replicas": draft_replicas}}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(23, 64)


@pytest.fixture(scope="module")
def references(prompts):
    return tiny_greedy(prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def router(ray_cluster):
    from ray import serve

    from deployments.app import build_app

    deploy(build_app(_args(1)), APP)
    handle = serve.get_deployment_handle("Router", app_name=APP)
    _wait_for_workers(handle, drafts=1)
    yield handle
    delete_app(APP)


def _wait_for_workers(handle, drafts: int) -> dict:
    deadline = time.monotonic() + 90
    while True:
        workers = handle.info.remote().result()["workers"]
        if (len(workers["draft"]), len(workers["verifier"])) == (drafts, 1) or time.monotonic() > deadline:
            return workers
        time.sleep(0.3)


def _request(prompt):
    from deployments.api import GenerateRequest

    return GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS)


async def _redeploy_during(router, prompts, draft_replicas: int) -> list:
    """All requests in flight, half unary and half streaming; a few steps in, the app is deployed again
    with ``draft_replicas`` draft replicas. Returns each request's tokens, or its exception."""
    from ray import serve

    from deployments.app import build_app

    async def unary(p):
        return (await router.generate.remote(_request(p))).token_ids

    async def streamed(p):
        tokens = []
        async for chunk in router.options(stream=True).generate_stream.remote(_request(p)):
            tokens.extend(chunk.token_ids)
        return tokens

    start = (await router.info.remote())["stats"]["steps"]
    tasks = [asyncio.ensure_future(unary(p) if i % 2 == 0 else streamed(p)) for i, p in enumerate(prompts)]
    while (await router.info.remote())["stats"]["steps"] < start + 3:
        await asyncio.sleep(0.02)
    serve._run(build_app(_args(draft_replicas)), name=APP, _blocking=False)
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("draft_replicas", [2, 1], ids=["add", "remove"])
def test_changing_the_draft_pool_under_load_loses_no_request(router, prompts, references, draft_replicas):
    from deployments.launch import wait_running

    before = router.info.remote().result()["workers"]
    outputs = asyncio.run(_redeploy_during(router, prompts, draft_replicas))
    failed = [(i, o) for i, o in enumerate(outputs) if isinstance(o, BaseException)]
    assert not failed, f"{len(failed)} of {len(prompts)} requests failed: {failed[:3]}"
    mismatched = [i for i, (o, r) in enumerate(zip(outputs, references)) if o != r]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} outputs differ: {mismatched[:5]}"
    wait_running(APP, timeout_s=120)
    workers = _wait_for_workers(router, drafts=draft_replicas)
    assert len(workers["draft"]) == draft_replicas and len(workers["verifier"]) == 1, workers
    # The new router uses the new build's workers only: none of the names it had before.
    assert not set(workers["draft"] + workers["verifier"]) & set(before["draft"] + before["verifier"]), \
        (before, workers)
    later = [router.generate.remote(_request(p)).result().token_ids for p in prompts[:8]]
    assert later == references[:8]
