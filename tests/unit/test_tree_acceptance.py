"""Acceptance over a token tree: verifier/rejection.py's entry points given ``parents``, which walk the tree in
verifier/tree_acceptance.py (docs/design.md#tree-acceptance).

- Table tests on hand-built trees with ±100 logits (p and q one-hot: every outcome is deterministic), for
  ``rejection_sample`` with no q and with dense one-hot q, and for ``greedy_accept`` (each given ``parents``).
- Greedy identity: on random trees holding the greedy continuation somewhere, the emitted tokens are plain
  greedy decoding and the accepted depth is the deepest the tree allows (checked by a walk over explicit
  child lists).
- Chain equivalence: a width-1 tree given as ``parents`` gets the chain branch's outputs bit for bit (all three
  modes), with coins and noise from the verify streams of ``runtime.rng``.
- χ² per output position (vocab 16, 60k rows, width 2–8, fixed seeds): the target is a position-dependent
  Markov model, so the token at position t given the token before it must follow the warped p_t(·|prev).
  Trees: independent draft chains (each child with its own q ≠ p), the same chains with common prefixes
  merged (duplicates kept as leaves), and a deterministic top-k tree (no q). The acceptance rate at the
  root must match 1 − Π(1 − β_i) of the residual sequence.
- Negative controls: a plain reference walk with one deliberate bug each (siblings tested against p instead
  of the residual; the recovered token drawn from p instead of the residual; a repeated sibling token
  skipped instead of rejected) must fail the same χ² test, while the reference without a bug passes and
  agrees with the module.

Thresholds: a correct rule passes with p > P_MIN = 1e-3 (as the chain's tests). The seeds are fixed, so the
test is deterministic; with these seeds the smallest p-value of the correct rule over the 45 position tests
is 0.044 (the reference without a bug: 0.040). A control must fail with p < P_CONTROL = 1e-8, five orders of
magnitude below the pass line; the controls give p ≤ 1e-82 (most underflow to 0), so the test's power is
shown with margin, not by a lucky draw. The acceptance rate at the root must lie within 5σ of its exact
value (a binomial proportion over 60k rows).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from runtime import rng
from runtime.sampling import race, warp_probs
from tests.unit.helpers import P_MIN
from verifier.rejection import PAD, ROOT, greedy_accept, rejection_sample, threshold_accept

pytestmark = pytest.mark.timeout(120)

V = 16
P_CONTROL = 1e-8  # a negative control's χ² p-value must fall below this


def _one_hot_probs(argmax: list[int], vocab: int = V) -> torch.Tensor:
    """[T, V] probabilities from ±100 logits: 1.0 on the listed token, 0.0 elsewhere in fp32."""
    logits = torch.full((len(argmax), vocab), -100.0)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 100.0
    return logits.softmax(-1)


def _noise(B: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return gen, torch.empty(B, V).exponential_(generator=gen)


def _sample_tree(parents, *args):
    """``rejection_sample`` on tree arguments in the order ``_reference`` takes them (parents first)."""
    return rejection_sample(*args, parents=parents)


# -- table tests ------------------------------------------------------------------------------------------
#
#   prefix ─┬─ 0:3 ─┬─ 2:5 ── 4:7
#           │       └─ 3:6
#           └─ 1:4 ── 5:8            (node:token)

TREE = ([ROOT, ROOT, 0, 0, 2, 1], [3, 4, 5, 6, 7, 8])
DUPLICATE = ([ROOT, ROOT, 0, 1], [3, 3, 5, 6])  # two root children with token 3, each with its own child
CHAIN = ([ROOT, 0, 1], [3, 5, 7])

TABLE = [
    # (name, (parents, tokens), num_nodes, target argmax after the prefix and after each node, output, path)
    ("deepest path and bonus", TREE, 6, [3, 5, 4, 7, 0, 9, 0], [3, 5, 7, 9], [0, 2, 4]),
    ("second root child", TREE, 6, [4, 0, 8, 0, 0, 0, 10], [4, 8, 10], [1, 5]),
    ("second child of an inner node", TREE, 6, [3, 6, 0, 0, 11, 0, 0], [3, 6, 11], [0, 3]),
    ("no root child matches", TREE, 6, [9, 0, 0, 0, 0, 0, 0], [9], []),
    ("stop inside the tree", TREE, 6, [3, 12, 0, 0, 0, 0, 0], [3, 12], [0]),
    ("leaf's subtree cut by num_nodes", TREE, 4, [3, 5, 4, 7, 0, 9, 0], [3, 5, 7], [0, 2]),
    ("no nodes: just the bonus", TREE, 0, [13, 3, 3, 3, 3, 3, 3], [13], []),
    ("repeated sibling token: the first wins", DUPLICATE, 4, [3, 6, 6, 0, 0], [3, 6], [0]),
    ("chain fully accepted", CHAIN, 3, [3, 5, 7, 14], [3, 5, 7, 14], [0, 1, 2]),
    ("chain rejected in the middle", CHAIN, 3, [3, 6, 7, 14], [3, 6], [0]),
]


def _padded(out: list[int], path: list[int], n: int) -> tuple[list[int], list[int]]:
    return out + [PAD] * (n + 1 - len(out)), path + [PAD] * (n - len(path))


def _table_batch(cases) -> tuple[torch.Tensor, ...]:
    """The cases as one padded batch: parents and tokens [B, N] (garbage beyond num_nodes), argmax [B, N+1]."""
    N = max(len(tree[0]) for _, tree, *_ in cases)
    parents = torch.full((len(cases), N), 0, dtype=torch.long)
    tokens = torch.full((len(cases), N), V - 1, dtype=torch.long)
    argmax = torch.zeros(len(cases), N + 1, dtype=torch.long)
    for b, (_, (par, tok), _, target, *_) in enumerate(cases):
        parents[b, : len(par)] = torch.tensor(par)
        tokens[b, : len(tok)] = torch.tensor(tok)
        argmax[b, : len(target)] = torch.tensor(target)
    num_nodes = torch.tensor([c[2] for c in cases])
    return parents, tokens, num_nodes, argmax


def _all_rules(parents, tokens, num_nodes, argmax, seed: int):
    """The three ways to accept a greedy tree: sampled rule with no q, with dense one-hot q, greedy rule."""
    B, N = tokens.shape
    p = _one_hot_probs(argmax.reshape(-1).tolist()).view(B, N + 1, V)
    q = _one_hot_probs(tokens.reshape(-1).tolist()).view(B, N, V)
    gen, noise = _noise(B, seed)
    uniform = torch.rand(B, N, generator=gen)
    return [rejection_sample(tokens, num_nodes, p, None, uniform, noise, parents=parents),
            rejection_sample(tokens, num_nodes, p, q, uniform, noise, parents=parents),
            greedy_accept(tokens, num_nodes, argmax, parents=parents)]


@pytest.mark.parametrize("name,tree,num_nodes,target,expected,path", TABLE, ids=[t[0] for t in TABLE])
def test_table(name, tree, num_nodes, target, expected, path):
    case = (name, tree, num_nodes, target, expected, path)
    exp_out, exp_path = _padded(expected, path, len(tree[0]))
    for seed in range(3):  # the coins and the noise cannot change a one-hot outcome
        for result in _all_rules(*_table_batch([case]), seed):
            assert result.output.tolist() == [exp_out]
            assert result.path.tolist() == [exp_path]
            assert result.num_accepted.tolist() == [len(path)]
            assert result.output.dtype == result.path.dtype == result.num_accepted.dtype == torch.long


def test_table_as_one_ragged_batch():
    """Every row of a mixed batch (different trees, sizes, garbage padding) decides on its own."""
    parents, tokens, num_nodes, argmax = _table_batch(TABLE)
    N = tokens.shape[1]
    expected = [_padded(out, path, N) for *_, out, path in TABLE]
    for result in _all_rules(parents, tokens, num_nodes, argmax, seed=0):
        assert result.output.tolist() == [o for o, _ in expected]
        assert result.path.tolist() == [p for _, p in expected]


def test_recovered_token_excludes_every_rejected_sibling():
    """p = ⅓ on tokens 3, 4, 5; root children 3 then 4 (one-hot q). Child 3 is accepted iff u₀ < ⅓; after its
    rejection the residual is ½ on 4 and 5, so child 4 is accepted iff u₁ < ½; after both, only 5 is left."""
    parents, tokens = torch.tensor([[ROOT, ROOT]]), torch.tensor([[3, 4]])
    p = torch.zeros(1, 3, V)
    p[0, 0, 3:6] = 1 / 3
    p[0, 1, 10] = p[0, 2, 11] = 1.0
    for coins, expected in [((0.32, 0.9), [3, 10, PAD]), ((0.34, 0.49), [4, 11, PAD]), ((0.34, 0.51), [5, PAD, PAD]),
                            ((0.99, 0.99), [5, PAD, PAD])]:
        for seed in range(3):
            _, noise = _noise(1, seed)
            for q in (None, _one_hot_probs([3, 4]).unsqueeze(0)):
                result = rejection_sample(tokens, torch.tensor([2]), p, q, torch.tensor([coins]), noise,
                                          parents=parents)
                assert result.output.tolist() == [expected]


def test_extreme_logits_stay_finite():
    """±100 logits at temperature 1 underflow most probabilities to exactly 0 in p and q: no NaN, every emitted
    token lies in the support of the target at its position."""
    gen = torch.Generator().manual_seed(5)
    B, N = 4096, 6
    parents = torch.tensor([ROOT, ROOT, 0, 0, 1, 2]).expand(B, N)
    p = (torch.randint(0, 2, (B, N + 1, V), generator=gen).float() * 200 - 100).softmax(-1)
    q = (torch.randint(0, 2, (B, N, V), generator=gen).float() * 200 - 100).softmax(-1)
    tokens = race(q, torch.empty(B, N, V).exponential_(generator=gen))
    result = rejection_sample(tokens, torch.full((B,), N), p, q, torch.rand(B, N, generator=gen),
                              torch.empty(B, V).exponential_(generator=gen), parents=parents)
    row = torch.arange(B)
    last = torch.where(result.num_accepted > 0, result.path[row, (result.num_accepted - 1).clamp(min=0)], ROOT)
    assert (p[row, last + 1, result.output[row, result.num_accepted]] > 0).all()
    assert (result.num_accepted > 0).any() and (result.num_accepted < 3).any()


def test_pure_function():
    gen = torch.Generator().manual_seed(0)
    B, N = 8, 5
    args = (torch.tensor([ROOT, ROOT, 0, 1, 1]).expand(B, N), torch.randint(0, V, (B, N), generator=gen),
            torch.randint(0, N + 1, (B,), generator=gen), torch.rand(B, N + 1, V, generator=gen).softmax(-1),
            torch.rand(B, N, V, generator=gen).softmax(-1), torch.rand(B, N, generator=gen),
            torch.empty(B, V).exponential_(generator=gen))
    a, b = _sample_tree(*args), _sample_tree(*args)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- greedy: plain greedy decoding ------------------------------------------------------------------------


def _full_tree(width: int, depth: int) -> list[int]:
    """Parents of the complete tree of that width and depth, in breadth-first (topological) order."""
    parents, level = [], [ROOT]
    for _ in range(depth):
        nxt = []
        for parent in level:
            for _ in range(width):
                parents.append(parent)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def _walk(parents: list[int], tokens: list[int], greedy: list[int]) -> list[int]:
    """Reference greedy walk over explicit child lists: at depth d, the first child whose token is greedy[d],
    until none is."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path, node = [], ROOT
    while True:
        match = [c for c in children.get(node, []) if tokens[c] == greedy[len(path)]]
        if not match:
            return path
        node = match[0]
        path.append(node)


