"""Where Hugging Face's assisted generation wins, at batch 1 (issue 32, point 2): ``scripts/bench_assisted.py``.

On a synthetic pair (``evaluation.synthetic_pair``; ``--preset real-shaped`` has the 0.5B/1.5B instruct
pairs' cost, fp32 on the CPU, built once and cached outside the checkout), for each wanted greedy agreement
(ε calibrated), every prompt goes through these runs in turn, one prompt at a time, greedy:

- this engine plain, and speculative with the policy as configured by default, with HF's drafting settings
  (γ up to 16, confidence stop 0.4), and at each ``--fixed-gammas``;
- HF ``generate``, plain and with ``assistant_model`` (HF's defaults: 20 draft tokens, a confidence stop at
  0.4), both models instrumented with forward hooks.

Then the breakdown: per draft token, this engine's draft time (its draft loop, per drafted token) against HF's
one-token draft forward; tokens drafted and emitted per target pass, and the share of HF's rounds its
confidence stop cut short; and the verify cost by width (one forward of w tokens after a prompt), this
engine's runner against HF's model with a cropped cache. The Leviathan bound S at the measured α, mean γ and
c is given for each speculative run. Prints a table and writes JSON (``--out``).

    python scripts/bench_assisted.py [--preset real-shaped|tiny] [--agreements 0.95,0.7] [--prompts 3]
        [--max-tokens 48] [--fixed-gammas 4,8] [--threads 2] [--out DIR]
    python scripts/bench_assisted.py --target DIR --draft DIR [--prompts-file F.jsonl] [--chat] ...

With ``--target``/``--draft`` (a real pair, HF folders or GGUF files) the scenarios are the prompts files'
(``evaluation.scenarios``' sets by default), tokenized by the target's tokenizer, instead of agreements.

With ``--batch 1,2,4,8,16`` each scenario gets the scenario benchmark's batch rows on this pair instead of the
breakdown (``evaluation.scenarios.batch_row``): plain against a second plain engine (the control), the
default γ controller and each ``--fixed-gammas``, every prompt ``batch`` sequences at a time, gains the
median of ``--repeats`` interleaved rounds, outputs compared with plain decoding. Use at least as many
``--prompts`` as the largest batch.
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
WIDTHS = (1, 2, 4, 8, 12, 16, 21)
HF_DRAFT_TOKENS = 20  # generation_config.num_assistant_tokens's default, with the "constant" schedule


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="real-shaped", help="real-shaped (0.5B/1.5B cost) or tiny")
    p.add_argument("--target", help="a real pair instead: the target's folder (HF or GGUF), with --draft")
    p.add_argument("--draft", help="the draft's folder (with --target)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="with --target/--draft: JSONL prompts by scenario (default: scripts/prompts/{json,code,prose})")
    p.add_argument("--chat", action="store_true", help="send prompt rows through the target's chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="where built pairs are kept (default ~/.cache/specserve/pairs)")
    p.add_argument("--agreements", default="0.95,0.7", help="wanted greedy agreements, comma-separated")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--fixed-gammas", default="", help='fixed γ runs, e.g. "4,8" (default: none)')
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", default="", help='batch rows instead of the breakdown, e.g. "1,2,4,8,16"')
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the batch rows")
    p.add_argument("--calib-trials", type=int, default=8)
    p.add_argument("--out", default=str(REPO / "bench-out"))
    p.add_argument("--name", default="assisted", help="the report's file name, without .json/.md")
    args = p.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    args.agreement_list = [float(a) for a in args.agreements.split(",") if a.strip()]
    args.gamma_list = [int(g) for g in args.fixed_gammas.split(",") if g.strip()]
    args.batch_list = [int(b) for b in args.batch.split(",") if b.strip()]
    return args


class ForwardLog:
    """Every forward of a model while active: (tokens fed, seconds). HF calls its models with keyword inputs."""

    def __init__(self, model):
        self.model, self.calls, self._t0, self._width, self._hooks = model, [], 0.0, 0, []

    def __enter__(self):
        def pre(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._width = ids.shape[1] if ids is not None else 0
            self._t0 = time.perf_counter()

        def post(_module, _args, _kwargs, _out):
            self.calls.append((self._width, time.perf_counter() - self._t0))

        self._hooks = [self.model.register_forward_pre_hook(pre, with_kwargs=True),
                       self.model.register_forward_hook(post, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()


def hf_generate(target, prompt: tuple[int, ...], max_tokens: int, assistant=None) -> tuple[list[int], float]:
    import torch

    from evaluation.synthetic_pair import greedy_continuation

    t0 = time.perf_counter()
    out = greedy_continuation(target, torch.tensor([prompt]), max_tokens, assistant)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


class Engines:
    """One verify stage and one draft proposer per confidence threshold over the pair, shared by the engines of
    every run. No prefix cache: HF computes every prompt afresh, and the runs feed the same prompts."""

    def __init__(self, target, draft, max_len: int):
        from draftpool.draft_model import DraftModelProposer
        from runtime.runner import ModelRunner
        from verifier.verify import VerifyStage

        self.max_len = max_len
        self.verifier = VerifyStage(ModelRunner(target, max_slots=1, max_len=max_len, prefix_cache=False))
        self.proposers = {c: DraftModelProposer(draft, max_slots=1, max_len=max_len, confidence_threshold=c,
                                                prefix_cache=False)
                          for c in (0.0, 0.4)}
        self.built = 0

    def engine(self, **policy):
        """An engine that keeps its γ policy's measurements from one request to the next, as a served one
        does; each numbers its sequences from a block of its own."""
        from engine.assembly import EngineSettings, make_engine
        from engine.engine import LocalStages

        confidence = policy.pop("confidence_threshold", 0.0)
        speculate = policy.pop("speculate", True)
        settings = EngineSettings(target=None, draft="built" if speculate else None, max_len=self.max_len,
                                  max_slots=1, **policy)
        proposer = self.proposers[confidence] if speculate else None
        self.built += 1
        return make_engine(settings, stages=LocalStages(self.verifier, proposer), first_seq_id=self.built << 20)


def runs(args) -> dict[str, dict]:
    """The engine runs by name: keyword arguments of ``Engines.engine``."""
    out = {"engine plain": {"speculate": False}, "engine adaptive (default)": {},
           "engine adaptive, γ ≤ 16, confidence 0.4": {"gamma_max": 16, "confidence_threshold": 0.4}}
    for g in args.gamma_list:
        out[f"engine γ = {g}"] = {"gamma": g, "gamma_max": max(g, 8), "adaptive": False}
    return out


def _verify_rows(step, vocab: int, widths, repeats: int) -> list[float]:
    """ms of ``step(drafts)`` — one target forward of the prompt's last token and w − 1 drafts — per width,
    the fastest of ``repeats``."""
    import torch

    gen = torch.Generator().manual_seed(7)
    out = []
    for w in widths:
        times = []
        for _ in range(repeats):
            drafts = torch.randint(0, vocab, (w - 1,), generator=gen).tolist()
            t0 = time.perf_counter()
            step(drafts)
            times.append(time.perf_counter() - t0)
        out.append(round(min(times) * 1e3, 2))
    return out


def hf_verify_cost(target, prompt: tuple[int, ...], widths=WIDTHS, repeats: int = 3) -> list[float]:
    """HF's model on a cache of the prompt's first L − 1 tokens, cropped back after each forward."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        target(input_ids=torch.tensor([prompt[:-1]]), cache=cache, use_cache=True)

        def step(drafts):
            target(input_ids=torch.tensor([[prompt[-1], *drafts]]), cache=cache, use_cache=True)
            cache.crop(-(len(drafts) + 1))

        return _verify_rows(step, target.config.vocab_size, widths, repeats)


