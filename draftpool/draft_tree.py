"""One row's draft token tree as it grows, EAGLE-2 style (Li et al. 2024): dynamic expansion by cumulative
draft probability under a node budget.

Every node carries the product of the draft's probabilities along its path (kept as a sum of logs), an
estimate of the chance that the target accepts the whole path. Level by level, the ``top_k`` most likely
children of each frontier node become candidates, and the ``top_k`` best candidates of the level form the
next frontier, down to ``depth`` levels. The tree proposed is the ``budget`` best candidates of all levels,
in creation order: a child's score is at most its parent's and ties go to the earlier node, so the chosen
set holds every chosen node's ancestors, and creation order is topological. A frontier node whose score
cannot beat the budget-th best candidate any more can place no descendant in the tree: it is dropped, and
a row stops expanding when its frontier is empty.

The tokens are deterministic given the draft's logits (one-hot q): tree acceptance is exact for them for
greedy and sampled rows alike (``verifier/tree_acceptance.py``). Siblings are created in the order of
their draft probability, so the first branch is the draft's greedy chain as far as the budget keeps it.
"""

from __future__ import annotations

import math
from typing import Sequence


class TreeGrowth:
    def __init__(self, budget: int, depth: int, top_k: int):
        if budget < 1 or depth < 1 or top_k < 1:
            raise ValueError(f"need budget, depth and top_k ≥ 1, got {budget}, {depth}, {top_k}")
        self.budget, self.depth, self.top_k = budget, depth, top_k
        self.parents: list[int] = []
        self.tokens: list[int] = []
        self.scores: list[float] = []  # log of the product of draft probabilities along the path
        self.depths: list[int] = []
        self.frontier: list[int] = [-1]  # nodes whose children the next draft forward scores (-1: the root)

    def expand(self, children: Sequence[tuple[Sequence[int], Sequence[float]]]) -> None:
        """Add the children of every frontier node, given per frontier node (in frontier order) its top
        tokens and their draft log-probabilities, best first; then choose the next frontier."""
        new = []
        for node, (tokens, logps) in zip(self.frontier, children):
            base, depth = (0.0, 0) if node < 0 else (self.scores[node], self.depths[node] + 1)
            for token, logp in zip(tokens, logps):
                if logp == -math.inf:  # outside the draft's warped support
                    continue
                new.append(len(self.tokens))
                self.parents.append(node)
                self.tokens.append(int(token))
                self.scores.append(base + float(logp))
                self.depths.append(depth)
        frontier = sorted((n for n in new if self.depths[n] + 1 < self.depth), key=lambda n: (-self.scores[n], n))
        if len(self.scores) >= self.budget:
            bar = sorted(self.scores, reverse=True)[self.budget - 1]
            frontier = [n for n in frontier if self.scores[n] > bar]
        self.frontier = frontier[: self.top_k]

    def fed(self) -> tuple[list[int], list[int], list[int]]:
        """What the next draft forward feeds: the frontier and its ancestors in node order, as a tree
        (parents re-indexed, tokens), and each frontier node's index in it."""
        keep: set[int] = set()
        for node in self.frontier:
            while node >= 0 and node not in keep:
                keep.add(node)
                node = self.parents[node]
        order = sorted(keep)
        index = {n: i for i, n in enumerate(order)}
        parents = [-1 if self.parents[n] < 0 else index[self.parents[n]] for n in order]
        return parents, [self.tokens[n] for n in order], [index[n] for n in self.frontier]

    def result(self) -> tuple[list[int], list[int]]:  # parents, tokens of the proposed tree
        """The ``budget`` best candidates in creation (topological) order."""
        best = sorted(range(len(self.scores)), key=lambda n: (-self.scores[n], n))[: self.budget]
        chosen = sorted(best)
        index = {n: i for i, n in enumerate(chosen)}
        return [-1 if self.parents[n] < 0 else index[self.parents[n]] for n in chosen], [self.tokens[n] for n in chosen]
