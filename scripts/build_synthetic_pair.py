#!/usr/bin/env python3
"""A synthetic target/draft pair built from config, where the target *extends* the draft.  (`evaluation.synthetic_pair`; options: --help)"""

from evaluation.synthetic_pair import main

if __name__ == "__main__":
    raise SystemExit(main())
