"""The typed Serve-handle API: what internal services send to the router and get back.

    handle = serve.get_deployment_handle("Router", app_name="specserve")
    resp: GenerateResponse = await handle.generate.remote(GenerateRequest(prompt="..."))
    chat = GenerateRequest(messages=[{"role": "user", "content": "..."}])  # the target's chat template
    async for chunk in handle.options(stream=True).generate_stream.remote(GenerateRequest(...)):
        ...  # GenerateChunk

Validation lives here (``GenerateRequest.validate``: pydantic checks the field annotations) so the HTTP
ingress and handle callers get the same checks and the same messages; a bad request raises
``InvalidRequest`` naming the parameter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Literal

from typing_extensions import NotRequired, TypedDict  # pydantic needs this TypedDict before Python 3.12

from pydantic import (ConfigDict, Field, Strict, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter,
                      ValidationError, WrapValidator, with_config)
from pydantic_core import PydanticCustomError


class InvalidRequest(ValueError):
    """A request the caller must fix (HTTP 400). ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code  # e.g. "context_length_exceeded" (OpenAI's code for a prompt that does not fit)


class Overloaded(RuntimeError):
    """Admission control refused the request (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StageUnavailable(RuntimeError):
    """A stage the call must ask (verifier, draft pool) has no live replica right now (HTTP 503)."""


class GenerationFailed(RuntimeError):
    """The request was admitted but could not be completed (timeout, verifier lost, …)."""


class RequestTimedOut(GenerationFailed):
    """The request ran past ``router.request_timeout_s`` (HTTP 504)."""


MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_MESSAGES = 1024

# A field's own complaint replaces pydantic's wording: ``PREDICATE`` follows the field's path ("top_k must
# be ..."), ``SENTENCE`` stands alone ("only n=1 is supported, got 2"); "{got}" in it shows the value.
PREDICATE, SENTENCE = "predicate", "sentence"


def says(message: str, kind: str = PREDICATE) -> WrapValidator:
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(kind, message, {"got": show(value)}) from None
    return WrapValidator(check)


ROLES = ("system", "developer", "user", "assistant")
Role = Annotated[Literal[ROLES], says(f"must be one of {', '.join(ROLES)}, got {{got}}")]


@with_config(ConfigDict(extra="forbid", strict=True))
class Message(TypedDict):
    """A chat message as the target's chat template gets it."""

    role: Role
    content: str
    name: NotRequired[str]


MAX_CHOICES = 1024


@with_config(ConfigDict(extra="forbid", strict=True))
class StructuredOutputs(TypedDict, total=False):
    """What the output must match (structured outputs, issue 31; vLLM's names): exactly one key. ``json``: a
    JSON schema (an object, or a string holding one); ``json_object``: true for any JSON object; ``regex``;
    ``choice``: one of these strings; ``grammar``: a Lark grammar as llguidance reads it."""

    json: dict | StrictStr
    json_object: Literal[True]
    regex: StrictStr
    choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
    grammar: StrictStr


def _range(kind, lo, hi):
    what = "an integer" if kind is StrictInt else "a number"
    return Annotated[kind, Field(ge=lo, le=hi), says(f"must be {what} in [{lo}, {hi}], got {{got}}")] | None


