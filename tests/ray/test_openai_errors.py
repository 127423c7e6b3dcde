"""Bad input over HTTP: every mistake gets the right 4xx in OpenAI's error shape, naming the parameter,
and the server stays healthy. A property-based fuzz of request bodies finds no 5xx. The bearer API key
(a second ingress bound to the same router) is checked in constant time and never logged.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import ClusterConfig
from deployments.api import GenerationFailed, InvalidRequest, Overloaded, RequestTimedOut
from deployments.ingress import CHAT_FIELDS, COMPLETION_FIELDS, OpenAIIngress, _translate
from tests.ray.conftest import deploy
from tests.ray.openai_app import MAX_BODY, MAX_MODEL_LEN, MODEL, App, app_args, delete_app, http_port, \
    openai_client, wait_healthy

pytestmark = pytest.mark.ray

C, H = "/completions", "/chat/completions"
LONG_PROMPT = " ".join(["stars"] * (MAX_MODEL_LEN + 20))  # more tokens than the context holds
USER = [{"role": "user", "content": "hi"}]


def c(**kw) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **kw}


def h(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, path, JSON body, status, error type, param, code)
BAD_JSON = [
    ("max_tokens negative", C, c(max_tokens=-1), 400, "invalid_request_error", "max_tokens", None),
    ("max_tokens zero", C, c(max_tokens=0), 400, "invalid_request_error", "max_tokens", None),
    ("max_tokens huge", C, c(max_tokens=10 ** 12), 400, "invalid_request_error", "max_tokens", None),
    ("max_tokens past context", C, c(max_tokens=MAX_MODEL_LEN), 400, "invalid_request_error", "max_tokens",
     "context_length_exceeded"),
    ("max_tokens string", C, c(max_tokens="ten"), 400, "invalid_request_error", "max_tokens", None),
    ("max_tokens fraction", C, c(max_tokens=2.5), 400, "invalid_request_error", "max_tokens", None),
    ("temperature negative", C, c(temperature=-0.5), 400, "invalid_request_error", "temperature", None),
    ("temperature too high", C, c(temperature=7), 400, "invalid_request_error", "temperature", None),
    ("temperature string", C, c(temperature="hot"), 400, "invalid_request_error", "temperature", None),
    ("top_p zero", C, c(top_p=0), 400, "invalid_request_error", "top_p", None),
    ("top_p above one", C, c(top_p=1.5), 400, "invalid_request_error", "top_p", None),
    ("top_k negative", C, c(top_k=-3), 400, "invalid_request_error", "top_k", None),
    ("top_k fraction", C, c(top_k=2.5), 400, "invalid_request_error", "top_k", None),
    ("seed string", C, c(seed="x"), 400, "invalid_request_error", "seed", None),
    ("seed huge", C, c(seed=2 ** 80), 400, "invalid_request_error", "seed", None),
    ("unknown model", C, c(model="gpt-4"), 404, "invalid_request_error", "model", "model_not_found"),
    ("model not a string", C, c(model=123), 400, "invalid_request_error", "model", None),
    ("prompt too long", C, c(prompt=LONG_PROMPT), 400, "invalid_request_error", "prompt", "context_length_exceeded"),
    ("prompt missing", C, without(c(), "prompt"), 400, "invalid_request_error", "prompt", None),
    ("prompt number", C, c(prompt=42), 400, "invalid_request_error", "prompt", None),
    ("prompt empty string", C, c(prompt=""), 400, "invalid_request_error", "prompt", None),
    ("prompt empty list", C, c(prompt=[]), 400, "invalid_request_error", "prompt", None),
    ("prompt batch", C, c(prompt=["a", "b"]), 400, "invalid_request_error", "prompt", None),
    ("prompt token id out of vocab", C, c(prompt=[5, 10 ** 6]), 400, "invalid_request_error", "prompt", None),
    ("n=2", C, c(n=2), 400, "invalid_request_error", "n", None),
    ("n=0", C, c(n=0), 400, "invalid_request_error", "n", None),
    ("stop number", C, c(stop=5), 400, "invalid_request_error", "stop", None),
    ("stop list of numbers", C, c(stop=[1, 2]), 400, "invalid_request_error", "stop", None),
    ("stop too many", C, c(stop=[f"s{i}" for i in range(9)]), 400, "invalid_request_error", "stop", None),
    ("stop empty string", C, c(stop=[""]), 400, "invalid_request_error", "stop", None),
    ("stream not bool", C, c(stream="yes"), 400, "invalid_request_error", "stream", None),
    ("stream_options without stream", C, c(stream_options={"include_usage": True}), 400, "invalid_request_error",
     "stream_options", None),
    ("stream_options bad key", C, c(stream=True, stream_options={"foo": 1}), 400, "invalid_request_error",
     "stream_options.foo", None),
    ("unknown field", C, c(foo=1), 400, "invalid_request_error", "foo", None),
    ("logprobs", C, c(logprobs=5), 400, "invalid_request_error", "logprobs", None),
    ("echo", C, c(echo=True), 400, "invalid_request_error", "echo", None),
    ("presence_penalty", C, c(presence_penalty=0.5), 400, "invalid_request_error", "presence_penalty", None),
    ("best_of", C, c(best_of=3), 400, "invalid_request_error", "best_of", None),
    ("logit_bias", C, c(logit_bias={"5": 10}), 400, "invalid_request_error", "logit_bias", None),
    ("ignore_eos not bool", C, c(ignore_eos="no"), 400, "invalid_request_error", "ignore_eos", None),
    ("messages missing", H, without(h(), "messages"), 400, "invalid_request_error", "messages", None),
    ("messages empty", H, h(messages=[]), 400, "invalid_request_error", "messages", None),
    ("messages string", H, h(messages="hi"), 400, "invalid_request_error", "messages", None),
    ("message not object", H, h(messages=["hi"]), 400, "invalid_request_error", "messages[0]", None),
    ("unknown role", H, h(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_request_error",
     "messages[0].role", None),
    ("content missing", H, h(messages=[{"role": "user"}]), 400, "invalid_request_error", "messages[0].content",
     None),
    ("content number", H, h(messages=[{"role": "user", "content": 5}]), 400, "invalid_request_error",
     "messages[0].content", None),
    ("image content", H, h(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "invalid_request_error", "messages[0].content", None),
    ("chat too long", H, h(messages=[{"role": "user", "content": LONG_PROMPT}]), 400, "invalid_request_error",
     "messages", "context_length_exceeded"),
    ("max_completion_tokens zero", H, without(h(max_completion_tokens=0), "max_tokens"), 400,
     "invalid_request_error", "max_completion_tokens", None),
    ("max_tokens disagree", H, h(max_completion_tokens=5), 400, "invalid_request_error", "max_completion_tokens",
     None),
    ("chat n=3", H, h(n=3), 400, "invalid_request_error", "n", None),
    ("chat prompt field", H, h(prompt="x"), 400, "invalid_request_error", "prompt", None),
    ("tools", H, h(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "invalid_request_error", "tools",
     None),
    ("response_format bad schema", H, h(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400, "invalid_request_error", "response_format", None),
    ("structured_outputs bad regex", C, c(structured_outputs={"regex": "[a-"}), 400, "invalid_request_error",
     "structured_outputs", None),
    ("chat unknown model", H, h(model="nope"), 404, "invalid_request_error", "model", "model_not_found"),
    ("prompt token id bool", C, c(prompt=[5, True]), 400, "invalid_request_error", "prompt", None),
    ("two prompts as ids", C, c(prompt=[[5], [6]]), 400, "invalid_request_error", "prompt", None),
    ("top_p string", C, c(top_p="high"), 400, "invalid_request_error", "top_p", None),
    ("include_usage not bool", C, c(stream=True, stream_options={"include_usage": "yes"}), 400,
     "invalid_request_error", "stream_options.include_usage", None),
    ("message unknown field", H, h(messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400,
     "invalid_request_error", "messages[0].tool_calls", None),
    ("message name number", H, h(messages=[{"role": "user", "content": "x", "name": 1}]), 400,
     "invalid_request_error", "messages[0].name", None),
    ("user content null", H, h(messages=[{"role": "user", "content": None}]), 400, "invalid_request_error",
     "messages[0].content", None),
    ("too many messages", H, h(messages=USER * 1025), 400, "invalid_request_error", "messages", None),
    ("stop too long", C, c(stop=["x" * 257]), 400, "invalid_request_error", "stop", None),
    ("tool_choice auto", H, h(tool_choice="auto"), 400, "invalid_request_error", "tool_choice", None),
]

NESTED = b"[" * 30000 + b"]" * 30000  # within the size limit, too deep for the JSON parser
# (id, method, path, raw body, extra headers, status)
BAD_RAW = [
    ("malformed JSON", "POST", C, b'{"prompt": ', {}, 400),
    ("not JSON at all", "POST", H, b"hello", {}, 400),
    ("JSON array", "POST", C, b"[1, 2]", {}, 400),
    ("JSON string", "POST", H, b'"hi"', {}, 400),
    ("JSON null", "POST", C, b"null", {}, 400),
    ("empty body", "POST", C, b"", {}, 400),
    ("NaN", "POST", C, b'{"prompt": "x", "temperature": NaN}', {}, 400),
    ("Infinity", "POST", C, b'{"prompt": "x", "max_tokens": Infinity}', {}, 400),
    ("invalid UTF-8", "POST", C, b'{"prompt": "\xff\xfe\xfa"}', {}, 400),
    ("deeply nested", "POST", C, NESTED, {}, 400),
    ("huge integer", "POST", C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400),
    ("oversized body", "POST", C, b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}', {}, 413),
    ("lying Content-Length", "POST", H, b"{}", {"Content-Length": str(MAX_BODY * 4)}, 413),
    ("GET on a POST endpoint", "GET", C, None, {}, 405),
    ("unknown endpoint", "POST", "/engines", b"{}", {}, 404),
]


def _error(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def _assert_healthy(app: App) -> None:
    assert httpx.get(app.base + "/health", timeout=10).status_code == 200
    r = httpx.post(app.v1 + C, json=c(temperature=0), headers=app.headers(), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_bad_json_bodies(app):
    assert len(BAD_JSON) + len(BAD_RAW) >= 25
    failures = []
    with httpx.Client(timeout=30) as http:
        for name, path, body, status, kind, param, code in BAD_JSON:
            for stream in (False, True):
                if stream and ("stream" in body or "stream_options" in body or status != 400):
                    continue
                r = http.post(app.v1 + path, json={**body, "stream": True} if stream else body)
                got = (r.status_code, *(_error(r)[k] for k in ("type", "param"))) if r.status_code >= 400 else \
                    (r.status_code, None, None)
                if got != (status, kind, param) or (code and r.json()["error"]["code"] != code):
                    failures.append(f"{name}{' (stream)' if stream else ''}: got {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    _assert_healthy(app)


def test_bad_raw_bodies(app):
    failures = []
    with httpx.Client(timeout=30) as http:
        for name, method, path, raw, headers, status in BAD_RAW:
            if raw is not None and "Content-Length" in headers:
                r = _raw_request(app, method, path, raw, headers)
            else:
                r = http.request(method, app.v1 + path, content=raw,
                                 headers={"Content-Type": "application/json", **headers})
            if r.status_code != status:
                failures.append(f"{name}: got {r.status_code} {r.text[:200]}")
                continue
            err = _error(r)
            if status == 400 and "JSON" not in err["message"] and "body" not in err["message"]:
                failures.append(f"{name}: message does not name the problem: {err['message']}")
    assert not failures, "\n".join(failures)
    _assert_healthy(app)


def _raw_request(app: App, method: str, path: str, raw: bytes, headers: dict) -> httpx.Response:
    """httpx fixes Content-Length itself; a lying header needs a hand-written request."""
    import socket

    url = httpx.URL(app.v1 + path)
    lines = [f"{method} {url.raw_path.decode()} HTTP/1.1", f"Host: {url.host}:{url.port}",
             "Content-Type: application/json", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((url.host, url.port), timeout=30) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + raw)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    hdrs = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    return httpx.Response(status, headers=hdrs, content=body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_chunked_oversized_body(app):
    """No Content-Length (chunked): the bytes actually read are counted."""
    def body():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    r = httpx.post(app.v1 + C, content=body(), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"


def test_official_client_errors(app):
    client = openai_client(app)
    cases = [
        (openai.BadRequestError, "n", lambda: client.completions.create(model=MODEL, prompt="x", n=2)),
        (openai.BadRequestError, "max_tokens", lambda: client.completions.create(model=MODEL, prompt="x",
                                                                                  max_tokens=-5)),
        (openai.BadRequestError, "temperature", lambda: client.chat.completions.create(
            model=MODEL, messages=USER, temperature=3.5)),
        (openai.BadRequestError, "top_k", lambda: client.completions.create(model=MODEL, prompt="x",
                                                                             extra_body={"top_k": -1})),
        (openai.BadRequestError, "messages[0].role", lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "robot", "content": "x"}])),
        (openai.BadRequestError, "messages", lambda: client.chat.completions.create(model=MODEL, messages=[])),
        (openai.BadRequestError, "prompt", lambda: client.completions.create(model=MODEL, prompt=LONG_PROMPT)),
        (openai.NotFoundError, "model", lambda: client.completions.create(model="gpt-4o", prompt="x")),
        (openai.BadRequestError, "stop", lambda: client.completions.create(model=MODEL, prompt="x",
                                                                            stop=[f"s{i}" for i in range(9)])),
    ]
    for exc_type, param, call in cases:
        with pytest.raises(exc_type) as info:
            call()
        assert info.value.param == param, (param, info.value.body)
        assert info.value.type == ("invalid_request_error")
    _assert_healthy(app)


def test_error_translation():
    """Router-side exceptions → HTTP status, including the ones a healthy test app cannot provoke."""
    cases = [(InvalidRequest("bad", "top_p"), 400, "top_p"), (InvalidRequest("x", "prompt_token_ids"), 400, "prompt"),
             (Overloaded("busy", retry_after_s=2.5), 503, None), (RequestTimedOut("slow"), 504, None),
             (GenerationFailed("lost"), 500, None), (RuntimeError("bug"), 500, None)]
    for exc, status, param in cases:
        err = _translate(exc)
        assert (err.status, err.param) == (status, param)
    assert _translate(Overloaded("busy", retry_after_s=2.5)).headers["Retry-After"] == "3"
    assert _translate(RequestTimedOut("slow")).type == "timeout_error"
    assert _translate(RuntimeError("secret detail")).message == "internal server error"


# -- property-based fuzz -------------------------------------------------------------------------------

_leaf = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 300)
         | st.floats(allow_nan=False, allow_infinity=False) | st.floats(-1, 3) | st.text(max_size=12))
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json,
                                  "content": st.text(max_size=20) | _json})
_field = {
    "model": st.just(MODEL) | _json,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 500), max_size=5) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "max_tokens": st.integers(-2, 4) | _json,  # valid values stay small: a valid request generates
    "max_completion_tokens": st.integers(-2, 4) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-0.5, 1.5) | _json,
    "top_k": st.integers(-2, 500) | _json,
    "seed": st.integers(-2 ** 64, 2 ** 64) | _json,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=10) | _json,
    "n": st.integers(0, 3) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
}


def _bodies(fields: set[str]):
    known = {k: v for k, v in _field.items() if k in fields}
    others = {k: _json for k in sorted(fields - set(known))}
    base = st.fixed_dictionaries({}, optional={**known, **others})
    extra = st.dictionaries(st.text(min_size=1, max_size=10), _json, max_size=2)
    return st.one_of(base, st.tuples(base, extra).map(lambda t: {**t[1], **t[0]}), _json)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(body=st.one_of(_bodies(COMPLETION_FIELDS).map(lambda b: (C, b)), _bodies(CHAT_FIELDS).map(lambda b: (H, b))))
def _fuzz(app, http, body):
    path, payload = body
    r = http.post(app.v1 + path, content=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (payload, r.status_code, r.text)
    if r.status_code >= 400:
        _error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzz_bodies_never_5xx(app):
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as http:
        _fuzz(app, http)
        for blob in (os.urandom(64), os.urandom(512), b"\x00" * 10, "{\"prompt\": \"é\"".encode("utf-16")):
            r = http.post(app.v1 + C, content=blob)
            assert r.status_code == 400, r.text
    assert time.monotonic() - t0 < 120
    _assert_healthy(app)


# -- API key -------------------------------------------------------------------------------------------

SECRET = "sk-test-" + "7f3a9c1e5b2d4f60"


@pytest.fixture(scope="module")
def auth_app(app):
    """A second ingress, with an API key, in front of the main app's router (one cheap replica)."""
    from ray import serve

    router = serve.get_deployment_handle("Router", app_name=app.name)
    args = app_args(api_key=SECRET)
    deploy(OpenAIIngress.options(ray_actor_options={"num_cpus": 0.1}).bind(ClusterConfig.from_dict(args), router), "openai-auth",
           route_prefix="/oa-auth")
    auth = App("openai-auth", f"http://127.0.0.1:{http_port()}/oa-auth", SECRET)
    wait_healthy(auth)
    yield auth
    delete_app(auth.name)