def test_greedy_is_plain_greedy_decoding():
    """Target: logits in ±100 that depend on (depth, previous token). Each node's token is the greedy token with
    probability ½, else random, so paths of every depth occur."""
    gen = torch.Generator().manual_seed(6)
    B, width, depth = 400, 3, 3
    parents_list = _full_tree(width, depth)
    N = len(parents_list)
    logits = torch.rand(depth + 1, V, V, generator=gen) * 200 - 100  # [depth+1, prev, V]
    greedy_next = logits.argmax(-1)  # [depth+1, prev]
    prefix_token = 0
    node_depth = []
    for parent in parents_list:
        node_depth.append(0 if parent == ROOT else node_depth[parent] + 1)
    node_depth_t = torch.tensor(node_depth)
    parents = torch.tensor(parents_list).expand(B, N)

    tokens = torch.zeros(B, N, dtype=torch.long)
    for j, parent in enumerate(parents_list):  # parents first: a node's greedy token needs its parent's token
        prev = torch.full((B,), prefix_token) if parent == ROOT else tokens[:, parent]
        greedy = greedy_next[node_depth[j], prev]
        tokens[:, j] = torch.where(torch.rand(B, generator=gen) < 0.5, greedy, torch.randint(0, V, (B,), generator=gen))
    # Target logits after the prefix and after every node: [B, N+1, V]
    prev = torch.cat([torch.full((B, 1), prefix_token), tokens], 1)
    after_depth = torch.cat([torch.zeros(1, dtype=torch.long), node_depth_t + 1])
    target_logits = logits[after_depth.expand(B, N + 1), prev]
    zeros = torch.zeros(B)
    p = warp_probs(target_logits, zeros, zeros.long(), zeros + 1)  # greedy: one-hot
    argmax = target_logits.argmax(-1)

    plain = [prefix_token]  # plain greedy decoding
    for t in range(depth + 1):
        plain.append(int(greedy_next[t, plain[-1]]))
    plain = plain[1:]

    gen2, noise = _noise(B, 7)
    q = _one_hot_probs(tokens.reshape(-1).tolist()).view(B, N, V)
    results = [rejection_sample(tokens, torch.full((B,), N), p, q_, torch.rand(B, N, generator=gen2), noise,
                                parents=parents) for q_ in (None, q)]
    results.append(greedy_accept(tokens, torch.full((B,), N), argmax, parents=parents))
    depths = set()
    for b in range(B):
        path = _walk(parents_list, tokens[b].tolist(), plain)
        depths.add(len(path))
        for r in results:
            k = int(r.num_accepted[b])
            assert r.path[b, :k].tolist() == path
            assert r.output[b, : k + 1].tolist() == plain[: k + 1]
    assert depths == set(range(depth + 1))  # every depth, the full one included, occurred


