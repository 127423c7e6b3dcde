"""Paged-KV benchmark: capacity for one memory budget, the prefix cache's time to first token, and speed.

On a (target, draft) pair of local folders (default: the embedded pair), CPU, one run; in process but for the
last part:

- **capacity**: one KV memory budget — ``--budget-slots`` sequences at ``--max-len`` positions, what the
  slot layout (one block of ``max_len`` per sequence) could hold — served as blocks of 16 to ``--capacity
  -requests`` sequences of ~``--seq-len`` tokens at once (``router.max_running`` 64). Reported: sequences
  held at once (peak), preemptions, tokens/s, and every output against the slot layout's (greedy: identical);
- **prefix cache**: a multi-turn chat (each turn's prompt is the conversation so far plus a new user message,
  growing past ``--chat-tokens``) and a shared-system-prompt workload, every request once with the cache and
  once without, interleaved, speculative at a fixed γ: time to first token p50 of each, the ratio, decode
  tokens/s of each, the hit rate, outputs identical;
- **preemption**: the capacity workload on a block pool of half the blocks its sequences need at full length
  (``router.max_running`` 64, so all are admitted together): every request finishes, outputs identical to an
  ample pool's, preemptions counted;
- **speed without sharing**: plain and speculative tokens/s at batches 1 and 16, blocks of 16 against the
  slot layout (``kv.block_size`` = ``max_len``: one block per sequence, the pool as it was before paging), each
  batch of prompts timed by its fastest of ``--repeats`` interleaved rounds (for a machine shared with other work).
- **prefix cache over HTTP** (``--parts prefix_http``, asked for by name): the prefix workloads streamed to two
  served apps on loopback (the default config with the pair, ``kv.prefix_cache`` off and on, the same fixed
  γ); time to first token is the first streamed token's, the hits each response's
  ``usage.prompt_tokens_details.cached_tokens``.

    python scripts/bench_kv.py [--target DIR --draft DIR] [--out DIR] [--repeats 3] [--parts capacity,prefix,preemption,speed,prefix_http]

Writes DIR/NAME.json and DIR/NAME.md (default docs/results/kv), and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = REPO / "models" / "default"
BLOCK = 16
SPEED_GAMMA = 3


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(EMBEDDED / "target"))
    p.add_argument("--draft", default=str(EMBEDDED / "draft"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--budget-slots", type=int, default=4, help="the KV budget, in slots of --max-len positions")
    p.add_argument("--capacity-requests", type=int, default=48)
    p.add_argument("--seq-len", type=int, default=300, help="prompt + generated tokens per capacity request")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--chat-tokens", type=int, default=1500, help="a conversation grows past this many tokens")
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--speed-prompts", type=int, default=16)
    p.add_argument("--speed-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--name", default="kv", help="the report's file name, without .json/.md")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS) - set(SERVED_PARTS)
    if unknown:
        p.error(f"unknown --parts {sorted(unknown)}")
    return args


class Pair:
    """The models, built once, and engines over them with chosen KV settings."""

    def __init__(self, args):
        import torch

        from runtime.models import build_model

        torch.set_num_threads(args.threads)
        self.args = args
        self.target = build_model(args.target, "cpu", "float32")
        self.draft = build_model(args.draft, "cpu", "float32")
        self.vocab = self.target.config.vocab_size

    def engine(self, *, speculate=True, slots=64, block_size=BLOCK, blocks=None, prefix_cache=False, gamma=None):
        """``gamma``: a fixed γ (None: the adaptive policy)."""
        from engine.assembly import EngineSettings, make_engine

        settings = EngineSettings(target=self.args.target, draft=self.args.draft if speculate else None,
                                  device="cpu", dtype="float32", max_len=self.args.max_len, max_slots=slots,
                                  kv_block_size=block_size, kv_blocks=blocks, prefix_cache=prefix_cache,
                                  **({"gamma": gamma, "adaptive": False} if gamma else {}))
        return make_engine(settings, target_model=self.target, draft_model=self.draft if speculate else None)

    def prompts(self, seed: int, n: int, length: int) -> list[tuple[int, ...]]:
        import torch

        gen = torch.Generator().manual_seed(seed)
        return [tuple(torch.randint(3, self.vocab, (length,), generator=gen).tolist()) for _ in range(n)]


def _run(engine, requests, finished: list | None = None) -> tuple[list[tuple[int, ...]], float, int]:
    """Outputs, seconds, and the most sequences running at once; ``finished`` collects finish reasons."""
    ids = [engine.add(r) for r in requests]
    t0, peak = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        peak = max(peak, len(engine.running))
    seconds = time.perf_counter() - t0
    outputs = [engine.output(i) for i in ids]
    if finished is not None:
        finished += [o.finish_reason for o in outputs]
    return [o.tokens for o in outputs], seconds, peak


class Answer(NamedTuple):
    tokens: tuple[int, ...]
    ttft_s: float  # time to first token
    decode_tokens_per_s: float  # after the first token
    cached: int  # prompt tokens the prefix cache held


class EngineClient:
    """One request at a time to an engine in this process."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, prompt: tuple[int, ...], max_tokens: int) -> Answer:
        from engine.engine import Request

        t0 = time.perf_counter()
        seq_id = self.engine.add(Request(prompt, max_tokens=max_tokens, ignore_eos=True))
        first = None
        while self.engine.has_work:
            events = self.engine.step()
            if first is None and any(e.seq_id == seq_id and e.new_tokens for e in events):
                first = time.perf_counter()
        end = time.perf_counter()
        out = self.engine.output(seq_id)
        return Answer(out.tokens, first - t0, (len(out.tokens) - 1) / max(end - first, 1e-9),
                      out.stats.cached_tokens)


