"""The HTTP front door under hostile and heavy traffic (loopback only, bounded in time), against one app
with the default router capacity (max_running 32 + max_queue 128 = 160). (Overload — 640 simultaneous
requests — is tested on the launcher's own path, in test_sockets.py.)

- slow clients: 300 connections that send their headers and half their body, then stall, do not starve
  anyone: well-behaved requests complete with the reference output and ``/health`` answers in < 1 s
  while they are held; each stalled one gets 408 at ``http.body_timeout_s``; past
  ``http.max_pending_bodies`` a new one is refused with 503 at once;
- fuzz: 1,200 bodies from a fixed seed covering lone surrogates (prompt, content, field names, stop
  strings, model), deep nesting, huge numbers, NaN/Infinity, non-UTF-8 and UTF-16 bodies, wrong
  Content-Type/Encoding, empty bodies, non-object tops, truncations, byte flips and mistyped fields:
  0 × 5xx, every 4xx in OpenAI's shape, each hostile class a 400.

Load comes from ``tools.loadgen`` (one asyncio connection per request: httpx's pool would cost
seconds of client CPU at 640 connections, measured as server latency).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time

import httpx
import pytest

from deployments.ingress import CHAT_FIELDS, COMPLETION_FIELDS, ApiError, parse_body
from tests.fixtures_tokenizer import prompts, reference
from tests.ray.openai_app import BODY_TIMEOUT_S, MAIN_MAX_QUEUE, MAIN_MAX_RUNNING, MAX_PENDING_BODIES, MODEL, App, \
    main_app
from tools.loadgen import Result, Target, request

pytestmark = pytest.mark.ray

STALLED = 300
FUZZ_SEED, FUZZ_BODIES = 20240611, 1200


@pytest.fixture(scope="module")
def app(ray_cluster):
    return main_app()


def _completion(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}


def _check_reference(res: Result, prompt: str, max_tokens: int) -> None:
    ids, text, finish = reference(prompt, max_tokens)
    assert (res.token_ids, res.text, res.finish_reason) == (list(ids), text, finish), (prompt, res.body[:300])


def _openai_error(res: Result) -> dict:
    assert res.headers.get("content-type", "").startswith("application/json"), (res.status, res.body[:200])
    err = res.error_body
    assert err is not None and set(err) == {"message", "type", "param", "code"} and \
        isinstance(err["message"], str) and err["message"], (res.status, res.body[:300])
    return err


# -- slow clients ------------------------------------------------------------------------------------


class _Stalled:
    """A connection that sent a request's headers and half its body, then nothing; ``answer`` reads
    whatever the server sends back before it closes the connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.writer = writer
        self.answer = asyncio.create_task(self._read(reader))

    @classmethod
    async def open(cls, target: Target, body: bytes) -> "_Stalled":
        reader, writer = await asyncio.open_connection(target.host, target.port)
        writer.write(f"POST {target.prefix}/v1/completions HTTP/1.1\r\nHost: {target.host}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body[: len(body) // 2])
        await writer.drain()
        return cls(reader, writer)

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> Result:
        data = await reader.read()  # the server closes after answering (408 and 503 say Connection: close)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        return Result(status=int(lines[0].split()[1]) if lines[0] else None, headers=headers, body=body)

    def close(self) -> None:
        self.answer.cancel()
        self.writer.close()


def test_stalled_bodies_starve_nobody(app):
    asyncio.run(_stalled_bodies(Target.parse(app.base)))


async def _stalled_bodies(target: Target) -> None:
    body = json.dumps(_completion("Once upon a time", 4)).encode()
    stalled: list[_Stalled] = []
    since = time.monotonic()
    try:
        for i in range(STALLED):
            stalled.append(await _Stalled.open(target, body))
            if i % 50 == 49:
                # In waves: a request whose body has not started yet counts as about to generate (see
                # OpenAIIngress._generate), so 300 at once would rightly see some refused.
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # let the proxy hand every stalled request to the ingress
        # What is timed is /health while the uploads stall, not while the server still takes in the 300
        # connections just opened (a burst, timed by the overload test): an untimed /health queues behind
        # that intake and returns once it is done. On a slow box the intake ran past the sleep above and
        # the first timed /health took 1.03 s.
        intake = await request(target, "GET", "/health", timeout=30)
        print(f"/health behind the intake of {STALLED} stalled uploads: {intake.latency_s:.2f} s")
        for _ in range(3):
            health = await request(target, "GET", "/health", timeout=30)
            assert health.status == 200 and health.latency_s < 1.0, (health.status, health.latency_s)
        assert (await request(target, "GET", "/v1/models", timeout=30)).status == 200
        calm = prompts(4)
        results = await asyncio.gather(*(request(target, "POST", "/v1/completions", _completion(p, 8), timeout=30)
                                         for p in calm))
        for p, res in zip(calm, results):
            assert res.status == 200, res.body[:300]
            _check_reference(res, p, 8)
        assert time.monotonic() - since < BODY_TIMEOUT_S, "the checks ran past the body deadline: slow box?"
        refused = [s.answer.result() for s in stalled if s.answer.done()]  # while arriving: burst rules
        for res in refused:
            assert res.status == 503 and _openai_error(res)["code"] == "overloaded", res.body[:300]
        held = STALLED - len(refused)
        assert held >= MAIN_MAX_RUNNING + MAIN_MAX_QUEUE, len(refused)

        # Past max_pending_bodies a new stalled request is refused at once, in OpenAI's shape.
        for _ in range(MAX_PENDING_BODIES - held + 5):
            stalled.append(await _Stalled.open(target, body))
        t0 = time.monotonic()
        res = await asyncio.wait_for(stalled[-1].answer, 5)
        assert time.monotonic() - t0 < 1.0
        assert res.status == 503 and int(res.headers["retry-after"]) >= 1, res.body[:300]
        assert "sending their bodies" in _openai_error(res)["message"]

        # Each stalled request it held ends with 408 once its body deadline passes.
        ended = await asyncio.wait_for(asyncio.gather(*(s.answer for s in stalled[:STALLED])), BODY_TIMEOUT_S + 30)
        timed_out = [res for res in ended if res.status != 503]
        assert len(timed_out) == held
        for res in timed_out:
            assert res.status == 408 and _openai_error(res)["code"] == "body_timeout", res.body[:300]
        print(f"\n{held} stalled uploads held {BODY_TIMEOUT_S:g} s then 408, {len(refused)} refused on arrival; "
              "/health and well-behaved requests served meanwhile")
    finally:
        for s in stalled:
            s.close()
    assert (await request(target, "GET", "/health", timeout=30)).status == 200


# -- fuzz --------------------------------------------------------------------------------------------

SURROGATES = ["\ud800", "\udfff", "\udc00", "a\ud83d", "\ude00b"]  # lone halves, never a pair


def _valid(rng: random.Random, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": rng.randint(1, 3), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "Count the stars", "é ✓ 😀"])}]
    else:
        body["prompt"] = rng.choice(["Once upon a time", "Rivers flow", "naïve café 😀"])
    return body


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # ASCII: a lone surrogate becomes a "\ud800" escape, as a client sends it


def _surrogate(rng: random.Random, chat: bool):
    s = rng.choice(SURROGATES)
    body = _valid(rng, chat)
    where = rng.choice(["text", "text", "field", "stop", "model", "user", "nested", "message_field"])
    if where == "text":
        if chat:
            body["messages"][0]["content"] = "hi " + s
        else:
            body["prompt"] = rng.choice([s, "Once " + s, [s]])
    elif where == "field":
        body[rng.choice(["", "x", "prompt", "max_tokens"]) + s] = rng.choice([1, "v", None])
    elif where == "stop":
        body["stop"] = rng.choice([s, ["ok", s]])
    elif where == "model":
        body["model"] = MODEL + s
    elif where == "user":
        body["user"] = s
    elif where == "nested":
        body["stream_options" if rng.random() < 0.5 else "logit_bias"] = {s: True}
    else:
        body["messages" if chat else "extra"] = [{"role": "user", "content": "x", "name" + s: "y"}]
    raw = _dumps(body)
    if rng.random() < 0.2:  # the surrogate as raw (CESU-8) bytes instead of an escape: not UTF-8
        raw = raw.replace(b'"model"', b'"mo\xed\xa0\x80del"', 1)
    return raw, {}, 400


def _nesting(rng: random.Random, chat: bool):
    depth = rng.choice([33, 40, 100, 500, 999, 1500, 5000])
    inner = rng.choice(["[", '{"a":'])
    close = "]" if inner == "[" else "}"
    deep = inner * depth + "1" + close * depth
    body = _valid(rng, chat)
    where = rng.choice(["message", "field", "top"])
    text = _dumps(body).decode()
    if where == "message" and chat:  # the measured case: an extra message field, ~500 deep
        text = text.replace('"role": "user"', f'"role": "user", "extra": {deep}', 1)
    elif where == "top":
        text = deep
    else:
        text = text[:-1] + f', "{rng.choice(["stop", "prompt", "x"])}": {deep}}}'
    return text.encode(), {}, 400


def _huge_number(rng: random.Random, chat: bool):
    field = rng.choice(["max_tokens", "seed", "temperature", "top_k", "top_p", "n", "prompt"])
    literal = rng.choice([str(2 ** 64), str(-(2 ** 63) - 1), str(10 ** 30), "9" * 400, "1e400", "-1e400",
                          "1E999", "123456789e305"])
    if field == "prompt" and not chat:
        literal = f"[1, 2, {literal}]"
    text = _dumps(_valid(rng, chat)).decode()[:-1] + f', "{field}": {literal}}}'
    return text.encode(), {}, 400


def _constants(rng: random.Random, chat: bool):
    literal = rng.choice(["NaN", "Infinity", "-Infinity", "nan", "inf"])
    text = _dumps(_valid(rng, chat)).decode()[:-1] + f', "{rng.choice(["temperature", "top_p", "x"])}": {literal}}}'
    return text.encode(), {}, 400


def _encoding(rng: random.Random, chat: bool):
    text = json.dumps({**_valid(rng, chat), "user": "Öncé ✓"}, ensure_ascii=False)
    kind = rng.choice(["utf-16", "utf-16-be", "utf-32", "latin-1", "random", "overlong", "cut"])
    if kind == "latin-1":
        raw = text.encode("latin-1", "replace")  # Ö and é as single bytes
    elif kind == "random":
        raw = b'{"prompt": "' + bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 40))) + b'"}'
    elif kind == "overlong":
        raw = text.encode().replace(b"model", b"mod\xc1\xa5l", 1)  # "e" in two bytes: forbidden
    elif kind == "cut":
        raw = text.encode().replace("é".encode(), "é".encode()[:1], 1)  # half a character
    else:
        raw = (b"\xff\xfe" if kind == "utf-16" else b"") + text.encode("utf-16-le" if kind == "utf-16" else kind)
    return raw, {}, 400


