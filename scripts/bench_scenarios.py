#!/usr/bin/env python3
"""Scenario benchmark: JSON / code / prose, plain vs speculative, against the Leviathan bound and HF.

For a (target, draft) pair of local Hugging Face folders (default: the embedded pair in models/default),
per scenario (the prompt sets in scripts/prompts/), at batch 1 and in one run:

- plain greedy decoding tokens/s of the same engine, speculative tokens/s (adaptive γ), the gain, and the
  gain of specserve's own n-gram (prompt lookup) proposer beside HF's;
- acceptance rate, mean acceptance length, mean draft length γ, α, the cost ratio c (one draft forward /
  one target forward, measured here) and the Leviathan bound S = (1−α^(γ+1)) / ((1−α)(γc+1));
- Hugging Face ``generate`` plain, ``generate(assistant_model=draft)`` and
  ``generate(prompt_lookup_num_tokens=…)`` on the same pair: their speed-ups over HF plain;
- the share of JSON outputs ``json.loads`` accepts and of code outputs ``ast.parse`` accepts (and, stricter,
  of code outputs whose function holds a statement that is not a string: comments alone parse too);
- a batch-16 row: plain vs speculative throughput of the engine over all prompts;
- every speculative output checked token-identical to plain greedy decoding (count shown), and the
  engine's plain output compared with HF's.

Every prompt goes through all six runs in turn (engine plain, engine speculative with the draft, engine
n-gram, HF plain, HF assisted, HF prompt lookup), so the ratios are measured side by side. Models are built as ``serve`` builds them
(``verifier.models.build_model``; on CPU that prepacks the Linear weights, see ``verifier/cpu_linear.py``)
and HF generates with the same model objects.

    python scripts/bench_scenarios.py [--target DIR --draft DIR] [--max-tokens 64] [--prompts 24]
    specserve bench scenarios -- --max-tokens 32

Writes bench-out/scenarios.json, bench-out/scenarios.md and bench-out/scenarios.png (gain vs acceptance
with the bound curve); progress bars on stderr.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verifier.gamma import expected_speedup as leviathan_bound  # noqa: E402  S(α, γ, c), DESIGN.md §2

SCENARIOS = ("json", "code", "prose")


def load_prompts(name: str, limit: int) -> list[dict]:
    lines = (REPO / "scripts" / "prompts" / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:limit]


def json_ok(prompt: str, output: str) -> bool:
    """Does the prompt's JSON opening plus the output hold one complete, valid JSON value?"""
    starts = [i for i in (prompt.rfind("{"), prompt.rfind("[")) if i >= 0]
    text = (prompt[max(starts):] if starts else "") + output
    try:
        json.JSONDecoder().raw_decode(text.lstrip())
        return True
    except ValueError:
        return False


def completed_code(prompt: str, output: str) -> ast.Module | None:
    """prompt + output parsed as Python once the last, possibly cut-off, line is dropped; None if it fails.

    An output without one complete line counts as a failure: the prompt alone must not pass."""
    body = output.rsplit("\n", 1)[0] if "\n" in output else ""
    if not body.strip():
        return None
    try:
        return ast.parse(prompt + body)
    except SyntaxError:
        return None


def code_ok(prompt: str, output: str) -> bool:
    return completed_code(prompt, output) is not None


def code_has_statement(prompt: str, output: str) -> bool:
    """Stricter than ``code_ok``: the completed function must also hold a statement that is not a string.

    Comments vanish in the AST and a stray docstring is a string expression, so a body of only those
    parses but is not an implementation; this share says how often the model wrote actual code."""
    tree = completed_code(prompt, output)
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] if tree else []
    return any(not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
               for d in defs for stmt in d.body)