def test_api_key(auth_app):
    url = auth_app.v1
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}"},
                    {"Authorization": SECRET}, {"Authorization": f"Bearer {SECRET}x"}):
        for method, path, body in (("GET", "/models", None), ("POST", C, c()), ("POST", H, h())):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (headers, path, r.text)
            err = _error(r)
            assert err["type"] == "authentication_error" and SECRET not in r.text
    assert httpx.get(auth_app.base + "/debug/kv", timeout=30).status_code == 401
    assert httpx.get(auth_app.base + "/health", timeout=30).status_code == 200  # exempt: for load balancers

    client = openai_client(auth_app)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list()


def test_api_key_never_logged(auth_app, ray_cluster):
    httpx.get(auth_app.v1 + "/models", headers={"Authorization": f"Bearer {SECRET}"}, timeout=30)
    httpx.get(auth_app.v1 + "/models", headers={"Authorization": f"Bearer {SECRET}-guess"}, timeout=30)
    time.sleep(1.0)  # let the replicas flush their logs
    logs = ray_cluster._private.worker.global_worker.node.get_logs_dir_path()
    leaked = []
    for root, _, files in os.walk(logs):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    if SECRET.encode() in f.read():
                        leaked.append(path)
            except OSError:
                continue
    # The key travels in the app's deploy args (prefer http.api_key_env); only log files are checked.
    assert not leaked, leaked


