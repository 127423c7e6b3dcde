"""Draft-model token trees (issue 15): EAGLE-2-style growth, exact end to end, and draft branches.

- ``TreeGrowth`` as tables: the budget keeps the best cumulative scores, the tree is ancestor-closed and in
  topological order, pruning never changes the result, the first branch is the greedy chain.
- Greedy: draft-model trees (fixed budget, and the adaptive shape) are token-identical to HF ``generate``
  in one batch, with joins and cancels mid-generation, and for a sliding-window model (window shorter
  than the trees' depth). Trees of width > 1 are really verified, and after a tree step the draft's cache
  holds exactly the committed tokens (what the KV columns hold), so the next sync is exact.
- Sampled: the engine's output distribution with draft-model trees (one-hot q) is the target's (χ² on the
  first two tokens, as ``test_engine_sampling``), with a negative control; seeded trees reproduce.
- Branches: branch 0 is today's chain; a greedy branch b starts with the draft's (b+1)-th token, sampled
  branches draw from their own streams; the n-gram proposer's branches are its distinct continuations.
- The verify stage refuses a tree with q before any forward.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from draftpool.draft_tree import TreeGrowth
from draftpool.ngram import NgramProposer
from engine.engine import Request
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import ProposalBatch, ProposeItem, SamplingParams, SyncItem, VerifyItem
from runtime.token_tree import depths
from tests.unit.helpers import (MAX_NEW, NOISE, P_MIN, RecordingProposer, chi2_pvalue, hf_greedy, make_engine,
                                run_to_end, wide)
from tests.unit.test_engine_sampling import V32, _exact_joint, _sample_pairs
from verifier.verify import AcceptanceConfig

pytestmark = pytest.mark.timeout(300)

MAX_LEN = 128


# -- TreeGrowth ---------------------------------------------------------------------------------------------


def _log(*ps):
    return [math.log(p) for p in ps]


def test_growth_table():
    """Root children a (.6), b (.3); a's children c (.5 → .3), d (.4 → .24); b's children e (.9 → .27), f (.1)."""
    tree = TreeGrowth(budget=4, depth=3, top_k=2)
    tree.expand([([10, 11], _log(0.6, 0.3))])
    assert tree.frontier == [0, 1]
    assert tree.fed() == ([-1, -1], [10, 11], [0, 1])
    tree.expand([([12, 13], _log(0.5, 0.4)), ([14, 15], _log(0.9, 0.1))])
    # The 4 best so far: a .6, b .3, c .3, e .27; the next frontier: c (.3) and e (.27) beat the bar (.27)? e
    # does not (not strictly above the 4th best), and d (.24) cannot place a child either.
    assert tree.frontier == [2]
    assert tree.fed() == ([-1, 0], [10, 12], [1])
    tree.expand([([16, 17], _log(0.99, 0.01))])  # c's child g: .297 replaces e in the top 4
    assert tree.frontier == []  # depth 3 reached
    assert tree.result() == ([-1, -1, 0, 2], [10, 11, 12, 16])


def test_growth_properties():
    """Random log-probabilities: the result is the budget best candidates, ancestor-closed, in topological
    order, within the depth; the frontier-pruning never drops a node the result would hold."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        budget, depth, top_k = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 20), (1, 6),
                                                                                                (1, 5)))
        tree = TreeGrowth(budget, depth, top_k)
        while tree.frontier:
            children = []
            for _ in tree.frontier:
                p = torch.rand(6, generator=gen).softmax(-1).sort(descending=True).values
                children.append((torch.randperm(50, generator=gen)[:top_k].tolist(), p[:top_k].log().tolist()))
            tree.expand(children)
        parents, tokens = tree.result()
        assert len(tokens) == min(budget, len(tree.tokens)), trial
        assert all(-1 <= p < i for i, p in enumerate(parents)), trial
        assert max(depths(parents)) < depth, trial
        chosen = sorted(sorted(range(len(tree.scores)), key=lambda n: (-tree.scores[n], n))[:budget])
        assert tokens == [tree.tokens[n] for n in chosen], trial
        # A pruned frontier node had a score no child of it could lift into the result:
        assert all(tree.parents[n] in chosen or tree.parents[n] < 0 for n in chosen), trial


# -- greedy identity ----------------------------------------------------------------------------------------


def _tree_engine(target, draft, *, tree_nodes: int, gamma: int = 4, adaptive: bool = False, max_slots: int = 16,
                 acceptance=None):
    from engine.assembly import EngineSettings, make_verify_stage
    from engine.assembly import make_engine as assemble
    from engine.engine import LocalStages

    settings = EngineSettings(target=None, draft="built", max_len=MAX_LEN, max_slots=max_slots, gamma=gamma,
                              gamma_max=max(gamma, 8), adaptive=adaptive, tree_nodes=tree_nodes,
                              acceptance=acceptance or AcceptanceConfig())
    proposer = RecordingProposer(DraftModelProposer(draft, max_slots=max_slots, max_len=MAX_LEN, tree_top_k=4))
    return assemble(settings, stages=LocalStages(make_verify_stage(settings, target), proposer)), proposer


