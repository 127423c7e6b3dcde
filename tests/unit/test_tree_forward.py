"""Token-tree verification in one target forward (``ModelRunner.tree_forward``, ``runtime.token_tree``; issue 15).

- Every node's logits, and the root row (after the last committed token), equal Hugging Face's logits for the
  prefix plus that node's root-to-node path, for random trees (width ≤ 4, depth ≤ 5, random topological
  order) in one batch whose rows have different prefix lengths and cache states (fully cached, an uncached
  tail, just joined, an empty tree), on the static path (padded batch, fused projections) and the dynamic
  one, for Llama, Qwen2 with mixed sliding-window layers and Mistral, with prefixes longer than the window.
  Tolerance: fp32, atol = rtol = 1e-4. HF attends over the path's keys alone, the tree forward over every
  KV column with the others masked, in other GEMM shapes: the sums run in other orders, which moved these
  logits (|logit| up to ~9) by at most 1.3e-5. A node that sees its earlier siblings, or takes its column
  instead of prefix + depth for RoPE or for the window, fails the test (each tried). The window (3) is
  shorter than the trees' depth, so it cuts through ancestors, not only through the prefix.
- A chain (node i's parent is i − 1) is a width-1 tree: the tree forward gives the chain forward's logits
  bit for bit.
- After ``commit_paths`` the accepted path's K/V sit where a chain would have written them: greedy decoding
  that mixes tree steps (greedy acceptance down the tree) and plain steps is token-identical to plain
  greedy decoding, and the moves really ran. Control: the same bookkeeping without the move gives wrong
  logits.
- The layout and the masks of a hand-built tree, as tables.
"""

from __future__ import annotations

import pytest
import torch

from runtime import token_tree
from runtime.models import tiny_llama
from runtime.protocol import SyncItem
from runtime.runner import ModelRunner
from tests.unit.helpers import VOCAB, make_prompts

pytestmark = pytest.mark.timeout(300)

OPTIONS = {"static": {"static": True, "pad_batch": True, "fuse": True},  # a GPU runner's path, run eagerly
           "dynamic": {"static": False, "fuse": False}}
MAX_LEN = 96
WINDOW = 3  # under the trees' depth: the window cuts through a tree's ancestors too, not only through the prefix
FAMILIES = {"llama": {},
            "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
            "mistral": dict(model_type="mistral", sliding_window=WINDOW)}
ATOL = RTOL = 1e-4  # see the module docstring


def random_tree(gen: torch.Generator, max_nodes: int, max_width: int = 4, max_depth: int = 5) -> list[int]:
    """Parents of a random tree (at most ``max_width`` children per node, ``max_depth`` levels) in a random
    topological order (not level by level)."""
    children: dict[int, list[int]] = {}
    frontier, depth_of, count = [-1], {-1: -1}, 0
    while frontier and count < max_nodes:
        node = frontier.pop(int(torch.randint(len(frontier), (1,), generator=gen)))
        if depth_of[node] + 1 >= max_depth:
            continue
        width = int(torch.randint(1 if node < 0 else 0, max_width + 1, (1,), generator=gen))
        for _ in range(min(width, max_nodes - count)):
            children.setdefault(node, []).append(count)
            depth_of[count] = depth_of[node] + 1
            frontier.append(count)
            count += 1
    order, ready = [], list(children.get(-1, []))
    while ready:
        node = ready.pop(int(torch.randint(len(ready), (1,), generator=gen)))
        order.append(node)
        ready.extend(children.get(node, []))
    index = {node: i for i, node in enumerate(order)}
    parent_of = {c: p for p, cs in children.items() for c in cs}
    return [-1 if parent_of[node] < 0 else index[parent_of[node]] for node in order]


def tree_tokens(gen: torch.Generator, parents: list[int], planted: dict[int, int] | None = None) -> list[int]:
    """Random tokens, distinct among siblings; ``planted`` fixes some nodes' tokens."""
    planted = planted or {}
    tokens = [0] * len(parents)
    for parent in set(parents):
        group = [i for i, p in enumerate(parents) if p == parent]
        fixed = {planted[i] for i in group if i in planted}
        pool = [t for t in (torch.randperm(VOCAB - 3, generator=gen) + 3).tolist() if t not in fixed]
        for i in group:
            tokens[i] = planted[i] if i in planted else pool.pop()
    return tokens


