"""Several candidate chains per step merged into one tree (``speculation.draft_num``, issue 15).

Contract: ``merge_chains`` folds the branches' chains of each row into one tree with shared prefixes merged,
nodes in order of first appearance (branch 0's chain first), resyncs of any branch kept, an empty branch
adding nothing; an engine with ``draft_num`` > 1 drafts one call per branch and stays token-identical to
the target alone for greedy rows (every batch mix, joins and cancels mid-generation, sliding-window models),
with trees of width > 1 really verified and at least the chain's tokens per target forward; the
configuration example (six drafts, a verify threshold) builds and serves as written.
"""

from __future__ import annotations

import pytest
import torch

from cluster.config import BUILTIN_TINY, ClusterConfig
from deployments.settings import engine_settings
from draftpool.draft_model import DraftModelProposer
from engine.assembly import make_engine as assemble
from engine.candidates import merge_chains
from engine.engine import Request
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import ProposalBatch, SamplingParams
from runtime.token_tree import depths
from tests.unit.helpers import MAX_NEW, NOISE, RecordingProposer, hf_greedy, make_engine, run_to_end

pytestmark = pytest.mark.timeout(300)


def chains(rows: list[list[int]], seq_ids=None, resync=()) -> ProposalBatch:
    width = max((len(r) for r in rows), default=0)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ProposalBatch(seq_ids=list(seq_ids or range(len(rows))), tokens=tokens,
                         lengths=torch.tensor([len(r) for r in rows], dtype=torch.long), resync=list(resync))


@pytest.mark.parametrize("branches, parents, tokens", [
    ([[5, 6, 7], [5, 6, 8], [9]], [-1, 0, 1, 1, -1], [5, 6, 7, 8, 9]),  # shared prefix → one path
    ([[5, 6], [5, 6], [5, 6]], [-1, 0], [5, 6]),  # identical chains → the chain
    ([[], [4, 4], []], [-1, 0], [4, 4]),  # a branch that failed adds nothing
    ([[1, 2], [3, 2], [1, 3]], [-1, 0, -1, 2, 0], [1, 2, 3, 2, 3]),  # same token under other parents
    ([[], [], []], [], []),
])
def test_merge_table(branches, parents, tokens):
    merged = merge_chains([chains([r]) for r in branches])
    assert merged.row_parents(0) == parents and merged.row_tokens(0) == tokens
    assert all(p < i for i, p in enumerate(merged.row_parents(0)))  # topological
    assert merged.q_ids is None  # nodes are verified as deterministic proposals


def test_merge_keeps_rows_apart_and_every_resync():
    a = chains([[1, 2], [3]], seq_ids=[10, 11])
    b = chains([[1, 4], []], seq_ids=[10, 11], resync=[11])
    merged = merge_chains([a, b])
    assert merged.seq_ids == [10, 11] and merged.resync == [11]
    assert (merged.row_parents(0), merged.row_tokens(0)) == ([-1, 0, 0], [1, 2, 4])
    assert (merged.row_parents(1), merged.row_tokens(1)) == ([-1], [3])
    assert merged.tokens.shape == merged.parents.shape == (2, 3)
    assert merged.parents[1].tolist() == [-1, -1, -1]


def test_merge_refuses_mismatched_rows_and_trees():
    with pytest.raises(ValueError, match="different sequences"):
        merge_chains([chains([[1]], seq_ids=[0]), chains([[1]], seq_ids=[1])])
    tree = chains([[1, 2]])
    tree.parents = torch.tensor([[-1, -1]])
    with pytest.raises(ValueError, match="merges chains"):
        merge_chains([tree, chains([[1]])])


def _engine(target, draft, draft_num: int, **kw):
    proposer = RecordingProposer(DraftModelProposer(draft, max_slots=16, max_len=128))
    engine = make_engine(target, proposer, gamma=4, draft_num=draft_num, **kw)
    widths = []
    verify = engine.stages.verifier.verify

    def recording_verify(items, proposal):
        widths.extend(len(p) - (max(depths(p), default=-1) + 1)
                      for p in (proposal.row_parents(b) for b in range(len(proposal.seq_ids))))
        return verify(items, proposal)

    engine.stages.verifier.verify = recording_verify
    return engine, proposer, widths


