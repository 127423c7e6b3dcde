#!/usr/bin/env python3
"""Scenario benchmark: JSON / code / prose, plain vs speculative, against fixed γ, the Leviathan bound and HF.

For a (target, draft) pair of local Hugging Face folders (default: the embedded pair in models/default),
per scenario, at batch 1 and in one run:

- plain greedy decoding tokens/s of the same engine, speculative tokens/s with the adaptive γ policy, the
  gain, and the gain of specserve's own n-gram (prompt lookup) proposer beside HF's;
- a fixed-γ sweep (``--fixed-gammas``, default γ = 1…8): tokens/s at each fixed γ, the best of them, and
  the adaptive policy's tokens/s over the best fixed γ's;
- acceptance rate, mean acceptance length, mean draft length γ, α, the cost ratio c (one draft forward /
  one target forward, measured here) and the Leviathan bound S = (1−α^(γ+1)) / ((1−α)(γc+1));
- Hugging Face ``generate`` plain, ``generate(assistant_model=draft)`` and
  ``generate(prompt_lookup_num_tokens=…)`` on the same pair: their speed-ups over HF plain;
- for scenarios named ``json`` and ``code``, the share of valid outputs (``evaluation/quality.py``: the
  completion of the prompt's opening, or the fenced / raw JSON or code of a chat answer);
- chain vs token tree (issue 15; ``--trees``, default depth:nodes 4:16, 6:32, 8:64): mean tokens per target
  pass of every fixed-γ chain and every fixed draft-model tree, the best of each and their ratio, and the
  tokens/s of the automatic shape (the adaptive policy choosing chain or tree per step, ``--auto-tree-nodes``)
  beside the adaptive chain's;
- batch rows (``--batch``, default 1,2,4,8,16): plain vs speculative throughput of the engine over all
  prompts at each batch size, a second plain engine as the control (what the box's noise makes of 1.0 in
  the same rounds), and each fixed γ of the sweep beside the adaptive policy; the
  gains are the median over ``--repeats`` interleaved rounds;
- every speculative output checked token-identical to plain greedy decoding (counts shown), and the
  engine's plain output compared with HF's.

Every prompt goes through all runs in turn (engine plain, adaptive, n-gram, each fixed γ, each fixed tree,
the automatic shape, HF plain, HF assisted, HF prompt lookup; the order reversed every other prompt), so the ratios are measured side by
side; ``--repeats N`` runs the whole round N times and times each (prompt, run) by its fastest, for a
machine shared with other work. Models are built as ``serve`` builds them
(``runtime.models.build_model``; on CPU that prepacks the Linear weights, see ``runtime/cpu_linear.py``)
and HF generates with the same model objects.

Prompts: the repository's completion prompt sets (scripts/prompts/{json,code,prose}.jsonl), or your own
with ``--prompts-file FILE``: JSON lines, one prompt each, in either form

    {"scenario": "json", "prompt": "Convert to JSON: name Bob, age 40\\n{"}        sent as is
    {"scenario": "code", "messages": [{"role": "user", "content": "Write …"}]}   through the chat template

(an optional "id" names the row). ``messages`` rows go through the target tokenizer's chat template;
``--chat`` sends ``prompt`` rows through it too, as one user message. Scenarios are the rows' names, in
the order they first appear; ``--prompts N`` keeps the first N of each.

    python scripts/bench_scenarios.py [--target DIR --draft DIR] [--prompts-file F.jsonl] [--chat]
        [--prompts 24] [--max-tokens 64] [--fixed-gammas 1-8] [--trees 4:16,6:32,8:64] [--auto-tree-nodes 64]
        [--batch 1,2,4,8,16] [--skip-hf] [--out DIR]
    specserve bench scenarios -- --prompts 8

``--structured`` runs the structured-outputs benchmark instead (``evaluation/structured.py``).

Writes DIR/scenarios.json, DIR/scenarios.md and DIR/scenarios.png (gain vs acceptance with the bound
curve; DIR defaults to bench-out); progress bars on stderr. Run time grows with the runs per prompt:
``--prompts``, ``--fixed-gammas none`` and ``--skip-hf`` shorten it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from engine.gamma import expected_speedup as leviathan_bound
from evaluation.quality import code_has_statement, code_ok, json_ok

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("json", "code", "prose")


class PromptError(ValueError):
    """A prompts file or row the benchmark cannot use; the message says which and why."""


def load_prompts(name: str, limit: int) -> list[dict]:
    """The first ``limit`` prompts of one of the repository's sets (completion prompts)."""
    lines = (REPO / "scripts" / "prompts" / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:limit]