def test_stream_failing_midway_ends_with_error_event_and_no_done():
    """The SSE generator itself (no cluster): a router stream that fails after its first chunk."""
    import asyncio
    import types

    from deployments.api import GenerateChunk

    class FailingStream:
        cancelled = False

        def __init__(self, chunks, exc):
            self.chunks, self.exc = list(chunks), exc

        async def __anext__(self):
            if self.chunks:
                return self.chunks.pop(0)
            raise self.exc

        def cancel(self):
            self.cancelled = True

    events = OpenAIIngress.func_or_class._events
    fake = types.SimpleNamespace(model_name=MODEL)
    opts = {"include_usage": True, "token_ids": False, "renames": {}}

    async def collect(stream, chat):
        return [e async for e in events(fake, stream, GenerateChunk(text="a", token_ids=[5]), opts, "cmpl-x", chat)]

    for chat in (False, True):
        stream = FailingStream([GenerateChunk(text="b", token_ids=[6])], GenerationFailed("verifier lost"))
        out = asyncio.run(collect(stream, chat))
        assert all(e.startswith("data: ") and e.endswith("\n\n") for e in out)
        assert "[DONE]" not in "".join(out)
        last = json.loads(out[-1][len("data: "):])
        assert last == {"error": {"message": "verifier lost", "type": "server_error", "param": None,
                                  "code": "generation_failed"}}
        timed_out = asyncio.run(collect(FailingStream([], RequestTimedOut("request timed out after 1 s")), chat))
        assert json.loads(timed_out[-1][len("data: "):])["error"]["type"] == "timeout_error"

    ok = FailingStream([GenerateChunk(text="b", token_ids=[6], finish_reason="length", prompt_tokens=3,
                                      completion_tokens=2, stats={"steps": 1})], StopAsyncIteration())
    out = asyncio.run(collect(ok, False))
    assert out[-1] == "data: [DONE]\n\n"
    usage = json.loads(out[-2][len("data: "):])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}
    assert not ok.cancelled  # a finished stream is not cancelled
