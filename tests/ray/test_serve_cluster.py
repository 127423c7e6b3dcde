"""The Serve application on CPU, driven through the typed handle API (issue 3's acceptance 1-3), with a
tensor-parallel verifier group over Serve handles and over compiled channels (a single-process verifier's
share: tests/ray/test_reliability_faults.py, test_openai_api.py and this module's redeploy).

Tiny models built from config (``builtin:tiny``): no files, no downloads. The reference is the target
alone, greedy, one prompt at a time, with Hugging Face ``generate``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.ray.conftest import delete_app, deploy, random_prompts, tiny_greedy
from tests.ray.openai_app import assert_stages_refuse_malformed_frames

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

APP = "spec-handles"
MAX_TOKENS = 24
# The draft-replica kill's batch: 16 requests long enough (~20 steps of γ + 1 tokens) that the kill lands
# while they draft, however slowly the machine steps.
KILL_PROMPTS, KILL_TOKENS = 16, 96
ARGS = {
    "target": {"path": "builtin:tiny", "max_model_len": 256},
    "draft": {"kind": "model", "path": "builtin:tiny"},
    "speculation": {"gamma": 4, "adaptive": False},
    # batch_size 4: a micro-batch of the 11 prompts in flight is drafted in two parts (four keys, two replicas)
    "draft_pool": {"num_replicas": 2, "num_cpus": 0.25, "batch_size": 4},
    "router": {"micro_batches": 2, "max_running": 64, "max_queue": 64},
    "defaults": {"temperature": 0.0},
}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(11, 64)


@pytest.fixture(scope="module")
def references(prompts):
    return tiny_greedy(prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def long_references(prompts):
    return tiny_greedy(prompts[:KILL_PROMPTS], KILL_TOKENS)


# A single-process verifier over handles runs in tests/ray/test_reliability_faults.py (exact outputs, the
# draft and the verifier replica killed under load, malformed frames) and test_openai_api.py, and over
# compiled channels in this module's last test (the redeploy swaps the group for it).
@pytest.fixture(scope="module", params=[(2, "handles"), (2, "compiled")], ids=["tp2", "compiled-tp2"])
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def tp(variant):
    return variant[0]


@pytest.fixture(scope="module")
def transport(variant):
    return variant[1]


@pytest.fixture(scope="module")
def router(ray_cluster, tp, transport):
    """The app with a tensor-parallel (TP = 2, gloo) verifier group over Serve handles; then with the TP = 2
    group and every step's frames over compiled-graph channels
    to the stage replicas' workers (docs/transport.md; the verifier's worker drives the group's ranks),
    drafting two candidates per step (``speculation.draft_num``): a micro-batch's two branches go to the two
    draft workers."""
    from ray import serve

    from deployments.app import build_app

    global APP
    APP = f"spec-{transport}-tp{tp}"
    deploy(build_app(_args(tp, transport)), APP)
    handle = serve.get_deployment_handle("Router", app_name=APP)
    if transport != "handles":  # the router's directory registers each worker once its model is loaded
        workers = _wait_for_workers(handle, drafts=2, timeout_s=60)
        assert len(workers["draft"]) == 2 and len(workers["verifier"]) == 1, workers
    yield handle
    delete_app(APP)


def _args(tp: int, transport: str, draft_replicas: int = 2) -> dict:
    args = {**ARGS, "target": {**ARGS["target"], "tensor_parallel": tp},
            "draft_pool": {**ARGS["draft_pool"], "num_replicas": draft_replicas},
            "router": {**ARGS["router"], "transport": transport}}
    if transport == "compiled":  # two candidate chains per step, one per draft worker, verified as one tree
        args["speculation"] = {**ARGS["speculation"], "draft_num": 2}
    return args


def _wait_for_workers(router, drafts: int, timeout_s: float) -> dict:
    """The router's registered workers, once it has ``drafts`` draft workers and a verifier (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = router.info.remote().result()["workers"]
        if (len(workers["draft"]), len(workers["verifier"])) == (drafts, 1) or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def _request(prompt, max_tokens: int = MAX_TOKENS):
    from deployments.api import GenerateRequest

    return GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens)


