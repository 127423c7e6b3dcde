"""The ingress's OpenAI request models and their normaliser, without a cluster: each mistake is a 400
naming the parameter the caller can fix, and a valid request becomes the ``GenerateRequest`` the router
gets. (Ranges, the vocabulary and the context are the router's: tests/ray/test_openai_errors.py.)"""

from __future__ import annotations

import types

import pytest

from deployments.api import GenerateRequest, InvalidRequest
from deployments.ingress import CHAT_FIELDS, COMPLETION_FIELDS, ApiError, OpenAIIngress

MODEL = "served"
USER = [{"role": "user", "content": "hi"}]
_parse = OpenAIIngress.func_or_class._parse
_ingress = types.SimpleNamespace(model_name=MODEL, _unknown_model=OpenAIIngress.func_or_class._unknown_model)
_ingress._unknown_model = lambda model: OpenAIIngress.func_or_class._unknown_model(_ingress, model)


def parse(body: dict, chat: bool = False) -> tuple[GenerateRequest, dict]:
    return _parse(_ingress, body, chat)


def refused(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, chat)
    return info.value


def c(**kw) -> dict:
    return {"model": MODEL, "prompt": "Once", **kw}


def h(**kw) -> dict:
    return {"model": MODEL, "messages": USER, **kw}


def test_completion_normalises_to_the_router_request():
    req, opts = parse(c(max_tokens=16.0, temperature=1, top_p=0.5, top_k=4, seed=-3, stop="\n", ignore_eos=True,
                        stream=True, stream_options={"include_usage": True}, return_token_ids=True, n=1, user="u",
                        presence_penalty=0.0, logprobs=0, echo=False, best_of=1, suffix="", logit_bias={}))
    assert req == GenerateRequest(prompt="Once", max_tokens=16, temperature=1.0, top_p=0.5, top_k=4, seed=-3,
                                  stop=["\n"], ignore_eos=True)
    assert type(req.max_tokens) is int and type(req.temperature) is float
    assert opts == {"stream": True, "include_usage": True, "renames": {}, "token_ids": True}
    for prompt, ids in (([5, 6], [5, 6]), ([[7, 8]], [7, 8])):
        req, opts = parse(c(prompt=prompt))
        assert (req.prompt, req.prompt_token_ids) == (None, ids)
    assert parse(c(prompt=["one"]))[0].prompt == "one"
    assert opts == {"stream": False, "include_usage": False, "renames": {}, "token_ids": False}
    assert parse({"prompt": "x", "stream": None, "stop": None})[0] == GenerateRequest(prompt="x")


def test_chat_normalises_messages():
    messages = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "hi", "name": "ada"}, {"role": "assistant", "content": None},
                {"role": "developer", "content": "x", "name": None}]
    req, opts = parse(h(messages=messages, max_completion_tokens=5, tools=[], tool_choice="none",
                        response_format={"type": "text"}, parallel_tool_calls=False, logprobs=False), chat=True)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ada"},
                            {"role": "assistant", "content": ""}, {"role": "developer", "content": "x"}]
    assert (req.max_tokens, req.prompt, opts["renames"]) == (5, None, {"max_tokens": "max_completion_tokens"})
    assert parse(h(max_tokens=5, max_completion_tokens=5), chat=True)[0].max_tokens == 5


