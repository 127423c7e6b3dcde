"""The OpenAI-compatible HTTP ingress: FastAPI inside a Serve deployment, in front of the router.

    POST /v1/completions          text completion (prompt: a string, or token ids), SSE with stream: true
    POST /v1/chat/completions     chat completion (the target tokenizer's chat template, applied by the router)
    GET  /v1/models[/{model}]     the one served model (http.model_name)
    GET  /health                  200 "ok" or "degraded" (draft pool down, target-only), 503 "unhealthy"
    GET  /debug/kv                KV slots in use in verifier and draft pool, cancelled-request counter
    GET  /debug/stats             speculation totals, draft fallbacks by reason, verifier re-prefills

Contract (docs/http_api.md has the user-facing version):

- Every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with a 4xx for
  anything the caller must fix (400 naming the parameter, 401, 404 for an unknown model or path, 405,
  408 for a body that did not arrive within ``http.body_timeout_s``, 413 for a body over
  ``http.max_body_bytes``) and 503 + ``Retry-After`` when admission control refuses the request. Bad
  input never yields a 5xx: the body is size-checked (Content-Length, then the bytes actually read),
  then ``parse_body`` alone turns it into a dict, refusing what no later step should see (not UTF-8,
  lone surrogates, NaN/Infinity, numbers beyond 64 bits or a float, deep nesting), the pydantic models
  ``CompletionRequest`` / ``ChatRequest`` check every field's type, and ``normalise`` turns one into the
  ``GenerateRequest`` the router gets; ranges and the context check are ``GenerateRequest.validate``
  and the router's, so handle callers get the same messages.
- Limits that answer at once instead of queueing (Serve's own ``max_ongoing_requests`` sits far above
  them, see ``deployments.app._ingress``): at most ``router.max_running + max_queue`` generation calls
  in flight from here (503 past it, before the body is read), at most ``http.max_pending_bodies``
  bodies being received (503), each within ``http.body_timeout_s`` (408). ``/health``, ``/v1/models``
  and ``/debug/*`` count against none of them.
- ``stream: true`` answers ``text/event-stream``: OpenAI chunks, the last one carrying ``finish_reason``
  and the request's speculation statistics, then (with ``stream_options.include_usage``) a usage chunk
  with empty ``choices``, then ``data: [DONE]``. A stream that fails after its first chunk ends with
  ``data: {"error": {...}}`` and no ``[DONE]``. Admission errors arrive before the first byte, as a
  normal HTTP error.
- A client that goes away cancels its request: Serve cancels this handler's task, and the handler
  cancels its router call, whose ``_events`` then cancels the sequence in the engine (KV slots freed in
  the verifier and the draft pool; ``/debug/kv`` shows it).
- With ``http.api_key_file`` / ``api_key_env`` / ``api_key`` set, every path except ``/health`` needs
  ``Authorization: Bearer <key>``, compared in constant time; the key is never logged or echoed.
  ``/debug/kv`` is read-only (counters only, no request content) and behind the same key.
- ``/health`` and ``/debug/*`` wait at most ``router.health_timeout_s`` for the router, and answer 503
  when it (or, for ``/debug/kv``, a stage it must ask) is down; the router answers ``/health`` from
  state its step loop and stage prober keep, without calling any stage.

No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` annotation of the
endpoint methods, or it treats ``request`` as a required body field.
"""

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
import weakref
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.config import ClusterConfig
from deployments.api import (GenerateChunk, GenerateRequest, GenerateResponse, GenerationFailed, InvalidRequest,
                             Overloaded, PREDICATE, RequestTimedOut, Role, SENTENCE, StageUnavailable,
                             StructuredOutputs, field_path, invalid, says, show)

log = logging.getLogger("specserve.ingress")

app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII JSON: a message that quotes the caller's input (a lone surrogate, say) must still encode.
        return Response(json.dumps(self.body), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError):
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    first = (exc.errors() or [{}])[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    return _bad(f"invalid request: {first.get('msg', 'validation failed')}", ".".join(loc) or None).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                          str(exc.detail))
    return ApiError(exc.status_code, message, type=kind, headers=dict(exc.headers or {})).response()


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, "internal server error", type="server_error").response()


# -- translating errors ------------------------------------------------------------------------------