@pytest.mark.parametrize("tree_nodes,gamma", [(6, 3), (16, 5)])
def test_greedy_identity_in_one_batch(target, noisy_draft, prompts, refs, tree_nodes, gamma):
    engine, proposer = _tree_engine(target, noisy_draft, tree_nodes=tree_nodes, gamma=gamma)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.tokens == r, f"prompt {i}"
    assert sum(wide(t) for t in proposer.trees) > len(prompts)
    assert engine.stats.acceptance_length > 1.5  # the trees were accepted, not only verified


def test_greedy_identity_with_joins_and_cancels(target, noisy_draft, prompts, refs):
    engine, proposer = _tree_engine(target, noisy_draft, tree_nodes=12, gamma=4)
    ids, cancelled, events = {}, set(), []
    for i, p in enumerate(prompts):
        ids[engine.add(Request(p, max_tokens=MAX_NEW))] = i
        events += engine.step()
        if i % 5 == 4:
            victim = list(ids)[-1]  # joined one step ago: mid-generation
            engine.cancel(victim)
            cancelled.add(victim)
    events += run_to_end(engine)
    assert {e.seq_id for e in events if e.finish_reason == "cancelled"} == cancelled
    for seq_id, i in ids.items():
        if seq_id not in cancelled:
            assert engine.output(seq_id).tokens == refs[i], f"prompt {i}"
    assert any(wide(t) for t in proposer.trees)


def test_adaptive_shape_is_exact(target, noisy_draft, prompts, refs):
    engine, proposer = _tree_engine(target, noisy_draft, tree_nodes=16, gamma=4, adaptive=True, max_slots=1)
    for p, r in zip(prompts[:6], refs[:6]):
        assert engine.generate([Request(p, max_tokens=MAX_NEW)])[0].tokens == r


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_greedy_identity_sliding_window(family):
    extra = (dict(use_sliding_window=True, sliding_window=3, max_window_layers=1) if family == "qwen2"
             else dict(sliding_window=3))
    target = tiny_llama(0, model_type=family, **extra)
    draft = noisy_copy(target, NOISE, 1)
    prompts = [tuple(range(5, 5 + n)) for n in (4, 9, 17)]
    refs = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    engine, proposer = _tree_engine(target, draft, tree_nodes=10, gamma=5)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert [o.tokens for o in outs] == refs
    assert any(wide(t) for t in proposer.trees)


def test_draft_cache_after_a_tree_step_is_the_committed_tokens(target, noisy_draft):
    proposer = DraftModelProposer(noisy_draft, max_slots=2, max_len=MAX_LEN, tree_top_k=3)
    prompt = (5, 9, 13, 21, 8)
    batch = proposer.propose([ProposeItem(SyncItem(0, 0, prompt), 3, nodes=8)])
    assert wide(batch.row_parents(0)) and batch.q_ids is None
    state = proposer.runner.seqs[0]
    assert state.cached == list(prompt) and state.valid == len(prompt)
    # The next step commits the tree's last root child, whose K/V sit in a column that is not its position's:
    # the draft re-feeds it, and drafts what a fresh runner fed the same tokens drafts.
    parents = batch.row_parents(0)
    nxt = batch.row_tokens(0)[max(i for i, p in enumerate(parents) if p == -1)]
    again = proposer.propose([ProposeItem(SyncItem(0, len(prompt), (nxt, 7)), 3, nodes=8)])
    fresh = DraftModelProposer(noisy_draft, max_slots=2, max_len=MAX_LEN, tree_top_k=3)
    expected = fresh.propose([ProposeItem(SyncItem(0, 0, prompt + (nxt, 7)), 3, nodes=8)])
    assert again.row_tokens(0) == expected.row_tokens(0) and again.row_parents(0) == expected.row_parents(0)


# -- sampling ------------------------------------------------------------------------------------------------


def test_sampled_tree_output_distribution_is_the_targets():
    target, draft = tiny_llama(11, vocab_size=V32), tiny_llama(12, vocab_size=V32)
    params = SamplingParams(temperature=0.8, top_k=12)
    proposer = RecordingProposer(DraftModelProposer(draft, max_slots=64, max_len=32, tree_top_k=3))
    engine = make_engine(target, proposer, gamma=2, max_slots=64, max_len=32, tree_nodes=6)
    pairs = _sample_pairs(engine, params, seed0=5000)
    assert 0.05 < engine.stats.acceptance_rate < 0.9, "both the accept and the reject paths must run"
    assert sum(wide(t) for t in proposer.trees) > 1000
    joint = _exact_joint(target, params)
    assert chi2_pvalue(pairs // V32, joint.sum(1)) > P_MIN
    assert chi2_pvalue(pairs % V32, joint.sum(0)) > P_MIN
    assert chi2_pvalue(pairs, joint.flatten()) > P_MIN
    assert chi2_pvalue(pairs, _exact_joint(draft, params).flatten().clamp(min=1e-12)) < P_MIN


def test_seeded_sampled_trees_reproduce(target, noisy_draft, prompts):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=123)
    outs = []
    for _ in range(2):
        engine, proposer = _tree_engine(target, noisy_draft, tree_nodes=8, gamma=3)
        outs.append([o.tokens for o in engine.generate([Request(p, max_tokens=MAX_NEW, sampling=sampling)
                                                         for p in prompts[:4]])])
        assert any(wide(t) for t in proposer.trees)
    assert outs[0] == outs[1]


