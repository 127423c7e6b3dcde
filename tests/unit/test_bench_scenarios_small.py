"""scripts/bench_scenarios.py end to end on the embedded default pair, small: 2 prompts, 8 tokens.

Checks what the report must hold, not how fast anything was (figures come from full runs, README):
every scenario row with its ratios, the bound and the HF comparisons, the validity shares, the batch row,
the greedy identity count equal to the number of comparisons, and the three output files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not (REPO / "models" / "default" / "target").is_dir(),
                                 reason="models/default is not in this checkout")]

ROW = {"scenario", "prompts", "plain_tok_s", "spec_tok_s", "gain", "acceptance_rate", "acceptance_length",
       "mean_gamma", "alpha", "c", "bound", "gain_over_bound", "identical", "per_position_acceptance",
       "draft_ms_per_step", "verify_ms_per_step", "plain_ms_per_token", "samples", "hf_plain_tok_s",
       "hf_assisted_gain", "hf_prompt_lookup_gain", "gain_over_hf_assisted", "plain_matches_hf", "ngram_gain",
       "ngram_identical"}


def test_small_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "scen"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_scenarios.py"), "--prompts", "2",
                           "--max-tokens", "8", "--batch", "2", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert [r["scenario"] for r in report["scenarios"]] == ["json", "code", "prose"]
    for row in report["scenarios"]:
        assert ROW <= set(row), ROW - set(row)
        assert row["prompts"] == 2 and row["identical"] == 2 and row["ngram_identical"] == 2
        assert row["plain_matches_hf"] == 2  # the engine's plain decoding is HF's greedy decoding
        assert row["bound"] > 0 and row["c"] > 0 and 0 <= row["alpha"] <= 1
    assert 0 <= report["scenarios"][0]["json_valid_share"] <= 1
    code = report["scenarios"][1]
    assert 0 <= code["code_statement_share"] <= code["code_parse_share"] <= 1
    assert report["identical"] == report["compared"] == 6
    batch = report["batch"]
    assert batch["prompts"] == 6 and batch["identical"] == 6
    assert {"plain_tok_s", "spec_tok_s", "spec_guarded_tok_s", "gain", "gain_guarded"} <= set(batch)
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| scenario |") and table.count("\n| ") == 3  # 3 data rows after the header and its rule line
    assert "Greedy identity at batch 1: 6/6" in table and "n-gram proposer 6/6" in table
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "| json |" in done.stdout