_HTTP_PARAM = {"prompt_token_ids": "prompt"}  # the handle API's field → the OpenAI field it came from


def _translate(exc: BaseException, renames: dict | None = None) -> ApiError:
    """A router-side exception (possibly wrapped by Ray) → an OpenAI-shaped HTTP error."""
    cause = _cause(exc)
    if isinstance(cause, InvalidRequest):
        param = getattr(cause, "param", None)
        param = (renames or {}).get(param) or _HTTP_PARAM.get(param, param)
        return _bad(str(cause.args[0]) if cause.args else str(cause), param, getattr(cause, "code", None))
    if isinstance(cause, Overloaded):
        retry = max(1, math.ceil(getattr(cause, "retry_after_s", 1.0) or 1.0))
        return ApiError(503, str(cause.args[0]) if cause.args else "server overloaded; retry later",
                        type="server_overloaded", code="overloaded", headers={"Retry-After": str(retry)})
    if isinstance(cause, RequestTimedOut):
        return ApiError(504, str(cause.args[0]) if cause.args else "request timed out", type="timeout_error",
                        code="timeout")
    if isinstance(cause, GenerationFailed):
        return ApiError(500, str(cause.args[0]) if cause.args else "generation failed", type="server_error",
                        code="generation_failed")
    name = type(cause).__name__
    if name in ("BackPressureError", "DeploymentUnavailableError", "ActorDiedError", "ActorUnavailableError",
                "RayActorError"):
        return ApiError(503, "the router is unavailable or saturated; retry later", type="server_overloaded",
                        code="unavailable", headers={"Retry-After": "1"})
    log.error("request failed: %s: %s", name, cause)
    return ApiError(500, "internal server error", type="server_error")


def _cause(exc: BaseException) -> BaseException:
    """Ray wraps a replica's exception in a RayTaskError whose ``cause`` is the original."""
    seen = 0
    while seen < 4 and getattr(exc, "cause", None) is not None and isinstance(exc.cause, BaseException):
        exc = exc.cause
        seen += 1
    return exc


# -- the request body --------------------------------------------------------------------------------

MAX_JSON_DEPTH = 32  # OpenAI bodies nest ~4 deep (messages[i].content[j].text); deeper is a bug or an attack
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # int64 ∪ uint64: the widest any field here can mean


def parse_body(data: bytes, content_type: str | None = None, content_encoding: str | None = None) -> dict:
    """Request bytes → the request object: the one place a body is decoded and checked as JSON.

    Everything a JSON reader would accept but nothing downstream should see is refused here with a 400,
    before any tokenizer or serialisation step: a Content-Type that is not JSON (none at all counts as
    JSON) or a charset that is not UTF-8; a Content-Encoding; bytes that are not UTF-8 (Python's ``json``
    would detect and accept UTF-16/32); an empty body, malformed JSON, ``NaN``/``Infinity``; a top level
    that is not an object; and anywhere in the tree (``_check_tree``) lone surrogates, integers beyond
    64 bits, numbers beyond a float and nesting deeper than ``MAX_JSON_DEPTH``.
    """
    media, _, params = (content_type or "application/json").partition(";")
    media = media.strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise _bad(f"the request body must be JSON: send Content-Type: application/json, not {show(media)}",
                   None)
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise _bad(f"the request body must be UTF-8 JSON, not charset {show(value.strip())}", None)
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise _bad(f"the request body must be sent uncompressed, not Content-Encoding "
                   f"{show(content_encoding.strip())}", None)
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # RFC 8259 lets a parser ignore a UTF-8 BOM
    except UnicodeDecodeError as exc:
        raise _bad(f"the request body is not valid JSON: it is not UTF-8 ({exc.reason} at byte {exc.start})",
                   None) from None
    if not text.strip():
        raise _bad("the request body is empty; send a JSON object", None)
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise _bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None) from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers of more than 4300 digits
        raise _bad(f"the request body is not valid JSON: {str(exc)[:200]}", None) from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    _check_tree(body, (), 1)
    return body


