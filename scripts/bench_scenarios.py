#!/usr/bin/env python3
"""Scenario benchmark: JSON / code / prose, plain vs speculative, against fixed γ, the Leviathan bound and HF.  (`evaluation.scenarios`; options: --help)"""

from evaluation.scenarios import main

if __name__ == "__main__":
    raise SystemExit(main())