def engine_verify_cost(engines: "Engines", prompt: tuple[int, ...], widths=WIDTHS, repeats: int = 3
                       ) -> list[float]:
    """This engine's target runner: drafts fed after the prompt, never committed, so every forward starts at
    the prompt's last token."""
    from runtime.protocol import SyncItem

    runner, seq = engines.verifier.runner, 10**6
    runner.sync(SyncItem(seq, 0, prompt))
    runner.forward([seq], [[]], [1])
    try:
        return _verify_rows(lambda drafts: runner.forward([seq], [drafts], [len(drafts) + 1]), runner.vocab_size,
                            widths, repeats)
    finally:
        runner.release([seq])


def hf_phase(target, draft, prompts, max_tokens: int) -> dict:
    """HF plain and assisted generation of every prompt (stock models, as users run them), instrumented."""
    target_log, draft_log = ForwardLog(target), ForwardLog(draft)
    seconds, outputs = {"hf plain": 0.0, "hf assisted": 0.0}, {"hf plain": [], "hf assisted": []}
    rounds, drafted_s = [], 0.0  # per target pass: tokens verified beyond the first; the draft's seconds
    for prompt in prompts:
        tokens, s = hf_generate(target, prompt, max_tokens)
        seconds["hf plain"] += s
        outputs["hf plain"].append(tuple(tokens))
        with target_log, draft_log:
            first_t, first_d = len(target_log.calls), len(draft_log.calls)
            tokens, s = hf_generate(target, prompt, max_tokens, assistant=draft)
            rounds += [w - 1 for w, _ in target_log.calls[first_t + 1:]]  # the first call is the prefill
            drafted_s += sum(t for _, t in draft_log.calls[first_d + 1:])  # the first is the draft's prefill
        seconds["hf assisted"] += s
        outputs["hf assisted"].append(tuple(tokens))
    one_token = [t for w, t in draft_log.calls if w == 1]
    return {"seconds": seconds, "outputs": outputs, "rounds": rounds,
            "draft_forward_ms": round(statistics.median(one_token) * 1e3, 2) if one_token else None,
            "draft_ms_per_drafted_token": round(drafted_s / max(sum(rounds), 1) * 1e3, 2),
            "verify_ms": hf_verify_cost(target, prompts[0])}


