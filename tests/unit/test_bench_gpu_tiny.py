"""scripts/bench_gpu.py --tiny: the GPU benchmark's whole code path at tiny scale on CPU, in a subprocess.

A subprocess, because the benchmark must import neither ray nor pydantic nor deepspeed (a bare GPU box has
only torch + transformers) and this test process has usually imported them already; the script records
what it loaded and fails when a forbidden module got in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]

MINIMAL = ["--tiny", "--prompts", "1", "--max-tokens", "6", "--scan-tokens", "4", "--batches", "1,3",
           "--repeats", "1", "--calib-prompts", "2", "--calib-tokens", "8", "--calib-trials", "4"]

TOP = {"label", "device", "mode", "dtype", "settings", "pair", "memory", "plain", "kv_layout", "scenarios",
       "batch_scan", "seed_comparison", "elapsed_s", "skipped", "import_check"}
MEMORY = {"copy_bytes", "bandwidth_gb_s", "target_bytes", "draft_bytes", "target_step_floor_ms",
          "draft_step_floor_ms", "batch1_tokens_per_s_floor", "c_floor"}
PLAIN = {"engine_tokens_per_s", "engine_target_step_ms", "share_of_floor", "hf_generate_tokens_per_s"}
SCENARIO = {"name", "wanted_alpha", "epsilon", "calibration", "plain_tokens_per_s", "spec_tokens_per_s", "speedup",
            "acceptance_rate", "acceptance_length", "alpha", "mean_gamma", "target_step_ms", "draft_forward_ms", "c",
            "leviathan_bound", "cap_1_over_1_minus_alpha", "identical_to_plain", "hf_plain_tokens_per_s",
            "hf_assisted_tokens_per_s", "hf_assisted_speedup"}
SCAN_ROW = {"batch", "plain_tokens_per_s", "spec_tokens_per_s", "spec_speedup", "alpha", "runs"}
COMPARISON = {"name", "alpha", "seed_claim", "cap_1_over_1_minus_alpha", "measured_speedup",
              "leviathan_bound_measured", "claim_exceeds_cap"}


def test_bench_gpu_tiny(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py"), *MINIMAL, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())

    assert result["label"] == "CPU tiny-scale run, not H200 figures"
    assert "CPU tiny-scale run, not H200 figures" in proc.stdout
    assert result["import_check"]["loaded"] == []
    assert TOP <= set(result)
    assert MEMORY <= set(result["memory"])
    assert PLAIN <= set(result["plain"])
    kv = result["kv_layout"]  # the paged pool beside one slot of max_len per sequence
    assert kv["block_size"] < kv["slot_len"]
    assert [(r["batch"], r["mode"]) for r in kv["rows"]] == [(1, "plain"), (1, "speculative"), (3, "plain"),
                                                             (3, "speculative")]
    assert all(r["identical"] and r["blocks_over_slots"] > 0 for r in kv["rows"])  # fp32: the same tokens
    assert "paged KV (blocks of" in proc.stdout
    assert [s["name"] for s in result["scenarios"]] == ["json", "code", "prose"]
    for s in result["scenarios"]:
        assert SCENARIO <= set(s), SCENARIO - set(s)
        assert s["identical_to_plain"] == "1/1"  # fp32 on CPU: speculative output == plain output
        assert s["acceptance_length"] >= 1.0
        assert s["calibration"]["trials"]
    assert [r["batch"] for r in result["batch_scan"]["rows"]] == [1, 3]
    for r in result["batch_scan"]["rows"]:
        assert SCAN_ROW <= set(r)
        assert all(len(v) == 1 for v in r["runs"].values())
    assert [r["name"] for r in result["seed_comparison"]] == ["json", "code", "prose"]
    for r in result["seed_comparison"]:
        assert COMPARISON <= set(r)
    caps = {r["name"]: r["cap_1_over_1_minus_alpha"] for r in result["seed_comparison"]}
    assert caps["code"] == 2.63 and caps["prose"] == 1.22
    assert result["skipped"] == []