def read_prompts_file(path: Path, limit: int) -> dict[str, list[dict]]:
    """Rows of a JSONL prompts file grouped by scenario (first-appearance order), at most ``limit`` each."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise PromptError(f"cannot read the prompts file: {e}") from e
    groups: dict[str, list[dict]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PromptError(f"{where}: not a JSON object ({e})") from e
        if not isinstance(row, dict) or not isinstance(row.get("scenario"), str) or not row["scenario"]:
            raise PromptError(f'{where}: each row needs a "scenario" name (a non-empty string)')
        if ("prompt" in row) == ("messages" in row):
            raise PromptError(f'{where}: give exactly one of "prompt" (text) or "messages" (a chat)')
        if "prompt" in row and (not isinstance(row["prompt"], str) or not row["prompt"]):
            raise PromptError(f'{where}: "prompt" must be a non-empty string')
        if "messages" in row:
            msgs = row["messages"]
            if (not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)):
                raise PromptError(f'{where}: "messages" must be a non-empty list of {{"role": str, '
                                  f'"content": str}} objects')
        group = groups.setdefault(row["scenario"], [])
        if len(group) < limit:
            group.append({**row, "id": str(row.get("id", f"{row['scenario']}-{len(group)}"))})
    if not groups:
        raise PromptError(f"{path}: no prompts")
    return groups


def encode(row: dict, tok, chat: bool) -> dict:
    """Token ids of one row, and ``continues``: the text the output continues ("" for a chat answer)."""
    messages = row.get("messages") or ([{"role": "user", "content": row["prompt"]}] if chat else None)
    if messages is None:
        return {"id": row.get("id"), "text": row["prompt"], "ids": tok(row["prompt"])["input_ids"],
                "continues": row["prompt"]}
    if not getattr(tok, "chat_template", None):
        raise PromptError(f"row {row.get('id')!r} is a chat, but the target's tokenizer has no chat template: "
                          f'give it as a "prompt" row (sent as is), or use a model with a template')
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens itself (BOS, role markers): do not add them a second time.
    return {"id": row.get("id"), "text": text, "ids": tok(text, add_special_tokens=False)["input_ids"],
            "continues": ""}


def parse_counts(spec: str, what: str) -> list[int]:
    """"1-8", "1,2,4,8" or "none": positive integers, sorted, each once."""
    if spec.strip().lower() in ("", "none"):
        return []
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{what}: comma-separated integers or ranges a-b, got {spec!r}") from e
    if any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"{what} must be ≥ 1, got {spec!r}")
    return sorted(set(out))


def parse_gammas(spec: str) -> list[int]:
    return parse_counts(spec, "fixed γ")


def parse_batches(spec: str) -> list[int]:
    """Batch sizes; "0" (the old option's "no row") reads as none."""
    return [] if spec.strip() == "0" else parse_counts(spec, "batch sizes")


def parse_trees(spec: str) -> list[tuple[int, int]]:
    """"4:16,8:64" (depth γ : node budget) or "none"."""
    if spec.strip().lower() in ("", "none"):
        return []
    try:
        trees = [(int(d), int(n)) for d, n in (part.strip().split(":") for part in spec.split(","))]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"trees are depth:nodes pairs, got {spec!r}") from e
    if any(d < 1 or n < 1 for d, n in trees):
        raise argparse.ArgumentTypeError(f"tree depth and nodes must be ≥ 1, got {spec!r}")
    return trees


