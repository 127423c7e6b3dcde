"""The ``specserve`` console script.

    specserve generate --prompt "Convert to JSON: name Ada, age 36\\n{"      # embedded default pair
    specserve generate --target DIR|X.gguf --draft DIR|Y.gguf|ngram|none --prompt ... --gamma 4 --fixed-gamma
    specserve generate --prompt ... --json-schema person.json | --regex '[0-9]{4}' | --choice yes --choice no
    specserve serve [--config cluster/examples/local.yaml]                   # Ray Serve app, HTTP + handles
    specserve plan [--config X]                      # memory plan and threads per replica; exit 1 if unfit
    specserve bench scenarios ...                                            # scripts/bench_scenarios.py
    specserve dashboards render DIR | push --url URL --token-file F          # Grafana dashboards, alert rules
    specserve top --url http://127.0.0.1:PORT/metrics                        # terminal view of the metrics

Heavy imports happen inside the subcommands so ``specserve --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO_ROOT / "models" / "default" / "target"
DEFAULT_DRAFT = REPO_ROOT / "models" / "default" / "draft"


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.assembly import EngineSettings, make_engine
    from runtime.models import load_tokenizer
    from runtime.protocol import SamplingParams
    from engine.engine import Request

    tokenizer = load_tokenizer(args.target)
    draft = None if args.draft in ("none", "None") else args.draft
    settings = EngineSettings(target=args.target, draft=draft, device=args.device, dtype=args.dtype,
                              max_len=args.max_len, max_slots=max(1, len(args.prompt)), gamma=args.gamma,
                              gamma_max=max(args.gamma, args.gamma_max),
                              adaptive=EngineSettings.adaptive and not args.fixed_gamma)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    engine = make_engine(settings, eos_token_ids=eos,
                         detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    try:
        grammar = _grammar(args, tokenizer, engine.stages.verifier.vocab_size)
    except ValueError as exc:  # GrammarError, or a schema file that is not JSON
        print(f"specserve generate: {exc}", file=sys.stderr)
        return 2
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    requests = [Request(tuple(tokenizer(p)["input_ids"]), max_tokens=args.max_tokens, sampling=sampling,
                        stop=tuple(args.stop), grammar=grammar) for p in args.prompt]
    t0 = time.perf_counter()
    outputs = engine.generate(requests)
    seconds = time.perf_counter() - t0
    for prompt, out in zip(args.prompt, outputs):
        text = out.text if out.text is not None else tokenizer.decode(out.tokens, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "finish_reason": out.finish_reason,
                              "stats": out.stats.as_dict()}))
        else:
            print(f"--- prompt: {prompt!r}\n{prompt}{text}\n--- finish: {out.finish_reason}; "
                  f"{_stats_line(out.stats)}")
    total = engine.stats
    print(f"=== {sum(len(o.tokens) for o in outputs)} tokens in {seconds:.2f} s "
          f"({sum(len(o.tokens) for o in outputs) / seconds:.1f} tok/s); {_stats_line(total)}", file=sys.stderr)
    return 0


def _grammar(args: argparse.Namespace, tokenizer, vocab_size: int):
    """The compiled grammar of --json-schema / --regex / --choice (at most one of them), or None."""
    from engine.grammar import GrammarCompiler, GrammarSpec, map_tokenizer

    if args.json_schema:
        spec = GrammarSpec("json_schema", json.loads(Path(args.json_schema).read_text()))
    elif args.regex:
        spec = GrammarSpec("regex", args.regex)
    elif args.choice:
        spec = GrammarSpec("choice", args.choice)
    else:
        return None
    return GrammarCompiler(map_tokenizer(tokenizer, vocab_size)).compile(spec)


def _stats_line(stats) -> str:
    line = (f"steps {stats.steps}, acceptance rate {stats.acceptance_rate:.3f}, "
            f"acceptance length {stats.acceptance_length:.2f}, mean gamma {stats.mean_gamma:.2f}, "
            f"alpha {stats.alpha:.3f}")
    return line + (f", forced tokens {stats.forced}" if stats.forced else "")


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.config import ConfigError
    from cluster.memory_plan import PlanError
    from deployments.launch import serve_forever

    try:
        return serve_forever(config_path=args.config, host=args.host, port=args.port)
    except (ConfigError, PlanError) as exc:  # refused before anything was deployed: the message says why
        print(f"specserve serve: {exc}", file=sys.stderr)
        return 2


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what every replica of the config will hold, and whether it fits this machine as one node."""
    from cluster.config import ConfigError
    from cluster.memory_plan import PlanError, plan
    from cluster.node import cpu_cores, memory_available
    from cluster.threads import node_threads
    from deployments.launch import load_launch_config

    try:
        cfg = load_launch_config(args.config)
        app = plan(cfg)
    except ValueError as exc:
        print(f"specserve plan: {exc}", file=sys.stderr)
        return 2
    print(app.report())
    cores, available = cpu_cores(), memory_available()
    print(f"\nThis machine as the only node: {cores} CPU cores, "
          + (f"{available / (1 << 30):.2f} GiB available" if available is not None else "memory unknown"))
    try:
        threads = node_threads(cfg, cores, app)
        print("torch threads per replica: " + ", ".join(f"{role} {n}" for role, n in threads.items()))
        app.check(host_available=available)
    except (ConfigError, PlanError) as exc:
        print(f"does not fit: {str(exc).split(chr(10))[0]}", file=sys.stderr)
        return 1
    print("fits.")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    script = REPO_ROOT / "scripts" / f"bench_{args.which}.py"
    if not script.is_file():
        print(f"no benchmark named {args.which!r} (looked for {script})", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cluster import defaults as D

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in-process (no Ray) and print statistics")
    gen.add_argument("--target", default=str(DEFAULT_TARGET), help="the target: local HF folder or .gguf file")
    gen.add_argument("--draft", default=str(DEFAULT_DRAFT),
                     help="the draft: local HF folder or .gguf file, 'ngram' or 'none'")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=D.MAX_TOKENS)
    gen.add_argument("--gamma", type=int, default=D.GAMMA,
                     help="draft length (start value when adaptive)")
    gen.add_argument("--gamma-max", type=int, default=D.GAMMA_MAX)
    gen.add_argument("--fixed-gamma", action="store_true", help="disable the adaptive draft length policy")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None,
                     help="seed for sampled decoding (reproducible, fixed γ); unset: a fresh sample, adaptive γ")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--max-len", type=int, default=D.MAX_MODEL_LEN,
                     help="context length (prompt + output)")
    gen.add_argument("--device", default=D.DEVICE)
    gen.add_argument("--dtype", default=D.DTYPE)
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
    shape.add_argument("--regex", help="constrain the output to this regular expression")
    shape.add_argument("--choice", action="append", help="constrain the output to one of these strings (repeat)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="start a local Ray cluster and serve the app (HTTP + Serve handles)")
    srv.add_argument("--config", default=None, help="ClusterConfig YAML (default: the embedded default pair)")
    srv.add_argument("--host", default=None, help="HTTP host (default from config: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="HTTP port (default from config: 8000)")
    srv.set_defaults(func=cmd_serve)

    plan = sub.add_parser("plan", help="print the memory plan and threads per replica; exit 1 if this "
                          "machine cannot run the config")
    plan.add_argument("--config", default=None, help="ClusterConfig YAML (default: the embedded default pair)")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="run a benchmark script from scripts/ (bench_<name>.py)")
    bench.add_argument("which", help="benchmark name, e.g. scenarios, step_overhead, gpu")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    from specserve import dashboards_cmd, top

    dashboards_cmd.add_parser(sub)
    top.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