def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:  # [V]
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def prepare_rows(runner: ModelRunner, prompts, joined_len: int) -> None:
    """Row 0: prompt fully cached; row 1: prompt cached but a 3-token committed tail not; row 2: just joined
    (nothing cached, ``joined_len`` tokens); row 3: fully cached, gets an empty tree."""
    for i in (0, 1, 3):
        runner.sync(SyncItem(i, 0, prompts[i]))
    runner.forward([0, 1, 3], [[]] * 3, [1] * 3)
    runner.sync(SyncItem(1, len(prompts[1]), (7, 8, 9)))
    runner.sync(SyncItem(2, 0, prompts[2][:joined_len]))


@pytest.mark.parametrize("path", sorted(OPTIONS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_node_logits_equal_hf_on_the_path(family, path):
    model = tiny_llama(4, **FAMILIES[family])
    gen = torch.Generator().manual_seed(15)
    prompts = make_prompts(32, n=4, lo=12, hi=40)
    static = path == "static"
    max_nodes, joined_len = (12, 3) if static else (24, 40)  # the static path takes rows of ≤ 16 fed tokens
    for trial in range(3):
        runner = ModelRunner(model, max_slots=4, max_len=MAX_LEN, **OPTIONS[path])
        prepare_rows(runner, prompts, joined_len)
        prefixes = [list(runner.seqs[i].tokens) for i in range(4)]
        parents = [random_tree(gen, max_nodes) for _ in range(3)] + [[]]
        tokens = [tree_tokens(gen, p) for p in parents]
        order = [3, 1, 0, 2] if trial % 2 else [0, 1, 2, 3]  # the caller's row order need not be slot order
        logits = runner.tree_forward(order, [parents[i] for i in order], [tokens[i] for i in order])
        assert logits.shape[1] == 1 + max(len(t) for t in tokens)
        for b, i in enumerate(order):
            torch.testing.assert_close(logits[b, 0], hf_last_logits(model, prefixes[i]), atol=ATOL, rtol=RTOL)
            for node in range(len(tokens[i])):
                path_tokens = [tokens[i][j] for j in token_tree.path_to(parents[i], node)]
                torch.testing.assert_close(logits[b, 1 + node], hf_last_logits(model, prefixes[i] + path_tokens),
                                           atol=ATOL, rtol=RTOL, msg=lambda m: f"row {i} node {node}: {m}")
        assert any(key[0] == "tree" for key in runner._buffers) == static


def test_a_chain_is_a_width_one_tree():
    model = tiny_llama(4, **FAMILIES["qwen2"])
    prompts = make_prompts(33, n=4, lo=12, hi=30)
    drafts = [[5, 6, 7, 8], [9], [10, 11, 12], []]
    for options in OPTIONS.values():
        out = []
        for use_tree in (False, True):
            runner = ModelRunner(model, max_slots=4, max_len=MAX_LEN, **options)
            prepare_rows(runner, prompts, 3)
            if use_tree:
                out.append(runner.tree_forward(range(4), [list(range(-1, len(d) - 1)) for d in drafts], drafts))
            else:
                out.append(runner.forward(range(4), drafts, [len(d) + 1 for d in drafts]))
        assert torch.equal(out[0], out[1])


def plain_greedy(model, prompts, steps: int) -> list[list[int]]:
    """Greedy decoding one token per forward: the reference that never saw a tree."""
    runner = ModelRunner(model, max_slots=len(prompts), max_len=MAX_LEN)
    rows = range(len(prompts))
    for i in rows:
        runner.sync(SyncItem(i, 0, prompts[i]))
    out = [[] for _ in rows]
    for _ in range(steps):
        tokens = runner.forward(rows, [[]] * len(rows), [1] * len(rows))[:, 0].argmax(-1).tolist()
        for i in rows:
            out[i].append(tokens[i])
            runner.sync(SyncItem(i, len(runner.seqs[i].tokens), (tokens[i],)))
    return out


def accept_greedy(parents: list[int], tokens: list[int], logits: torch.Tensor  # [1 + n, V]
                  ) -> tuple[list[int], list[int]]:  # accepted nodes, emitted tokens (accepted + 1)
    """Follow the target's argmax down the tree."""
    best = logits.argmax(-1).tolist()
    path, node = [], -1
    while True:
        child = next((c for c, p in enumerate(parents) if p == node and tokens[c] == best[node + 1]), None)
        if child is None:
            return path, [tokens[c] for c in path] + [best[node + 1]]
        path.append(child)
        node = child


@pytest.mark.parametrize("path", sorted(OPTIONS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_commit_then_decoding_is_token_identical_to_plain_greedy(family, path):
    model = tiny_llama(4, **FAMILIES[family])
    prompts = make_prompts(34, n=4, lo=2, hi=30)
    steps = 30
    reference = plain_greedy(model, prompts, steps)
    gen = torch.Generator().manual_seed(16)
    runner = ModelRunner(model, max_slots=4, max_len=MAX_LEN, **OPTIONS[path])
    for i, p in enumerate(prompts):
        runner.sync(SyncItem(i, 0, p))
    out = [[] for _ in prompts]
    moved = tree_steps = 0
    while any(len(o) < steps for o in out):
        live = [i for i in range(4) if len(out[i]) < steps]
        if torch.rand((), generator=gen) < 0.7:
            parents, tokens = [], []
            for i in live:
                par = random_tree(gen, 12)
                # Plant the reference continuation on a random node's path, to a random depth.
                plant = token_tree.path_to(par, int(torch.randint(len(par), (1,), generator=gen)))
                plant = plant[: int(torch.randint(len(plant) + 1, (1,), generator=gen))]
                parents.append(par)
                tokens.append(tree_tokens(gen, par, {n: t for n, t in zip(plant, reference[i][len(out[i]):])}))
            logits = runner.tree_forward(live, parents, tokens)
            accepted = [accept_greedy(par, tok, logits[b, : 1 + len(tok)])
                        for b, (par, tok) in enumerate(zip(parents, tokens))]
            runner.commit_paths(live, [nodes for nodes, _ in accepted])
            emitted = [e for _, e in accepted]
            moved += sum(node != depth for nodes, _ in accepted for depth, node in enumerate(nodes))
            tree_steps += 1
        else:
            emitted = [[t] for t in runner.forward(live, [[]] * len(live), [1] * len(live))[:, 0].argmax(-1).tolist()]
        for i, e in zip(live, emitted):
            e = e[: steps - len(out[i])]
            out[i].extend(e)
            runner.sync(SyncItem(i, len(runner.seqs[i].tokens), tuple(e)))
    assert out == reference
    assert tree_steps >= 3 and moved >= 3  # accepted nodes away from their final columns were moved


def test_skipping_the_move_gives_wrong_logits():
    """The control for the test above: the bookkeeping of a commit without the K/V move."""
    model = tiny_llama(4)
    prompt = make_prompts(35, n=2, lo=10, hi=10)[0]
    parents, tokens = [-1, -1, 1, 2], [20, 21, 22, 23]  # path 1 → 2 → 3 sits one column past its place
    path = [1, 2, 3]
    expected = hf_last_logits(model, list(prompt) + [21, 22, 23, 24])
    for move in (True, False):
        runner = ModelRunner(model, max_slots=1, max_len=MAX_LEN)
        runner.sync(SyncItem(0, 0, prompt))
        runner.tree_forward([0], [parents], [tokens])
        if move:
            runner.commit_paths([0], [path])
        else:
            runner.seqs[0].cached.extend(tokens[n] for n in path)
        runner.sync(SyncItem(0, len(prompt), (21, 22, 23, 24)))
        assert runner.seqs[0].valid == len(prompt) + 3  # the path counts as cached: only token 24 is fed
        logits = runner.forward([0], [[]], [1])[0, 0]
        if move:
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
        else:
            assert (logits - expected).abs().max() > 1e-2


def test_commit_refuses_a_non_path_and_a_stale_tree():
    model = tiny_llama(4)
    runner = ModelRunner(model, max_slots=2, max_len=MAX_LEN)
    runner.sync(SyncItem(0, 0, (5, 6, 7)))
    runner.sync(SyncItem(1, 0, (8, 9)))
    runner.tree_forward([0], [[-1, -1, 0]], [[10, 11, 12]])
    with pytest.raises(ValueError, match="not a path"):
        runner.commit_paths([0], [[1, 2]])  # 2 is a child of 0, not of 1
    with pytest.raises(RuntimeError, match="no tree"):
        runner.commit_paths([1], [[]])  # row 1 was not in the tree forward
    runner.forward([1], [[]], [1])
    with pytest.raises(RuntimeError, match="no tree"):
        runner.commit_paths([0], [[0, 2]])  # a forward ran since: the tree's columns may be overwritten
    with pytest.raises(ValueError, match="topological"):
        runner.tree_forward([0], [[-1, 2, 0]], [[10, 11, 12]])


def test_tree_helpers():
    parents = [-1, -1, 0, 0, 2]
    assert token_tree.depths(parents) == [0, 0, 1, 1, 2]
    assert token_tree.path_to(parents, 4) == [0, 2, 4] and token_tree.path_to(parents, 1) == [1]
    assert token_tree.is_path(parents, []) and token_tree.is_path(parents, [0, 2, 4])
    assert not token_tree.is_path(parents, [2, 4]) and not token_tree.is_path(parents, [0, 4])
    assert not token_tree.is_path(parents, [0, 5])


def test_layout_and_masks_table():
    """Two committed tokens fed from column 2, then nodes with parents [-1, -1, 1, 2, 0], one padded token."""
    positions, visible = token_tree.layout(2, 2, [-1, -1, 1, 2, 0], 8)
    assert positions == [2, 3, 4, 4, 5, 6, 5, 9]  # committed: 2, 3; node: 2 + 2 + depth; pad: its column
    assert visible == [
        # committed  nodes 0-4   pad
        [1, 0, 0, 0, 0, 0, 0, 0],  # committed token at 2
        [1, 1, 0, 0, 0, 0, 0, 0],  # committed token at 3
        [1, 1, 1, 0, 0, 0, 0, 0],  # node 0: itself
        [1, 1, 0, 1, 0, 0, 0, 0],  # node 1: itself, not its sibling 0
        [1, 1, 0, 1, 1, 0, 0, 0],  # node 2: 1, itself
        [1, 1, 0, 1, 1, 1, 0, 0],  # node 3: 1, 2, itself
        [1, 1, 1, 0, 0, 0, 1, 0],  # node 4: 0, itself, not its cousins 2, 3
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding: its own column only
    ]
    masks = token_tree.tree_masks(torch.tensor([2]), torch.tensor([positions]), torch.tensor([visible]).bool(),
                                  10, [None, 2])
    # Columns 0, 1 were cached before the call, at their own positions; column 2 + t holds fed token t.
    assert masks[None][0, 0].long().tolist() == [[1, 1, *row] for row in visible]
    # Window 2 compares positions: a key is seen when its position > the query's − 2. Key positions by
    # column: 0, 1, 2, 3, then the nodes' 4, 4, 5, 6, 5, then 9.
    assert masks[2][0, 0].long().tolist() == [
        [0, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # position 2: keys at 1, 2
        [0, 0, 1, 1, 0, 0, 0, 0, 0, 0],  # position 3: 2, 3
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],  # node 0 (position 4): 3, itself
        [0, 0, 0, 1, 0, 1, 0, 0, 0, 0],  # node 1 (4): 3, itself
        [0, 0, 0, 0, 0, 1, 1, 0, 0, 0],  # node 2 (5): node 1 (4), itself
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # node 3 (6): node 2, itself — not node 1 (position 4, column 5)
        [0, 0, 0, 0, 1, 0, 0, 0, 1, 0],  # node 4 (5): node 0 (4), itself
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1],  # padding (9): its own column
    ]