def _check_tree(node: dict | list, path: tuple, depth: int) -> None:
    """Refuses, naming where: strings and field names holding a lone UTF-16 surrogate (a ``\\ud800`` escape
    decodes to one; tokenizers and UTF-8 encoders raise on it), integers outside 64 bits, numbers that
    overflowed a float (``1e400`` parses to infinity), containers nested deeper than ``MAX_JSON_DEPTH``."""
    if depth > MAX_JSON_DEPTH:
        raise _bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", field_path(path[:4]))
    if isinstance(node, list) and node and set(map(type, node)) == {int} and \
            _INT_MIN <= min(node) and max(node) <= _INT_MAX:
        return  # token ids: the common large list, checked at C speed
    for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
        if type(key) is str and not _valid_unicode(key):
            where = field_path(path) or "the request body"
            raise _bad(f"a field name in {where} is not valid Unicode: it holds a lone UTF-16 surrogate",
                       field_path(path + (key,)))
        kind = type(value)
        if kind is str:
            if not _valid_unicode(value):
                where = field_path(path + (key,))
                raise _bad(f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                           "escape without its pair)", where)
        elif kind is int:
            if not _INT_MIN <= value <= _INT_MAX:
                where = field_path(path + (key,))
                raise _bad(f"{where} is out of range: integers must fit in 64 bits", where)
        elif kind is float:
            if not math.isfinite(value):
                where = field_path(path + (key,))
                raise _bad(f"{where} is out of range: numbers must be finite (at most ~1.8e308)", where)
        elif kind is dict or kind is list:
            _check_tree(value, path + (key,), depth + 1)


def _valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# -- the ingress's own limits ------------------------------------------------------------------------

UNHEARD_S = 1.0  # how long a request whose body has not started counts against the router's capacity


class _Slots:
    """How many requests are in one phase (sending their body, waiting on the router), against a limit.
    The ingress serves from one event loop and nothing awaits between a check and its update: no lock."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def full(self) -> bool:
        return self.used >= self.limit

    def take(self) -> "_Slot | None":
        return None if self.full() else _Slot(self)


class _Slot:
    """One request's place in a ``_Slots``; ``release`` is idempotent, so every exit path may call it."""

    __slots__ = ("_slots",)

    def __init__(self, slots: _Slots):
        self._slots: _Slots | None = slots
        slots.used += 1

    @property
    def held(self) -> bool:
        return self._slots is not None

    def release(self) -> None:
        if self._slots is not None:
            self._slots.used -= 1
            self._slots = None


def _abandon(gen, slot: _Slot) -> None:
    """A stream response Starlette dropped before its generator ran (the client left at once): its
    ``finally`` never runs, so cancel the router call and free the slot here."""
    if slot.held:
        slot.release()
        gen.cancel()


# -- the request models ------------------------------------------------------------------------------
# Field types and shapes only; ranges, the vocabulary and the context are GenerateRequest.validate's and
# the router's (handle callers share them). Unknown fields are refused naming themselves: a typo must
# not be silently ignored. OpenAI features specserve lacks are accepted only at their "off" value.

def _integral(value):
    """JSON has one number type: 16.0 is 16."""
    return int(value) if type(value) is float and value.is_integer() and abs(value) < 2 ** 63 else value


JsonInt = Annotated[StrictInt, BeforeValidator(_integral)]


def _off(kind):
    return Annotated[kind | None, says("is not supported by this server; leave it unset")]


def _exactly(value: float):
    return Annotated[StrictFloat, Field(ge=value, le=value)]


