"""Shared by the OpenAI HTTP tests: Serve's HTTP proxy on a free loopback port, and the tiny-pair app.

Serve's HTTP options are cluster-wide and fixed by the first ``serve.start``/``serve.run`` of the
session, so ``http_port()`` starts Serve on 127.0.0.1 at a free port (or, when something started it
already, reads the port it got). ``main_app()`` deploys the app built from ``tests.fixtures_tokenizer``'s
tiny pair once per session under ``/oa``; the modules that use it run last and one after another
(``tests/ray/conftest.py``), so it is deployed once and ends with the session. Test modules that need other
router limits deploy their own app with ``deploy_app``. ``assert_stages_refuse_malformed_frames`` is the one
malformed-frame check of the cluster and reliability suites.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.fixtures_tokenizer import tiny_pair
from tests.ray.conftest import deploy
from tools.loadgen import free_port

MODEL = "tiny-chat"
MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024
# The main app's router capacity is the default config's (32 running + 128 queued); its body limits are
# short enough for test_reliability_http to see stalled bodies time out and overflow.
MAIN_MAX_RUNNING, MAIN_MAX_QUEUE = 32, 128
BODY_TIMEOUT_S, MAX_PENDING_BODIES = 6.0, 310
# Small enough for test_structured_outputs to send a schema over it within the body limit.
MAX_GRAMMAR_BYTES = 16 * 1024


def assert_stages_refuse_malformed_frames(app_name: str) -> None:
    """Stage calls no router sends (not msgpack, a map of the wrong shape, a reserved byte, one byte over the
    size cap, an operation the replica does not serve), straight to the app's draft pool and verifier: each
    is refused with ``WireError``."""
    from ray import serve

    from runtime import wire

    frames = (b"\x00garbage", b"\x81\xa1v\x63", b"\xc1", bytes(wire.MAX_FRAME_BYTES + 1))
    for name, op in (("DraftPool", wire.OP_PROPOSE), ("Verifier", wire.OP_VERIFY)):
        handle = serve.get_deployment_handle(name, app_name=app_name)
        for call in (*(op + frame for frame in frames), b"x" + wire.encode_release(wire.Release((1,)))):
            with pytest.raises(wire.WireError):
                handle.call.remote(call).result()


@dataclass(frozen=True)
class App:
    name: str
    base: str  # e.g. http://127.0.0.1:PORT/oa  (the OpenAI base URL is base + "/v1")
    api_key: str | None

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@functools.lru_cache(maxsize=None)
def http_port() -> int:
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        client = _get_global_client()
    return int(client.http_config.port)


def app_args(*, max_running: int = 32, max_queue: int = 16, request_timeout_s: float = 120.0,
             api_key: str | None = None, **sections) -> dict:
    pair = tiny_pair()
    args = {
        "target": {"path": pair.target, "max_model_len": MAX_MODEL_LEN},
        "draft": {"kind": "model", "path": pair.draft},
        "speculation": {"gamma": 4, "gamma_max": 8},
        "draft_pool": {"num_replicas": 1, "num_cpus": 0.25},
        "verifier": {"num_cpus": 0.25},
        "router": {"max_running": max_running, "max_queue": max_queue, "micro_batches": 2,
                   "request_timeout_s": request_timeout_s, "num_cpus": 0.25},
        "http": {"model_name": MODEL, "max_body_bytes": MAX_BODY, **({"api_key": api_key} if api_key else {})},
        "defaults": {"temperature": 0.0, "max_tokens": 32},
    }
    for section, values in sections.items():
        args.setdefault(section, {}).update(values)
    return args


def deploy_app(name: str, prefix: str, args: dict) -> App:
    from deployments.app import build_app

    port = http_port()
    deploy(build_app(args), name, route_prefix=prefix)
    key = (args.get("http") or {}).get("api_key")
    app = App(name, f"http://127.0.0.1:{port}{prefix}", key)
    wait_healthy(app)
    return app


def wait_healthy(app: App, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(app.base + "/health", timeout=5)
            if last.status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.3)
    raise TimeoutError(f"{app.base}/health not 200 after {timeout_s} s: {last}")


_apps: dict[str, App] = {}


def main_app() -> App:
    """The shared app: tiny pair with tokenizer, the default router capacity, no API key. Deployed once per
    session (redeployed if another module shut Serve down or deleted it)."""
    from ray import serve

    from ray.serve.schema import ApplicationStatus

    app = _apps.get("openai")
    status = serve.status().applications.get("openai")
    if app is not None and status is not None and status.status == ApplicationStatus.RUNNING:
        return app
    deadline = time.monotonic() + 120
    while "openai" in serve.status().applications:  # being deleted by a module's teardown: let it finish
        if time.monotonic() > deadline:
            raise TimeoutError(f"app 'openai' stuck: {serve.status().applications['openai']}")
        time.sleep(0.5)
    http_port.cache_clear()
    args = app_args(max_running=MAIN_MAX_RUNNING, max_queue=MAIN_MAX_QUEUE,
                    http={"body_timeout_s": BODY_TIMEOUT_S, "max_pending_bodies": MAX_PENDING_BODIES},
                    structured={"max_grammar_bytes": MAX_GRAMMAR_BYTES})
    app = _apps["openai"] = deploy_app("openai", "/oa", args)
    return app


def delete_app(name: str) -> None:
    """Free an app's replicas for the modules that follow (non-blocking; ``main_app`` redeploys on need)."""
    from ray import serve

    _apps.pop(name, None)
    serve.delete(name, _blocking=False)


def openai_client(app: App, *, asynchronous: bool = False, **kw):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=app.v1, api_key=app.api_key or "unused", max_retries=0, timeout=kw.pop("timeout", 120),
               **kw)
