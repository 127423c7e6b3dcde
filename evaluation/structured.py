"""Structured mode of the scenario benchmark (issue 31): ``scripts/bench_scenarios.py --structured``.

Prompts (``scripts/prompts/structured.jsonl``, or ``--prompts-file``): JSON lines with a ``scenario`` name, a
completion ``prompt`` and what the output must match — ``schema`` (a JSON schema), ``regex`` or ``choice``
(a list of strings). Per scenario, at batch 1, every prompt goes through five runs in turn (interleaved as
the scenario benchmark does, ``evaluation.scenarios.interleaved``):

- ``unconstrained plain``: the target alone, no grammar;
- ``unconstrained spec``: the draft model with the adaptive γ, no grammar (what a caller gets today);
- ``constrained plain``: the target alone, its logits masked by the grammar;
- ``constrained spec``: the draft model, masked q and masked p, forced tokens proposed free;
- ``constrained spec, no forced``: the same without forced tokens (``speculation.forced_tokens: false``).

The unconstrained runs stop at the length of the prompt's constrained answer (what constrained plain
decoding emits, run once before the timed rounds), so every run decodes as many tokens per prompt and their
tokens/s compare the same work: a choice is a few tokens, and left to run on, the unconstrained text would
spread its prompt's prefill over many more.

Columns: the share of outputs valid against their schema (``json.loads`` + ``jsonschema``) / regex / choice,
the acceptance rate of model drafts, tokens per target pass (emitted per verify step), tokens/s, forced-token
share, mask milliseconds per step and the mask's share of the run's wall time. Greedy outputs of the
speculative runs are compared with the plain run's of the same kind (they must be identical).

    python scripts/bench_scenarios.py --structured [--prompts 16] [--max-tokens 96] [--repeats 2] [--out DIR]
        [--mixed-batch 16]

``--mixed-batch N`` adds what constrained rows cost the unconstrained rows of their batch: N rows at once
through the speculative engine, half of them the scenarios' prompts constrained and half other prompts
unconstrained (``max_tokens``), against the same batch with the constrained half unconstrained and cut at its
constrained answers' lengths, so both batches shrink alike as rows finish. Two figures, each one less a ratio
of the two batches (median of ``--mixed-rounds`` interleaved rounds): ``cost``, of their tokens/s, which also
counts the constrained half's own decoding (its text is harder for the draft, and a batch lasts as long as
its slowest row); and ``cost_to_unconstrained``, of the unconstrained rows' own tokens/s, read from their
seconds from the batch's start to their last token, summed: what constrained rows cost the rows beside them.
The unconstrained rows' outputs must be the same in both.

Writes DIR/structured.json and DIR/structured.md.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "scripts" / "prompts" / "structured.jsonl"
RUNS = ("unconstrained plain", "unconstrained spec", "constrained plain", "constrained spec",
        "constrained spec, no forced")


def load_rows(path: Path, limit: int) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            group = groups.setdefault(row["scenario"], [])
            if len(group) < limit:
                group.append(row)
    return groups


def grammar_spec(row: dict):
    from engine.grammar import GrammarSpec

    if "schema" in row:
        return GrammarSpec("json_schema", row["schema"])
    if "regex" in row:
        return GrammarSpec("regex", row["regex"])
    return GrammarSpec("choice", row["choice"])


def valid(row: dict, text: str) -> bool:
    """Whether ``text`` is what ``row`` asks for."""
    import jsonschema

    if "regex" in row:
        return re.fullmatch(row["regex"], text) is not None
    if "choice" in row:
        return text in row["choice"]
    try:
        jsonschema.validate(json.loads(text), row["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def plain_of(run: str) -> str:
    """The plain run a run's greedy outputs must equal."""
    return "unconstrained plain" if run.startswith("unconstrained") else "constrained plain"