def _content_type(rng: random.Random, chat: bool):
    raw = _dumps(_valid(rng, chat))
    kind = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                       "application/xml", "application/json; charset=utf-16", "application/json; charset=latin-1",
                       "gzip", "br"])
    if kind == "gzip":
        return gzip.compress(raw), {"Content-Type": "application/json", "Content-Encoding": "gzip"}, 400
    if kind == "br":
        return raw, {"Content-Type": "application/json", "Content-Encoding": "br"}, 400
    return raw, {"Content-Type": kind}, 400


def _empty(rng: random.Random, chat: bool):
    return rng.choice([b"", b" ", b"\n\t ", b"\r\n"]), {}, 400


def _non_object(rng: random.Random, chat: bool):
    return rng.choice([b"[]", b"[1, 2]", b'"hi"', b"1", b"null", b"true", b"1e400", b'[{"prompt": "x"}]']), {}, 400


def _truncated(rng: random.Random, chat: bool):
    raw = _dumps(_valid(rng, chat))
    return raw[: rng.randrange(1, len(raw) - 1)], {}, 400


def _mutated(rng: random.Random, chat: bool):
    raw = bytearray(_dumps(_valid(rng, chat)))
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(raw))
        op = rng.random()
        if op < 0.4:
            raw[i] = rng.randrange(256)
        elif op < 0.7:
            raw.insert(i, rng.choice(b'{}[]",:\\0e-.\x00\xff'))
        else:
            del raw[i]
    return bytes(raw), {}, None  # may still be valid: any non-5xx answer


