"""scripts/bench_scenarios.py --structured end to end on the embedded default pair, small: one prompt per
scenario. Checks what the report must hold, not how fast anything was (figures: docs/results.md): the five
runs per scenario with their columns, every constrained output valid, the speculative ones identical to the
plain decoding of their kind, the unconstrained runs cut at the constrained answer's length, the mixed batch,
and the two output files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.structured import RUNS

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "models" / "default"

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not (DEFAULT / "target").is_dir(), reason="models/default is not in this checkout")]


def test_small_structured_run_writes_a_complete_report(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_scenarios.py"), "--structured", "--threads",
                           "1", "--prompts", "1", "--max-tokens", "64", "--mixed-batch", "4", "--mixed-rounds", "2",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "structured.json").read_text())
    assert [r["scenario"] for r in report["scenarios"]] == ["json", "regex", "choice"]
    for row in report["scenarios"]:
        assert list(row["runs"]) == list(RUNS)
        for name, run in row["runs"].items():
            assert {"valid_share", "acceptance_rate", "tokens_per_pass", "tok_s", "forced_share",
                    "mask_ms_per_step", "mask_share", "identical_to_plain"} <= set(run)
            assert run["identical_to_plain"] == row["prompts"], (row, name)
            if not name.startswith("unconstrained"):
                assert run["valid_share"] == 1.0, (row, name)
        # EOS may end an unconstrained answer sooner; never later than the constrained one.
        assert row["runs"]["unconstrained plain"]["tokens"] <= row["runs"]["constrained plain"]["tokens"]
        assert row["runs"]["constrained spec"]["forced_share"] > 0
        assert row["runs"]["constrained spec, no forced"]["forced_share"] == 0
    mixed = report["mixed_batch"]
    assert mixed["batch"] == 4 and mixed["constrained_rows"] == 2 and mixed["rounds"] == 2 and mixed["tokens"] > 0
    assert mixed["unconstrained_identical"] == mixed["unconstrained_rows"] == 2
    assert -1 < mixed["cost"] < 1 and -1 < mixed["cost_to_unconstrained"] < 1
    assert "the unconstrained rows' own tokens/s" in (tmp_path / "structured.md").read_text()
    assert "constrained plain / unconstrained plain" in (tmp_path / "structured.md").read_text()