def engine_phase(args, engines: "Engines", prompts) -> dict:
    """Every engine run of every prompt, the runs interleaved per prompt; one engine per run throughout."""
    from engine.engine import Request

    built = {name: engines.engine(**dict(policy)) for name, policy in runs(args).items()}
    seconds, outputs = {n: 0.0 for n in built}, {n: [] for n in built}
    for prompt in prompts:
        for name, engine in built.items():
            t0 = time.perf_counter()
            out = engine.generate([Request(prompt, max_tokens=args.max_tokens)])[0]
            seconds[name] += time.perf_counter() - t0
            outputs[name].append(out.tokens)
    return {"seconds": seconds, "outputs": outputs, "stats": {n: e.stats for n, e in built.items()},
            "verify_ms": engine_verify_cost(engines, prompts[0])}


def synthetic_scenario(args, wanted: float):
    """The preset pair at ε = 0, calibrated to ``wanted``, and random prompts."""
    from evaluation.synthetic_pair import PRESETS, cached_pair, calibrate_epsilon, random_prompts

    draft_cfg, extra = PRESETS[args.preset]
    target, draft = cached_pair(args.preset, seed=args.seed, cache_dir=args.cache_dir)
    cal = calibrate_epsilon(draft_cfg, extra, wanted, models=(target, draft), num_prompts=2, prompt_len=16,
                            new_tokens=24, max_trials=args.calib_trials)
    prompts = [tuple(p) for p in random_prompts(draft_cfg.vocab_size, args.prompts, args.prompt_len,
                                                seed=args.seed + 101).tolist()]
    return target, draft, prompts, {"wanted_agreement": wanted, "calibration": cal.as_dict()}


def folder_scenarios(args):
    """A real pair's scenarios: (name, prompts) from the prompts files, tokenized by the target's tokenizer."""
    from evaluation.scenarios import SCENARIOS, encode, load_prompts, read_prompts_file
    from runtime.models import load_tokenizer

    tok = load_tokenizer(args.target)
    groups = (read_prompts_file(args.prompts_file, args.prompts) if args.prompts_file else
              {s: load_prompts(s, args.prompts) for s in SCENARIOS})
    return [(name, [tuple(encode(row, tok, args.chat)["ids"]) for row in rows]) for name, rows in groups.items()]


