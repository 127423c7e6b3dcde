"""The OpenAI-compatible HTTP API against a real Serve app on CPU, with the official ``openai`` client.

The app serves ``tests.fixtures_tokenizer``'s tiny pair (a byte-level BPE tokenizer with a chat
template, a tiny Llama target and a noisy-copy draft). Greedy outputs must be token-identical to the
reference (the target alone, HF ``generate``, one prompt at a time) for completions, chat and streams;
a client that disconnects mid-stream must not disturb 20 others and must have its KV slots freed.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import torch
import pytest

from tests.fixtures_tokenizer import chat_prompt_ids, prompts, reference, tokenizer
from tests.ray.openai_app import MODEL, openai_client

pytestmark = pytest.mark.ray

MAX_NEW = 24
SPEC_KEYS = {"acceptance_rate", "acceptance_length", "steps", "proposed", "accepted", "emitted"}


def _check_speculation(spec: dict, completion_tokens: int) -> None:
    assert SPEC_KEYS <= set(spec), spec
    assert spec["emitted"] == completion_tokens
    assert spec["steps"] >= 1 and spec["acceptance_length"] >= 1.0
    assert 0.0 <= spec["acceptance_rate"] <= 1.0


def test_models(client, app):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    health = httpx.get(app.base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["step_loop_alive"] is True


def test_completions_greedy_match_reference(client):
    for prompt in prompts(4):
        ids, text, finish = reference(prompt, MAX_NEW)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == list(ids), prompt
        assert choice.text == text and choice.finish_reason == finish
        assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
        assert r.usage.prompt_tokens == len(tokenizer()(prompt)["input_ids"])
        assert r.usage.completion_tokens == len(ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + len(ids)
        _check_speculation(r.model_extra["speculation"], len(ids))


def test_completion_from_token_ids(client):
    prompt_ids = tokenizer()("Rivers flow to the sea")["input_ids"]
    ids, text, _ = reference(prompt_ids, 12)
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == list(ids) and r.choices[0].text == text


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    """The verifier's prefix cache keeps a finished request's full blocks: the same prompt again finds them
    (all but the last token's block), reports them in OpenAI's usage, and decodes the same tokens."""
    prompt_ids = [int(t) for t in torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(9))]
    first, again = (client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0,
                                              extra_body={"return_token_ids": True}) for _ in range(2))
    assert first.choices[0].model_extra["token_ids"] == again.choices[0].model_extra["token_ids"]
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == 32 and again.model_extra["speculation"]["cached_tokens"] == cached  # two blocks of 16


def test_the_kv_benchmarks_http_client_times_a_stream_and_reads_its_cached_tokens(app):
    """evaluation.kv_bench's client over HTTP (what its prefix_http part measures with): the tokens of a
    stream, its first token's time and the hits from the final usage chunk."""
    from evaluation.kv_bench import HttpClient

    ask = HttpClient(app.base, MODEL, headers=app.headers())
    prompt = tuple(int(t) for t in torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(10)))
    first, again = ask(prompt, 8), ask(prompt, 8)
    assert first.tokens == again.tokens and len(first.tokens) == 8
    assert (first.cached, again.cached) == (0, 32)
    assert 0 < again.ttft_s < 60 and again.decode_tokens_per_s > 0


def test_chat_greedy_match_reference(client):
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the stars"},
                      {"role": "assistant", "content": "one, two"}, {"role": "user", "content": "go on"}]):
        ids, text, finish = reference(chat_prompt_ids(messages), MAX_NEW)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_NEW,
                                           temperature=0, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == text
        assert choice.model_extra["token_ids"] == list(ids) and choice.finish_reason == finish
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.usage.prompt_tokens == len(chat_prompt_ids(messages))
        _check_speculation(r.model_extra["speculation"], len(ids))


