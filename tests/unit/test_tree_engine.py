"""Token trees end to end, in process (issue 15): the n-gram proposer drafts every distinct continuation as one
tree per sequence, the verify stage scores it in one target forward and accepts a path exactly.

Contract: greedy output is token-identical to the target alone (HF ``generate``) for prompts whose repeated
motifs give trees of width > 1, in one batch, with joins mid-generation and next to sampled rows; trees of
width > 1 are really verified; the tree's tokens per target forward are at least the chain's. The tree
proposer's first branch is the chain proposer's draft, and a remote proposal refuses a tree.
"""

from __future__ import annotations

import random

import pytest
import torch

from draftpool.ngram import NgramProposer
from engine.engine import Request
from runtime.protocol import ProposeItem, SamplingParams, SyncItem
from runtime.models import tiny_llama
from runtime.token_tree import depths
from tests.unit.helpers import VOCAB, RecordingProposer, hf_greedy, make_engine, run_to_end, wide

pytestmark = pytest.mark.timeout(300)

TREE_NODES = 16
GAMMA = 4
MAX_NEW = 24
MIX = 0.01  # the repetitive target's scale on attention and MLP outputs


@pytest.fixture(scope="module")
def motif_prompts():
    """Prompts built from a few short motifs with varying endings: a suffix recurs with several continuations."""
    gen = random.Random(11)
    prompts = []
    for _ in range(8):
        motifs = [[gen.randrange(3, 96) for _ in range(gen.randint(2, 3))] for _ in range(3)]
        prompt = []
        while len(prompt) < gen.randint(20, 40):
            prompt += gen.choice(motifs) + [gen.randrange(3, 12)]
        prompts.append(tuple(prompt))
    return prompts


@pytest.fixture(scope="module")
def motif_refs(target, motif_prompts):
    return [hf_greedy(target, p, MAX_NEW) for p in motif_prompts]


@pytest.fixture(scope="module")
def repetitive():
    """``tiny_llama(0)`` with every attention and MLP output scaled by ``MIX``: its next token is mostly a
    function f of the current one (the context still shifts it), so n-gram drafts copied from the prompt
    can be right. A random target's greedy output seldom repeats its prompt."""
    model = tiny_llama(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(MIX)
            layer.mlp.down_proj.weight.mul_(MIX)
    return model


@pytest.fixture(scope="module")
def orbit_prompts(repetitive):
    """Each prompt holds the pairs (x, f(x)) of a start token's orbit under f, then — more recently — each x
    followed by a random token, then the start token: the latest continuation of a token (the chain's
    draft) is the random one, the tree also holds f(x)."""
    with torch.no_grad():
        f = repetitive(torch.arange(VOCAB).view(VOCAB, 1)).logits[:, -1].argmax(-1).tolist()
    gen = random.Random(11)
    prompts = []
    for _ in range(8):
        orbit = [gen.randrange(3, VOCAB)]
        for _ in range(5):
            orbit.append(f[orbit[-1]])
        prompt = []
        for x in orbit:
            prompt += [x, f[x], gen.randrange(3, VOCAB)]
        for x in orbit:
            prompt += [x, gen.randrange(3, VOCAB), gen.randrange(3, VOCAB)]
        prompts.append(tuple(prompt + [orbit[0]]))
    return prompts


@pytest.fixture(scope="module")
def orbit_refs(repetitive, orbit_prompts):
    return [hf_greedy(repetitive, p, MAX_NEW) for p in orbit_prompts]


def _engine(target, tree_nodes: int):
    proposer = RecordingProposer(NgramProposer(tree_nodes=tree_nodes))
    return make_engine(target, proposer, gamma=GAMMA), proposer


@pytest.mark.parametrize("history,gamma,budget,parents,tokens", [
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 16, [-1, 0, -1, 2], [4, 1, 3, 1]),  # most recent first; [2]'s add nothing new
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 3, [-1, 0, -1], [4, 1, 3]),  # the node budget cuts the tree
    ([5, 1, 7, 1, 7, 1], 3, 16, [-1, 0, 1], [7, 1, 7]),  # [1]'s longer continuation extends [7, 1, 7]'s
    ([1, 2, 1, 3, 1], 1, 16, [-1, -1], [3, 2]),  # width 2 at γ = 1
    ([1, 2, 3], 2, 16, [], []),  # no earlier occurrence: no tree
])
def test_lookup_tree(history, gamma, budget, parents, tokens):
    proposer = NgramProposer(tree_nodes=budget)
    batch = proposer.propose([ProposeItem(SyncItem(0, 0, tuple(history)), gamma)])
    assert (batch.row_parents(0), batch.row_tokens(0)) == (parents, tokens)
    assert batch.q_ids is None


