#!/usr/bin/env python3
"""scripts/bench_assisted.py: where HF assisted generation wins, at batch 1 (evaluation/assisted_breakdown.py)."""

from evaluation.assisted_breakdown import main

if __name__ == "__main__":
    raise SystemExit(main())