# -- chains: a width-1 tree gets the chain branch's outputs ------------------------------------------------


@pytest.mark.parametrize("logit_scale", [1.5, 100.0], ids=["moderate", "extreme"])
def test_chain_as_tree_equals_chain(logit_scale):
    """Width-1 trees, ragged γ, coins and noise from the verify streams (counter = node index = draft index):
    each mode's tree branch gives its chain branch's output, count and path."""
    gen = torch.Generator().manual_seed(8)
    B, G = 20_000, 5
    p = warp_probs(torch.randn(B, G + 1, V, generator=gen).clamp(-1, 1) * logit_scale,
                   torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B))
    q_logits = torch.randn(B, G, V, generator=gen).clamp(-1, 1) * logit_scale
    q = q_logits.softmax(-1)
    drafts = race(q, torch.empty(B, G, V).exponential_(generator=gen))
    num_draft = torch.randint(0, G + 1, (B,), generator=gen)
    seeds, positions = torch.randint(0, 2**62, (B,), generator=gen).tolist(), [17] * B
    uniform = rng.uniform(rng.stream_keys(seeds, positions, rng.VERIFY_COIN).unsqueeze(1), torch.arange(G))
    noise = rng.exponential(rng.stream_keys(seeds, positions, rng.VERIFY_NOISE).unsqueeze(1), torch.arange(V))
    parents = (torch.arange(G) - 1).expand(B, G)
    positions_ = torch.arange(G).unsqueeze(0)
    for q_ in (q, None):
        chain = rejection_sample(drafts, num_draft, p, q_, uniform, noise)
        tree = rejection_sample(drafts, num_draft, p, q_, uniform, noise, parents=parents)
        assert all(torch.equal(t, c) for t, c in zip(tree, chain))
        assert torch.equal(tree.path, torch.where(positions_ < chain.num_accepted.unsqueeze(1), positions_, PAD))
        assert 0 < int(chain.num_accepted.sum()) < int(num_draft.sum())  # both outcomes occur
    argmax = p.argmax(-1)
    chain = greedy_accept(drafts, num_draft, argmax)
    tree = greedy_accept(drafts, num_draft, argmax, parents=parents)
    assert all(torch.equal(t, c) for t, c in zip(tree, chain))
    threshold = torch.full((B,), 0.05)
    chain = threshold_accept(drafts, num_draft, p, threshold, noise)
    tree = threshold_accept(drafts, num_draft, p, threshold, noise, parents=parents)
    assert all(torch.equal(t, c) for t, c in zip(tree, chain))
    assert 0 < int(chain.num_accepted.sum()) < int(num_draft.sum())