def run_structured(args) -> int:
    from tqdm import tqdm

    from engine.assembly import EngineSettings, make_engine
    from engine.engine import Request
    from engine.grammar import GrammarCompiler, map_tokenizer
    from evaluation.scenarios import interleaved, load_pair

    tok, target, draft, eos, max_len = load_pair(args)
    compiler = GrammarCompiler(map_tokenizer(tok, target.config.vocab_size))

    def engine(proposer: str | None, forced: bool = True, slots: int = 1):
        settings = EngineSettings(target=args.target, draft=proposer, device="cpu", dtype="float32", max_len=max_len,
                                  max_slots=slots, gamma=args.gamma, gamma_max=args.gamma_max, forced_tokens=forced)
        return make_engine(settings, target_model=target, draft_model=draft, eos_token_ids=eos)

    engines = dict(zip(RUNS, (engine(None), engine(args.draft), engine(None), engine(args.draft),
                              engine(args.draft, forced=False))))

    def runner(name: str):
        eng = engines[name]
        constrained = not name.startswith("unconstrained")

        def run_one(x):
            ids, grammar, length = x
            request = Request(tuple(ids), max_tokens=args.max_tokens if constrained else length,
                              grammar=grammar if constrained else None)
            return list(eng.generate([request])[0].tokens)
        return run_one

    runs = {name: runner(name) for name in RUNS}
    groups = load_rows(args.prompts_file or PROMPTS, args.prompts)
    rows, every = [], []  # every: each scenario's (ids, grammar), for --mixed-batch
    for scenario, prompt_rows in groups.items():
        inputs = []
        for r in prompt_rows:
            ids, grammar = tok(r["prompt"])["input_ids"], compiler.compile(grammar_spec(r))
            inputs.append((ids, grammar, len(runs["constrained plain"]((ids, grammar, args.max_tokens)))))
            every.append((ids, grammar))
        for run_one in runs.values():
            run_one(inputs[0])  # warm-up: first-call costs, the γ policy's first steps
        for eng in engines.values():
            eng.stats = type(eng.stats)()
        outputs, seconds = interleaved(runs, inputs, args.repeats, tqdm(desc=scenario, file=sys.stderr, leave=False))
        row = {"scenario": scenario, "prompts": len(inputs), "runs": {}}
        for name in RUNS:
            st = engines[name].stats
            texts = [tok.decode(o, skip_special_tokens=True) for o in outputs[name]]
            tokens = sum(map(len, outputs[name]))
            row["runs"][name] = {
                "valid_share": sum(valid(r, t) for r, t in zip(prompt_rows, texts)) / len(texts),
                "acceptance_rate": st.acceptance_rate, "tokens_per_pass": st.acceptance_length,
                "tokens": tokens, "tok_s": tokens / seconds[name], "forced_share": st.forced_share,
                # per repeat: the stats count every repeat's steps, the seconds the fastest repeat
                "mask_ms_per_step": 1e3 * st.mask_seconds / max(st.steps, 1),
                "mask_share": st.mask_seconds / args.repeats / seconds[name],
                "identical_to_plain": sum(a == b for a, b in zip(outputs[name], outputs[plain_of(name)])),
                "sample": texts[0]}
        tok_s = {name: v["tok_s"] for name, v in row["runs"].items()}
        row["constrained_over_unconstrained_spec"] = tok_s["constrained spec"] / tok_s["unconstrained spec"]
        row["constrained_over_unconstrained_plain"] = tok_s["constrained plain"] / tok_s["unconstrained plain"]
        row["spec_over_plain_constrained"] = tok_s["constrained spec"] / tok_s["constrained plain"]
        row["forced_gain"] = tok_s["constrained spec"] / tok_s["constrained spec, no forced"]
        rows.append(row)

    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": time.strftime("%Y-%m-%d"), "target": args.target, "draft": args.draft,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "scenarios": rows}
    if args.mixed_batch:
        report["mixed_batch"] = mixed_batch(args, engine(args.draft, slots=args.mixed_batch), every)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "structured.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {args.out / 'structured.json'}, {args.out / 'structured.md'}")
    return 0