def _one_prompt(value):
    """OpenAI's batched forms with a single prompt → that prompt; several → refused."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise PydanticCustomError(SENTENCE, "only one prompt per request is supported (n=1, no batched prompts)")
        return value[0]
    return value


def _text_parts(value):
    """Content parts → their text; only text parts are supported."""
    if not isinstance(value, list):
        return value
    if not all(isinstance(p, dict) and p.get("type") == "text" and type(p.get("text")) is str
               for p in value):
        raise PydanticCustomError(PREDICATE, 'must be a string or {"type": "text", "text": ...} parts; only text '
                                             'content is supported')
    return "".join(p["text"] for p in value)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class ChatMessage(_Strict):
    role: Role
    content: Annotated[StrictStr | None, BeforeValidator(_text_parts)] = Field(None, validate_default=True)
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | None, info: ValidationInfo) -> str:
        if value is None:
            if info.data.get("role") != "assistant":  # an assistant turn that only called tools
                raise PydanticCustomError(PREDICATE, "must be a string")
            return ""
        return value


class JsonSchemaFormat(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    schema_: Annotated[dict, Field(alias="schema")] = Field(default_factory=dict)  # {}: any JSON value
    description: StrictStr | None = None
    strict: StrictBool | None = None  # the grammar is enforced either way


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (unconstrained), json_object, or json_schema (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(SENTENCE, 'response_format needs "json_schema" exactly when its type is '
                                                '"json_schema"')
        return self

    def structured_outputs(self) -> dict | None:
        """The handle API's ``structured_outputs`` this format asks for (None: text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class _OpenAIRequest(_Strict):
    model: StrictStr | None = None
    max_tokens: JsonInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: JsonInt | None = None
    seed: JsonInt | None = None
    stop: Annotated[list[StrictStr] | None, BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
                    says("must be a string or a list of strings, got {got}")] = None
    n: Annotated[Annotated[StrictInt, Field(ge=1, le=1)] | None, says("only n=1 is supported, got {got}", SENTENCE)] = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None  # (its messages: deployments.api._SHAPES)
    presence_penalty: _off(_exactly(0)) = None
    frequency_penalty: _off(_exactly(0)) = None
    logit_bias: _off(Annotated[dict, Field(max_length=0)]) = None
    logprobs: Annotated[Literal[False, 0] | None,
                        says("are not supported by this server; leave logprobs unset")] = None
    user: StrictStr | None = None
    ignore_eos: StrictBool | None = None
    return_token_ids: StrictBool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # the extension (vLLM's name); see deployments.api

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError(PREDICATE, "is only allowed when stream is true")
        return value


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[StrictStr | Annotated[list[StrictInt], Field(min_length=1)],
                      says("must be a string or a non-empty list of token ids"), BeforeValidator(_one_prompt)]
    echo: _off(Literal[False]) = None
    best_of: _off(_exactly(1)) = None
    suffix: _off(Literal[""]) = None


class ChatRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: JsonInt | None = None
    top_logprobs: _off(_exactly(0)) = None
    tools: _off(Annotated[list, Field(max_length=0)]) = None
    tool_choice: _off(Literal["none"]) = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees(cls, value, info: ValidationInfo):
        theirs = info.data.get("max_tokens")
        if value is not None and theirs is not None and value != theirs:
            raise PydanticCustomError(SENTENCE, "max_tokens and max_completion_tokens disagree; send one")
        return value


COMPLETION_FIELDS = frozenset(CompletionRequest.model_fields)
CHAT_FIELDS = frozenset(ChatRequest.model_fields)


def normalise(req: CompletionRequest | ChatRequest) -> GenerateRequest:
    """A validated OpenAI request → what the router gets."""
    structured = req.response_format.structured_outputs() if req.response_format is not None else None
    common = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                  stop=req.stop or [], ignore_eos=bool(req.ignore_eos),
                  structured_outputs=structured or req.structured_outputs)
    if isinstance(req, ChatRequest):
        messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
                    for m in req.messages]
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        return GenerateRequest(messages=messages, max_tokens=max_tokens, **common)
    prompt = {"prompt": req.prompt} if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
    return GenerateRequest(max_tokens=req.max_tokens, **prompt, **common)


def _usage(prompt_tokens: int, completion_tokens: int, stats: dict) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens", 0))}}