class NodeCount:
    """The engine's proposer, counting the draft tokens (a chain's drafts, a tree's nodes) it proposes."""

    def __init__(self, proposer):
        self.proposer, self.nodes = proposer, 0

    def propose(self, items):
        batch = self.proposer.propose(items)
        self.nodes += int(batch.lengths.sum())
        return batch

    def release(self, seq_ids):
        self.proposer.release(seq_ids)


def cost_ratio(target, draft, prompt: list[int], steps: int = 40) -> float:
    """c = one draft decode forward / one target decode forward, batch 1, same context.

    The two alternate, as they do in the speculative loop, so each finds the caches the other left
    (measured back to back, the small draft would run from a warm cache it never has in practice).
    Median of ``steps`` each.
    """
    from runtime.protocol import SyncItem
    from runtime.runner import ModelRunner

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


def validity(scenario: str, prompts: list[dict], texts: list[str]) -> dict:
    """Shares of valid outputs for the json and code scenarios (empty for others)."""
    pairs = [(p["continues"], t) for p, t in zip(prompts, texts)]
    if scenario == "json":
        return {"json_valid_share": sum(json_ok(*pt) for pt in pairs) / len(pairs)}
    if scenario == "code":
        return {"code_parse_share": sum(code_ok(*pt) for pt in pairs) / len(pairs),
                "code_statement_share": sum(code_has_statement(*pt) for pt in pairs) / len(pairs)}
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO / "models" / "default" / "target"))
    parser.add_argument("--draft", default=str(REPO / "models" / "default" / "draft"))
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSONL prompts (scenario + prompt or messages); "
                             "default: scripts/prompts/{json,code,prose}.jsonl")
    parser.add_argument("--chat", action="store_true",
                        help="send prompt rows through the chat template too (as one user message)")
    parser.add_argument("--prompts", type=int, default=24, help="prompts per scenario (the first N)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="initial γ of the adaptive policy")
    parser.add_argument("--gamma-max", type=int, default=8)
    parser.add_argument("--fixed-gammas", type=parse_gammas, default="1-8",
                        help='fixed-γ sweep beside the adaptive policy: "1-8", "1,2,4" or "none"')
    parser.add_argument("--trees", type=parse_trees, default="4:16,6:32,8:64",
                        help='fixed draft-model trees beside the chains, depth:nodes pairs, or "none"')
    parser.add_argument("--auto-tree-nodes", type=int, default=64,
                        help="largest tree of the automatic shape run (0: no such run)")
    parser.add_argument("--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument("--batch", type=parse_batches, default="1,2,4,8,16",
                        help='batch sizes of the throughput rows, comma-separated, or "none"')
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every prompt this many times and time each run by its fastest (shared machines)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face comparisons")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for scenarios.{json,md,png}")
    parser.add_argument("--structured", action="store_true",
                        help="structured outputs instead (evaluation/structured.py): JSON schema, regex and choice "
                             "prompts, unconstrained vs constrained, plain and speculative")
    parser.add_argument("--mixed-batch", type=int, default=0,
                        help="with --structured: also this many rows at once, half constrained, against the same "
                             "batch unconstrained (0: not measured)")
    parser.add_argument("--mixed-rounds", type=int, default=21,
                        help="interleaved rounds of --mixed-batch (the adaptive γ makes single rounds of the same "
                             "batch differ by more than the cost measured)")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_tokens < 1 or args.repeats < 1 or args.mixed_rounds < 1:
        parser.error("--prompts, --max-tokens, --repeats and --mixed-rounds must be ≥ 1")
    if args.structured:
        from evaluation.structured import run_structured

        return run_structured(args)
    try:
        return run(args)
    except PromptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def load_pair(args):
    """The benchmark's pair on CPU at ``args.threads`` threads: (tokenizer, target, draft, eos ids, max_len)."""
    import torch

    from cluster.model_files import check_pair
    from runtime.models import build_model, load_tokenizer

    torch.set_num_threads(args.threads)
    check_pair(args.target, args.draft, where=(args.target, args.draft))
    tok = load_tokenizer(args.target)
    # build_model is what serving uses (CPU float32: oneDNN-prepacked Linear layers); HF generate runs on
    # these same model objects, so both sides get the same kernels.
    target = build_model(args.target, "cpu", "float32")
    draft = build_model(args.draft, "cpu", "float32")
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return tok, target, draft, eos, min(1024, target.config.max_position_embeddings)


