"""A model plus its KV pool, holding each sequence's tokens and what of them is cached.

Both stages use it: the verifier for the target, the draft proposer for the draft. A sequence's state is
a cache of the router's truth (see ``protocol``): ``sync`` brings it up to date or reports that it
cannot, and ``forward`` feeds every row whatever it has not cached yet — one token in steady state, the
whole prompt on a join or a resync, a bonus token plus the last draft after a fully accepted chain — in
one batched call, returning logits at the last ``n`` fed positions of each row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from runtime import forward as fwd
from runtime.kv_cache import KVPool
from runtime.protocol import SyncItem


class SequenceTooLong(ValueError):
    pass


@dataclass
class SequenceState:
    slot: int
    tokens: list[int] = field(default_factory=list)  # committed tokens this stage holds
    cached: list[int] = field(default_factory=list)  # tokens whose K/V sit in the slot, in order
    valid: int = 0  # leading positions where cached == tokens
    last_used: int = 0  # forward tick of the last use, for LRU eviction


@dataclass
class ForwardStats:
    calls: int = 0
    seconds: float = 0.0
    tokens_fed: int = 0


class ModelRunner:
    def __init__(self, model, *, max_slots: int, max_len: int, kv_bucket: int = 16):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size
        self.max_len = max_len
        self.kv_bucket = kv_bucket
        self.windows = fwd.layer_windows(model)
        # +1 column: the scratch position that padded tokens write to (see forward.py).
        self.pool = KVPool(num_layers=len(model.model.layers), num_slots=max_slots, max_len=max_len + 1,
                           kv_heads=fwd.local_kv_heads(model), head_dim=fwd.head_dim_of(model),
                           dtype=self.dtype, device=self.device)
        self.pool.max_len = max_len  # reads never reach the scratch column
        self.seqs: dict[int, SequenceState] = {}
        self.stats = ForwardStats()
        self.tick = 0  # forward calls so far
        self.evictions = 0

    # -- sequence bookkeeping ------------------------------------------------------------------------

    def sync(self, item: SyncItem) -> bool:
        """Apply ``item``; False when this runner does not hold ``item.base`` tokens (needs a resync)."""
        state = self.seqs.get(item.seq_id)
        if state is None:
            if item.base != 0:
                return False
            state = self.seqs[item.seq_id] = SequenceState(slot=self._allocate())
        elif len(state.tokens) < item.base:
            return False
        if item.base + len(item.tokens) > self.max_len:
            raise SequenceTooLong(f"sequence {item.seq_id} would exceed max_len {self.max_len}")
        state.last_used = self.tick + 1  # in the coming forward: not evictable until it has run
        del state.tokens[item.base:]
        state.tokens.extend(item.tokens)
        state.valid = min(state.valid, item.base)
        # Extend agreement over what was cached speculatively (accepted drafts) — only the new tail is scanned.
        limit = min(len(state.tokens), len(state.cached))
        while state.valid < limit and state.cached[state.valid] == state.tokens[state.valid]:
            state.valid += 1
        return True

    def _allocate(self) -> int:
        """A free slot; when none is left, evict the least recently used sequence not in the coming forward.

        Only orphans should ever be evicted — sequences whose release was lost, or that moved to another
        replica after a failure; a live sequence that is evicted anyway is merely re-prefilled (resync).
        """
        if self.pool.slots_in_use == self.pool.num_slots:
            idle = [s for s in self.seqs.items() if s[1].last_used <= self.tick]
            if idle:
                victim = min(idle, key=lambda kv: kv[1].last_used)[0]
                self.release([victim])
                self.evictions += 1
        return self.pool.allocate()

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                self.pool.free(state.slot)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    # -- the batched forward -------------------------------------------------------------------------

    def forward(self, seq_ids: Sequence[int], extra: Sequence[Sequence[int]], num_logits: Sequence[int]
                ) -> torch.Tensor:  # [B, max(num_logits), V] float; row b valid in [:num_logits[b]]
        """Feed each row's uncached part of ``tokens + extra`` and return logits at its last n positions."""
        t0 = time.perf_counter()
        B = len(seq_ids)
        states = [self.seqs[s] for s in seq_ids]
        feeds, starts = [], []
        for state, more, n in zip(states, extra, num_logits):
            full_len = len(state.tokens) + len(more)
            if full_len > self.max_len:
                raise SequenceTooLong(f"{full_len} tokens exceed max_len {self.max_len}")
            begin = state.valid
            if begin == len(state.tokens):  # also reuse drafts this runner fed itself earlier in the step
                j = 0
                while j < len(more) and begin < len(state.cached) and state.cached[begin] == more[j]:
                    begin, j = begin + 1, j + 1
            begin = min(begin, full_len - n)
            if begin < len(state.tokens):
                feed = state.tokens[begin:] + list(more)
            else:
                feed = list(more[begin - len(state.tokens):])
            feeds.append(feed)
            starts.append(begin)
            del state.cached[begin:]
            state.cached.extend(feed)
            state.valid = len(state.tokens)

        # Rows in slot order, so that a contiguous run of slots is read as a view instead of gathered.
        # Built from Python lists in one go: for batch-1 decoding this bookkeeping is a visible share of
        # a small model's step.
        order = sorted(range(B), key=lambda b: states[b].slot)
        slots = [states[b].slot for b in order]
        T = max(len(f) for f in feeds)
        N = max(num_logits)
        ids = torch.tensor([feeds[b] + [0] * (T - len(feeds[b])) for b in order], dtype=torch.long)
        logit_index = torch.tensor([list(range(len(feeds[b]) - num_logits[b], len(feeds[b])))
                                    + [0] * (N - num_logits[b]) for b in order], dtype=torch.long)
        start = torch.tensor([starts[b] for b in order], dtype=torch.long)
        lengths = torch.tensor([len(feeds[b]) for b in order], dtype=torch.long)
        end = max(st + len(f) for st, f in zip(starts, feeds))
        kv_len = min(self.max_len, -(-end // self.kv_bucket) * self.kv_bucket)
        contiguous = slots[0] if slots[-1] - slots[0] == B - 1 else None
        dev = self.device
        logits = fwd.forward(self.model, self.pool, self.windows, torch.tensor(slots, dtype=torch.long, device=dev),
                             start.to(dev), ids.to(dev), lengths.to(dev), logit_index.to(dev), kv_len, contiguous)
        if order != list(range(B)):
            inverse = [0] * B
            for i, b in enumerate(order):
                inverse[b] = i
            logits = logits[torch.tensor(inverse, device=dev)]
        self.tick += 1
        self.stats.calls += 1
        self.stats.tokens_fed += sum(len(f) for f in feeds)
        self.stats.seconds += time.perf_counter() - t0
        return logits