_ANY = [None, True, False, 0, -1, 1, 2, 3, 0.5, -0.5, 2.5, 1e300, "", "x", "\u0000", "😀", [], [1], ["a"], {},
        {"a": 1}, [[1, 2]], {"type": "text"}, [{"role": "user", "content": "hi"}], 2 ** 63 - 1, -(2 ** 63)]


def _typed(rng: random.Random, chat: bool):
    """Structurally valid JSON, fields of any type: the field checks must turn each into a 400 or a reply."""
    body = _valid(rng, chat)
    fields = sorted(CHAT_FIELDS if chat else COMPLETION_FIELDS)
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(fields + ["unknown", "prompt", "messages"])] = rng.choice(_ANY)
    if not isinstance(body.get("max_tokens"), int) or not 0 < body["max_tokens"] <= 3:
        body["max_tokens"] = rng.randint(1, 3)  # what does generate stays short
    body.pop("max_completion_tokens", None)
    return _dumps(body), {}, None


CLASSES = {"surrogate": _surrogate, "nesting": _nesting, "huge_number": _huge_number, "constants": _constants,
           "encoding": _encoding, "content_type": _content_type, "empty": _empty, "non_object": _non_object,
           "truncated": _truncated, "mutated": _mutated, "typed": _typed}


def fuzz_cases(n: int = FUZZ_BODIES, seed: int = FUZZ_SEED) -> list[tuple[str, str, bytes, dict, int | None]]:
    """(class, endpoint, body, headers, expected status or None for "any non-5xx"), the same every run."""
    rng = random.Random(seed)
    names = sorted(CLASSES)
    cases = []
    for i in range(n):
        name = names[i % len(names)]
        chat = rng.random() < 0.5
        raw, headers, expect = CLASSES[name](rng, chat)
        cases.append((name, "/chat/completions" if chat else "/completions", raw, headers, expect))
    return cases