class HttpClient:
    """One streamed request at a time to a served app's OpenAI completions route (token ids in and out)."""

    def __init__(self, url: str, model: str, headers: dict | None = None):
        import httpx

        self.url, self.model, self.http = url, model, httpx.Client(timeout=600, headers=headers)

    def __call__(self, prompt: tuple[int, ...], max_tokens: int) -> Answer:
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens: list[int] = []
        first, usage = None, None
        t0 = time.perf_counter()
        with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices") or ():
                    if choice.get("token_ids") and first is None:
                        first = time.perf_counter()
                    tokens += choice.get("token_ids") or ()
                usage = chunk.get("usage") or usage
        end = time.perf_counter()
        if first is None or usage is None:
            raise RuntimeError(f"{self.url}: a stream without tokens or without usage")
        return Answer(tuple(tokens), first - t0, (len(tokens) - 1) / max(end - first, 1e-9),
                      usage["prompt_tokens_details"]["cached_tokens"])


CAPACITY_NEW = 40  # generated tokens per capacity request


def _capacity_requests(pair: Pair, args) -> list:
    from engine.engine import Request

    prompts = pair.prompts(1, args.capacity_requests, args.seq_len - CAPACITY_NEW)
    return [Request(p, max_tokens=CAPACITY_NEW) for p in prompts]


def capacity(pair: Pair, args) -> dict:
    blocks = args.budget_slots * args.max_len // BLOCK
    requests = _capacity_requests(pair, args)
    slots = pair.engine(slots=args.budget_slots, block_size=args.max_len)
    paged = pair.engine(slots=64, blocks=blocks)
    ref, ref_s, ref_peak = _run(slots, requests)
    out, s, peak = _run(paged, requests)
    tokens = sum(len(o) for o in out)
    return {"budget_positions": blocks * BLOCK, "slot_layout_sequences": ref_peak, "paged_sequences": peak,
            "ratio": peak / ref_peak, "preemptions": paged.preemptions, "requests": len(requests),
            "slot_tokens_per_s": tokens / ref_s, "paged_tokens_per_s": tokens / s,
            "identical": sum(a == b for a, b in zip(out, ref))}