def scenario(args, target, draft, prompts: list[tuple[int, ...]], meta: dict) -> dict:
    """One scenario's runs: HF's on the stock models; then the models packed for this engine's CPU kernels, as
    ``runtime.models.build_model`` loads them to serve."""
    from engine.gamma import expected_speedup
    from runtime.cpu_linear import pack_linears

    hf = hf_phase(target, draft, prompts, args.max_tokens)
    pack_linears(target)
    pack_linears(draft)
    longest = max(len(p) for p in prompts)
    ours = engine_phase(args, Engines(target, draft, max_len=longest + args.max_tokens + 64), prompts)
    seconds, outputs = {**ours["seconds"], **hf["seconds"]}, {**ours["outputs"], **hf["outputs"]}
    emitted = args.prompts * args.max_tokens
    reference = outputs["engine plain"]
    stats = ours["stats"]
    plain_step = stats["engine plain"].verify_seconds / max(stats["engine plain"].steps, 1)
    rows = {}
    for name in seconds:
        row = {"tokens_per_s": round(emitted / seconds[name], 3),
               "identical_to_plain": sum(tuple(a) == tuple(b) for a, b in zip(outputs[name], reference))}
        st = stats.get(name)
        if st is not None and st.proposed:
            draft_ms = st.draft_seconds / st.proposed * 1e3
            c = draft_ms / (plain_step * 1e3)
            row.update(alpha=round(st.alpha, 4), mean_gamma=round(st.mean_gamma, 3),
                       acceptance_length=round(st.acceptance_length, 3), draft_ms_per_token=round(draft_ms, 2),
                       tokens_per_target_pass=round(st.emitted / max(st.steps, 1), 3), c=round(c, 4),
                       leviathan_bound=round(expected_speedup(st.alpha, st.mean_gamma, c), 3))
        rows[name] = row
    plain_tps, hf_tps = rows["engine plain"]["tokens_per_s"], rows["hf assisted"]["tokens_per_s"]
    for name, row in rows.items():
        row["over_engine_plain"] = round(row["tokens_per_s"] / plain_tps, 3)
        row["over_hf_assisted"] = round(row["tokens_per_s"] / hf_tps, 3)
        if "leviathan_bound" in row:
            row["gain_over_bound"] = round(row["over_engine_plain"] / row["leviathan_bound"], 3)
    rounds = hf["rounds"]
    rows["hf assisted"].update(
        draft_ms_per_token=hf["draft_ms_per_drafted_token"], draft_forward_ms=hf["draft_forward_ms"],
        drafted_per_target_pass=round(statistics.mean(rounds), 3) if rounds else None,
        tokens_per_target_pass=round(emitted / max(len(rounds) + args.prompts, 1), 3),
        rounds_cut_short=round(sum(r < HF_DRAFT_TOKENS for r in rounds) / max(len(rounds), 1), 3))
    verify = [{"width": w, "engine_ms": e, "hf_ms": h, "engine_over_width_1": round(e / ours["verify_ms"][0], 3),
               "hf_over_width_1": round(h / hf["verify_ms"][0], 3)}
              for w, e, h in zip(WIDTHS, ours["verify_ms"], hf["verify_ms"])]
    return {**meta, "runs": rows, "verify_cost": {"prompt_len": len(prompts[0]), "rows": verify}}


def batch_scenario(args, target, draft, prompts: list[tuple[int, ...]], meta: dict) -> dict:
    """The scenario's batch rows (``--batch``) on the models packed as the engine serves them."""
    from tqdm import tqdm

    from engine.assembly import EngineSettings, make_engine
    from engine.engine import Request
    from evaluation.scenarios import batch_row
    from runtime.cpu_linear import pack_linears

    pack_linears(target)
    pack_linears(draft)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 64

    def engine(proposer, slots: int = 1, gamma: int | None = None):
        fixed = {} if gamma is None else {"gamma": gamma, "gamma_max": max(gamma, EngineSettings.gamma_max),
                                          "adaptive": False}
        settings = EngineSettings(target=None, draft=proposer, max_len=max_len, max_slots=slots, **fixed)
        return make_engine(settings, target_model=target, draft_model=draft if proposer else None)

    rows = argparse.Namespace(draft="built", fixed_gammas=args.gamma_list, max_tokens=args.max_tokens,
                              repeats=args.repeats)
    return {**meta, "batches": [batch_row(rows, b, [list(p) for p in prompts], engine, Request, tqdm)
                                for b in args.batch_list]}


def then(args) -> str:
    """What a scenario runs, for the progress line."""
    if args.batch_list:
        return f"the batch rows at batch {', '.join(map(str, args.batch_list))}"
    return f"HF's runs and {len(runs(args))} engine runs per prompt"