@dataclass
class GenerateRequest:
    prompt: Annotated[StrictStr, Field(min_length=1)] | None = None  # text, tokenized with the target's tokenizer
    prompt_token_ids: Annotated[list[StrictInt], Strict(), Field(min_length=1)] | None = None  # or token ids
    messages: Annotated[list[Message], Strict(), Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    max_tokens: _range(StrictInt, 1, 1 << 20) = None  # None: the config's default
    temperature: _range(StrictFloat, 0.0, 2.0) = None  # None: the config's default; 0 = greedy
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0), says("must be in (0, 1], got {got}")] | None = None
    top_k: _range(StrictInt, 0, 1 << 20) = None
    seed: _range(StrictInt, -(1 << 63), (1 << 63) - 1) = None
    stop: Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_LENGTH)]], Strict(),
                    Field(max_length=MAX_STOP_STRINGS),
                    says(f"must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                         f"{MAX_STOP_LENGTH} characters")] = field(default_factory=list)
    ignore_eos: StrictBool = False
    structured_outputs: StructuredOutputs | None = None

    def grammar_spec(self) -> tuple[str, object] | None:
        """(kind, value) of ``structured_outputs`` as ``engine.grammar.GrammarSpec`` takes them; call after
        ``validate``."""
        if self.structured_outputs is None:
            return None
        (key, value), = self.structured_outputs.items()
        if key == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidRequest(f"structured_outputs.json is not valid JSON: {exc}",
                                         "structured_outputs") from None
            return "json_schema", value
        return key, None if key == "json_object" else value

    def validate(self, *, vocab_size: int, has_tokenizer: bool) -> None:
        """The field annotations (types, ranges, message shapes), then what depends on the deployment."""
        given = [self.prompt is not None, self.prompt_token_ids is not None, self.messages is not None]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompt_token_ids and messages",
                                 "messages" if self.messages is not None else "prompt")
        try:
            _FIELDS.validate_python(vars(self))
        except ValidationError as err:
            raise invalid(err) from None
        if self.prompt_token_ids is not None and not 0 <= min(self.prompt_token_ids) <= max(
                self.prompt_token_ids) < vocab_size:
            raise InvalidRequest(f"prompt_token_ids must be integers in [0, {vocab_size})", "prompt_token_ids")
        if not has_tokenizer and self.prompt is not None:
            raise InvalidRequest("this deployment has no tokenizer: send prompt_token_ids", "prompt")
        if not has_tokenizer and self.messages is not None:
            raise InvalidRequest("this deployment has no tokenizer, so no chat template: send prompt_token_ids",
                                 "messages")
        if self.structured_outputs is not None and len(self.structured_outputs) != 1:
            raise InvalidRequest("structured_outputs must have exactly one of json, json_object, regex, choice, "
                                 f"grammar; got {sorted(self.structured_outputs) or 'none'}", "structured_outputs")


_FIELDS = TypeAdapter(GenerateRequest)


_TYPES = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
          "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean",
          "bool_parsing": "a boolean", "string_type": "a string"}
# A container of the wrong shape, by its path with list indices as [].
_SHAPES = {"messages": "must be a non-empty list of {role, content} objects",
           "messages[]": "must be an object with role and content", "stream_options": "must be an object"}


def invalid(err: ValidationError) -> InvalidRequest:
    """Pydantic's first complaint → ``InvalidRequest`` whose ``param`` is what the caller can act on: a
    top-level field, a stream option, or one message's field (``messages[0].role``); the message gives
    the full path."""
    first = err.errors(include_url=False)[0]
    loc, kind, value = first["loc"], first["type"], first.get("input")
    where = field_path(loc)
    param = field_path(loc[:{"messages": 3, "stream_options": 2}.get(loc[0], 1)] if loc else ())
    shape = _SHAPES.get(field_path(["[]" if isinstance(p, int) else p for p in loc]).replace(".[]", "[]"))
    if kind == "extra_forbidden":
        if loc[0] == "stream_options":
            return InvalidRequest(f"unrecognized stream option: {loc[-1]}", param)
        if loc[0] == "messages":
            return InvalidRequest(f"{field_path(loc[:-1])} has unsupported field {loc[-1]!r}", param)
        return InvalidRequest(f"unrecognized request argument supplied: {where}", param)
    if kind == "missing" or (value is None and loc in (("prompt",), ("messages",))):
        return InvalidRequest(f"{where} is required", param)
    if kind == SENTENCE:
        return InvalidRequest(first["msg"], param)
    if kind == PREDICATE:
        return InvalidRequest(f"{where} {first['msg']}", param)
    if shape is not None and not kind.startswith(("int", "float", "bool", "string")):
        return InvalidRequest(f"{where} {shape}", param)
    if kind in _TYPES:  # a string field's message never quoted the value, a boolean's showed it as Python does
        got = "" if kind == "string_type" else f", got {_clip(repr(value)) if kind.startswith('bool') else show(value)}"
        return InvalidRequest(f"{where} must be {_TYPES[kind]}{got}", param)
    msg = first["msg"]
    return InvalidRequest(f"{where}: {msg[:1].lower()}{msg[1:]} (got {show(value)})", param)


def field_path(loc) -> str | None:
    """("messages", 0, "content") → "messages[0].content" (a name's surrogates shown as "?")."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part.encode("utf-8", "replace").decode()
    return out or None


def show(value) -> str:
    """A value as an error message quotes it: JSON for a scalar, else its type; at most 40 characters."""
    return _clip(json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__)


def _clip(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class GenerateResponse:
    text: str | None  # None when the deployment has no tokenizer
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: dict  # acceptance_rate, acceptance_length, steps, … (engine.stats.SpecStats.as_dict)


@dataclass
class GenerateChunk:
    text: str  # new text since the previous chunk ("" without a tokenizer)
    token_ids: list[int]  # new tokens since the previous chunk
    finish_reason: str | None = None  # set on the last chunk only
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: dict | None = None  # on the last chunk only
