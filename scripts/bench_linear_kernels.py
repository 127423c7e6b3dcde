#!/usr/bin/env python3
"""CPU Linear kernels: stock ``nn.Linear`` (MKL) vs the oneDNN-prepacked weight, per row count.

Decides how ``runtime/cpu_linear.py`` holds a weight. For the layer shapes of the embedded target
(hidden 384, MLP 1024, vocabulary 4096) and of a Qwen2.5-0.5B-sized model (hidden 896, MLP 4864), times
one pass over the block's projections at 1 row (batch-1 decode), 2 and 5 rows (a verify of γ = 1, 4),
17 (prefill-ish) and 80 (batch 16 × 5), each way interleaved, median of repeats:

- ``stock``: ``F.linear`` on the dense weight (MKL GEMV for one row, GEMM that repacks per call otherwise);
- ``packed``: ``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once.

If ``packed`` is as fast at one row, the dense weight need not be kept beside the packed one: one copy.

    python scripts/bench_linear_kernels.py [--threads 2] [--out bench-out/linear_kernels.json]

Prints a table; writes JSON.
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

SHAPES = {  # (in, out) of q, k, o, gate, down, LM head
    "embedded target": [(384, 384), (384, 128), (384, 384), (384, 1024), (1024, 384), (384, 4096)],
    "0.5B-sized": [(896, 896), (896, 128), (896, 896), (896, 4864), (4864, 896), (896, 32768)],
}
ROWS = (1, 2, 5, 17, 80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench-out/linear_kernels.json")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def timed(fn, n: int) -> float:
        for _ in range(max(3, n // 10)):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    results = []
    for name, shapes in SHAPES.items():
        weights = [torch.randn(o, i) for i, o in shapes]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        for rows in ROWS:
            xs = [torch.randn(rows, i) for i, _ in shapes]
            ways = {"stock": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
                    "packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                       for x, p in zip(xs, packed)]}
            n = 200 if name == "embedded target" else 20
            times: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(args.repeats):
                for way, fn in ways.items():
                    times[way].append(timed(fn, n))
            ms = {way: 1e3 * statistics.median(t) for way, t in times.items()}
            results.append({"model": name, "rows": rows, "stock_ms": ms["stock"], "packed_ms": ms["packed"],
                            "packed_over_stock": ms["packed"] / ms["stock"]})
            r = results[-1]
            print(f"{name:16s} rows {rows:3d}: stock {r['stock_ms']:7.3f} ms  packed {r['packed_ms']:7.3f} ms  "
                  f"packed/stock {r['packed_over_stock']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{platform.node()}: {os.cpu_count()} CPUs", "threads": args.threads,
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                               "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