@pytest.mark.parametrize("body, chat, param, words", [
    (c(max_tokens="ten"), False, "max_tokens", "integer"),
    (c(max_tokens=2.5), False, "max_tokens", "integer"),
    (c(max_tokens=True), False, "max_tokens", "integer"),
    (c(temperature="hot"), False, "temperature", "number"),
    (c(temperature=False), False, "temperature", "number"),
    (c(top_k=2.5), False, "top_k", "integer"),
    (c(seed="x"), False, "seed", "integer"),
    (c(model=123), False, "model", "string"),
    ({"model": MODEL}, False, "prompt", "required"),
    (c(prompt=None), False, "prompt", "prompt is required"),
    (c(prompt=42), False, "prompt", "string or a non-empty list of token ids"),
    (c(prompt=[]), False, "prompt", "non-empty"),
    (c(prompt=[1, True]), False, "prompt", "token ids"),
    (c(prompt=["a", "b"]), False, "prompt", "only one prompt"),
    (c(n=2), False, "n", "n=1"),
    (c(n=1.0), False, "n", "n=1"),
    (c(stop=5), False, "stop", "list of strings"),
    (c(stop=[1, 2]), False, "stop", "list of strings"),
    (c(stream="yes"), False, "stream", "boolean"),
    (c(stream_options={"include_usage": True}), False, "stream_options", "stream is true"),
    (c(stream=True, stream_options={"foo": 1}), False, "stream_options.foo", "unrecognized"),
    (c(stream=True, stream_options={"include_usage": 1}), False, "stream_options.include_usage", "boolean"),
    (c(stream=True, stream_options=[]), False, "stream_options", "stream_options must be an object"),
    (c(foo=1), False, "foo", "unrecognized request argument supplied: foo"),
    (c(logprobs=5), False, "logprobs", "not supported"),
    (c(echo=True), False, "echo", "not supported"),
    (c(presence_penalty=0.5), False, "presence_penalty", "not supported"),
    (c(frequency_penalty=True), False, "frequency_penalty", "not supported"),
    (c(best_of=3), False, "best_of", "not supported"),
    (c(suffix="x"), False, "suffix", "not supported"),
    (c(logit_bias={"5": 10}), False, "logit_bias", "not supported"),
    (c(ignore_eos="no"), False, "ignore_eos", "boolean"),
    (c(user=5), False, "user", "string"),
    (c(return_token_ids=1), False, "return_token_ids", "boolean"),
    (c(max_completion_tokens=4), False, "max_completion_tokens", "unrecognized"),
    ({"model": MODEL}, True, "messages", "required"),
    (h(messages=[]), True, "messages", "non-empty list of {role, content} objects"),
    (h(messages="hi"), True, "messages", "list"),
    (h(messages=["hi"]), True, "messages[0]", "messages[0] must be an object with role and content"),
    (h(messages=[{"role": "wizard", "content": "x"}]), True, "messages[0].role",
     'must be one of system, developer, user, assistant, got "wizard"'),
    (h(messages=[{"role": "user"}]), True, "messages[0].content", "messages[0].content must be a string"),
    (h(messages=[{"role": "user", "content": None}]), True, "messages[0].content", "must be a string"),
    (h(messages=[{"role": "user", "content": 5}]), True, "messages[0].content", "string"),
    (h(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), True,
     "messages[0].content", "only text content"),
    (h(messages=[USER[0], {"role": "user", "content": "x", "tool_calls": []}]), True, "messages[1].tool_calls",
     "messages[1] has unsupported field 'tool_calls'"),
    (h(messages=[{"role": "user", "content": "x", "name": 3}]), True, "messages[0].name", "string"),
    (h(max_tokens=4, max_completion_tokens=5), True, "max_completion_tokens", "disagree"),
    (h(max_completion_tokens="5"), True, "max_completion_tokens", "integer"),
    (h(n=3), True, "n", "n=1"),
    (h(prompt="x"), True, "prompt", "unrecognized"),
    (h(tools=[{"type": "function", "function": {"name": "f"}}]), True, "tools", "not supported"),
    (h(tool_choice="auto"), True, "tool_choice", "not supported"),
    (h(top_logprobs=2), True, "top_logprobs", "not supported"),
    (h(parallel_tool_calls="no"), True, "parallel_tool_calls", "boolean"),
    (h(response_format={"type": "json_schema"}), True, "response_format", '"json_schema" exactly when'),
    (h(response_format={"type": "xml"}), True, "response_format", "response_format.type: input should be"),
    (h(response_format={"type": "text", "x": 1}), True, "response_format", "unrecognized"),
    (c(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), False, "response_format",
     "response_format.json_schema.name is required"),
    (c(structured_outputs={"regex": 1}), False, "structured_outputs", "structured_outputs.regex must be a string"),
    (c(structured_outputs={"choice": "yes"}), False, "structured_outputs", "list"),
    (h(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), True, "structured_outputs",
     "not both"),
    (h(echo=False), True, "echo", "unrecognized"),
])
def test_mistakes_name_the_parameter(body, chat, param, words):
    err = refused(body, chat)
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, None), err.body
    assert words in err.message, err.body


