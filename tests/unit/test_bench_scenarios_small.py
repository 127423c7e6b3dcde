"""scripts/bench_scenarios.py end to end on the embedded default pair, small: 2 prompts, 8 tokens.

Checks what the report must hold, not how fast anything was (figures come from full runs, docs/results.md):
every scenario row with its ratios, the bound, the fixed-γ sweep and the HF comparisons, the validity
shares, the batch row, the greedy identity counts equal to the number of comparisons, and the three
output files in the --out folder. Then a chat-style prompts file (``messages`` rows through the pair's chat
template): the JSON answers are judged as answers, not as continuations, and are valid. Then the clear
errors a user gets for a prompts file or a model the benchmark cannot use.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "models" / "default"
SCRIPT = str(REPO / "scripts" / "bench_scenarios.py")

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not (DEFAULT / "target").is_dir(), reason="models/default is not in this checkout")]

ROW = {"scenario", "prompts", "format", "plain_tok_s", "spec_tok_s", "gain", "acceptance_rate",
       "acceptance_length", "mean_gamma", "alpha", "c", "bound", "gain_over_bound", "identical",
       "per_position_acceptance", "draft_ms_per_step", "verify_ms_per_step", "plain_ms_per_token", "samples",
       "hf_plain_tok_s", "hf_assisted_gain", "hf_prompt_lookup_gain", "gain_over_hf_assisted", "plain_matches_hf",
       "ngram_gain", "ngram_identical", "fixed_tok_s", "best_fixed_gamma", "best_fixed_tok_s",
       "adaptive_over_best_fixed", "fixed_identical"}


def bench(*args: str, timeout: int = 280) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, "--threads", "1", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def test_small_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "scen"
    done = bench("--prompts", "2", "--max-tokens", "8", "--batch", "1,2", "--fixed-gammas", "1-3",
                 "--trees", "3:8,4:16", "--auto-tree-nodes", "16", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "scenarios.json").read_text())
    assert [r["scenario"] for r in report["scenarios"]] == ["json", "code", "prose"]
    for row in report["scenarios"]:
        assert ROW <= set(row), ROW - set(row)
        assert row["format"] == "completion"
        assert row["prompts"] == 2 and row["identical"] == 2 and row["ngram_identical"] == 2
        assert row["fixed_identical"] == 2 * 3  # every fixed γ decodes exactly what plain decoding does
        assert row["plain_matches_hf"] == 2  # the engine's plain decoding is HF's greedy decoding
        assert row["bound"] > 0 and row["c"] > 0 and 0 <= row["alpha"] <= 1
        assert sorted(row["fixed_tok_s"]) == ["1", "2", "3"]
        assert row["best_fixed_tok_s"] == max(row["fixed_tok_s"].values())
        assert row["fixed_tok_s"][str(row["best_fixed_gamma"])] == row["best_fixed_tok_s"]
        assert row["adaptive_over_best_fixed"] == pytest.approx(row["spec_tok_s"] / row["best_fixed_tok_s"])
    assert 0 <= report["scenarios"][0]["json_valid_share"] <= 1
    code = report["scenarios"][1]
    assert 0 <= code["code_statement_share"] <= code["code_parse_share"] <= 1
    assert report["identical"] == report["compared"] == 6
    assert report["fixed_identical"] == report["fixed_compared"] == 18
    assert [b["batch"] for b in report["batches"]] == [1, 2]
    for batch in report["batches"]:
        runs = ["control", "spec", "fixed1", "fixed2", "fixed3"]
        assert batch["prompts"] == 6 and all(batch[f"identical_{n}"] == 6 for n in runs)
        assert all(batch[f"gain_{n}"] > 0 and f"{n}_tok_s" in batch for n in runs)
        assert all(len(batch[f"rounds_{n}"]) == batch["repeats"] for n in runs)
        assert batch["gain_spec"] == pytest.approx(statistics.median(batch["rounds_spec"]), abs=1e-3)
        best = batch["best_fixed_gamma"]
        assert batch[f"gain_fixed{best}"] == max(batch[f"gain_fixed{g}"] for g in (1, 2, 3))
        assert batch["spec_over_best_fixed"] == pytest.approx(batch["gain_spec"] / batch[f"gain_fixed{best}"])
    table = (out / "scenarios.md").read_text()
    assert table.startswith("| scenario |")
    assert "| γ=1 | γ=2 | γ=3 | best fixed γ | adaptive / best fixed |" in table
    # the scenario table, the fixed-γ table, and chain vs tree
    assert sum(line.startswith(("| json |", "| code |", "| prose |")) for line in table.splitlines()) == 9
    assert "Chain vs tree at batch 1" in table
    assert sum(line.startswith(("| 1 |", "| 2 |")) for line in table.splitlines()) == 2  # the batch rows
    for row in report["scenarios"]:
        assert row["best_tree"] in row["trees"] and row["best_chain"] in row["chains"]
        assert all(t["identical"] == 2 for t in row["trees"].values()) and row["auto"]["identical"] == 2
    assert "Greedy identity at batch 1: 6/6" in table and "fixed γ 18/18" in table and "n-gram proposer 6/6" in table
    assert (out / "scenarios.png").stat().st_size > 10_000
    assert "| json |" in done.stdout


def test_chat_prompts_file(tmp_path):
    """The repository's example chat file: rows with ``messages``, through the pair's chat template. The
    embedded pair answers the JSON requests with bare JSON (no prompt opens it): judged as answers."""
    out = tmp_path / "chat"
    done = bench("--prompts-file", str(REPO / "scripts" / "prompts" / "chat.jsonl"), "--prompts", "2",
                 "--max-tokens", "64", "--batch", "none", "--fixed-gammas", "none", "--trees", "none",
                 "--auto-tree-nodes", "0", "--skip-hf", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "scenarios.json").read_text())
    rows = {r["scenario"]: r for r in report["scenarios"]}
    assert list(rows) == ["json", "code", "prose"] and "batches" not in report
    assert all(r["format"] == "chat" and r["identical"] == 2 for r in rows.values())
    assert rows["json"]["samples"][0]["prompt"].endswith("### Assistant:\n")  # the template was applied
    assert rows["json"]["json_valid_share"] > 0
    assert 0 <= rows["code"]["code_parse_share"] <= 1


def test_unusable_prompts_are_refused_with_a_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    cases = {
        '{"scenario": "json"}': 'give exactly one of "prompt" (text) or "messages"',
        '{"prompt": "x"}': 'needs a "scenario" name',
        '{"scenario": "code", "messages": [{"role": "user"}]}': '"messages" must be a non-empty list',
        'not json': "not a JSON object",
    }
    for line, message in cases.items():
        bad.write_text('{"scenario": "json", "prompt": "ok"}\n' + line + "\n")
        done = bench("--prompts-file", str(bad), "--out", str(tmp_path / "x"), timeout=120)
        assert done.returncode == 2 and f"{bad}:2: " in done.stderr and message in done.stderr, done.stderr
    assert not (tmp_path / "x").exists()


def test_chat_rows_need_a_chat_template(tmp_path):
    """A model whose tokenizer has no chat template cannot take ``messages`` rows: said so, not a crash."""
    plain = tmp_path / "target"
    plain.mkdir()
    for f in (DEFAULT / "target").iterdir():
        if f.name == "model.safetensors":
            (plain / f.name).symlink_to(f)
        elif f.name != "chat_template.jinja":
            shutil.copy(f, plain / f.name)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    done = bench("--target", str(plain), "--draft", str(DEFAULT / "draft"),
                 "--prompts-file", str(REPO / "scripts" / "prompts" / "chat.jsonl"), "--out", str(tmp_path / "x"),
                 timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is a chat, but the target's tokenizer has no chat template" in done.stderr