def preemption(pair: Pair, args) -> dict:
    requests = _capacity_requests(pair, args)
    need = len(requests) * -(-args.seq_len // BLOCK)  # every sequence at its full length at once
    ample, half = pair.engine(slots=64, blocks=need + 64), pair.engine(slots=64, blocks=need // 2)
    ref, ref_s, _ = _run(ample, requests)
    reasons: list[str] = []
    out, s, peak = _run(half, requests, reasons)
    tokens = sum(len(o) for o in out)
    return {"requests": len(requests), "blocks_needed": need, "pool_blocks": need // 2,
            "ample_preemptions": ample.preemptions, "preemptions": half.preemptions, "peak_running": peak,
            "finished": sum(r == "length" for r in reasons), "failed": sum(r == "error" for r in reasons),
            "ample_tokens_per_s": tokens / ref_s, "half_tokens_per_s": tokens / s,
            "identical": sum(a == b for a, b in zip(out, ref))}


def prefix(pair: Pair, args, clients: dict | None = None) -> dict:
    """``clients``: "off" and "on" (the cache without and with) → a callable (prompt, max_tokens) → Answer;
    default: engines in this process."""
    # One request at a time: a few sequences' worth of blocks holds everything the cache keeps here. A fixed γ:
    # the adaptive policy's choices follow each engine's own measured step times, and their spread between the
    # two engines (up to 1.5× in decode tokens/s on the 0.5B/1.5B-class pair, docs/results.md) is not the cache's.
    clients = clients or {mode: EngineClient(pair.engine(slots=4, prefix_cache=mode == "on", gamma=SPEED_GAMMA))
                          for mode in ("off", "on")}
    runs = _Runs(clients)
    # Multi-turn chat: the conversation so far plus a new user message; the answer joins the conversation.
    user_len, answer_len = 80, 32
    for c in range(args.conversations):
        conversation: list[int] = []
        turn = 0
        while len(conversation) < args.chat_tokens:
            conversation += list(pair.prompts(100 + 17 * c + turn, 1, user_len)[0])
            # the first turn has nothing cached
            answer = runs.both(tuple(conversation), answer_len, flip=turn % 2, timed=turn > 0)
            conversation += list(answer)
            turn += 1
    results = {"chat": runs.summary(longest=len(conversation))}
    # A shared system prompt before short questions.
    system = tuple(pair.prompts(7, 1, args.system_tokens)[0])
    runs = _Runs(clients)
    for q, question in enumerate(pair.prompts(8, args.questions + 1, 40)):
        runs.both(system + question, answer_len, flip=q % 2, timed=q > 0)  # the first caches the system prompt
    results["system_prompt"] = runs.summary(longest=len(system) + 40)
    return results


class _Runs:
    """Each prompt once without the cache and once with it, in alternating order; what they measured."""

    def __init__(self, clients: dict):
        self.clients = clients
        self.ttft, self.tps = {"on": [], "off": []}, {"on": [], "off": []}
        self.identical = self.requests = self.cached = self.prompt_tokens = 0

    def both(self, prompt: tuple[int, ...], max_tokens: int, flip: bool, timed: bool) -> tuple[int, ...]:
        answers = {}
        for mode in (("on", "off") if flip else ("off", "on")):
            answers[mode] = a = self.clients[mode](prompt, max_tokens)
            if timed:
                self.ttft[mode].append(a.ttft_s)
                self.tps[mode].append(a.decode_tokens_per_s)
        print(f"[bench_kv]   {len(prompt)}-token prompt: first token after {answers['off'].ttft_s:.3f} s without the "
              f"cache, {answers['on'].ttft_s:.3f} s with it ({answers['on'].cached} cached)", flush=True)
        self.identical += answers["on"].tokens == answers["off"].tokens
        self.requests += 1
        self.cached += answers["on"].cached
        self.prompt_tokens += len(prompt)
        return answers["off"].tokens

    def summary(self, longest: int) -> dict:
        on, off = statistics.median(self.ttft["on"]), statistics.median(self.ttft["off"])
        return {"ttft_p50_off_s": off, "ttft_p50_on_s": on, "ttft_ratio": off / on,
                "decode_tokens_per_s_off": statistics.median(self.tps["off"]),
                "decode_tokens_per_s_on": statistics.median(self.tps["on"]),
                "hit_rate": self.cached / max(1, self.prompt_tokens), "identical": self.identical,
                "requests": self.requests, "longest_prompt": longest}


def prefix_http(pair: Pair, args, serve) -> dict:
    """The prefix part over HTTP: ``serve(args)`` is a context manager that serves the pair twice, the cache off
    and on, and yields their clients (scripts/bench_kv.py starts two apps of the embedded default config)."""
    with serve(args) as clients:
        return prefix(pair, args, clients)


def speed(pair: Pair, args) -> dict:
    from engine.engine import Request

    prompts = pair.prompts(3, args.speed_prompts, 96)
    rows = {}
    for batch in (1, 16):
        for speculate in (False, True):
            # A fixed γ: the adaptive policy's choices follow measured step times, which would add its own noise
            # to a comparison of KV layouts.
            layouts = {"slots": pair.engine(speculate=speculate, slots=16, block_size=args.max_len, gamma=SPEED_GAMMA),
                       "blocks": pair.engine(speculate=speculate, slots=16, gamma=SPEED_GAMMA)}
            chunks = range(0, len(prompts), batch)
            best = {name: [float("inf")] * len(chunks) for name in layouts}  # fastest time of each chunk
            outputs, tokens = {}, 0
            for r in range(args.repeats):
                for name in (("slots", "blocks") if r % 2 else ("blocks", "slots")):
                    outs = []
                    for c, i in enumerate(chunks):
                        o, seconds, _ = _run(layouts[name], [Request(p, max_tokens=args.speed_tokens)
                                                             for p in prompts[i:i + batch]])
                        outs += o
                        best[name][c] = min(best[name][c], seconds)
                    outputs[name] = outs
                    tokens = sum(len(x) for x in outs)
            key = f"batch {batch}, {'speculative' if speculate else 'plain'}"
            slots_rate, blocks_rate = tokens / sum(best["slots"]), tokens / sum(best["blocks"])
            rows[key] = {"slots_tokens_per_s": slots_rate, "blocks_tokens_per_s": blocks_rate,
                         "ratio": blocks_rate / slots_rate, "identical": outputs["slots"] == outputs["blocks"]}
    return rows


def _markdown(report: dict) -> str:
    lines = [f"Paged KV ({report['machine']}, {report['date']}; embedded pair unless named: {report['pair']})", ""]
    if "capacity" in report:
        c = report["capacity"]
        lines += ["Capacity for one KV budget of "
                  f"{c['budget_positions']} positions per pool (max_model_len {report['max_len']}):", "",
                  "| layout | sequences at once | tokens/s | identical |", "|---|---|---|---|",
                  f"| slots (one block of max_model_len each) | {c['slot_layout_sequences']} | "
                  f"{c['slot_tokens_per_s']:.0f} | reference |",
                  f"| blocks of {BLOCK} | {c['paged_sequences']} (**{c['ratio']:.1f}×**; {c['preemptions']} "
                  f"preemptions) | {c['paged_tokens_per_s']:.0f} | {c['identical']}/{c['requests']} |", ""]
    for part, where in (("prefix", "in process"), ("prefix_http", "over HTTP, streamed, two served apps")):
        if part not in report:
            continue
        lines += [f"Prefix cache {where}, time to first token p50 (each request with and without the cache, "
                  "interleaved):", "", "| workload | longest prompt | TTFT without | TTFT with | ratio | decode "
                  "tok/s without / with | hit rate | identical |", "|---|---|---|---|---|---|---|---|"]
        for name, r in report[part].items():
            lines.append(f"| {name} | {r['longest_prompt']} | {r['ttft_p50_off_s'] * 1e3:.1f} ms | "
                         f"{r['ttft_p50_on_s'] * 1e3:.1f} ms | **{r['ttft_ratio']:.1f}×** | "
                         f"{r['decode_tokens_per_s_off']:.0f} / {r['decode_tokens_per_s_on']:.0f} | "
                         f"{r['hit_rate']:.0%} | {r['identical']}/{r['requests']} |")
        lines.append("")
    if "preemption" in report:
        c = report["preemption"]
        lines += [f"Preemption: {c['requests']} sequences of ~{report['seq_len']} tokens admitted at once, "
                  f"{c['blocks_needed']} blocks at full length:", "",
                  "| pool | preemptions | finished / failed | tokens/s | identical |", "|---|---|---|---|---|",
                  f"| {c['blocks_needed'] + 64} blocks (ample) | {c['ample_preemptions']} | reference | "
                  f"{c['ample_tokens_per_s']:.0f} | reference |",
                  f"| {c['pool_blocks']} blocks (half) | {c['preemptions']} | {c['finished']} / {c['failed']} | "
                  f"{c['half_tokens_per_s']:.0f} | {c['identical']}/{c['requests']} |", ""]
    if "speed" in report:
        lines += [f"Speed without sharing: blocks of {BLOCK} vs the slot layout (speculative at a fixed γ = "
                  f"{SPEED_GAMMA}), each batch timed by its fastest of {report['repeats']} interleaved rounds:", "", "| run | slots tok/s | blocks tok/s | blocks / slots | identical |",
                  "|---|---|---|---|---|"]
        for name, r in report["speed"].items():
            lines.append(f"| {name} | {r['slots_tokens_per_s']:.0f} | {r['blocks_tokens_per_s']:.0f} | "
                         f"**{r['ratio']:.2f}** | {r['identical']} |")
        lines.append("")
    return "\n".join(lines)


PARTS = {"capacity": capacity, "prefix": prefix, "preemption": preemption, "speed": speed}
SERVED_PARTS = {"prefix_http": prefix_http}  # need ``serve``; run only when asked for


def main(argv=None, serve=None) -> int:
    args = _args(argv)
    if SERVED_PARTS.keys() & set(args.parts) and serve is None:
        raise SystemExit(f"--parts {sorted(SERVED_PARTS)} serve the pair: run scripts/bench_kv.py")
    pair = Pair(args)
    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": datetime.date.today().isoformat(), "pair": f"{args.target}, {args.draft}",
              "max_len": args.max_len, "seq_len": args.seq_len, "repeats": args.repeats}
    for part in args.parts:
        t0 = time.perf_counter()
        print(f"[bench_kv] {part} …", flush=True)
        report[part] = PARTS[part](pair, args) if part in PARTS else SERVED_PARTS[part](pair, args, serve)
        print(f"[bench_kv] {part} done in {time.perf_counter() - t0:.0f} s", flush=True)
    text = _markdown(report)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(text + "\n")
    print(f"wrote {out / args.name}.json, .md")
    return 0