@pytest.mark.parametrize("draft_num", [2, 4])
def test_greedy_identity_with_several_candidates(target, noisy_draft, prompts, refs, draft_num):
    engine, proposer, widths = _engine(target, noisy_draft, draft_num, micro_batches=2)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.tokens == r, f"draft_num={draft_num}, prompt {i}: {o.tokens} != {r}"
    assert set(proposer.branches) == set(range(draft_num))
    assert any(w > 0 for w in widths), "no merged tree had two children anywhere"
    chain, _, _ = _engine(target, noisy_draft, 1, micro_batches=2)
    chain.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    per_pass = engine.stats.emitted / engine.stats.steps
    assert per_pass >= chain.stats.emitted / chain.stats.steps
    print(f"draft_num={draft_num}: tokens per target forward per sequence {per_pass:.3f}, chain "
          f"{chain.stats.emitted / chain.stats.steps:.3f}")


def test_joins_cancels_and_sampled_rows_beside_greedy_ones(target, noisy_draft, prompts, refs):
    engine, _, widths = _engine(target, noisy_draft, 3)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    ids, sampled_ids, cancelled = {}, [], []
    for i, p in enumerate(prompts[:8]):
        ids[engine.add(Request(p, max_tokens=MAX_NEW))] = i
        sampled_ids.append(engine.add(Request(p, max_tokens=MAX_NEW, sampling=sampled)))
        cancelled.append(engine.add(Request(p, max_tokens=MAX_NEW)))
        engine.step()
        engine.cancel(cancelled[-1])  # mid-generation: its slots in both stages are freed
    run_to_end(engine)
    for seq_id, i in ids.items():
        assert engine.output(seq_id).tokens == refs[i]
    assert all(engine.output(seq_id).finish_reason == "cancelled" for seq_id in cancelled)
    assert engine.stages.verifier.runner.slots_in_use == 0
    assert engine.stages.proposer.runner.slots_in_use == 0
    for seq_id in sampled_ids:
        out = engine.output(seq_id)
        assert len(out.tokens) == MAX_NEW and all(0 <= t < target.config.vocab_size for t in out.tokens)
    assert any(w > 0 for w in widths)


def test_the_configuration_example_is_served_as_written():
    """The alternative layout's example block (six drafts, temperature 0.7, a 0.9 verify threshold), as the
    router builds its engine from it: six branch calls per step, merged trees walked by the threshold rule."""
    cfg = ClusterConfig.from_dict({
        "target": {"path": BUILTIN_TINY, "device": "cpu", "max_model_len": 128},
        "draft": {"kind": "model", "path": BUILTIN_TINY},
        "speculative_decoding": {"draft_num": 6, "temperature": 0.7, "verify_threshold": 0.9, "batch_size": 32}})
    settings = engine_settings(cfg, max_slots=8)
    assert (settings.draft_num, settings.acceptance.mode, settings.acceptance.threshold) == (6, "threshold", 0.9)
    engine = assemble(settings)
    sampling = SamplingParams(temperature=cfg.defaults.temperature, seed=3)
    outs = engine.generate([Request(tuple(range(5, 5 + n)), max_tokens=16, sampling=sampling) for n in (3, 9, 17)])
    assert [len(o.tokens) for o in outs] == [16, 16, 16]
    assert engine.stats.nodes > engine.stats.proposed  # trees wider than a chain were verified


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_greedy_identity_sliding_window(family):
    """A window (3) shorter than the merged tree's depth: a node's keys count at prefix + depth."""
    extra = (dict(use_sliding_window=True, sliding_window=3, max_window_layers=1) if family == "qwen2"
             else dict(sliding_window=3))
    target = tiny_llama(0, model_type=family, **extra)
    prompts = [tuple(range(5, 5 + n)) for n in (4, 9, 17)]
    refs = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    engine, _, widths = _engine(target, noisy_copy(target, NOISE, 1), 3)
    assert [o.tokens for o in engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])] == refs
    assert any(w > 0 for w in widths)