def _holds_path(parents: list[int], tokens: list[int], chain: list[int]) -> bool:
    """The tree has a path from the root whose tokens are ``chain``."""
    node = -1
    for tok in chain:
        node = next((i for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == tok), None)
        if node is None:
            return False
    return True


def test_tree_holds_the_chain():
    gen = random.Random(3)
    for _ in range(200):
        history = [gen.randrange(4) for _ in range(gen.randint(1, 30))]
        gamma = gen.randint(1, 5)
        item = [ProposeItem(SyncItem(0, 0, tuple(history)), gamma)]
        chain = NgramProposer().propose(item).row_tokens(0)
        tree = NgramProposer(tree_nodes=TREE_NODES).propose(item)
        parents, tokens = tree.row_parents(0), tree.row_tokens(0)
        assert _holds_path(parents, tokens, chain), (history, gamma, chain, parents, tokens)
        assert len(tokens) <= TREE_NODES and max(depths(parents), default=-1) < gamma


@pytest.mark.parametrize("case", ["random", "repetitive"])
def test_greedy_identity_and_tokens_per_pass(case, request):
    """Chains and trees both give the target's greedy tokens. Tokens per target forward, per sequence:
    emitted tokens over verify steps (rows × forwards), the same prompts in one batch."""
    model = request.getfixturevalue({"random": "target", "repetitive": "repetitive"}[case])
    prompts = request.getfixturevalue({"random": "motif_prompts", "repetitive": "orbit_prompts"}[case])
    refs = request.getfixturevalue({"random": "motif_refs", "repetitive": "orbit_refs"}[case])
    per_pass = {}
    for tree_nodes in (0, TREE_NODES):
        engine, proposer = _engine(model, tree_nodes)
        outs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
        for i, (o, r) in enumerate(zip(outs, refs)):
            assert o.tokens == r, f"tree_nodes={tree_nodes}, prompt {i}: {o.tokens} != {r}"
        per_pass[tree_nodes] = engine.stats.emitted / engine.stats.steps
        n_wide = sum(wide(t) for t in proposer.trees)
        assert (n_wide > 0) == bool(tree_nodes), f"{n_wide} trees of width > 1 with tree_nodes={tree_nodes}"
    print(f"{case}: tokens per target forward per sequence: chain {per_pass[0]:.3f}, tree {per_pass[TREE_NODES]:.3f}")
    if case == "repetitive":  # the random target accepts ~nothing either way (~1.03 both)
        assert per_pass[TREE_NODES] >= per_pass[0]


def test_joins_mid_generation(target, motif_prompts, motif_refs):
    engine, proposer = _engine(target, TREE_NODES)
    ids = {}
    for i, p in enumerate(motif_prompts):
        ids[engine.add(Request(p, max_tokens=MAX_NEW))] = i
        engine.step()
        engine.step()
    run_to_end(engine)
    for seq_id, i in ids.items():
        assert engine.output(seq_id).tokens == motif_refs[i]
    assert any(wide(t) for t in proposer.trees)


def test_greedy_rows_exact_next_to_sampled_rows(target, motif_prompts, motif_refs):
    """A batch with sampled rows takes ``rejection_sample`` over the tree: its greedy rows still emit greedy tokens."""
    engine, proposer = _engine(target, TREE_NODES)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    greedy_ids = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in motif_prompts[:4]]
    sampled_ids = [engine.add(Request(p, max_tokens=MAX_NEW, sampling=sampled)) for p in motif_prompts[4:]]
    run_to_end(engine)
    for i, seq_id in enumerate(greedy_ids):
        assert engine.output(seq_id).tokens == motif_refs[i]
    for seq_id in sampled_ids:
        out = engine.output(seq_id)
        assert len(out.tokens) == MAX_NEW and all(0 <= t < target.config.vocab_size for t in out.tokens)
    assert any(wide(t) for t in proposer.trees)