async def _collect_stream(router, prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
    tokens, last = [], None
    async for chunk in router.options(stream=True).generate_stream.remote(_request(prompt, max_tokens)):
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None and last.finish_reason == "length" and last.stats is not None
    return tokens


async def _run_mixed(router, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Half the requests unary, half streaming, all in flight at once."""
    async def unary(p):
        return (await router.generate.remote(_request(p, max_tokens))).token_ids

    tasks = [unary(p) if i % 2 == 0 else _collect_stream(router, p, max_tokens) for i, p in enumerate(prompts)]
    return await asyncio.gather(*tasks)


def test_greedy_matches_reference_and_in_process_engine(router, prompts, references):
    from deployments.api import GenerateResponse
    from engine.engine import Request
    from engine.assembly import EngineSettings, make_engine
    from runtime.models import resolve_spec

    resp = router.generate.remote(_request(prompts[0])).result()
    assert isinstance(resp, GenerateResponse)
    assert resp.token_ids == references[0]
    assert resp.finish_reason == "length" and resp.completion_tokens == MAX_TOKENS
    assert resp.stats["steps"] >= 1 and 0.0 <= resp.stats["acceptance_rate"] <= 1.0

    engine = make_engine(EngineSettings(target=resolve_spec("builtin:tiny", "target"),
                                        draft=resolve_spec("builtin:tiny", "draft"), device="cpu", max_len=256,
                                        adaptive=False))
    local = engine.generate([Request(tuple(p), max_tokens=MAX_TOKENS) for p in prompts[:8]])
    served = [router.generate.remote(_request(p)).result().token_ids for p in prompts[:8]]
    assert served == [list(o.tokens) for o in local] == references[:8]


def test_64_concurrent_streaming_and_unary(router, prompts, references):
    before = router.info.remote().result()
    outputs = asyncio.run(_run_mixed(router, prompts))
    mismatched = [i for i, (o, r) in enumerate(zip(outputs, references)) if o != r]
    assert not mismatched, f"{len(mismatched)} of 64 outputs differ from the reference: {mismatched[:5]}"
    info = router.info.remote().result()
    assert info["stats"]["proposed"] > 0  # speculation actually happened
    if info["transport"] == "compiled":  # and its frames went through the workers' channels, not handles
        calls, was = info["calls"], before["calls"]
        assert calls.get("verify compiled", 0) - was.get("verify compiled", 0) >= 10, (was, calls)
        assert calls.get("draft compiled", 0) - was.get("draft compiled", 0) >= 10, (was, calls)
        assert calls.get("verify handles", 0) == was.get("verify handles", 0), (was, calls)
        # draft_num 2: every speculative step drafted on both workers (prefill-only steps draft nothing)
        drafts, verifies = (calls.get(k, 0) - was.get(k, 0) for k in ("draft compiled", "verify compiled"))
        assert drafts >= 1.5 * verifies, (was, calls)


def test_killing_a_draft_replica_loses_no_request(router, prompts, references, long_references):
    import ray

    before = router.info.remote().result()["fallbacks"]

    async def scenario():
        from ray import serve

        info = await router.info.remote()
        pool = serve.get_deployment_handle("DraftPool", app_name=APP)
        # The replica that drafts micro-batch 0 (shard keys route to the replica holding them), found before
        # the batch starts so that nothing but the kill comes between its first step and the kill.
        victim = (await pool.options(multiplexed_model_id=f"{info['shard_prefix']}-0").stats.remote())["actor_name"]
        victim = ray.get_actor(victim, namespace="serve")
        task = asyncio.ensure_future(_run_mixed(router, prompts[:KILL_PROMPTS], KILL_TOKENS))
        # Kill once every row has been drafted (a prefill-only step calls no drafter, so until then the
        # victim may hold nothing to lose), and early: with the draft equal to the target every step emits
        # γ + 1 tokens, so a micro-batch is done drafting after ~KILL_TOKENS / 5 steps.
        drafted = info["stats"]["proposed"] + ARGS["speculation"]["gamma"] * len(prompts[:KILL_PROMPTS])
        while (await router.info.remote())["stats"]["proposed"] < drafted:
            await asyncio.sleep(0.005)
        ray.kill(victim, no_restart=True)
        return await task

    outputs = asyncio.run(scenario())
    mismatched = [i for i, (o, r) in enumerate(zip(outputs, long_references)) if o != r]
    assert not mismatched, f"outputs differ after a draft replica died: {mismatched[:5]}"
    info = router.info.remote().result()
    assert info["fallbacks"] > before
    if info["workers"] is None:
        return
    # Compiled transport: the dead replica's worker left membership; Serve's replacement registers its
    # own while the next batch runs, and that batch too is exact.
    outputs = asyncio.run(_run_mixed(router, prompts))
    assert outputs == references
    workers = _wait_for_workers(router, drafts=2, timeout_s=60)
    assert len(workers["draft"]) == 2 and workers["rebuilds"] >= info["workers"]["rebuilds"] + 1, workers
    assert asyncio.run(_run_mixed(router, prompts[:16])) == references[:16]


async def _streams_through_a_kill(router, prompts, references, victim_pid) -> list:
    """20 streaming requests; once 3 steps ran, SIGKILL the process ``await victim_pid()`` names. Each
    request's result: True (its full reference output), False (a wrong or truncated one) or "error"."""
    from deployments.api import GenerationFailed

    async def one(p, ref):
        try:
            return await _collect_stream(router, p) == ref
        except GenerationFailed:
            return "error"

    tasks = [asyncio.ensure_future(one(p, r)) for p, r in zip(prompts[:20], references[:20])]
    start = (await router.info.remote())["stats"]["steps"]
    while (await router.info.remote())["stats"]["steps"] < start + 3:
        await asyncio.sleep(0.05)
    os.kill(await victim_pid(), signal.SIGKILL)
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)


def test_killing_the_verifier_worker_ends_every_request_cleanly(router, transport, prompts, references):
    """Compiled transport: the verifier replica's worker process is killed during 20 streaming requests.
    Each request ends with its full reference output or an explicit error, never a wrong or truncated one;
    the replica exits with its worker, Serve replaces both, and later requests are exact over a new worker."""
    if transport == "handles":
        pytest.skip("the stage workers of the compiled transport")
    from ray import serve

    async def worker_pid():
        return (await serve.get_deployment_handle("Verifier", app_name=APP).stats.remote())["pid"]

    old = router.info.remote().result()["workers"]["verifier"]
    results = asyncio.run(_streams_through_a_kill(router, prompts, references, worker_pid))
    assert all(r is True or r == "error" for r in results), results
    deadline = time.monotonic() + 120
    while (new := router.info.remote().result()["workers"]["verifier"]) in ([], old) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert new and new != old, (old, new)
    later = [router.generate.remote(_request(p)).result().token_ids for p in prompts[20:24]]
    assert later == references[20:24]


def test_malformed_frames_get_typed_errors_and_replicas_keep_serving(router, prompts, references):
    assert_stages_refuse_malformed_frames(APP)
    # Everyone still serves, and correctly.
    assert router.generate.remote(_request(prompts[1])).result().token_ids == references[1]


def test_invalid_handle_requests_are_refused_with_a_named_parameter(router):
    from deployments.api import GenerateRequest, InvalidRequest

    for req, param in ((GenerateRequest(), "prompt"),
                       (GenerateRequest(prompt_token_ids=[1, 2], max_tokens=0), "max_tokens"),
                       (GenerateRequest(prompt_token_ids=[1, 9999]), "prompt_token_ids"),
                       (GenerateRequest(prompt_token_ids=[1, 2], temperature=-1.0), "temperature"),
                       (GenerateRequest(prompt_token_ids=[1] * 300), "prompt"),
                       (GenerateRequest(prompt="text needs a tokenizer"), "prompt")):
        with pytest.raises(InvalidRequest) as err:
            router.generate.remote(req).result()
        assert err.value.param == param, (req, err.value)


def test_health_reports_progress(router):
    health = router.health.remote().result()
    assert health["status"] == "ok" and health["step_loop_alive"], health
    t0 = time.monotonic()
    assert router.health.remote().result()["seconds_since_progress"] < 5 + (time.monotonic() - t0)


def test_killing_a_verifier_rank_ends_every_request_cleanly(router, prompts, references):
    """TP = 2: kill one rank during 20 streaming requests. Each request ends, within a bound, with its full
    reference output or an explicit error; the group is rebuilt and later requests succeed."""
    from ray import serve

    verifier = serve.get_deployment_handle("Verifier", app_name=APP)
    before = verifier.stats.remote().result()

    async def rank_pid():
        group = before["group"]
        assert len(group["ranks"]) == 2, group
        return group["ranks"][1]["pid"]  # a rank process crashes

    results = asyncio.run(_streams_through_a_kill(router, prompts, references, rank_pid))
    assert all(r is True or r == "error" for r in results), results  # never a silently wrong answer
    later = [router.generate.remote(_request(p)).result().token_ids for p in prompts[20:24]]
    assert later == references[20:24]
    # The group was rebuilt where it lived: Serve did not replace the process that drives it.
    after = verifier.stats.remote().result()
    assert after["pid"] == before["pid"] and after["group"]["generation"] == before["group"]["generation"] + 1, \
        (before, after)


def _new_build(workers: dict, before: dict, drafts: int) -> bool:
    """``workers`` (a router's) are the new build's: ``drafts`` draft workers and a verifier, none of them
    a worker the old router had (``before``); a draining old router can be down to ``drafts`` too."""
    names = workers["draft"] + workers["verifier"]
    return (len(workers["draft"]), len(workers["verifier"])) == (drafts, 1) and \
        not set(names) & set(before["draft"] + before["verifier"])


async def _keep_busy_through_a_redeploy(router, prompts, args, before: dict, drafts: int, in_flight: int = 8) -> list:
    """Keep ``in_flight`` requests running (half unary, half streaming, cycling through ``prompts``) from
    before the app is deployed again with ``args`` until the router the handle reaches is the new build's
    (``_new_build``: ``drafts`` draft workers, none of ``before``); returns (prompt index, tokens or the
    exception) for every request sent."""
    from ray import serve

    from deployments.app import build_app

    async def one(i):
        try:
            if i % 2:
                return i, await _collect_stream(router, prompts[i % len(prompts)])
            return i, (await router.generate.remote(_request(prompts[i % len(prompts)]))).token_ids
        except Exception as exc:  # noqa: BLE001  (a lost request is what the test counts)
            return i, exc

    running = {asyncio.ensure_future(one(i)) for i in range(in_flight)}
    sent, results = in_flight, []
    start = (await router.info.remote())["stats"]["steps"]
    while (await router.info.remote())["stats"]["steps"] < start + 3:
        await asyncio.sleep(0.02)
    serve._run(build_app(args), name=APP, _blocking=False)
    deadline = time.monotonic() + 300
    while not _new_build((await router.info.remote())["workers"], before, drafts) and time.monotonic() < deadline:
        done, running = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        results += [t.result() for t in done]
        running |= {asyncio.ensure_future(one(sent + k)) for k in range(len(done))}
        sent += len(done)
    return results + await asyncio.gather(*running)


def test_redeploying_with_a_draft_replica_fewer_under_load_loses_no_request(router, transport, prompts, references):
    """Compiled transport: the app is deployed again with one draft replica instead of two while requests
    keep arriving, until the new router serves. The config is every deployment's init argument, so Serve
    rolls the whole app: a new router, ingress and stage replicas start while the old ones drain. The old
    router must finish its requests on the workers of its own build and the new one use the new build's,
    never each other's (``deployments.transport.directory.app_key``): before that, the draining router compiled
    graphs onto the new workers, every stage call of both routers waited out its timeout, and 63 of 64
    requests failed. Where both routers still reach one stage replica (over handles), their sequence ids
    differ (``engine.engine.random_first_seq_id``): both counting from 0, one request in ~500 came out
    wrong. The new build also swaps the TP = 2 group for a single-process verifier, so the suite serves over
    that worker too. Runs last: it replaces the module's app."""
    if transport != "compiled":
        pytest.skip("the stage workers of the compiled transport")
    before = router.info.remote().result()["workers"]
    t0 = time.monotonic()
    results = asyncio.run(_keep_busy_through_a_redeploy(router, prompts, _args(1, "compiled", draft_replicas=1),
                                                        before, drafts=1))
    print(f"{len(results)} requests in {time.monotonic() - t0:.0f} s through the redeploy")
    failed = [(i, o) for i, o in results if isinstance(o, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    wrong = [i for i, o in results if o != references[i % len(prompts)]]
    assert not wrong, (f"{len(wrong)} of {len(results)} outputs differ: {wrong[:5]}",
                       [(o, references[i % len(prompts)]) for i, o in results if i in wrong[:2]])
    # The new router uses the new build's workers only: none of the names it had before.
    workers = router.info.remote().result()["workers"]
    assert _new_build(workers, before, drafts=1), (before, workers)
    assert [router.generate.remote(_request(p)).result().token_ids for p in prompts[:8]] == references[:8]