def run(args) -> int:
    groups = (read_prompts_file(args.prompts_file, args.prompts) if args.prompts_file else
              {s: load_prompts(s, args.prompts) for s in SCENARIOS})

    import torch
    from tqdm import tqdm

    from engine.engine import Request
    from engine.assembly import EngineSettings, make_engine

    tok, target, draft, eos, max_len = load_pair(args)
    prompts = {s: [encode(row, tok, args.chat) for row in rows] for s, rows in groups.items()}
    for s, ps in prompts.items():
        for p in ps:
            if len(p["ids"]) + args.max_tokens > max_len:
                raise PromptError(f"{s} prompt {p['id']!r}: {len(p['ids'])} tokens + --max-tokens "
                                  f"{args.max_tokens} exceed the context of {max_len} tokens")

    def engine(proposer: str | None, slots: int = 1, gamma: int | None = None, tree_nodes: int = 0):
        """proposer: the draft folder, "ngram" (prompt lookup) or None (plain decoding); gamma: fixed γ
        (None: the adaptive policy starting at --gamma); tree_nodes: the draft model's tree budget."""
        settings = EngineSettings(target=args.target, draft=proposer, device="cpu", dtype="float32",
                                  max_len=max_len, max_slots=slots, gamma=gamma or args.gamma,
                                  gamma_max=max(gamma or 0, args.gamma_max), adaptive=gamma is None,
                                  tree_nodes=tree_nodes)
        eng = make_engine(settings, target_model=target, draft_model=draft, eos_token_ids=eos)
        if proposer == args.draft:
            eng.stages.proposer = NodeCount(eng.stages.proposer)
        return eng

    def engine_run(eng):
        def run_one(ids):
            return list(eng.generate([Request(tuple(ids), max_tokens=args.max_tokens)])[0].tokens)
        return run_one

    def hf_run(**kwargs):
        def run_one(ids):
            with torch.inference_mode():
                x = torch.tensor([ids])
                out = target.generate(x, max_new_tokens=args.max_tokens, do_sample=False,
                                      pad_token_id=tok.pad_token_id or 0, **kwargs)
            return out[0, x.shape[1]:].tolist()
        return run_one

    rows, identical_total, compared_total, fixed_identical_total = [], 0, 0, 0
    for scenario, ps in prompts.items():
        prompt_ids = [p["ids"] for p in ps]
        eng_spec = engine(args.draft)
        runs = {"plain": engine_run(engine(None)), "spec": engine_run(eng_spec), "ngram": engine_run(engine("ngram"))}
        shaped = {f"fixed{g}": engine(args.draft, gamma=g) for g in args.fixed_gammas}
        shaped.update({f"tree{d}:{n}": engine(args.draft, gamma=d, tree_nodes=n) for d, n in args.trees})
        if args.auto_tree_nodes:
            shaped["auto"] = engine(args.draft, tree_nodes=args.auto_tree_nodes)
        runs.update({name: engine_run(eng) for name, eng in shaped.items()})
        if not args.skip_hf:
            runs.update(hf_plain=hf_run(), hf_assisted=hf_run(assistant_model=draft),
                        hf_lookup=hf_run(prompt_lookup_num_tokens=args.prompt_lookup))
        for run_one in runs.values():
            run_one(prompt_ids[0][:8])  # warm-up: allocator, oneDNN primitives, first-call costs
        for eng in [eng_spec, *shaped.values()]:
            eng.stats = type(eng.stats)()
            eng.stages.proposer.nodes = 0
        # Interleaved, so a slow spell of a shared machine lands on all runs alike.
        outputs, seconds = interleaved(runs, prompt_ids, args.repeats, tqdm(desc=scenario, file=sys.stderr,
                                                                             leave=False))
        tok_s = {name: sum(map(len, outputs[name])) / seconds[name] for name in runs}
        identical = sum(a == b for a, b in zip(outputs["plain"], outputs["spec"]))
        ngram_identical = sum(a == b for a, b in zip(outputs["plain"], outputs["ngram"]))
        fixed_identical = sum(a == b for g in args.fixed_gammas
                              for a, b in zip(outputs["plain"], outputs[f"fixed{g}"]))
        identical_total += identical
        fixed_identical_total += fixed_identical
        compared_total += len(prompt_ids)
        c = cost_ratio(target, draft, prompt_ids[0])
        st = eng_spec.stats
        bound = leviathan_bound(st.alpha, st.mean_gamma, c)
        gain = tok_s["spec"] / tok_s["plain"]
        texts = [tok.decode(o, skip_special_tokens=True) for o in outputs["spec"]]
        chat = [not p["continues"] for p in ps]
        row = {"scenario": scenario, "prompts": len(ps),
               "format": "chat" if all(chat) else "completion" if not any(chat) else "mixed",
               "plain_tok_s": tok_s["plain"], "spec_tok_s": tok_s["spec"], "gain": gain,
               "acceptance_rate": st.acceptance_rate, "acceptance_length": st.acceptance_length,
               "mean_gamma": st.mean_gamma, "alpha": st.alpha, "c": c, "bound": bound,
               "gain_over_bound": gain / bound, "identical": identical,
               "per_position_acceptance": st.per_position(),
               "draft_ms_per_step": 1e3 * st.draft_seconds / max(st.steps, 1),
               "verify_ms_per_step": 1e3 * st.verify_seconds / max(st.steps, 1),
               "plain_ms_per_token": 1e3 / tok_s["plain"],
               "ngram_gain": tok_s["ngram"] / tok_s["plain"], "ngram_identical": ngram_identical}
        if args.fixed_gammas:
            fixed = {g: tok_s[f"fixed{g}"] for g in args.fixed_gammas}
            best = max(fixed, key=fixed.get)
            row.update(fixed_tok_s={str(g): v for g, v in fixed.items()}, best_fixed_gamma=best,
                       best_fixed_tok_s=fixed[best], adaptive_over_best_fixed=tok_s["spec"] / fixed[best],
                       fixed_identical=fixed_identical)
        row.update(shape_row(args, shaped, tok_s, outputs))
        row.update(validity(scenario, ps, texts))
        row["samples"] = [{"prompt": p["text"], "output": t} for p, t in zip(ps[:2], texts[:2])]
        if not args.skip_hf:
            row.update(hf_plain_tok_s=tok_s["hf_plain"], hf_assisted_gain=tok_s["hf_assisted"] / tok_s["hf_plain"],
                       hf_prompt_lookup_gain=tok_s["hf_lookup"] / tok_s["hf_plain"])
            row["gain_over_hf_assisted"] = gain / row["hf_assisted_gain"]
            row["plain_matches_hf"] = sum(a == b for a, b in zip(outputs["plain"], outputs["hf_plain"]))
        rows.append(row)

    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": time.strftime("%Y-%m-%d"), "target": args.target, "draft": args.draft,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "scenarios": rows, "identical": identical_total, "compared": compared_total,
              "fixed_identical": fixed_identical_total, "fixed_compared": compared_total * len(args.fixed_gammas)}
    if args.batch:
        all_ids = [p["ids"] for ps in prompts.values() for p in ps]
        report["batches"] = [batch_row(args, b, all_ids, engine, Request, tqdm) for b in args.batch]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenarios.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "scenarios.md").write_text(table + "\n")
    plot(rows, out / "scenarios.png")
    print(table)
    print(f"\nwrote {out / 'scenarios.json'}, {out / 'scenarios.md'}, {out / 'scenarios.png'}")
    return 0


