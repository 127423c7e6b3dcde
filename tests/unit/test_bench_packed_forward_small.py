"""scripts/bench_packed_forward.py end to end on the embedded target, one round. Checks what the report must
hold, not how fast anything was (figures: docs/results.md): every case, its padding, packed logits equal to
padded ones, and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "default" / "target"

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not TARGET.is_dir(), reason="models/default is not in this checkout")]


def test_one_round_writes_every_case_with_equal_logits(tmp_path):
    out = tmp_path / "packed.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_packed_forward.py"), "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["case"]: r for r in report["rows"]}
    assert len(rows) == 10 and rows["16 plain"]["padding"] == 0
    assert rows["1 of 9, 15 plain"]["padding"] == pytest.approx(1 - 24 / 144)
    for row in rows.values():
        assert row["max_logit_gap"] <= 1e-5 and row["padded_ms"] > 0 and row["packed_ms"] > 0, row
    assert "| 8 of 5, 8 plain | 40% |" in done.stdout
