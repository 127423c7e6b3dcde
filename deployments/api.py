"""The typed Serve-handle API: what internal services send to the router and get back.

    handle = serve.get_deployment_handle("Router", app_name="specserve")
    resp: GenerateResponse = await handle.generate.remote(GenerateRequest(prompt="..."))
    chat = GenerateRequest(messages=[{"role": "user", "content": "..."}])  # the target's chat template
    async for chunk in handle.options(stream=True).generate_stream.remote(GenerateRequest(...)):
        ...  # GenerateChunk

Validation lives here (``GenerateRequest.validate``) so the HTTP ingress and handle callers get the same
checks and the same messages; a bad request raises ``InvalidRequest`` naming the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
CHAT_ROLES = ("system", "developer", "user", "assistant")


@dataclass
class GenerateRequest:
    prompt: str | None = None  # text, tokenized by the router with the target's tokenizer
    prompt_token_ids: list[int] | None = None  # or token ids directly
    messages: list[dict] | None = None  # or a chat: [{"role", "content": str}], rendered by the chat template
    max_tokens: int | None = None  # None: the config's default
    temperature: float | None = None  # None: the config's default; 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, *, vocab_size: int, has_tokenizer: bool) -> None:
        given = [self.prompt is not None, self.prompt_token_ids is not None, self.messages is not None]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompt_token_ids and messages",
                                 "messages" if self.messages is not None else "prompt")
        if self.messages is not None:
            _check_messages(self.messages, has_tokenizer)
        elif self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise InvalidRequest("prompt must be a string", "prompt")
            if not has_tokenizer:
                raise InvalidRequest("this deployment has no tokenizer: send prompt_token_ids", "prompt")
            if not self.prompt:
                raise InvalidRequest("prompt must not be empty", "prompt")
        else:
            ids = self.prompt_token_ids
            if not isinstance(ids, list) or not ids:
                raise InvalidRequest("prompt_token_ids must be a non-empty list of integers", "prompt_token_ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
                raise InvalidRequest(f"prompt_token_ids must be integers in [0, {vocab_size})", "prompt_token_ids")
        _check_int(self.max_tokens, "max_tokens", 1, 1 << 20)
        _check_number(self.temperature, "temperature", 0.0, 2.0)
        if self.top_p is not None:
            _check_number(self.top_p, "top_p", 0.0, 1.0)
            if self.top_p <= 0:
                raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        _check_int(self.top_k, "top_k", 0, 1 << 20)
        _check_int(self.seed, "seed", -(1 << 63), (1 << 63) - 1)
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop must be a list of at most {MAX_STOP_STRINGS} strings", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH:
                raise InvalidRequest(f"each stop string must be a non-empty string of at most {MAX_STOP_LENGTH} "
                                     "characters", "stop")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos must be a boolean", "ignore_eos")


def _check_messages(messages, has_tokenizer: bool) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages per request", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                 f"{where}.role")
        if not isinstance(m.get("content"), str):
            raise InvalidRequest(f"{where}.content must be a string", f"{where}.content")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise InvalidRequest(f"{where} has unsupported field {unknown[0]!r}", f"{where}.{unknown[0]}")
        if "name" in m and not isinstance(m["name"], str):
            raise InvalidRequest(f"{where}.name must be a string", f"{where}.name")
    if not has_tokenizer:
        raise InvalidRequest("this deployment has no tokenizer, so no chat template: send prompt_token_ids",
                             "messages")


def _check_int(value, name: str, lo: int, hi: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)


def _check_number(value, name: str, lo: float, hi: float) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be a number in [{lo}, {hi}], got {value!r}", name)


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