def test_structured_outputs_normalise_to_the_handle_field():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    for chat, body in ((True, h(response_format=fmt)), (False, c(response_format=fmt))):
        req, opts = parse(body, chat)
        assert req.structured_outputs == {"json": schema} and opts["renames"]["structured_outputs"] == "response_format"
    assert parse(h(response_format={"type": "json_object"}), True)[0].structured_outputs == {"json_object": True}
    assert parse(h(response_format={"type": "text"}), True)[0].structured_outputs is None
    req, opts = parse(c(structured_outputs={"choice": ["yes", "no"]}))
    assert req.structured_outputs == {"choice": ["yes", "no"]} and "structured_outputs" not in opts["renames"]


def test_unknown_model_is_404():
    for chat, body in ((False, c(model="gpt-4")), (True, h(model="gpt-4"))):
        err = refused(body, chat)
        assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert parse(c(model=None))[0].prompt == "Once"  # model is optional


def test_field_tables_are_the_models():
    assert {"prompt", "echo", "suffix", "best_of"} <= COMPLETION_FIELDS and "messages" not in COMPLETION_FIELDS
    assert {"messages", "max_completion_tokens", "tools"} <= CHAT_FIELDS and "prompt" not in CHAT_FIELDS
    assert COMPLETION_FIELDS & CHAT_FIELDS >= {"model", "max_tokens", "stop", "stream", "ignore_eos"}


@pytest.mark.parametrize("req, has_tokenizer, param", [
    (GenerateRequest(), True, "prompt"),
    (GenerateRequest(prompt="x", prompt_token_ids=[1]), True, "prompt"),
    (GenerateRequest(prompt_token_ids=[1, 2], max_tokens=0), True, "max_tokens"),
    (GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2.0), True, "max_tokens"),
    (GenerateRequest(prompt_token_ids=[1, 256]), True, "prompt_token_ids"),
    (GenerateRequest(prompt_token_ids=[1, True]), True, "prompt_token_ids"),
    (GenerateRequest(prompt_token_ids=(1, 2)), True, "prompt_token_ids"),
    (GenerateRequest(prompt_token_ids=[1, 2], temperature=-1.0), True, "temperature"),
    (GenerateRequest(prompt_token_ids=[1], top_p=0), True, "top_p"),
    (GenerateRequest(prompt_token_ids=[1], seed=1 << 63), True, "seed"),
    (GenerateRequest(prompt_token_ids=[1], stop=["a"] * 9), True, "stop"),
    (GenerateRequest(prompt_token_ids=[1], stop=["x" * 257]), True, "stop"),
    (GenerateRequest(prompt_token_ids=[1], ignore_eos=1), True, "ignore_eos"),
    (GenerateRequest(prompt=""), True, "prompt"),
    (GenerateRequest(prompt="text needs a tokenizer"), False, "prompt"),
    (GenerateRequest(messages=USER), False, "messages"),
    (GenerateRequest(messages=[]), True, "messages"),
    (GenerateRequest(messages=USER * 1025), True, "messages"),
    (GenerateRequest(messages=[{"role": "wizard", "content": "x"}]), True, "messages[0].role"),
    (GenerateRequest(messages=[{"role": "user", "content": "x", "name": None}]), True, "messages[0].name"),
    (GenerateRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}]), True,
     "messages[0].content"),
    (GenerateRequest(prompt="x", structured_outputs={"regex": "a", "choice": ["b"]}), True, "structured_outputs"),
    (GenerateRequest(prompt="x", structured_outputs={"json_object": False}), True, "structured_outputs"),
    (GenerateRequest(prompt="x", structured_outputs={"xml": "<a/>"}), True, "structured_outputs"),
])
def test_handle_requests_are_checked_by_the_same_types(req, has_tokenizer, param):
    """``GenerateRequest.validate``, which the router runs for every caller (ingress or handle)."""
    with pytest.raises(InvalidRequest) as info:
        req.validate(vocab_size=256, has_tokenizer=has_tokenizer)
    assert info.value.param == param and str(info.value), info.value


def test_valid_handle_requests_pass():
    for req in (GenerateRequest(prompt_token_ids=[0, 255], max_tokens=1, temperature=2, top_p=1.0, top_k=0,
                                seed=-(1 << 63), stop=["a"] * 8, ignore_eos=True),
                GenerateRequest(messages=[{"role": "developer", "content": "", "name": "x"}] * 1024),
                GenerateRequest(prompt="x")):
        req.validate(vocab_size=256, has_tokenizer=True)
