"""scripts/bench_kv.py end to end on the embedded default pair, small. Checks what the report must hold, not
how fast anything was (figures: docs/results.md): more sequences at once than the slot layout holds, the
prefix cache hit on both workloads, a pool of half the blocks preempting and finishing everything, every
output identical, and the two output files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "models" / "default"

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not (DEFAULT / "target").is_dir(), reason="models/default is not in this checkout")]


def test_small_kv_run_writes_a_complete_report(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_kv.py"), "--threads", "1",
                           "--max-len", "512", "--budget-slots", "1", "--capacity-requests", "6", "--seq-len", "80",
                           "--conversations", "1", "--chat-tokens", "300", "--system-tokens", "100",
                           "--questions", "2", "--speed-prompts", "2", "--speed-tokens", "8", "--repeats", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "kv.json").read_text())
    capacity = report["capacity"]
    assert capacity["slot_layout_sequences"] == 1 and capacity["paged_sequences"] > 1
    assert capacity["identical"] == capacity["requests"] == 6
    for workload in ("chat", "system_prompt"):
        row = report["prefix"][workload]
        assert row["hit_rate"] > 0 and row["identical"] == row["requests"], row
    preemption = report["preemption"]
    assert preemption["pool_blocks"] * 2 <= preemption["blocks_needed"] and preemption["preemptions"] > 0
    assert preemption["finished"] == preemption["identical"] == 6 and preemption["failed"] == 0, preemption
    assert set(report["speed"]) == {f"batch {b}, {m}" for b in (1, 16) for m in ("plain", "speculative")}
    assert all(row["identical"] for row in report["speed"].values())
    text = (tmp_path / "kv.md").read_text()
    assert "Prefix cache" in text and "Preemption" in text