def test_body_parser_refuses_each_hostile_class_without_a_cluster():
    """The normaliser itself: every fuzz body parses to an object or raises a 400, never anything else."""
    counts: dict[str, int] = {}
    for name, _, raw, headers, expect in fuzz_cases():
        try:
            parse_body(raw, headers.get("Content-Type", "application/json"), headers.get("Content-Encoding"))
        except ApiError as err:
            assert err.status == 400 and err.message, (name, raw[:80])
            json.dumps(err.body)  # encodable
            counts[name] = counts.get(name, 0) + 1
        else:
            assert expect is None, (name, raw[:120])
    for name in ("surrogate", "nesting", "huge_number", "constants", "encoding", "content_type", "empty",
                 "non_object", "truncated"):
        assert counts.get(name, 0) >= FUZZ_BODIES // len(CLASSES) - 1, (name, counts)


@pytest.mark.parametrize("raw, param, words", [
    (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
    (b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', "messages[0].content", "surrogate"),
    (b'{"\\ud800": 1}', "?", "field name"),
    (b'{"stop": ["a", "\\udc00"]}', "stop[1]", "surrogate"),
    (b'{"seed": 18446744073709551616}', "seed", "64 bits"),
    (b'{"temperature": 1e400}', "temperature", "finite"),
    (b'{"messages": [{"role": "user", "content": "x", "e": ' + b"[" * 500 + b"]" * 500 + b"}]}",
     "messages[0].e", "nests deeper"),
    (b'{"prompt": "x", "temperature": NaN}', None, "JSON"),
    ('{"prompt": "x"}'.encode("utf-16"), None, "UTF-8"),
])
def test_body_parser_names_the_problem(raw, param, words):
    with pytest.raises(ApiError) as info:
        parse_body(raw, "application/json")
    err = info.value
    assert err.status == 400 and words in err.message and (err.param or "").startswith(param or ""), err.body
    assert param is not None or err.param is None


def test_fuzzed_bodies_never_5xx(app):
    cases = fuzz_cases()
    assert len(cases) >= 1000 and {c[0] for c in cases} == set(CLASSES)
    t0 = time.monotonic()
    results = asyncio.run(_fuzz(app, cases))
    failures, tally = [], {}
    for (name, endpoint, raw, _, expect), (status, content_type, text) in zip(cases, results):
        tally.setdefault(name, {}).setdefault(status, 0)
        tally[name][status] += 1
        problem = None
        if status >= 500:
            problem = "5xx"
        elif status >= 400:
            try:
                err = json.loads(text)["error"]
                if set(err) != {"message", "type", "param", "code"} or not content_type.startswith("application/json"):
                    problem = "not OpenAI-shaped"
            except (ValueError, KeyError, TypeError):
                problem = "not OpenAI-shaped"
        if expect is not None and status != expect:
            problem = problem or f"expected {expect}"
        if status == 200 and "event-stream" in content_type and not text.rstrip().endswith("data: [DONE]"):
            problem = "stream without [DONE]"
        if problem:
            failures.append(f"{name} {endpoint} {raw[:100]!r}: {problem}: {status} {text[:200]}")
    print(f"\nfuzz: {len(cases)} bodies in {time.monotonic() - t0:.1f} s: {json.dumps(tally, sort_keys=True)}")
    assert not failures, "\n".join(failures[:20])
    assert sum(n for by in tally.values() for s, n in by.items() if s == 200) > 0  # the valid ones ran
    res = asyncio.run(request(Target.parse(app.base), "POST", "/v1/completions", _completion("Once upon a time", 8)))
    assert res.status == 200, res.body[:300]
    _check_reference(res, "Once upon a time", 8)


async def _fuzz(app: App, cases) -> list[tuple[int, str, str]]:
    gate = asyncio.Semaphore(8)

    async def one(http, endpoint, raw, headers):
        async with gate:
            r = await http.post(app.v1 + endpoint, content=raw,
                                headers={"Content-Type": "application/json", **headers})
            return r.status_code, r.headers.get("content-type", ""), r.text

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=8)) as http:
        return await asyncio.gather(*(one(http, e, raw, h) for _, e, raw, h, _ in cases))
