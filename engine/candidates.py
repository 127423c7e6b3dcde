"""Several candidate chains per sequence and step (``speculation.draft_num``), merged into one token tree.

The engine asks for ``draft_num`` chains per row, one propose call per branch (``ProposeItem.branch``: the
proposer's usual chain for branch 0, another first token or another random stream for the others). On a
cluster each branch's call is routed on its own (``deployments.transport``), so the branches of a micro-batch
are drafted on different draft replicas at the same time. ``merge_chains`` folds the chains of each row
into one tree — a prefix shared by two chains becomes one path — and the verifier scores the whole tree in
one target pass (``runtime.token_tree``).

The tree carries no draft distribution q: every node is checked as a deterministic proposal against the
target's residual distribution (``verifier.tree_acceptance``). That is exact for greedy and for sampled rows
whichever replica drafted a node and however, because no draft's randomness is shared with the verifier's.
A branch whose call failed (a dead replica, a timeout) comes back empty and adds nothing; a row some branch
could not sync is marked for resync, as with one chain.
"""

from __future__ import annotations

from typing import Sequence

import torch

from runtime.protocol import ProposalBatch


def merge_chains(proposals: Sequence[ProposalBatch]) -> ProposalBatch:
    """One tree per row from the rows' chains in ``proposals`` (all over the same ``seq_ids``, in order).

    Nodes are numbered in order of first appearance — branch 0's chain first — so every parent precedes its
    children, as ``runtime.token_tree`` requires."""
    first = proposals[0]
    if any(p.seq_ids != first.seq_ids for p in proposals):
        raise ValueError("merge_chains: the proposals cover different sequences")
    if any(p.parents is not None for p in proposals):
        raise ValueError("merge_chains: merges chains, got a tree")
    trees = []
    for b in range(len(first.seq_ids)):
        parents: list[int] = []
        tokens: list[int] = []
        node_of: dict[tuple[int, int], int] = {}  # (parent, token) → node
        for proposal in proposals:
            parent = -1
            for token in proposal.row_tokens(b):
                node = node_of.get((parent, token))
                if node is None:
                    node = node_of[(parent, token)] = len(tokens)
                    parents.append(parent)
                    tokens.append(token)
                parent = node
        trees.append((parents, tokens))
    n = len(trees)
    width = max((len(t) for _, t in trees), default=0)
    merged = ProposalBatch(seq_ids=list(first.seq_ids), tokens=torch.zeros((n, width), dtype=torch.long),
                           lengths=torch.tensor([len(t) for _, t in trees], dtype=torch.long).view(n),
                           parents=torch.full((n, width), -1, dtype=torch.long),
                           resync=[s for s in first.seq_ids if any(s in p.resync for p in proposals)],
                           draft_seconds=sum(p.draft_seconds for p in proposals))
    for b, (parents, tokens) in enumerate(trees):
        merged.tokens[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        merged.parents[b, : len(parents)] = torch.tensor(parents, dtype=torch.long)
    return merged


class Candidates:
    """The in-flight propose calls of one micro-batch's branches; ``result`` waits for all and merges."""

    def __init__(self, pending: Sequence):
        self.pending = list(pending)

    def result(self) -> ProposalBatch:
        return merge_chains([p.result() for p in self.pending])