def test_threshold_table():
    """The lossy rule follows the first child the target gives ≥ threshold, then samples p after it."""
    p = torch.zeros(1, 5, V)
    p[0, 0, [4, 5]] = torch.tensor([0.3, 0.7])  # after the prefix: 4 below the threshold, 5 above
    p[0, 2, 6] = 1.0  # after node 1 (token 5): 6 for sure
    p[0, 3, 8] = 1.0  # after node 2 (token 7): never reached
    p[0, 4, 9] = 1.0  # after node 3 (token 6): 9
    parents = torch.tensor([[ROOT, ROOT, 1, 1]])
    tokens = torch.tensor([[4, 5, 7, 6]])
    noise = torch.ones(1, V)
    out = threshold_accept(tokens, torch.tensor([4]), p, torch.tensor([0.5]), noise, parents=parents)
    assert out.num_accepted.tolist() == [2] and out.path[0, :2].tolist() == [1, 3]
    assert out.output[0, :3].tolist() == [5, 6, 9]
    out = threshold_accept(tokens, torch.tensor([4]), p, torch.tensor([0.8]), noise, parents=parents)
    assert out.num_accepted.tolist() == [0] and out.output[0, 0].item() == 5  # sampled from p: 0.7 beats 0.3


def test_repeated_sibling_token_is_never_accepted():
    """After a sibling with token x is rejected the residual at x is exactly 0, so a later sibling with token x
    is never accepted and its subtree never reached (cutting it off changes nothing) — but its q still counts
    (cutting off the duplicate itself changes the recovered token in some rows)."""
    gen = torch.Generator().manual_seed(9)
    B = 50_000
    #   prefix ─┬─ 0:x ── 4      (node 1 repeats node 0's token; node 3 hangs under the repeat)
    #           ├─ 1:x ── 3
    #           └─ 2:y
    parents = torch.tensor([ROOT, ROOT, ROOT, 1, 0]).expand(B, 5)
    p = torch.rand(B, 6, V, generator=gen).pow(3).softmax(-1)
    q = (torch.rand(B, 5, V, generator=gen) * 4).softmax(-1)
    tokens = race(q, torch.empty(B, 5, V).exponential_(generator=gen))
    tokens[:, 1] = tokens[:, 0]
    num_nodes, uniform, noise = torch.full((B,), 5), torch.rand(B, 5, generator=gen), torch.empty(B, V).exponential_(
        generator=gen)
    base = rejection_sample(tokens, num_nodes, p, q, uniform, noise, parents=parents)
    on_path = (base.path[:, :, None] == torch.tensor([1, 3])).any(-1)
    assert not on_path.any()
    cut = parents.clone()
    cut[:, 3] = 4  # a parent after the node: never reached
    assert all(torch.equal(a, b) for a, b in zip(base, rejection_sample(tokens, num_nodes, p, q, uniform, noise,
                                                                        parents=cut)))
    cut[:, 1] = 4
    assert not torch.equal(base.output, rejection_sample(tokens, num_nodes, p, q, uniform, noise, parents=cut).output)


