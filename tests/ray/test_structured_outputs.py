"""Structured outputs over real HTTP (issue 31): the shared tiny-pair app (remote stages: the verify frames
carry the grammar masks; local stages, where the draft masks its q too, are tested in process by
tests/unit/test_structured_*.py), asked through the official ``openai`` client with ``response_format``
(json_schema, json_object), ``client.beta.chat.completions.parse`` with a pydantic model, and the
``structured_outputs`` extension (regex, choice), streaming and not.
Every finished output is validated (``jsonschema``, the regex, the choice list); every bad grammar is a 400
naming the field it came from, while a stream in flight keeps going."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.ray.openai_app import MAX_GRAMMAR_BYTES, MODEL, openai_client

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

MAX_NEW = 200  # enough for every answer here to finish; the app's default is 32
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "languages": {"type": "array", "maxItems": 3,
                                       "items": {"enum": ["Python", "Rust", "C"]}}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["Paris", "London", "Rome"]
ASK = [{"role": "user", "content": "Please convert the following record to JSON: name Ada, age 36"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=12)


def person_format(schema=PERSON) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_chat_and_completion_outputs_are_valid(client):
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=person_format(),
                                           temperature=temperature, seed=7, max_tokens=MAX_NEW)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        spec = r.model_extra["speculation"]
        assert spec["forced"] > 0 and spec["emitted"] == r.usage.completion_tokens
    r = client.completions.create(model=MODEL, prompt="Record:", max_tokens=MAX_NEW,
                                  extra_body={"response_format": person_format()})  # the client's own field is chat's
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=MAX_NEW)
    assert r.choices[0].finish_reason in ("stop", "length")  # an open object may outrun max_tokens
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_streamed_json_schema_is_the_same_valid_text(client):
    whole = client.chat.completions.create(model=MODEL, messages=ASK, response_format=person_format(),
                                           max_tokens=MAX_NEW)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, response_format=person_format(),
                                                 max_tokens=MAX_NEW, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_with_a_pydantic_model(client):
    for temperature in (0.0, 0.8):
        r = client.beta.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,
                                               temperature=temperature, max_tokens=MAX_NEW)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Person), r
        jsonschema.validate(json.loads(r.choices[0].message.content), Person.model_json_schema())


def test_regex_and_choice_extension(client):
    for temperature in (0.0, 1.0):
        r = client.completions.create(model=MODEL, prompt="Today is", max_tokens=40, temperature=temperature,
                                      extra_body={"structured_outputs": {"regex": DATE}})
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(DATE, r.choices[0].text), r
        stream = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=temperature, stream=True,
                                                messages=[{"role": "user", "content": "Capital of France?"}],
                                                extra_body={"structured_outputs": {"choice": CHOICES}})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text in CHOICES and chunks[-1].choices[0].finish_reason == "stop"


BAD = [  # (what the request sends, the parameter the 400 names, words in the message)
    ({"response_format": person_format({"type": "nonsense"})}, "response_format", "invalid JSON schema"),
    ({"response_format": person_format({"type": "array", "uniqueItems": True})}, "response_format", "Unimplemented"),
    ({"response_format": person_format({"type": "object", "properties": {
        f"field_number_{i}": {"type": "string", "description": "x" * 40} for i in range(400)}})},
     "response_format", f"the limit is {MAX_GRAMMAR_BYTES}"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
]


def test_bad_grammars_are_400s_while_a_stream_keeps_going(app):
    async def run():
        aclient = openai_client(app, asynchronous=True)
        stream = await aclient.chat.completions.create(model=MODEL, messages=ASK, response_format=person_format(),
                                                       max_tokens=MAX_NEW, stream=True)
        first = await stream.__anext__()
        async with httpx.AsyncClient(timeout=30) as http:
            answers = await asyncio.gather(*(http.post(app.v1 + "/chat/completions",
                                                       json={"model": MODEL, "messages": ASK, **body})
                                             for body, _, _ in BAD))
        rest = [c async for c in stream]
        return first, answers, rest

    first, answers, rest = asyncio.run(run())
    for (body, param, words), answer in zip(BAD, answers):
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (400, param), (body, error)
        assert words in error["message"], error
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    assert rest[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_no_5xx_over_generated_schemas(client):
    """A small fuzz over HTTP (the 500-schema fuzz of the grammar layer is tests/unit/test_structured_fuzz.py):
    every answer is a 200 with a valid object or a 400."""
    from tests.unit.test_structured_fuzz import random_schema

    import random

    rng = random.Random(3)
    for _ in range(12):
        schema = random_schema(rng)
        try:
            r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=person_format(schema),
                                               max_tokens=60)
        except openai.BadRequestError as err:
            assert err.body["param"] == "response_format"
            continue
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