def mixed_batch(args, eng, prompts: list[tuple]) -> dict:
    """``--mixed-batch``: what constrained rows cost the unconstrained rows beside them (see the module docstring).
    ``prompts``: (ids, grammar) of every scenario's prompts, cycled through for the constrained half; the
    unconstrained half takes the prompts after them."""
    from engine.engine import Request
    from tqdm import tqdm

    from evaluation.scenarios import interleaved

    n = args.mixed_batch
    half = [prompts[i % len(prompts)] for i in range(n // 2)]
    free = [Request(tuple(prompts[(n // 2 + i) % len(prompts)][0]), max_tokens=args.max_tokens)
            for i in range(n - n // 2)]
    beside = [Request(tuple(ids), max_tokens=args.max_tokens, grammar=grammar) for ids, grammar in half] + free
    warm = eng.generate(beside)
    lengths = [len(o.tokens) for o in warm[: len(half)]]
    alone = [Request(tuple(ids), max_tokens=m) for (ids, _), m in zip(half, lengths)] + free
    finished: dict[str, list[float]] = {"alone": [], "beside constrained rows": []}  # per round

    def run(name: str, batch: list) -> list[tuple[int, ...]]:
        """The batch to its end; the unconstrained rows' seconds to their last token go to ``finished``."""
        ids, seconds, started = [eng.add(r) for r in batch], {}, time.perf_counter()
        while len(seconds) < len(ids):
            eng.step()
            seconds.update((i, time.perf_counter() - started) for i in ids if i not in seconds and i in eng.finished)
        finished[name].append(sum(seconds[i] for i in ids[len(half):]))
        return [eng.output(i).tokens for i in ids]

    runs = {name: (lambda _, name=name, batch=batch: run(name, batch))
            for name, batch in (("alone", alone), ("beside constrained rows", beside))}
    rounds: dict = {}
    outputs, _ = interleaved(runs, [None], args.mixed_rounds,
                             tqdm(desc=f"mixed batch {n}", file=sys.stderr, leave=False), rounds)
    alone_out, beside_out = outputs["alone"][0], outputs["beside constrained rows"][0]

    def cost(seconds: dict) -> float:
        return 1 - statistics.median(a / b for a, b in zip(seconds["alone"], seconds["beside constrained rows"]))

    return {"batch": n, "constrained_rows": len(half), "rounds": args.mixed_rounds, "tokens": sum(map(len, alone_out)),
            "tok_s_alone": sum(map(len, alone_out)) / min(rounds["alone"]),
            "tok_s_beside": sum(map(len, beside_out)) / min(rounds["beside constrained rows"]),
            "cost": cost(rounds), "cost_to_unconstrained": cost(finished),
            "unconstrained_identical": sum(a == b for a, b in zip(alone_out[len(half):], beside_out[len(half):])),
            "unconstrained_rows": len(free)}


def markdown(report: dict) -> str:
    head = ["scenario", "run", "valid", "acceptance rate", "tokens / target pass", "tok/s*", "forced share",
            "mask ms / step", "mask share", "identical to plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["scenarios"]:
        for name, v in r["runs"].items():
            same = "" if name == plain_of(name) else f"{v['identical_to_plain']}/{r['prompts']}"
            lines.append("| " + " | ".join([
                f"{r['scenario']} ({r['prompts']})", name, f"{v['valid_share']:.0%}", f"{v['acceptance_rate']:.1%}",
                f"{v['tokens_per_pass']:.2f}", f"{v['tok_s']:.1f}", f"{v['forced_share']:.1%}",
                f"{v['mask_ms_per_step']:.3f}", f"{v['mask_share']:.1%}", same]) + " |")
    lines.append("")
    lines += [f"{r['scenario']}: constrained spec / unconstrained spec "
              f"{r['constrained_over_unconstrained_spec']:.2f}×, constrained plain / unconstrained plain "
              f"{r['constrained_over_unconstrained_plain']:.2f}×, constrained spec / constrained plain "
              f"{r['spec_over_plain_constrained']:.2f}×, forced tokens gain {r['forced_gain']:.2f}×"
              for r in report["scenarios"]]
    if report.get("mixed_batch"):
        m = report["mixed_batch"]
        lines.append(f"batch {m['batch']}, {m['constrained_rows']} rows constrained: the batch's tokens/s "
                     f"{m['tok_s_beside']:.1f} against {m['tok_s_alone']:.1f} with those rows unconstrained "
                     f"({m['cost']:.1%} less); the unconstrained rows' own tokens/s (from their seconds to their "
                     f"last token) {m['cost_to_unconstrained']:.1%} less (medians of {m['rounds']} rounds); their outputs "
                     f"identical {m['unconstrained_identical']}/{m['unconstrained_rows']}")
    lines.append(f"*absolute figures: {report['machine']}, {report['date']}; batch 1, max_tokens "
                 f"{report['max_tokens']} (unconstrained runs: the constrained answer's length), fastest of "
                 f"{report['repeats']} repeats.")
    return "\n".join(lines)