def shape_row(args, shaped: dict, tok_s: dict, outputs: dict) -> dict:
    """Chain vs tree for one scenario: tokens per target pass (emitted per verify step; batch 1) of each fixed
    chain and tree, mean nodes verified per step, and the automatic shape's tokens/s over the adaptive
    chain's."""
    def per_pass(name):
        st = shaped[name].stats
        return {"tokens_per_pass": st.acceptance_length, "tok_s": tok_s[name], "accepted_depth": st.accepted_depth,
                "mean_nodes": shaped[name].stages.proposer.nodes / max(st.steps, 1),
                "identical": sum(a == b for a, b in zip(outputs["plain"], outputs[name]))}
    row: dict = {"chains": {str(g): per_pass(f"fixed{g}") for g in args.fixed_gammas},
                 "trees": {f"{d}:{n}": per_pass(f"tree{d}:{n}") for d, n in args.trees}}
    if row["chains"] and row["trees"]:
        best_chain = max(row["chains"], key=lambda g: row["chains"][g]["tokens_per_pass"])
        best_tree = max(row["trees"], key=lambda t: row["trees"][t]["tokens_per_pass"])
        row.update(best_chain=best_chain, best_tree=best_tree,
                   tree_over_chain_per_pass=row["trees"][best_tree]["tokens_per_pass"]
                   / row["chains"][best_chain]["tokens_per_pass"])
    if "auto" in shaped:
        row["auto"] = per_pass("auto")
        row["auto_over_chain_tok_s"] = tok_s["auto"] / tok_s["spec"]
    return row


