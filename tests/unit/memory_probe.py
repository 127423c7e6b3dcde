"""Measure what a colocated verifier replica of a config really holds: run as a fresh process,

    python -m tests.unit.memory_probe '<config as JSON>'

it sets itself up as a replica does (``deployments.replica_process.configure_process``), imports and warms
everything on a throwaway builtin engine, then builds the config's engine (target + draft, as the verifier
replica with a colocated draft does) and runs the largest step the config allows: ``max_running`` sampled
(top-p) requests whose prompts fill the context, in one micro-batch. It prints one JSON line: resident
memory after building and at the peak, both relative to before building, in bytes. Mapped checkpoint pages
(page cache: shared and reclaimable) are left out, as the plan leaves them out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _status() -> dict[str, int]:
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text()
            .splitlines() if line.split(":")[0] in fields}


def main(raw: str) -> dict[str, int]:
    import torch

    from cluster.config import ClusterConfig
    from deployments.replica_process import configure_process
    from deployments.settings import engine_settings
    from engine.engine import Request
    from engine.assembly import make_engine
    from runtime.protocol import SamplingParams

    configure_process(1)
    cfg = ClusterConfig.from_dict(json.loads(raw))
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(cfg.router.max_running)]
    warm = make_engine(engine_settings(ClusterConfig.from_dict(
        {"target": {"path": "builtin:tiny", "max_model_len": 64}, "draft": {"kind": "model", "path": "builtin:tiny"},
         "router": {"max_running": 1}})))
    warm.generate([Request((3, 4, 5), max_tokens=4, sampling=sampled[0])])
    del warm

    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) counts from here
    before = _status()
    engine = make_engine(engine_settings(cfg))
    built = _status()
    prompt_len = cfg.target.max_model_len - cfg.speculation.gamma_max - 2
    vocab = engine.stages.verifier.vocab_size
    gen = torch.Generator().manual_seed(0)
    engine.generate([Request(tuple(torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()), max_tokens=2,
                             sampling=s) for s in sampled])
    after = _status()
    return {"built": built["RssAnon"] - before["RssAnon"],
            "peak": after["VmHWM"] - before["VmRSS"] - (after["RssFile"] - before["RssFile"])}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
