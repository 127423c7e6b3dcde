"""scripts/bench_assisted.py at tiny scale: the breakdown's runs, its HF instrumentation and the verify-cost
table, end to end on a pair built into a temporary cache (and loaded from it the second time)."""

from __future__ import annotations

import json

import pytest

from evaluation.assisted_breakdown import HF_DRAFT_TOKENS, WIDTHS, main

pytestmark = pytest.mark.timeout(240)


def test_a_tiny_run_writes_the_breakdown(tmp_path):
    cache, out = tmp_path / "pairs", tmp_path / "out"
    argv = ["--preset", "tiny", "--cache-dir", str(cache), "--agreements", "0.9", "--prompts", "2",
            "--max-tokens", "16", "--fixed-gammas", "3", "--threads", "1", "--calib-trials", "3", "--out", str(out)]
    assert main(argv) == 0
    assert (cache / "tiny-seed0" / "target" / "config.json").exists()
    first = json.loads((out / "assisted.json").read_text())
    assert main(argv) == 0  # the pair now comes from the cache: the same pair, the same outputs
    report = json.loads((out / "assisted.json").read_text())
    [s] = report["scenarios"]
    assert s["calibration"] == first["scenarios"][0]["calibration"]
    runs = s["runs"]
    assert list(runs) == ["engine plain", "engine adaptive (default)", "engine adaptive, γ ≤ 16, confidence 0.4",
                          "engine γ = 3", "hf plain", "hf assisted"]
    for name, r in runs.items():
        assert r["tokens_per_s"] > 0 and r["over_hf_assisted"] > 0
        if name.startswith("engine"):
            assert r["identical_to_plain"] == 2, name  # fp32 greedy: speculation never changes the output
        if name.startswith("engine") and name != "engine plain":
            assert 0 < r["alpha"] <= 1 and r["mean_gamma"] > 0 and r["leviathan_bound"] > 0, r
    hf = runs["hf assisted"]
    assert 0 < hf["drafted_per_target_pass"] <= HF_DRAFT_TOKENS and hf["draft_ms_per_token"] > 0
    assert 0 <= hf["rounds_cut_short"] <= 1
    assert runs["engine γ = 3"]["mean_gamma"] <= 3
    assert [r["width"] for r in s["verify_cost"]["rows"]] == list(WIDTHS)
    text = (out / "assisted.md").read_text()
    assert "Verify cost by width" in text and "| hf assisted |" in text


def test_a_real_pair_of_folders_runs_by_scenario(tmp_path):
    """``--target/--draft``: the embedded pair's folders, one prompt of each default scenario, no calibration."""
    from evaluation.assisted_breakdown import REPO

    pair = REPO / "models" / "default"
    argv = ["--target", str(pair / "target"), "--draft", str(pair / "draft"), "--prompts", "1", "--max-tokens",
            "8", "--threads", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "assisted.json").read_text())
    assert [s["name"] for s in report["scenarios"]] == ["json", "code", "prose"]
    for s in report["scenarios"]:
        assert "calibration" not in s
        assert s["runs"]["engine adaptive (default)"]["identical_to_plain"] == 1
    assert "Scenario code:" in (tmp_path / "assisted.md").read_text()


def test_batch_rows_instead_of_the_breakdown(tmp_path):
    """``--batch``: plain against the default controller and a fixed γ at each batch size, on the same pair."""
    argv = ["--preset", "tiny", "--cache-dir", str(tmp_path / "pairs"), "--agreements", "0.9", "--prompts", "4",
            "--max-tokens", "8", "--fixed-gammas", "2", "--batch", "1,4", "--repeats", "1", "--threads", "1",
            "--calib-trials", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    [s] = json.loads((tmp_path / "assisted.json").read_text())["scenarios"]
    assert "runs" not in s and [b["batch"] for b in s["batches"]] == [1, 4]
    for b in s["batches"]:
        assert b["prompts"] == 4 and b["identical_spec"] == 4 and b["identical_fixed2"] == 4
        assert b["gain_spec"] > 0 and b["best_fixed_gamma"] == 2
        assert b["identical_control"] == 4 and b["gain_control"] > 0  # a second plain engine: the noise's 1.0
    table = (tmp_path / "assisted.md").read_text()
    assert "| 4 |" in table and "plain again (control)" in table