def interleaved(runs: dict, inputs: list, repeats: int, progress, rounds: dict | None = None) -> tuple[dict, dict]:
    """Every input through every run in turn (the order reversed every other time), ``repeats`` times.

    Returns each run's outputs (of the first repeat) and its seconds: per input, the fastest of the
    repeats, so a slow spell of a shared machine that hit one run once does not count against it.
    ``rounds``, where given, gets each run's total seconds per repeat.
    """
    outputs = {name: [] for name in runs}
    best = {name: [float("inf")] * len(inputs) for name in runs}
    if rounds is not None:
        rounds.update({name: [0.0] * repeats for name in runs})
    progress.reset(total=len(inputs) * repeats)
    for r in range(repeats):
        for i, x in enumerate(inputs):
            for name in (list(runs) if (i + r) % 2 == 0 else list(runs)[::-1]):
                t0 = time.perf_counter()
                out = runs[name](x)
                seconds = time.perf_counter() - t0
                best[name][i] = min(best[name][i], seconds)
                if rounds is not None:
                    rounds[name][r] += seconds
                if r == 0:
                    outputs[name].append(out)
            progress.update()
    progress.close()
    return outputs, {name: sum(b) for name, b in best.items()}


def batch_row(args, batch: int, all_ids: list[list[int]], engine, Request, tqdm) -> dict:
    """Every prompt, ``batch`` sequences at a time: plain, speculative (serve's defaults), each fixed γ of the
    sweep, and a second plain engine as a control, interleaved per group of prompts. Gains are the median over
    the repeats of each round's tokens/s ratio (each round's in ``rounds_<run>``); tokens/s the fastest per
    group. The control's gain (``gain_control``: plain over plain, the same work) is what this machine's noise
    makes of 1.0 in the same rounds, the yardstick for every other gain of the row."""
    engines = {"plain": engine(None, slots=batch), "control": engine(None, slots=batch),
               "spec": engine(args.draft, slots=batch)}
    engines.update({f"fixed{g}": engine(args.draft, slots=batch, gamma=g) for g in args.fixed_gammas})
    groups = [[Request(tuple(ids), max_tokens=args.max_tokens) for ids in all_ids[i:i + batch]]
              for i in range(0, len(all_ids), batch)]
    # Warm-up, the first group once: what a server pays once per batch size stays out of the rounds — first
    # calls, and the adaptive policy's first entry at this batch size, which it cannot price before it has
    # seen one (its draft's prefill of a whole group's prompts).
    for eng in engines.values():
        eng.generate(groups[0])
        eng.stats = type(eng.stats)()
    runs = {name: (lambda group, eng=eng: [o.tokens for o in eng.generate(group)]) for name, eng in engines.items()}
    rounds: dict = {}
    per_group, seconds = interleaved(runs, groups, args.repeats,
                                     tqdm(desc=f"batch {batch}", file=sys.stderr, leave=False), rounds)
    outputs = {name: [t for group in out for t in group] for name, out in per_group.items()}
    row = {"batch": batch, "prompts": len(all_ids), "groups": len(groups), "repeats": args.repeats}
    for name, eng in engines.items():
        row[f"{name}_tok_s"] = sum(map(len, outputs[name])) / seconds[name]
        if name != "plain":
            row[f"identical_{name}"] = sum(a == b for a, b in zip(outputs["plain"], outputs[name]))
            if name != "control":
                row[f"mean_gamma_{name}"] = eng.stats.mean_gamma
            # Every run emits the same tokens each round, so the ratio of seconds is the ratio of tokens/s.
            gains = [p / x for p, x in zip(rounds["plain"], rounds[name])]
            row[f"gain_{name}"], row[f"rounds_{name}"] = statistics.median(gains), [round(g, 3) for g in gains]
    if args.fixed_gammas:
        best = max(args.fixed_gammas, key=lambda g: row[f"gain_fixed{g}"])
        row["best_fixed_gamma"] = best
        row["spec_over_best_fixed"] = row["gain_spec"] / row[f"gain_fixed{best}"]
    return row


