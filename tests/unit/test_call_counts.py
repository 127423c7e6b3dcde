"""Model calls per step: one batched target forward, at most γ batched draft forwards — whatever the batch.

Counted at the lowest level (``runtime.forward.forward``, the only place a model runs, wrapped per
model object) and cross-checked with the runners' own ``stats.calls``. The batch of 16 ragged prompts
joins in three waves, so some steps prefill new sequences while others are mid-chain; a joining
sequence's prefill is fed in the step's target forward and its first draft forward — or, where padding
every row to the prompt's length would waste most of that forward (``runtime.runner.ragged_groups``), in
one more forward of each beside it, on that step only.
"""

from __future__ import annotations

import pytest

import runtime.forward
from tests.unit.helpers import MAX_NEW, draft_runner, make_engine, target_runner
from engine.engine import Request

pytestmark = pytest.mark.timeout(300)

JOINS = {0: range(0, 6), 2: range(6, 11), 3: range(11, 16)}  # step → prompts that join before it


@pytest.fixture
def forward_calls(monkeypatch):
    """Every model forward as (model, rows in the batch, tokens fed per row)."""
    calls = []
    real = runtime.forward.forward

    def counting(model, pool, windows, rows, start, input_ids, *args, **kwargs):
        calls.append((model, int(rows.shape[0]), int(input_ids.shape[1])))
        return real(model, pool, windows, rows, start, input_ids, *args, **kwargs)

    monkeypatch.setattr(runtime.forward, "forward", counting)
    return calls


def _run_with_joins(engine, prompts, calls, on_step):
    ids = {}
    step = 0
    while True:
        for i in JOINS.get(step, ()):
            ids[i] = engine.add(Request(prompts[i], max_tokens=MAX_NEW))
        if not engine.has_work:
            return ids
        calls.clear()
        events = engine.step()
        on_step(step, events, list(calls))
        step += 1


@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("draft", ["noisy", "same-weights"])
def test_one_target_forward_and_at_most_gamma_draft_forwards(draft, gamma, target, noisy_draft, target_copy,
                                                             prompts, refs, forward_calls):
    draft_model = {"noisy": noisy_draft, "same-weights": target_copy}[draft]
    engine = make_engine(target, draft_model, gamma=gamma)
    seen = {"steps": 0, "target_calls": 0, "draft_calls": 0, "join_steps": 0}

    def on_step(step, events, calls):
        target_calls = [c for c in calls if c[0] is target]
        draft_calls = [c for c in calls if c[0] is draft_model]
        assert len(target_calls) + len(draft_calls) == len(calls)
        split = 1 if step in JOINS else 0  # a join's prompt may run beside the decoding rows
        assert 1 <= len(target_calls) <= 1 + split, f"step {step}: {len(target_calls)} target forwards"
        assert sum(c[1] for c in target_calls) == len(events), "every running sequence rides in one target forward"
        assert len(draft_calls) <= gamma + split, f"step {step}: {len(draft_calls)} draft forwards for γ = {gamma}"
        seen["steps"] += 1
        seen["target_calls"] += len(target_calls)
        seen["draft_calls"] += len(draft_calls)
        if step in JOINS:
            seen["join_steps"] += 1
            assert max(c[2] for c in target_calls) > gamma + 1  # the joiners' prompts were prefilled this step

    ids = _run_with_joins(engine, prompts, forward_calls, on_step)
    assert seen["join_steps"] == 3
    assert target_runner(engine).stats.calls == seen["target_calls"] <= seen["steps"] + seen["join_steps"]
    assert draft_runner(engine).stats.calls == seen["draft_calls"]
    assert seen["draft_calls"] >= seen["steps"] * min(gamma, 2) // 2  # drafting really happened
    assert [engine.output(ids[i]).tokens for i in range(len(prompts))] == refs


def test_ngram_proposer_runs_no_model(target, prompts, refs, forward_calls):
    engine = make_engine(target, "ngram", gamma=4)

    def on_step(step, events, calls):
        assert [c[0] for c in calls] in ([target], [target, target] if step in JOINS else None)

    ids = _run_with_joins(engine, prompts, forward_calls, on_step)
    assert [engine.output(ids[i]).tokens for i in range(len(prompts))] == refs


def test_plain_decoding_is_one_forward_per_token(target, prompts, refs, forward_calls):
    """With speculation off, each step is one target forward emitting one token per sequence."""
    engine = make_engine(target, None, gamma=4)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert len(forward_calls) == MAX_NEW
    assert all(c[1] == len(prompts) for c in forward_calls)
    assert [o.tokens for o in outs] == refs