# -- χ²: every emitted token follows the target's warped distribution ---------------------------------------

N_ROWS = 60_000
DEPTH = 2  # draft tokens per chain; positions 0, 1 (accepted or recovered) and 2 (also bonus) are tested
PREFIX_TOKEN = 0
WARPS = [  # (temperature, top_k, top_p), applied to p and every q alike
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.0, 6, 1.0),
    (1.0, 0, 0.8),
    (0.8, 8, 0.9),
]
KINDS = ["chains", "merged", "top-k"]
WIDTHS = [2, 3, 4, 6, 8]


def _warp(logits: torch.Tensor, warp) -> torch.Tensor:  # [..., V] logits → warped probabilities, same shape
    temperature, top_k, top_p = warp
    flat = logits.reshape(-1, 1, V)
    n = flat.shape[0]
    probs = warp_probs(flat, torch.full((n,), float(temperature)), torch.full((n,), top_k, dtype=torch.long),
                       torch.full((n,), float(top_p)))
    return probs.view(logits.shape)


def _markov_tree(seed: int, kind: str, width: int, warp):
    """A batch of N_ROWS trees of ``width`` draft chains of DEPTH tokens, nodes in breadth-first order
    (node t·width + c is chain c's token t), against a Markov target.

    Target: p[t, prev] is the warped distribution of position t after token ``prev``. Chain c drafts from its
    own model q[c, t, prev] (the target's logits plus noise, warped alike). Kinds:
    - "chains": chain c's tokens sampled from its q, each chain its own branch under the prefix;
    - "merged": the same chains with common prefixes merged — chain c's token t hangs under the node of the
      first chain a ≤ c with the same first t tokens; a chain repeating an earlier chain's token keeps its
      node (a leaf);
    - "top-k": deterministic, no q: chain c starts with the draft's c-th most likely first token and
      continues greedily.
    Returns (p [DEPTH+1, V, V], q [width, DEPTH, V, V], tree args (parents first) for _sample_tree).
    """
    gen = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(DEPTH + 1, V, V, generator=gen) * 1.5
    p = _warp(p_logits, warp)
    q = _warp(p_logits[:DEPTH].expand(width, -1, -1, -1) + torch.randn(width, DEPTH, V, V, generator=gen) * 1.5, warp)
    B, N = N_ROWS, width * DEPTH
    chain = torch.arange(width)
    x = torch.zeros(B, width, DEPTH, dtype=torch.long)  # chain c's token t
    for t in range(DEPTH):
        prev = torch.full((B, width), PREFIX_TOKEN) if t == 0 else x[:, :, t - 1]
        if kind == "top-k":  # one draft model (chain 0's): its most likely first tokens, then greedy
            first = q[0, 0, PREFIX_TOKEN].argsort(descending=True)[:width]
            x[:, :, t] = first.expand(B, width) if t == 0 else q[0, t, prev].argmax(-1)
        else:
            q_t = q[chain, t, prev]  # [B, width, V]
            x[:, :, t] = race(q_t, torch.empty(B, width, V).exponential_(generator=gen))
    tokens = x.transpose(1, 2).reshape(B, N)  # breadth-first: [t, c] → t·width + c
    parents = torch.full((B, width, DEPTH), ROOT, dtype=torch.long)
    for t in range(1, DEPTH):
        if kind == "merged":  # the first chain sharing the first t tokens
            same = (x[:, :, None, :t] == x[:, None, :, :t]).all(-1)  # [B, c, a]
            first = same.long().argmax(-1)  # [B, c]
        else:
            first = chain.expand(B, width)
        parents[:, :, t] = (t - 1) * width + first
    parents = parents.transpose(1, 2).reshape(B, N)
    prev = torch.cat([torch.full((B, width, 1), PREFIX_TOKEN), x[:, :, :-1]], -1)  # each node's previous token
    node_q = q[chain[None, :, None], torch.arange(DEPTH)[None, None], prev]  # [B, width, DEPTH, V]
    draft_probs = None if kind == "top-k" else node_q.transpose(1, 2).reshape(B, N, V)
    after = p[torch.arange(1, DEPTH + 1)[None, None], x]  # [B, width, DEPTH, V]: p after each node
    target_probs = torch.cat([p[0, PREFIX_TOKEN].expand(B, 1, V), after.transpose(1, 2).reshape(B, N, V)], 1)
    args = (parents, tokens, torch.full((B,), N), target_probs, draft_probs,
            torch.rand(B, N, generator=gen), torch.empty(B, V).exponential_(generator=gen))
    return p, q, args