def batch_table(batches: list[dict]) -> list[str]:
    """The markdown lines of ``batch_row``'s rows: gains over plain, each fixed γ, and outputs identical."""
    head = ["batch", "plain tok/s*", "plain again (control)", "speculative"]
    gammas = [int(k[5:-6]) for k in batches[0] if k.startswith("fixed") and k.endswith("_tok_s")]
    head += [f"γ={g}" for g in gammas] + (["speculative / best fixed"] if gammas else []) + ["identical"]
    lines = [f"Batches ({batches[0]['prompts']} prompts; gains over plain, median of {batches[0]['repeats']} "
             "interleaved rounds; mean γ in brackets; the control is a second plain engine, the same work):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in batches:
        cells = [str(b["batch"]), f"{b['plain_tok_s']:.1f}", f"{b['gain_control']:.2f}×"]
        cells.append(f"{b['gain_spec']:.2f}× ({b['mean_gamma_spec']:.2f})")
        cells += [f"{b[f'gain_fixed{g}']:.2f}×" for g in gammas]
        if gammas:
            cells.append(f"**{b['spec_over_best_fixed']:.2f}** (γ={b['best_fixed_gamma']})")
        names = [n[len("identical_"):] for n in b if n.startswith("identical_")]
        cells.append(f"{min(b[f'identical_{n}'] for n in names)}/{b['prompts']} (each run)")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    rows = report["scenarios"]
    hf = "hf_assisted_gain" in rows[0]
    head = ["scenario", "gain", "bound S", "gain/S", "acceptance rate", "acceptance length", "mean γ", "α", "c"]
    if hf:
        head += ["HF assisted", "HF prompt lookup", "gain / HF assisted"]
    head += ["n-gram (specserve)", "plain tok/s*", "spec tok/s*", "identical", "valid"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["scenario"], f"{r['gain']:.2f}×", f"{r['bound']:.2f}×", f"{r['gain_over_bound']:.2f}",
                 f"{r['acceptance_rate']:.1%}", f"{r['acceptance_length']:.2f}", f"{r['mean_gamma']:.2f}",
                 f"{r['alpha']:.3f}", f"{r['c']:.3f}"]
        if hf:
            cells += [f"{r['hf_assisted_gain']:.2f}×", f"{r['hf_prompt_lookup_gain']:.2f}×",
                      f"{r['gain_over_hf_assisted']:.2f}"]
        valid = (f"JSON {r['json_valid_share']:.0%}" if "json_valid_share" in r else
                 f"parses {r['code_parse_share']:.0%}, with a statement {r['code_statement_share']:.0%}"
                 if "code_parse_share" in r else "")
        cells += [f"{r['ngram_gain']:.2f}×", f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                  f"{r['identical']}/{r['prompts']}", valid]
        lines.append("| " + " | ".join(cells) + " |")
    if "fixed_tok_s" in rows[0]:
        gammas = list(rows[0]["fixed_tok_s"])
        head = ["scenario", "plain", "adaptive"] + [f"γ={g}" for g in gammas] + ["best fixed γ",
                                                                                   "adaptive / best fixed"]
        lines += ["", "Fixed-γ sweep, tokens/s* at batch 1 (same run, interleaved):", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["scenario"], f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f} (mean γ {r['mean_gamma']:.2f})"]
            cells += [f"{r['fixed_tok_s'][g]:.1f}" for g in gammas]
            cells += [str(r["best_fixed_gamma"]), f"**{r['adaptive_over_best_fixed']:.2f}**"]
            lines.append("| " + " | ".join(cells) + " |")
    if rows[0].get("trees"):
        chains, trees = list(rows[0]["chains"]), list(rows[0]["trees"])
        head = (["scenario"] + [f"chain γ={g}" for g in chains] + [f"tree {t}" for t in trees]
                + ["best tree / best chain", "chain tok/s* (adaptive)", "automatic tok/s*", "automatic / chain"])
        lines += ["", "Chain vs tree at batch 1 (same run): mean tokens per target pass (tree d:n = depth d, "
                  "n nodes; mean nodes verified per step in brackets), and tokens/s* of the automatic shape:", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["scenario"]] + [f"{r['chains'][g]['tokens_per_pass']:.2f}" for g in chains]
            cells += [f"{r['trees'][t]['tokens_per_pass']:.2f} ({r['trees'][t]['mean_nodes']:.0f})" for t in trees]
            cells.append(f"**{r['tree_over_chain_per_pass']:.2f}×** ({r['best_tree']} vs γ={r['best_chain']})"
                         if "best_tree" in r else "(no fixed chain run)")
            if "auto" in r:
                cells += [f"{r['spec_tok_s']:.1f}", f"{r['auto']['tok_s']:.1f} (mean nodes "
                          f"{r['auto']['mean_nodes']:.1f})", f"**{r['auto_over_chain_tok_s']:.2f}**"]
            else:
                cells += ["", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
        same = sum(v["identical"] for r in rows for v in [*r["trees"].values(), *([r["auto"]] if "auto" in r else [])])
        total = sum(r["prompts"] * (len(r["trees"]) + ("auto" in r)) for r in rows)
        lines.append(f"Trees and the automatic shape: {same}/{total} outputs identical to plain greedy decoding.")
    lines.append("")
    if report.get("batches"):
        lines += batch_table(report["batches"]) + [""]
    ngram = sum(r["ngram_identical"] for r in rows)
    fixed = (f"fixed γ {report['fixed_identical']}/{report['fixed_compared']}; " if report["fixed_compared"]
             else "")
    lines.append(f"Greedy identity at batch 1: {report['identical']}/{report['compared']} speculative outputs equal "
                 f"plain decoding (draft model, adaptive γ); {fixed}n-gram proposer {ngram}/{report['compared']}.")
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