def run(args) -> dict:
    import torch
    import transformers

    from evaluation.synthetic_pair import PRESETS, param_count

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    measure = batch_scenario if args.batch_list else scenario
    report = {"machine": f"vm: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": datetime.date.today().isoformat(), "platform": platform.platform(),
              "prompts": args.prompts, "max_tokens": args.max_tokens, "batch": args.batch_list, "scenarios": []}
    if args.target:
        from runtime.models import load_causal_lm

        report["pair"] = {"target": args.target, "draft": args.draft}
        for name, prompts in folder_scenarios(args):
            print(f"[bench_assisted] {name}: the pair loaded, then {then(args)}", flush=True)
            target, draft = (load_causal_lm(p, "float32", "cpu") for p in (args.target, args.draft))
            report["scenarios"].append(measure(args, target, draft, prompts, {"name": name}))
    else:
        report["pair"] = {"preset": args.preset, "draft_params": param_count(PRESETS[args.preset][0]),
                          "target_params": param_count(*PRESETS[args.preset])}
        for wanted in args.agreement_list:
            print(f"[bench_assisted] agreement {wanted}: the {args.preset} pair (built and cached on first use), ε "
                  f"calibrated, then {then(args)}", flush=True)
            target, draft, prompts, meta = synthetic_scenario(args, wanted)
            report["scenarios"].append(measure(args, target, draft, prompts, {"name": f"α {wanted}", **meta}))
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return report


def markdown(report: dict) -> str:
    from evaluation.scenarios import batch_table

    pair = report["pair"]
    what = (f"{pair['target']} / {pair['draft']}" if "target" in pair else
            f"{pair['preset']} pair, {pair['target_params'] / 1e9:.2f}B / {pair['draft_params'] / 1e9:.2f}B")
    lines = [f"Assisted-generation breakdown ({report['machine']}, {report['date']}; {what}, fp32; "
             f"{report['prompts']} prompts × {report['max_tokens']} tokens, "
             f"{'batch rows' if report.get('batch') else 'batch 1'}, greedy)", ""]
    for s in report["scenarios"]:
        cal = s.get("calibration")
        lines += [(f"Agreement {cal['agreement']:.3f} (wanted {s['wanted_agreement']}, ε {cal['epsilon']:.4g}):"
                   if cal else f"Scenario {s['name']}:"), ""]
        if "batches" in s:
            lines += batch_table(s["batches"]) + [""]
            continue
        lines += ["| run | tok/s | over plain | over HF assisted | α | mean γ drafted | tokens / target pass | "
                  "draft ms / token | c | bound S | gain / S | identical |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in s["runs"].items():
            def cell(key, fmt="{:.2f}"):
                return fmt.format(r[key]) if r.get(key) is not None else ""
            drafted = r.get("mean_gamma", r.get("drafted_per_target_pass"))
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['over_engine_plain']:.2f}× | "
                         f"{r['over_hf_assisted']:.2f}× | {cell('alpha', '{:.3f}')} | "
                         f"{'' if drafted is None else f'{drafted:.2f}'} | {cell('tokens_per_target_pass')} | "
                         f"{cell('draft_ms_per_token')} | {cell('c', '{:.3f}')} | {cell('leviathan_bound')} | "
                         f"{cell('gain_over_bound')} | {r['identical_to_plain']}/{report['prompts']} |")
        hf = s["runs"]["hf assisted"]
        lines += ["", f"HF assisted: {hf['rounds_cut_short']:.0%} of its rounds drafted fewer than "
                      f"{HF_DRAFT_TOKENS} tokens (the confidence stop, or the end of the answer); its one-token "
                      f"draft forward {hf['draft_forward_ms']} ms, {hf['draft_ms_per_token']} ms per drafted token "
                      "with each round's first, wider forward. The engine's draft ms / token is its draft "
                      "loop's time per drafted token, likewise. The engine runs on the models packed for its CPU "
                      "kernels, as it serves them; HF's on the stock models.", "",
                  f"Verify cost by width (one target forward after a {s['verify_cost']['prompt_len']}-token prompt, "
                  "fastest of 3):", "", "| width | engine ms | × width 1 | HF ms | × width 1 |",
                  "|---|---|---|---|---|"]
        for r in s["verify_cost"]["rows"]:
            lines.append(f"| {r['width']} | {r['engine_ms']:.1f} | {r['engine_over_width_1']:.2f} | {r['hf_ms']:.1f} | "
                         f"{r['hf_over_width_1']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / f"{args.name}.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / args.name}.json, .md")
    return 0