def _chi2_per_position(output: torch.Tensor, num_accepted: torch.Tensor, p: torch.Tensor) -> list[float]:
    """p-values, per position t, of the emitted token given the one before it against p[t, prev], pooled over
    prev (one χ² with the degrees of freedom summed). Cells expected < 5 times are pooled per context; a
    token outside its context's support makes the p-value 0."""
    pvalues = []
    for t in range(DEPTH + 1):
        reached = num_accepted >= t
        prev = torch.full_like(output[:, 0], PREFIX_TOKEN) if t == 0 else output[:, t - 1]
        counts = torch.zeros(V, V, dtype=torch.float64).index_put_(
            (prev[reached], output[reached, t]), torch.ones(int(reached.sum()), dtype=torch.float64), accumulate=True)
        probs = p[t].double()
        if bool((counts[probs <= 0] > 0).any()):
            pvalues.append(0.0)
            continue
        expected = counts.sum(1, keepdim=True) * probs
        big = expected >= 5
        stat = float((((counts - expected) ** 2 / expected.clamp(min=1e-300))[big]).sum())
        small_obs, small_exp = (counts * ~big).sum(1), (expected * ~big).sum(1)
        pooled = small_exp > 0
        stat += float(((small_obs - small_exp)[pooled] ** 2 / small_exp[pooled]).sum())
        cells = big.sum(1) + pooled.long()
        dof = int((cells - 1).clamp(min=0).sum())
        pvalues.append(float(chi2.sf(stat, dof)) if dof else 1.0)
    return pvalues