# -- branches ------------------------------------------------------------------------------------------------


def _items(prompts, gamma, branch, sampling=None, nodes=0):
    return [ProposeItem(SyncItem(i, 0, p), gamma, sampling or SamplingParams(), branch, nodes=nodes)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("sampled", [False, True])
def test_draft_branches(noisy_draft, prompts, sampled):
    sampling = SamplingParams(temperature=1.0, seed=4) if sampled else None
    chains = {}
    for branch in (0, 1, 2):
        proposer = DraftModelProposer(noisy_draft, max_slots=16, max_len=MAX_LEN)
        chains[branch] = proposer.propose(_items(prompts, 4, branch, sampling))
    default = DraftModelProposer(noisy_draft, max_slots=16, max_len=MAX_LEN).propose(
        [ProposeItem(SyncItem(i, 0, p), 4, sampling or SamplingParams()) for i, p in enumerate(prompts)])
    assert torch.equal(chains[0].tokens, default.tokens)  # branch 0 is today's chain
    first = {b: chains[b].tokens[:, 0] for b in chains}
    if sampled:  # independent streams: most rows start differently
        assert int((first[1] != first[0]).sum()) > len(prompts) // 2
        assert chains[1].q_ids is not None
    else:  # the (b+1)-th most likely token of the draft
        runner = DraftModelProposer(noisy_draft, max_slots=16, max_len=MAX_LEN).runner
        for i, p in enumerate(prompts):
            runner.sync(SyncItem(i, 0, p))
        logits = runner.forward(list(range(len(prompts))), [[]] * len(prompts), [1] * len(prompts))[:, 0]
        top = logits.topk(3, dim=-1).indices
        for b in (0, 1, 2):
            assert torch.equal(first[b], top[:, b])
        # ... and then the draft's greedy continuation of that token
        follow = DraftModelProposer(noisy_draft, max_slots=16, max_len=MAX_LEN).propose(
            [ProposeItem(SyncItem(i, 0, p + (int(first[1][i]),)), 3) for i, p in enumerate(prompts)])
        assert torch.equal(chains[1].tokens[:, 1:], follow.tokens)


def test_branch_rows_are_chains_even_with_a_tree_budget(noisy_draft, prompts):
    proposer = DraftModelProposer(noisy_draft, max_slots=16, max_len=MAX_LEN)
    batch = proposer.propose(_items(prompts[:3], 3, 1, nodes=8))
    assert batch.parents is None and batch.lengths.tolist() == [3, 3, 3]


@pytest.mark.parametrize("history,gamma,branches", [
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, [[4, 1], [3, 1], []]),  # longest suffix, most recent first; [2]'s add nothing new
    ([1, 2, 1, 2, 1], 2, [[2, 1], []]),  # both occurrences continue alike: one distinct continuation
    ([1, 2, 3], 2, [[]]),
])
def test_ngram_branches(history, gamma, branches):
    for b, expected in enumerate(branches):
        batch = NgramProposer().propose([ProposeItem(SyncItem(0, 0, tuple(history)), gamma, branch=b)])
        assert batch.row_tokens(0) == expected, b
    chain = NgramProposer().propose([ProposeItem(SyncItem(0, 0, tuple(history)), gamma)])
    assert chain.row_tokens(0) == branches[0]


# -- refusals before any forward ----------------------------------------------------------------------------


def test_verify_refuses_a_tree_with_q_before_any_forward(target):
    engine = make_engine(target, None)
    stage = engine.stages.verifier
    proposal = ProposalBatch(seq_ids=[0], tokens=torch.tensor([[4, 5]]), lengths=torch.tensor([2]),
                             parents=torch.tensor([[-1, -1]]))
    proposal.q_ids = torch.tensor([[[4], [5]]])
    proposal.q_probs = torch.ones((1, 2, 1))
    calls = stage.runner.stats.calls
    with pytest.raises(ValueError, match="one-hot q"):
        stage.verify([VerifyItem(SyncItem(0, 0, (3, 9, 4)))], proposal)
    assert stage.runner.stats.calls == calls and not stage.runner.holds(0)
