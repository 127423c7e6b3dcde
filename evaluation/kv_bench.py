"""Paged-KV benchmark: capacity for one memory budget, the prefix cache's time to first token, and speed.

On a (target, draft) pair of local folders (default: the embedded pair), CPU, in process, one run:

- **capacity**: one KV memory budget — ``--budget-slots`` sequences at ``--max-len`` positions, what the
  slot layout (one block of ``max_len`` per sequence) could hold — served as blocks of 16 to ``--capacity
  -requests`` sequences of ~``--seq-len`` tokens at once (``router.max_running`` 64). Reported: sequences
  held at once (peak), preemptions, tokens/s, and every output against the slot layout's (greedy: identical);
- **prefix cache**: a multi-turn chat (each turn's prompt is the conversation so far plus a new user message,
  growing past ``--chat-tokens``) and a shared-system-prompt workload, every request once with the cache and
  once without, interleaved: time to first token p50 of each, the ratio, decode tokens/s of each, the hit
  rate, outputs identical;
- **preemption**: the capacity workload on a block pool of half the blocks its sequences need at full length
  (``router.max_running`` 64, so all are admitted together): every request finishes, outputs identical to an
  ample pool's, preemptions counted;
- **speed without sharing**: plain and speculative tokens/s at batches 1 and 16, blocks of 16 against the
  slot layout (``kv.block_size`` = ``max_len``: one block per sequence, the pool as it was before paging), each
  batch of prompts timed by its fastest of ``--repeats`` interleaved rounds (for a machine shared with other work).

    python scripts/bench_kv.py [--target DIR --draft DIR] [--out DIR] [--repeats 3] [--parts capacity,prefix,preemption,speed]

Writes DIR/kv.json and DIR/kv.md (default docs/results), and prints the tables.
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
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS)
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


def _ttft(engine, request) -> tuple[tuple[int, ...], float, float]:
    """One request alone: its output, time to first token, and decode tokens/s after it."""
    t0 = time.perf_counter()
    seq_id = engine.add(request)
    first = None
    while engine.has_work:
        events = engine.step()
        if first is None and any(e.seq_id == seq_id and e.new_tokens for e in events):
            first = time.perf_counter()
    end = time.perf_counter()
    out = engine.output(seq_id).tokens
    return out, first - t0, (len(out) - 1) / max(end - first, 1e-9)


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


def prefix(pair: Pair, args) -> dict:
    from engine.engine import Request

    engines = {"off": pair.engine(prefix_cache=False), "on": pair.engine(prefix_cache=True)}
    results = {}
    # Multi-turn chat: the conversation so far plus a new user message; the answer joins the conversation.
    ttft, tps, identical, turns = {"on": [], "off": []}, {"on": [], "off": []}, 0, 0
    user_len, answer_len = 80, 32
    for c in range(args.conversations):
        conversation: list[int] = []
        turn = 0
        while len(conversation) < args.chat_tokens:
            conversation += list(pair.prompts(100 + 17 * c + turn, 1, user_len)[0])
            outs = {}
            for mode in (("on", "off") if turn % 2 else ("off", "on")):
                outs[mode], first, rate = _ttft(engines[mode], Request(tuple(conversation), max_tokens=answer_len))
                if turn:  # the first turn has nothing cached
                    ttft[mode].append(first)
                    tps[mode].append(rate)
            identical += outs["on"] == outs["off"]
            turns += 1
            conversation += list(outs["off"])
            turn += 1
    results["chat"] = _summary(ttft, tps, identical, turns, engines, longest=len(conversation))
    for engine in engines.values():
        engine.stages.verifier.runner.pool.hit_tokens = engine.stages.verifier.runner.pool.lookup_tokens = 0
    # A shared system prompt before short questions.
    system = list(pair.prompts(7, 1, args.system_tokens)[0])
    ttft, tps, identical = {"on": [], "off": []}, {"on": [], "off": []}, 0
    for q, question in enumerate(pair.prompts(8, args.questions + 1, 40)):
        outs = {}
        for mode in (("on", "off") if q % 2 else ("off", "on")):
            outs[mode], first, rate = _ttft(engines[mode], Request(tuple(system) + question, max_tokens=answer_len))
            if q:  # the first question caches the system prompt
                ttft[mode].append(first)
                tps[mode].append(rate)
        identical += outs["on"] == outs["off"]
    results["system_prompt"] = _summary(ttft, tps, identical, args.questions + 1, engines,
                                        longest=len(system) + 40)
    return results


def _summary(ttft, tps, identical, total, engines, longest) -> dict:
    pool = engines["on"].stages.verifier.runner.pool
    on, off = statistics.median(ttft["on"]), statistics.median(ttft["off"])
    return {"ttft_p50_off_s": off, "ttft_p50_on_s": on, "ttft_ratio": off / on,
            "decode_tokens_per_s_off": statistics.median(tps["off"]),
            "decode_tokens_per_s_on": statistics.median(tps["on"]),
            "hit_rate": pool.hit_tokens / max(1, pool.lookup_tokens), "identical": identical, "requests": total,
            "longest_prompt": longest}


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
    if "prefix" in report:
        lines += ["Prefix cache, time to first token p50 (each request with and without the cache, interleaved):",
                  "", "| workload | longest prompt | TTFT without | TTFT with | ratio | decode tok/s without / with "
                  "| hit rate | identical |", "|---|---|---|---|---|---|---|---|"]
        for name, r in report["prefix"].items():
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


def main(argv=None) -> int:
    args = _args(argv)
    pair = Pair(args)
    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": datetime.date.today().isoformat(), "pair": f"{args.target}, {args.draft}",
              "max_len": args.max_len, "seq_len": args.seq_len, "repeats": args.repeats}
    for part in args.parts:
        t0 = time.perf_counter()
        print(f"[bench_kv] {part} …", flush=True)
        report[part] = PARTS[part](pair, args)
        print(f"[bench_kv] {part} done in {time.perf_counter() - t0:.0f} s", flush=True)
    text = _markdown(report)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "kv.md").write_text(text + "\n")
    print(f"wrote {out / 'kv.json'}, {out / 'kv.md'}")
    return 0
