"""N-gram / prompt-lookup proposer: no model, drafts copied from earlier in the sequence.

For the longest suffix of the sequence (n_max down to n_min tokens) that occurred before, propose the γ
tokens that followed its most recent earlier occurrence. Proposals are deterministic, i.e. q is one-hot
on the proposed token, which the verifier handles exactly for greedy and sampled requests alike.
An index from each n-gram to its end positions is maintained as tokens arrive, so a step costs
O(γ + n_max) per row instead of a scan of the history.

A row of ``ProposeItem.branch`` b > 0 (``speculation.draft_num`` > 1) gets, as a chain, the b-th distinct
continuation (up to γ tokens) of the suffix's earlier occurrences — longest suffix first, most recent
occurrence first, then the shorter suffixes' — and none when there are fewer; branch 0 is the usual draft.
The engine merges a row's branches into one tree (``engine.candidates``); their tokens are deterministic
(one-hot q), which tree acceptance handles exactly for greedy and sampled rows
(``verifier/tree_acceptance.py``).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from runtime.protocol import ProposalBatch, ProposeItem


class _History:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram → end positions (exclusive), oldest first

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):  # rare (resync): rebuild rather than track removals
            kept = self.tokens[:length]
            self.tokens, self.index = [], {}
            self.extend(kept)

    def extend(self, new: Sequence[int]) -> None:
        for tok in new:
            # Index the n-grams ending at the previous position first, so a lookup of the current suffix
            # finds an *earlier* occurrence, never itself.
            end = len(self.tokens)
            for n in range(self.n_min, self.n_max + 1):
                if end >= n:
                    self.index.setdefault(tuple(self.tokens[end - n:end]), []).append(end)
            self.tokens.append(tok)

    def lookup(self, gamma: int) -> list[int]:
        toks = self.tokens
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(toks) < n:
                continue
            ends = self.index.get(tuple(toks[len(toks) - n:]))
            if ends:
                return toks[ends[-1]:ends[-1] + gamma]
        return []

    def continuations(self, gamma: int):
        """The suffix's earlier occurrences' continuations (≤ γ tokens), in the order of the module docstring."""
        toks = self.tokens
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(toks) < n:
                continue
            for end in reversed(self.index.get(tuple(toks[len(toks) - n:]), ())):
                yield toks[end:end + gamma]

    def branch(self, gamma: int, b: int) -> list[int]:
        """The b-th distinct continuation (0: ``lookup``'s), or [] when there are not that many."""
        seen: set[tuple[int, ...]] = set()
        for cont in self.continuations(gamma):
            if tuple(cont) not in seen:
                if len(seen) == b:
                    return cont
                seen.add(tuple(cont))
        return []


class NgramProposer:
    def __init__(self, *, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.histories: dict[int, _History] = {}

    def release(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self.histories.pop(s, None)

    def propose(self, items: Sequence[ProposeItem]) -> ProposalBatch:
        t0 = time.perf_counter()
        seq_ids = [it.sync.seq_id for it in items]
        resync, drafts = [], []
        for it in items:
            hist = self.histories.get(it.sync.seq_id)
            if hist is None and it.sync.base == 0:
                hist = self.histories[it.sync.seq_id] = _History(self.n_min, self.n_max)
            if hist is None or len(hist.tokens) < it.sync.base:
                resync.append(it.sync.seq_id)
                drafts.append([])
                continue
            hist.truncate(it.sync.base)
            hist.extend(it.sync.tokens)
            committed = len(hist.tokens)
            # Drafts continue after the tokens the grammar forces; they are forgotten after the lookup (the
            # rebuild this costs happens only on such steps).
            hist.extend(it.forced)
            if it.gamma <= 0:
                drafts.append([])
            elif it.branch:
                drafts.append(hist.branch(it.gamma, it.branch))
            else:
                drafts.append(hist.lookup(it.gamma))
            if it.forced:
                hist.truncate(committed)
        batch = ProposalBatch.empty(seq_ids, resync)
        G = max((len(d) for d in drafts), default=0)
        batch.tokens = torch.zeros((len(items), G), dtype=torch.long)
        for b, d in enumerate(drafts):
            batch.tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        batch.lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        batch.draft_seconds = time.perf_counter() - t0
        return batch