def _root_acceptance(p: torch.Tensor, q: torch.Tensor, args) -> float:
    """P(some root child accepted) = 1 − Π(1 − β_i), β_i = Σ min(q_i, r_{i−1}); the residuals depend on the q's
    only, not on the drawn tokens, so the figure is exact for any kind."""
    parents, tokens, _, _, draft_probs, *_ = args
    residual, reject_all = p[0, PREFIX_TOKEN].double(), 1.0
    for c in range(q.shape[0]):  # the root children are nodes 0..width-1 in chain order
        q_c = q[c, 0, PREFIX_TOKEN].double() if draft_probs is not None else torch.nn.functional.one_hot(
            tokens[0, c], V).double()
        beta = float(torch.minimum(q_c, residual).sum())
        reject_all *= 1 - beta
        left = (residual - q_c).clamp(min=0)
        residual = left / left.sum() if left.sum() > 0 else residual
    return 1 - reject_all


# Every kind at every width, the warps rotated so that every kind also meets every warp.
CASES = [(kind, width, WARPS[(i + k) % len(WARPS)]) for k, kind in enumerate(KINDS) for i, width in enumerate(WIDTHS)]


@pytest.mark.parametrize("kind,width,warp", CASES, ids=[f"{k}-w{w}-{t}" for k, w, t in CASES])
def test_chi2_per_position(kind, width, warp):
    p, q, args = _markov_tree(CASES.index((kind, width, warp)), kind, width, warp)
    if kind != "top-k":
        assert (p[:DEPTH].expand_as(q) - q).abs().sum(-1).mean() > 0.2  # p and q really differ
    result = _sample_tree(*args)
    for t, pvalue in enumerate(_chi2_per_position(result.output, result.num_accepted, p)):
        assert pvalue > P_MIN, f"position {t}: p-value {pvalue:.2e}"
    assert int((result.num_accepted == DEPTH).sum()) > 100  # the bonus position is reached
    beta = _root_acceptance(p, q, args)
    rate = float((result.num_accepted > 0).double().mean())
    assert abs(rate - beta) < 5 * (beta * (1 - beta) / N_ROWS) ** 0.5 + 1e-9  # 5σ of a binomial proportion


