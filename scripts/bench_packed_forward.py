#!/usr/bin/env python3
"""One verify forward of rows of unequal length, padded vs packed (``runtime.forward``, ``packed``).

Decides when ``ModelRunner`` runs a forward packed (``ModelRunner._ragged``). Sixteen rows of the embedded
target, each with a 30–90-token context, verify the widths of each case below (tokens fed per row: 1 is a
plain step, w a chain of w − 1 drafts or a forced run) through ``ModelRunner.forward``, padded and packed
interleaved, median of repeats; the logits of the two must agree.

    python scripts/bench_packed_forward.py [--threads 1] [--model models/default/target] [--out bench-out/packed_forward.json]

Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

B = 16
CASES = {  # name: tokens fed per row
    "16 plain": [1] * B,
    "16 of 4": [4] * B,
    "16 of 8": [8] * B,
    "12 of 4, 4 plain": [4] * 12 + [1] * 4,
    "10 of 3, 6 of 2": [3] * 10 + [2] * 6,
    "8 of 5, 8 plain": [5] * 8 + [1] * 8,
    "2 of 6, 14 of 3": [6] * 2 + [3] * 14,
    "1 to 6": [1 + i % 6 for i in range(B)],
    "2 of 6, 14 plain": [6] * 2 + [1] * 14,
    "1 of 9, 15 plain": [9] + [1] * 15,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=str(REPO / "models" / "default" / "target"))
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of 7 forwards each way")
    parser.add_argument("--out", type=Path, default=Path("bench-out/packed_forward.json"))
    args = parser.parse_args()

    import torch

    from runtime.models import build_model
    from runtime.protocol import SyncItem
    from runtime.runner import ModelRunner

    torch.set_num_threads(args.threads)
    model = build_model(args.model, "cpu", "float32")
    vocab = model.config.vocab_size
    rng = random.Random(0)
    runner = ModelRunner(model, max_slots=B, max_len=512)
    for s in range(B):
        runner.sync(SyncItem(s, 0, tuple(rng.randrange(vocab) for _ in range(rng.randrange(30, 90)))))
    runner.forward(list(range(B)), [[]] * B, [1] * B)
    ragged = ModelRunner.__dict__["_ragged"]  # the staticmethod itself, put back after each forward

    def forward(widths: list[int], packed: bool, drafts: list[list[int]]) -> torch.Tensor:
        """One verify of ``drafts``, forced padded or packed; the rows' caches left as they were."""
        ModelRunner._ragged = staticmethod(lambda feeds, rows, T: packed)
        try:
            logits = runner.forward(list(range(B)), drafts, widths)
        finally:
            ModelRunner._ragged = ragged
            for s in range(B):
                del runner.seqs[s].cached[runner.seqs[s].valid:]
        return logits

    rows = []
    for name, widths in CASES.items():
        drafts = [[rng.randrange(vocab) for _ in range(w - 1)] for w in widths]
        gap = max((forward(widths, True, drafts)[b, :w] - forward(widths, False, drafts)[b, :w]).abs().max().item()
                  for b, w in enumerate(widths))
        ms = {True: [], False: []}
        for _ in range(args.repeats):
            for packed in (False, True):
                t0 = time.perf_counter()
                for _ in range(7):
                    forward(widths, packed, drafts)
                ms[packed].append((time.perf_counter() - t0) / 7 * 1e3)
        padded, packed = statistics.median(ms[False]), statistics.median(ms[True])
        rows.append({"case": name, "widths": widths, "padding": 1 - sum(widths) / (B * max(widths)),
                     "padded_ms": padded, "packed_ms": packed, "ratio": packed / padded, "max_logit_gap": gap})

    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, CPU only, torch threads {args.threads}",
              "date": time.strftime("%Y-%m-%d"), "model": args.model, "batch": B, "rows": rows}
    lines = ["| rows (tokens fed) | padding | padded ms | packed ms | packed ÷ padded | max logit gap |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['padding']:.0%} | {r['padded_ms']:.2f} | {r['packed_ms']:.2f} | {r['ratio']:.2f} "
              f"| {r['max_logit_gap']:.1e} |" for r in rows]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