def cost_ratio(target, draft, prompt: list[int], steps: int = 40) -> float:
    """c = one draft decode forward / one target decode forward, batch 1, same context.

    The two alternate, as they do in the speculative loop, so each finds the caches the other left
    (measured back to back, the small draft would run from a warm cache it never has in practice).
    Median of ``steps`` each.
    """
    import statistics

    from verifier.protocol import SyncItem
    from verifier.runner import ModelRunner

    runners = [ModelRunner(m, max_slots=1, max_len=len(prompt) + steps + 2) for m in (draft, target)]
    times: list[list[float]] = [[], []]
    for runner in runners:
        runner.sync(SyncItem(0, 0, tuple(prompt)))
        runner.forward([0], [[]], [1])  # prefill
    for i in range(steps):
        for runner, record in zip(runners, times):
            runner.sync(SyncItem(0, len(prompt) + i, (5,)))
            t0 = time.perf_counter()
            runner.forward([0], [[]], [1])
            record.append(time.perf_counter() - t0)
    return statistics.median(times[0]) / statistics.median(times[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO / "models" / "default" / "target"))
    parser.add_argument("--draft", default=str(REPO / "models" / "default" / "draft"))
    parser.add_argument("--prompts", type=int, default=24, help="prompts per scenario")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="initial γ of the adaptive policy")
    parser.add_argument("--gamma-max", type=int, default=8)
    parser.add_argument("--fixed-gamma", action="store_true")
    parser.add_argument("--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument("--batch", type=int, default=16, help="batch size of the throughput row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face comparisons")
    parser.add_argument("--out", default="bench-out/scenarios")
    args = parser.parse_args()

    import torch
    from tqdm import tqdm

    from verifier.engine import Request
    from verifier.factory import EngineSettings, make_engine
    from verifier.models import build_model, check_vocab_compatible, load_tokenizer

    torch.set_num_threads(args.threads)
    check_vocab_compatible(args.target, args.draft)
    tok = load_tokenizer(args.target)
    # build_model is what serving uses (CPU float32: oneDNN-prepacked Linear layers); HF generate runs on
    # these same model objects, so both sides get the same kernels.
    target = build_model(args.target, "cpu", "float32")
    draft = build_model(args.draft, "cpu", "float32")
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    max_len = min(1024, target.config.max_position_embeddings)

    def engine(proposer: str | None, slots: int = 1, guard: bool = False):
        """proposer: the draft folder, "ngram" (prompt lookup) or None (plain decoding)."""
        settings = EngineSettings(target=args.target, draft=proposer, device="cpu",
                                  dtype="float32", max_len=max_len, max_slots=slots, gamma=args.gamma,
                                  gamma_max=args.gamma_max, adaptive=not args.fixed_gamma, goodput_guard=guard)
        return make_engine(settings, target_model=target, draft_model=draft, eos_token_ids=eos)

    def engine_run(eng):
        def run(ids):
            return list(eng.generate([Request(tuple(ids), max_tokens=args.max_tokens)])[0].tokens)
        return run

    def hf_run(**kwargs):
        def run(ids):
            with torch.inference_mode():
                x = torch.tensor([ids])
                out = target.generate(x, max_new_tokens=args.max_tokens, do_sample=False,
                                      pad_token_id=tok.pad_token_id or 0, **kwargs)
            return out[0, x.shape[1]:].tolist()
        return run

    rows, identical_total, compared_total = [], 0, 0
    for scenario in SCENARIOS:
        prompts = load_prompts(scenario, args.prompts)
        prompt_ids = [tok(p["prompt"])["input_ids"] for p in prompts]
        eng_spec = engine(args.draft)
        runs = {"plain": engine_run(engine(None)), "spec": engine_run(eng_spec), "ngram": engine_run(engine("ngram"))}
        if not args.skip_hf:
            runs.update(hf_plain=hf_run(), hf_assisted=hf_run(assistant_model=draft),
                        hf_lookup=hf_run(prompt_lookup_num_tokens=args.prompt_lookup))
        for run in runs.values():
            run(prompt_ids[0][:8])  # warm-up: allocator, oneDNN primitives, first-call costs
        eng_spec.stats = type(eng_spec.stats)()
        # Interleaved: every prompt goes through every run in turn (order alternating), so a slow spell
        # of this shared machine lands on all of them alike instead of on whichever ran then.
        outputs = {name: [] for name in runs}
        seconds = dict.fromkeys(runs, 0.0)
        for i, ids in enumerate(tqdm(prompt_ids, desc=scenario, file=sys.stderr, leave=False)):
            for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                t0 = time.perf_counter()
                outputs[name].append(runs[name](ids))
                seconds[name] += time.perf_counter() - t0
        tok_s = {name: sum(map(len, outputs[name])) / seconds[name] for name in runs}
        identical = sum(a == b for a, b in zip(outputs["plain"], outputs["spec"]))
        ngram_identical = sum(a == b for a, b in zip(outputs["plain"], outputs["ngram"]))
        identical_total += identical
        compared_total += len(prompt_ids)
        c = cost_ratio(target, draft, prompt_ids[0])
        st = eng_spec.stats
        bound = leviathan_bound(st.alpha, st.mean_gamma, c)
        gain = tok_s["spec"] / tok_s["plain"]
        texts = [tok.decode(o, skip_special_tokens=True) for o in outputs["spec"]]
        row = {"scenario": scenario, "prompts": len(prompts), "plain_tok_s": tok_s["plain"],
               "spec_tok_s": tok_s["spec"], "gain": gain, "acceptance_rate": st.acceptance_rate,
               "acceptance_length": st.acceptance_length, "mean_gamma": st.mean_gamma, "alpha": st.alpha,
               "c": c, "bound": bound, "gain_over_bound": gain / bound, "identical": identical,
               "per_position_acceptance": st.per_position(),
               "draft_ms_per_step": 1e3 * st.draft_seconds / max(st.steps, 1),
               "verify_ms_per_step": 1e3 * st.verify_seconds / max(st.steps, 1),
               "plain_ms_per_token": 1e3 / tok_s["plain"],
               "ngram_gain": tok_s["ngram"] / tok_s["plain"], "ngram_identical": ngram_identical}
        if scenario == "json":
            row["json_valid_share"] = sum(json_ok(p["prompt"], t) for p, t in zip(prompts, texts)) / len(texts)
        if scenario == "code":
            row["code_parse_share"] = sum(code_ok(p["prompt"], t) for p, t in zip(prompts, texts)) / len(texts)
            row["code_statement_share"] = (sum(code_has_statement(p["prompt"], t) for p, t in zip(prompts, texts))
                                           / len(texts))
        row["samples"] = [{"prompt": p["prompt"], "output": t} for p, t in zip(prompts[:2], texts[:2])]
        if not args.skip_hf:
            row.update(hf_plain_tok_s=tok_s["hf_plain"], hf_assisted_gain=tok_s["hf_assisted"] / tok_s["hf_plain"],
                       hf_prompt_lookup_gain=tok_s["hf_lookup"] / tok_s["hf_plain"])
            row["gain_over_hf_assisted"] = gain / row["hf_assisted_gain"]
            row["plain_matches_hf"] = sum(a == b for a, b in zip(outputs["plain"], outputs["hf_plain"]))
        rows.append(row)

    # Batch row: every prompt, `batch` sequences at a time: plain, speculative (serve's defaults) and
    # speculative with the opt-in goodput guard, interleaved per group of prompts.
    all_ids = [tok(p["prompt"])["input_ids"] for s in SCENARIOS for p in load_prompts(s, args.prompts)]
    batch_engines = {"plain": engine(None, slots=args.batch), "spec": engine(args.draft, slots=args.batch),
                     "spec_guarded": engine(args.draft, slots=args.batch, guard=True)}
    batch_out = {name: [] for name in batch_engines}
    batch_s = dict.fromkeys(batch_engines, 0.0)
    for i in tqdm(range(0, len(all_ids), args.batch), desc=f"batch {args.batch}", file=sys.stderr, leave=False):
        group = [Request(tuple(ids), max_tokens=args.max_tokens) for ids in all_ids[i:i + args.batch]]
        for name, eng in batch_engines.items():
            t0 = time.perf_counter()
            batch_out[name].extend(o.tokens for o in eng.generate(group))
            batch_s[name] += time.perf_counter() - t0
    batch_row = {"batch": args.batch, "prompts": len(all_ids),
                 "identical": sum(a == b for a, b in zip(batch_out["plain"], batch_out["spec"]))}
    for name in batch_engines:
        batch_row[f"{name}_tok_s"] = sum(map(len, batch_out[name])) / batch_s[name]
    batch_row["mean_gamma"] = batch_engines["spec"].stats.mean_gamma
    batch_row["mean_gamma_guarded"] = batch_engines["spec_guarded"].stats.mean_gamma
    batch_row["gain"] = batch_row["spec_tok_s"] / batch_row["plain_tok_s"]
    batch_row["gain_guarded"] = batch_row["spec_guarded_tok_s"] / batch_row["plain_tok_s"]

    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": time.strftime("%Y-%m-%d"), "target": args.target, "draft": args.draft, "args": vars(args),
              "scenarios": rows, "batch": batch_row, "identical": identical_total, "compared": compared_total}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    out.with_suffix(".md").write_text(table + "\n")
    plot(rows, out.with_suffix(".png"))
    print(table)
    print(f"\nwrote {out.with_suffix('.json')}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


def markdown(report: dict) -> str:
    hf = "hf_assisted_gain" in report["scenarios"][0]
    head = ["scenario", "gain", "bound S", "gain/S", "acceptance rate", "acceptance length", "mean γ", "α", "c"]
    if hf:
        head += ["HF assisted", "HF prompt lookup", "gain / HF assisted"]
    head += ["n-gram (specserve)", "plain tok/s*", "spec tok/s*", "identical", "valid"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["scenarios"]:
        cells = [r["scenario"], f"{r['gain']:.2f}×", f"{r['bound']:.2f}×", f"{r['gain_over_bound']:.2f}",
                 f"{r['acceptance_rate']:.1%}", f"{r['acceptance_length']:.2f}", f"{r['mean_gamma']:.2f}",
                 f"{r['alpha']:.3f}", f"{r['c']:.3f}"]
        if hf:
            cells += [f"{r['hf_assisted_gain']:.2f}×", f"{r['hf_prompt_lookup_gain']:.2f}×",
                      f"{r['gain_over_hf_assisted']:.2f}"]
        valid = (f"json.loads {r['json_valid_share']:.0%}" if "json_valid_share" in r else
                 f"ast.parse {r['code_parse_share']:.0%}, with a statement {r['code_statement_share']:.0%}"
                 if "code_parse_share" in r else "")
        cells += [f"{r['ngram_gain']:.2f}×", f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                  f"{r['identical']}/{r['prompts']}", valid]
        lines.append("| " + " | ".join(cells) + " |")
    b = report["batch"]
    lines.append("")
    lines.append(f"Batch {b['batch']} ({b['prompts']} prompts): plain {b['plain_tok_s']:.1f} tok/s*, speculative "
                 f"{b['spec_tok_s']:.1f} tok/s* (gain {b['gain']:.2f}×, mean γ {b['mean_gamma']:.2f}; with the "
                 f"goodput guard {b['spec_guarded_tok_s']:.1f} tok/s*, {b['gain_guarded']:.2f}×, mean γ "
                 f"{b['mean_gamma_guarded']:.2f}); {b['identical']}/{b['prompts']} identical to plain.")
    ngram = sum(r["ngram_identical"] for r in report["scenarios"])
    lines.append(f"Greedy identity at batch 1: {report['identical']}/{report['compared']} speculative outputs equal "
                 f"plain decoding (draft model); n-gram proposer {ngram}/{report['compared']}.")
    lines.append(f"*absolute figures: {report['machine']}, {report['date']}.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    alphas = [i / 100 for i in range(0, 100)]
    for r in rows:
        curve = [leviathan_bound(a, r["mean_gamma"], r["c"]) for a in alphas]
        ax.plot(alphas, curve, lw=0.8, alpha=0.6, label=f"bound, γ={r['mean_gamma']:.1f}, c={r['c']:.2f}")
        ax.scatter([r["alpha"]], [r["gain"]], zorder=3)
        ax.annotate(r["scenario"], (r["alpha"], r["gain"]), textcoords="offset points", xytext=(4, 4))
        if "hf_assisted_gain" in r:
            ax.scatter([r["alpha"]], [r["hf_assisted_gain"]], marker="x", color="grey", zorder=3)
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel("α (per-position acceptance)")
    ax.set_ylabel("throughput gain over plain decoding")
    ax.set_title("specserve gain (dots), HF assisted (×), Leviathan bound (lines)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