# -- negative controls: wrong rules fail the same test ------------------------------------------------------


def _reference(parents, tokens, num_nodes, target_probs, draft_probs, uniform, exp_noise, bug: str | None = None):
    """The tree walk written plainly (residual renormalised after every rejection, division form), with at most
    one deliberate bug:

    - "stale residual": every sibling is tested against the node's p, and the recovered token comes from
      norm(max(0, p − q)) of the last rejected sibling only — the chain rule applied per child;
    - "recover from p": right acceptance, but the recovered token is drawn from p, not from the residual;
    - "skip repeats": a sibling repeating a rejected sibling's token is skipped, so its q is never
      subtracted (the tempting shortcut the module's docstring warns about).
    """
    B, N = tokens.shape
    row = torch.arange(B)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(tokens, V).float()
    current = torch.full((B,), ROOT)
    node_p = target_probs[:, 0]  # the target's p at the current node
    residual = node_p
    rejected_tokens = torch.zeros(B, V, dtype=torch.bool)
    output = torch.full((B, N + 1), PAD)
    depth = torch.zeros(B, dtype=torch.long)
    for j in range(N):
        x, q = tokens[:, j], draft_probs[:, j]
        tried = (j < num_nodes) & (parents[:, j] == current)
        if bug == "skip repeats":
            tried &= ~rejected_tokens[row, x]
        against = node_p if bug == "stale residual" else residual
        accepted = tried & (uniform[:, j] < against[row, x] / q[row, x])
        left = (against - q).clamp(min=0)
        mass = left.sum(-1, keepdim=True)
        shrink = tried & ~accepted & (mass.squeeze(-1) > 0)
        residual = torch.where(shrink[:, None], left / mass.clamp(min=1e-30), residual)
        rejected_tokens[row, x] |= tried & ~accepted
        node_p = torch.where(accepted[:, None], target_probs[:, j + 1], node_p)
        residual = torch.where(accepted[:, None], target_probs[:, j + 1], residual)
        rejected_tokens &= ~accepted[:, None]
        output[row, depth] = torch.where(accepted, x, output[row, depth])
        depth += accepted.long()
        current = torch.where(accepted, j, current)
    output[row, depth] = race(node_p if bug == "recover from p" else residual, exp_noise)
    return output, depth


CONTROLS = [  # (bug, kind, width, warp): data on which the bug has a large effect
    ("stale residual", "chains", 4, WARPS[0]),
    ("stale residual", "top-k", 4, WARPS[3]),
    ("recover from p", "chains", 2, WARPS[0]),
    ("recover from p", "merged", 6, WARPS[4]),
    ("skip repeats", "merged", 8, WARPS[1]),
]


@pytest.mark.parametrize("bug,kind,width,warp", CONTROLS, ids=[f"{b}-{k}-w{w}" for b, k, w, _ in CONTROLS])
def test_chi2_negative_controls(bug, kind, width, warp):
    """The reference without its bug passes and agrees with the module (up to rounding near a coin's
    threshold); with its bug it fails at some position with p < P_CONTROL."""
    p, _, args = _markov_tree(1000 + CONTROLS.index((bug, kind, width, warp)), kind, width, warp)
    module = _sample_tree(*args)
    right_out, right_acc = _reference(*args)
    agree = (right_out == module.output).all(-1)
    assert float(agree.double().mean()) > 1 - 1e-3
    assert min(_chi2_per_position(right_out, right_acc, p)) > P_MIN
    wrong_out, wrong_acc = _reference(*args, bug=bug)
    assert min(_chi2_per_position(wrong_out, wrong_acc, p)) < P_CONTROL
