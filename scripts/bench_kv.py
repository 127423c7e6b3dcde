#!/usr/bin/env python3

from evaluation.kv_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