# Defined last: ``serve.ingress`` pickles the class by value when it is decorated, capturing only the
# module globals that exist at that point, so every helper it calls must be defined above.
@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, cfg: ClusterConfig, router):  # cfg: validated once, by deployments.app.build_app
        # gRPC straight to the router replica rather than a Ray actor task per call: half the CPU a request
        # costs both processes (docs/results.md, per-request CPU). Nothing here needs the call's object ref.
        self.router = router.options(_by_reference=False)
        self.model_name = cfg.http.model_name
        self.max_body = cfg.http.max_body_bytes
        self.body_timeout_s = cfg.http.body_timeout_s
        self.receiving = _Slots(cfg.http.max_pending_bodies)
        # Of those, the ones with no body byte yet (for at most UNHEARD_S): counted with ``generating``.
        self.unheard = _Slots(cfg.http.max_pending_bodies)
        # The router admits this many (it stays the authority: handle callers share it); more calls in
        # flight from here could only come back as 503s, slowly, after queueing behind the rest.
        self.generating = _Slots(cfg.router.max_running + cfg.router.max_queue)
        self.health_timeout_s = cfg.router.health_timeout_s
        key = cfg.http.resolve_api_key()
        self._key = key.encode() if key else None
        self.created = int(time.time())

    # -- endpoints ----------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        self._authorize(request)
        if model != self.model_name:
            raise self._unknown_model(model)
        return self._model_card()

    @app.get("/health")
    async def health(self):
        try:
            state = await self._ask_router("health")
        except ApiError as err:  # router unreachable, dead or stuck
            return JSONResponse({"status": "unhealthy", "reason": err.message}, status_code=503)
        return JSONResponse(state, status_code=503 if state["status"] == "unhealthy" else 200)

    @app.get("/debug/kv")
    async def debug_kv(self, request: Request):
        self._authorize(request)
        return await self._ask_router("kv_usage")

    @app.get("/debug/stats")
    async def debug_stats(self, request: Request):
        self._authorize(request)
        return await self._ask_router("info")

    async def _ask_router(self, method: str) -> dict:
        """A router introspection call, bounded by ``router.health_timeout_s``; 503 when it cannot answer."""
        response = getattr(self.router, method).remote()
        try:
            return await asyncio.wait_for(response, self.health_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            message = f"the router did not answer within {self.health_timeout_s:g} s"
        except Exception as exc:
            cause = _cause(exc)
            if not isinstance(cause, StageUnavailable):
                raise _translate(exc) from None
            message = str(cause)
        raise ApiError(503, message, type="server_error", code="unavailable", headers={"Retry-After": "1"})

    # -- request handling ---------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Compare in constant time whatever was sent; never log or echo the header.
        ok = hmac.compare_digest(token.strip().encode("utf-8", "replace"), self._key)
        if not ok or scheme.lower() != "bearer":
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, request: Request) -> bytes:
        """The body's bytes, within ``http.body_timeout_s``: Serve's proxy forwards a request to this replica
        as soon as its headers arrive and the body follows message by message, so a client that stalls
        mid-body holds an ingress slot until this deadline (408), and at most ``max_pending_bodies`` do."""
        limit = self.max_body
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _bad("invalid Content-Length header", None)
            if int(length) > limit:
                raise self._too_large(int(length))
        slot = self.receiving.take()
        if slot is None:
            raise ApiError(503, f"{self.receiving.used} requests are still sending their bodies (limit "
                           f"{self.receiving.limit}); retry later", type="server_overloaded", code="overloaded",
                           headers={"Retry-After": "1"})
        unheard = _Slot(self.unheard)
        timer = asyncio.get_running_loop().call_later(UNHEARD_S, unheard.release)
        data = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    unheard.release()
                    data += chunk
                    if len(data) > limit:
                        raise self._too_large(len(data))
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                           f"({len(data)} bytes received)", type="timeout_error", code="body_timeout") from None
        except ClientDisconnect:  # nobody reads this answer; it keeps a routine event out of the error log
            raise _bad("the client disconnected before sending the whole body", None) from None
        finally:
            timer.cancel()
            unheard.release()
            slot.release()
        return bytes(data)

    def _too_large(self, n: int) -> ApiError:
        return ApiError(413, f"request body of {n} bytes exceeds the limit of {self.max_body} bytes",
                        code="request_too_large")

    def _unknown_model(self, model: str) -> ApiError:
        return ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                        param="model", code="model_not_found")

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specserve"}

    def _overloaded(self) -> ApiError:
        return _translate(Overloaded(f"{self.generating.used} requests in flight (limit "
                                     f"{self.generating.limit}); retry later"))

    async def _generate(self, request: Request, *, chat: bool):
        try:
            self._authorize(request)
            # Refused before its body is read when the router is full, counting the requests whose body
            # has not started to arrive: in a burst each of those is about to take a place, and reading a
            # body costs a round trip to Serve's proxy. A stalled upload stops counting at its first body
            # byte, or after UNHEARD_S, so slow clients cannot hold places they are not using.
            if self.generating.used + self.unheard.used >= self.generating.limit:
                raise self._overloaded()
            data = await self._read_body(request)
        except ApiError as err:  # the rest of the body may never come: do not wait for it on this connection
            err.headers.setdefault("Connection", "close")
            raise
        body = parse_body(data, request.headers.get("content-type"), request.headers.get("content-encoding"))
        req, opts = self._parse(body, chat)
        slot = self.generating.take()
        if slot is None:
            raise self._overloaded()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if opts["stream"]:
            return await self._stream(req, opts, rid, chat, slot)
        response = self.router.generate.remote(req)
        try:
            resp: GenerateResponse = await response
        except asyncio.CancelledError:  # the client went away: free the request's caches
            response.cancel()
            raise
        except Exception as exc:
            raise _translate(exc, opts["renames"]) from None
        finally:
            slot.release()
        # Rendered here: a dict returned would first be walked by FastAPI's jsonable_encoder, for nothing.
        return JSONResponse(self._full_body(resp, opts, rid, chat))

    def _parse(self, body: dict, chat: bool) -> tuple[GenerateRequest, dict]:
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as err:
            raise _translate(invalid(err)) from None
        if req.model is not None and req.model != self.model_name:
            raise self._unknown_model(req.model)
        renames = {"max_tokens": "max_completion_tokens"} if chat and req.max_completion_tokens is not None else {}
        if req.response_format is not None and req.response_format.type != "text":
            if req.structured_outputs is not None:
                raise _bad("send response_format or structured_outputs, not both", "structured_outputs")
            renames["structured_outputs"] = "response_format"  # the router's name for what came from here
        opts = {"stream": bool(req.stream), "renames": renames, "token_ids": bool(req.return_token_ids),
                "include_usage": bool(req.stream_options and req.stream_options.include_usage)}
        return normalise(req), opts

    # -- responses ----------------------------------------------------------------------------------

    def _full_body(self, resp: GenerateResponse, opts: dict, rid: str, chat: bool) -> dict:
        text = resp.text or ""
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": resp.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": resp.finish_reason}
        if opts["token_ids"]:
            choice["token_ids"] = list(resp.token_ids)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": _usage(resp.prompt_tokens, resp.completion_tokens, resp.stats), "speculation": resp.stats}

    async def _stream(self, req: GenerateRequest, opts: dict, rid: str, chat: bool, slot: _Slot):
        gen = self.router.options(stream=True).generate_stream.remote(req)
        try:
            first = await gen.__anext__()  # admission and validation errors surface here, before any byte
        except StopAsyncIteration:
            first = None
        except asyncio.CancelledError:
            gen.cancel()
            slot.release()
            raise
        except Exception as exc:
            gen.cancel()
            slot.release()
            raise _translate(exc, opts["renames"]) from None
        events = self._events(gen, first, opts, rid, chat, slot)
        weakref.finalize(events, _abandon, gen, slot).atexit = False
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, gen, first: GenerateChunk | None, opts: dict, rid: str, chat: bool,
                      slot: _Slot | None = None):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_key = {"usage": None} if opts["include_usage"] else {}
        done = False

        def frame(choice: dict | None, **extra) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                       "choices": [choice] if choice is not None else [], **usage_key, **extra}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield frame({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            chunk = first
            last: GenerateChunk | None = None
            while chunk is not None:
                if chat:
                    delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
                    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": chunk.finish_reason}
                else:
                    choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": chunk.finish_reason}
                if opts["token_ids"]:
                    choice["token_ids"] = list(chunk.token_ids)
                extra = {"speculation": chunk.stats} if chunk.finish_reason is not None else {}
                yield frame(choice, **extra)
                if chunk.finish_reason is not None:
                    last = chunk
                    break
                chunk = await gen.__anext__()
            done = True
            if last is None:
                raise GenerationFailed("the stream ended without a final chunk")
            if opts["include_usage"]:
                usage_key = {}
                yield frame(None, usage=_usage(last.prompt_tokens, last.completion_tokens, last.stats),
                            speculation=last.stats)
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            done = True
            err = _translate(exc if not isinstance(exc, StopAsyncIteration)
                             else GenerationFailed("the stream ended without a final chunk"), opts["renames"])
            yield f"data: {json.dumps(err.body)}\n\n"
        finally:
            if not done:  # the client went away mid-stream: cancel the router call (frees the KV caches)
                gen.cancel()
            if slot is not None:
                slot.release()