def test_chat_text_parts_and_integral_float_are_normalised(app):
    """Content as text parts is joined, and ``max_tokens: 8.0`` is 8: the same reply as the plain request."""
    plain = [{"role": "user", "content": "Count the stars"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Count the "}, {"type": "text", "text": "stars"}]}]
    ids, text, finish = reference(chat_prompt_ids(plain), 8)
    r = httpx.post(app.v1 + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": parts, "max_tokens": 8.0, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["token_ids"], choice["finish_reason"]) == (text, list(ids), finish)


def test_stream_completion(client):
    prompt = "Once upon a time"
    ids, text, finish = reference(prompt, MAX_NEW)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    chunks = list(stream)
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == text
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == list(ids)
    assert [c.choices[0].finish_reason for c in body[:-1]] == [None] * (len(body) - 1)
    assert body[-1].choices[0].finish_reason == finish
    _check_speculation(body[-1].model_extra["speculation"], len(ids))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_chat(client):
    messages = [{"role": "user", "content": "How many legs does a spider have?"}]
    ids, text, finish = reference(chat_prompt_ids(messages), MAX_NEW)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish and chunks[-1].object == "chat.completion.chunk"
    _check_speculation(chunks[-1].model_extra["speculation"], len(ids))
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_sse_wire_format(app):
    """The raw stream: ``data: {json}`` events, a blank line after each, ``data: [DONE]`` last."""
    body = {"model": MODEL, "prompt": "The weather today is", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", app.v1 + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "speculation" in payloads[-1]


def test_stop_strings(client):
    prompt = "The quick brown fox"
    ids, text, _ = reference(prompt, MAX_NEW)
    # a stop string from the middle of the reference text: output is the text before its first occurrence
    start = next(i for i in range(3, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[start:start + 2]
    expected = text[:text.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_sampling_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Numbers: 0 1 2", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"top_k": 50, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert len(a.choices[0].model_extra["token_ids"]) >= 1


def _fixed_gamma_steps(spec: dict, gamma: int, slack: int) -> bool:
    """Whether every step drafted the configured γ, but for the last few clamped by the room left."""
    return len(spec["per_position_acceptance"]) <= gamma and spec["proposed"] >= gamma * spec["steps"] - slack


def test_unseeded_sampled_requests_adapt_gamma_and_seeded_ones_do_not(client):
    """A request without a seed is the engine's to seed, and so its γ the adaptive policy's (which measures
    plain steps, and drafts past the configured γ when the draft agrees); a seeded one drafts the configured
    γ every step so that its sample is reproducible. The router once seeded every request itself, which pinned
    all served sampled traffic to the fixed γ."""
    gamma = 4  # openai_app's speculation.gamma (gamma_max 8, adaptive)
    kw = dict(model=MODEL, prompt="Numbers: 0 1 2", max_tokens=48, temperature=1.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    seeded = [client.completions.create(seed=1234, **kw) for _ in range(2)]
    assert seeded[0].choices[0].model_extra["token_ids"] == seeded[1].choices[0].model_extra["token_ids"]
    for r in seeded:
        assert _fixed_gamma_steps(r.model_extra["speculation"], gamma, slack=2 * gamma), r.model_extra
    unseeded = [client.completions.create(**kw) for _ in range(3)]
    specs = [r.model_extra["speculation"] for r in unseeded]
    assert not all(_fixed_gamma_steps(s, gamma, slack=2 * gamma) for s in specs), specs
    assert len({tuple(r.choices[0].model_extra["token_ids"]) for r in unseeded}) > 1


async def _stream_text(aclient, prompt: str, max_tokens: int) -> tuple[str, str]:
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True)
    parts, finish = [], None
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


async def _disconnect_after(aclient, prompt: str, chunks: int) -> int:
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    seen = 0
    async for chunk in stream:
        assert chunk.choices[0].finish_reason is None, "the victim finished before it could disconnect"
        seen += 1
        if seen == chunks:
            break
    await stream.close()  # closes the HTTP connection mid-stream
    return seen


def _kv(app) -> dict:
    r = httpx.get(app.base + "/debug/kv", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_disconnect_one_of_21_streams(app):
    texts = prompts(21)
    victim, others = texts[0], texts[1:]
    refs = {p: reference(p, MAX_NEW) for p in others}
    before = _kv(app)

    async def run():
        aclient = openai_client(app, asynchronous=True)
        try:
            return await asyncio.gather(_disconnect_after(aclient, victim, 2),
                                        *(_stream_text(aclient, p, MAX_NEW) for p in others))
        finally:
            await aclient.close()

    seen, *results = asyncio.run(run())
    assert seen == 2
    for p, (text, finish) in zip(others, results):
        assert (text, finish) == refs[p][1:], p

    # The victim's request is cancelled in the router, and every KV slot comes back.
    deadline = time.monotonic() + 30
    while True:
        kv = _kv(app)
        idle = kv["in_flight"] == 0 and kv["running"] == 0 and all(v == 0 for v in kv["slots_in_use"].values())
        if idle and kv["cancelled"] - before["cancelled"] == 1:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"caches not freed or cancel not counted: before {before}, now {kv}")
        time.sleep(0.2)
    assert all(e["slots_in_use"] == 0 for e in kv["verifier"] + kv["draft_pool"]), kv

