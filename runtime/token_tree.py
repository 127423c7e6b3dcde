"""Token trees for verification: one target forward scores every node of each row's tree (issue 15).

A row's tree is given by ``parents`` (-1: a child of the last committed token; otherwise the index of an
earlier node, so the order is topological) and the nodes' tokens. ``ModelRunner.tree_forward`` feeds the
row's uncached committed tail (at least its last token, whose logits score the root's children) and then
the nodes, written to consecutive KV columns after the committed tokens, in node order. Two things differ
from a chain:

- **Positions.** Node i sits at position prefix length + depth(i) (depth 0 for the root's children) for
  RoPE and for the sliding window, whatever its column.
- **Visibility.** A node sees the whole committed prefix, its ancestors and itself — never a sibling or a
  cousin, although their K/V sit in neighbouring columns.

A chain is the tree whose node i has parent i − 1: its positions are its columns and its visibility is
causal, so the tree forward and the chain forward coincide there. After acceptance, ``KVPool.move`` copies
the accepted path's K/V from its nodes' columns to the columns a chain would have used (prefix + 0, 1, …);
their keys were rotated at prefix + depth, which is exactly that column, so nothing is recomputed.

Nothing in ``tree_masks`` reads a tensor back to the host or allocates with a data-dependent shape: a tree
step with fixed-shape inputs can be captured as a CUDA graph like a chain step.
"""

from __future__ import annotations

from typing import Sequence

import torch


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (0 for the root's children); refuses a parent that is not an earlier node."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}: parent {p} is not -1 or an earlier node (nodes must be in topological order)")
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``, in that order."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def is_path(parents: Sequence[int], nodes: Sequence[int]) -> bool:
    """Whether ``nodes`` go down the tree from a child of the root, each the parent of the next."""
    return all(0 <= n < len(parents) and parents[n] == (nodes[j - 1] if j else -1) for j, n in enumerate(nodes))


def layout(start: int, num_committed: int, parents: Sequence[int], width: int
           ) -> tuple[list[int], list[list[int]]]:  # positions [width], visible [width][width] (0/1)
    """Positions and mutual visibility of one row's fed tokens: ``num_committed`` committed tokens (from
    position ``start``, causal among themselves), then the tree's nodes, then padding up to ``width``.

    A padded token sees only its own column (whatever it holds): its output is discarded, and a query that
    sees no key at all would make NaNs."""
    c, n = num_committed, len(parents)
    positions = list(range(start, start + width))
    visible = [[int(s == t) for s in range(width)] for t in range(width)]
    for t in range(c):
        visible[t][:t + 1] = [1] * (t + 1)
    for i, d in enumerate(depths(parents)):
        positions[c + i] = start + c + d
        row = visible[c + i]
        row[:c] = [1] * c
        for j in path_to(parents, i):
            row[c + j] = 1
    return positions, visible


def tree_masks(start: torch.Tensor,  # [B] int64 column of each row's first fed token
               positions: torch.Tensor,  # [B, T] int64 position of each fed token (a node's: prefix + depth)
               visible: torch.Tensor,  # [B, T, T] bool: fed token t sees fed token s
               kv_len: int, windows: list[int | None],
               ) -> dict[int | None, torch.Tensor]:  # window → [B, 1, T, kv_len] bool attention mask
    """Attention masks over the KV columns for fed tokens laid out by ``layout``.

    Columns before ``start`` hold committed tokens cached earlier, at their own positions: every fed token
    sees them (its position is later). Columns from ``start`` on hold this call's tokens: ``visible`` says
    which. A sliding window compares positions, not columns — a node's keys sit at prefix + its index but
    count as prefix + its depth."""
    B, T = positions.shape
    column = torch.arange(kv_len, device=positions.device).unsqueeze(0)  # [1, K]
    fed = column - start.unsqueeze(1)  # [B, K] which fed token wrote the column (when 0 ≤ fed < T)
    in_call = (fed >= 0) & (fed < T)
    index = fed.clamp(0, T - 1)
    seen = visible.gather(2, index.unsqueeze(1).expand(B, T, kv_len)) & in_call.unsqueeze(1)  # [B, T, K]
    allowed = (fed < 0).unsqueeze(1) | seen
    key_pos = torch.where(in_call, positions.gather(1, index), column).unsqueeze(1)  # [B, 1, K]
    query_pos = positions.unsqueeze(2)  # [B, T, 1]
    masks = {}
    for window in set(windows):
        masks[window] = (allowed if window is None else allowed & (key_pos > query_pos - window)).unsqueeze(1)
    return masks
