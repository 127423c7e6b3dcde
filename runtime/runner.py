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

from cluster import defaults as D
from runtime import forward as fwd
from runtime import token_tree
from runtime.cuda_graphs import DEFAULT_MAX_GRAPHS, StepGraphs
from runtime.fusion import fuse_projections
from runtime.kv_cache import ROOT_UID, KVPool, KVPoolFull, block_run
from runtime.protocol import SyncItem


class SequenceTooLong(ValueError):
    pass


@dataclass
class SequenceState:
    blocks: list[int] = field(default_factory=list)  # block table: position p lives in blocks[p // block_size]
    tokens: list[int] = field(default_factory=list)  # committed tokens this stage holds
    cached: list[int] = field(default_factory=list)  # tokens whose K/V sit in the blocks, in order
    valid: int = 0  # leading positions where cached == tokens
    last_used: int = 0  # forward tick of the last use, for LRU eviction
    uids: list[int] = field(default_factory=list)  # prefix-cache uids of the leading blocks offered to it
    hit: int = 0  # tokens its start took from the prefix cache, until ``take_hits`` reports them


@dataclass
class ForwardStats:
    calls: int = 0
    seconds: float = 0.0
    tokens_fed: int = 0


STATIC_MAX_TOKENS = 16  # rows feeding more than this (a prompt, a resync) take the dynamic, eager path


# A join's prompt in a batch of decoding rows: one forward pads every row to the prompt's length (16 rows
# decoding 2 tokens beside a 100-token prompt compute 1,600 positions for 130). Split when that saves at
# least half the padded positions and this many: below it, a second forward's fixed cost (a pass over the
# weights, its launches) outweighs the padding.
RAGGED_MIN_SAVED = 256


def ragged_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices in one group, or in two — the shorter rows, the longer ones — where one forward padded
    to the longest row would compute far more positions than two (see ``RAGGED_MIN_SAVED``)."""
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    padded = len(lengths) * lengths[order[-1]]
    best, cut = padded, 0
    for i in range(1, len(order)):
        cost = i * lengths[order[i - 1]] + (len(order) - i) * lengths[order[-1]]
        if cost < best:
            best, cut = cost, i
    if padded - best < max(RAGGED_MIN_SAVED, padded / 2):
        return [list(range(len(lengths)))]
    return [sorted(order[:cut]), sorted(order[cut:])]


def batch_bucket(n: int) -> int:
    """The static step's batch size for ``n`` rows: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class ModelRunner:
    """KV lives in a paged pool (``runtime.kv_cache``) of ``num_blocks`` blocks of ``block_size`` positions
    (default: enough for ``max_slots`` sequences of ``max_len``); ``max_slots`` bounds the sequences held.
    With ``prefix_cache`` (default on) a new sequence starts from the longest run of cached blocks of its
    prompt (at most its length − 1 tokens: the last one must be fed for its logits), and every full block of
    committed tokens is offered to the cache; only committed tokens are ever cached, never drafts.

    ``static`` (default on): forwards whose rows feed ≤ ``STATIC_MAX_TOKENS`` tokens run through fixed
    input buffers keyed by (batch bucket, tokens per row, logits per row, KV-length bucket), captured as CUDA
    graphs on a GPU (``graphs``, default: on CUDA) and run eagerly on the CPU. ``pad_batch`` (default: where
    graphs run) pads the batch to a power of two so that few shapes exist; padded rows write to the scratch
    column. ``fuse`` (default: on CUDA) fuses each layer's q/k/v and gate/up projections (``runtime.fusion``).
    """

    def __init__(self, model, *, max_slots: int, max_len: int, kv_bucket: int = 16, static: bool = True,
                 graphs: bool | None = None, pad_batch: bool | None = None, fuse: bool | None = None,
                 max_graphs: int = DEFAULT_MAX_GRAPHS, block_size: int = D.KV_BLOCK_SIZE,
                 num_blocks: int | None = None, prefix_cache: bool = D.PREFIX_CACHE):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size
        self.max_len = max_len
        self.kv_bucket = kv_bucket
        self.windows = fwd.layer_windows(model)
        if self.device.type == "cuda" if fuse is None else fuse:
            fuse_projections(model)
        self.static = static
        self.graphs = StepGraphs(self.device, enabled=graphs, max_graphs=max_graphs)
        self.pad_batch = self.graphs.enabled if pad_batch is None else pad_batch
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}
        self.max_slots = max_slots
        self.block_size = block_size
        self.pool = KVPool(num_layers=len(model.model.layers), block_size=block_size,
                           num_blocks=num_blocks or D.kv_blocks(max_slots, max_len, block_size),
                           kv_heads=fwd.local_kv_heads(model), head_dim=fwd.head_dim_of(model),
                           dtype=self.dtype, device=self.device, prefix_cache=prefix_cache)
        self.seqs: dict[int, SequenceState] = {}
        # The latest tree_forward's rows: seq_id → (tick, committed length, parents, tokens), for commit_paths.
        self._trees: dict[int, tuple[int, int, list[int], list[int]]] = {}
        self.stats = ForwardStats()
        self.tick = 0  # forward calls so far

    # -- sequence bookkeeping ------------------------------------------------------------------------

    def sync(self, item: SyncItem) -> bool:
        """Apply ``item``; False when this runner does not hold ``item.base`` tokens (needs a resync)."""
        state = self.seqs.get(item.seq_id)
        new = state is None
        if new:
            if item.base != 0:
                return False
            if len(self.seqs) >= self.max_slots and not self._evict_idle():
                raise KVPoolFull(f"all {self.max_slots} sequence slots are in use")
            state = self.seqs[item.seq_id] = SequenceState()
        elif len(state.tokens) < item.base:
            return False
        if item.base + len(item.tokens) > self.max_len:
            raise SequenceTooLong(f"sequence {item.seq_id} would exceed max_len {self.max_len}")
        state.last_used = self.tick + 1  # in the coming forward: not evictable until it has run
        del state.tokens[item.base:]
        state.tokens.extend(item.tokens)
        state.valid = min(state.valid, item.base)
        del state.uids[state.valid // self.block_size:]
        if new:
            self._take_prefix(state)
        # Extend agreement over what was cached speculatively (accepted drafts) — only the new tail is scanned.
        limit = min(len(state.tokens), len(state.cached))
        while state.valid < limit and state.cached[state.valid] == state.tokens[state.valid]:
            state.valid += 1
        self._publish(state)
        return True

    def _evict_idle(self) -> bool:
        """Release the least recently used sequence not in the coming forward; False when there is none.

        Only orphans should ever be evicted — sequences whose release was lost, or that moved to another
        replica after a failure; a live sequence that is evicted anyway is merely re-prefilled (resync).
        """
        idle = [s for s in self.seqs.items() if s[1].last_used <= self.tick]
        if not idle:
            return False
        self.release([min(idle, key=lambda kv: kv[1].last_used)[0]])
        return True

    def _allocate_block(self, after: int | None = None) -> int:
        while True:
            try:
                return self.pool.allocate(after)
            except KVPoolFull:
                if not self._evict_idle():
                    raise

    def _take_prefix(self, state: SequenceState) -> None:
        """Start a new sequence from the cached blocks of its prompt's longest cached prefix."""
        found = self.pool.lookup(state.tokens, (len(state.tokens) - 1) // self.block_size)
        state.blocks = [block for block, _ in found]
        state.uids = [uid for _, uid in found]
        state.valid = state.hit = len(found) * self.block_size
        state.cached = state.tokens[: state.valid]

    def _publish(self, state: SequenceState) -> None:
        """Offer every full block of committed, cached tokens not offered yet to the prefix cache."""
        if not self.pool.prefix_cache:
            return
        bs = self.block_size
        while len(state.uids) < min(state.valid // bs, len(state.blocks)):
            i = len(state.uids)
            parent = state.uids[-1] if state.uids else ROOT_UID
            state.uids.append(self.pool.publish(state.blocks[i], parent, state.tokens[i * bs:(i + 1) * bs]))

    def _prepare_write(self, state: SequenceState, begin: int, end: int, shrink: bool = True) -> None:
        """Blocks for positions [begin, end) that this sequence alone holds and no cache lists (a shared block
        is copied first, a cached one taken out of the cache), and, with ``shrink``, none past ``end``."""
        bs, blocks = self.block_size, state.blocks
        del state.uids[begin // bs:]
        for i in range(begin // bs, min(len(blocks), -(-end // bs))):
            if self.pool.shared(blocks[i]):
                copy = self._allocate_block()
                self.pool.copy_block(blocks[i], copy)
                self.pool.release(blocks[i])
                blocks[i] = copy
            else:
                self.pool.unpublish(blocks[i])
        while len(blocks) * bs < end:
            blocks.append(self._allocate_block(blocks[-1] if blocks else None))
        while shrink and (len(blocks) - 1) * bs >= end:
            self.pool.release(blocks.pop())

    def reserve(self, seq_ids: Sequence[int], begins: Sequence[int], ends: Sequence[int]) -> None:
        """Make positions [begins[b], ends[b]) of each sequence writable (for forwards run outside ``forward``:
        the draft's device loop)."""
        states = [self.seqs[s] for s in seq_ids]
        self._mark(states)
        for state, begin, end in zip(states, begins, ends):
            self._prepare_write(state, begin, end, shrink=False)

    def _mark(self, states: list[SequenceState]) -> None:
        for state in states:
            state.last_used = self.tick + 1  # in the coming forward: not evictable by its own allocations

    def table(self, state: SequenceState, width: int) -> list[int]:
        """``state``'s block table padded to ``width`` entries: continuing its run of blocks where those exist
        (the padding is never read unmasked, and a run lets attention read the pool as a view), else scratch."""
        blocks = state.blocks
        last = blocks[-1] if blocks else -1
        return blocks[:width] + [last + 1 + i if last + 1 + i < self.pool.num_blocks else self.pool.scratch
                                 for i in range(width - len(blocks))]

    def table_run(self, tables: list[list[int]]) -> int | None:
        """``kv_cache.block_run`` of the tables where eager steps run (a captured graph must not depend on it)."""
        return None if self.graphs.enabled else block_run(tables)

    def take_hits(self, seq_ids: Sequence[int]) -> list[int]:
        """Per sequence, the tokens it took from the prefix cache since the last call (0 for one not held)."""
        hits = []
        for seq_id in seq_ids:
            state = self.seqs.get(seq_id)
            hits.append(state.hit if state is not None else 0)
            if state is not None:
                state.hit = 0
        return hits

    @property
    def slots_in_use(self) -> int:
        return len(self.seqs)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._trees.pop(seq_id, None)
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                for block in state.blocks:
                    self.pool.release(block)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    # -- the batched forward -------------------------------------------------------------------------

    def forward(self, seq_ids: Sequence[int], extra: Sequence[Sequence[int]], num_logits: Sequence[int]
                ) -> torch.Tensor:  # [B, max(num_logits), V] float; row b valid in [:num_logits[b]]
        """Feed each row's uncached part of ``tokens + extra`` and return logits at its last n positions.

        From the static path the logits are a view of a fixed output buffer: valid until the next forward."""
        t0 = time.perf_counter()
        states = [self.seqs[s] for s in seq_ids]
        self._mark(states)
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
        for state, begin, feed in zip(states, starts, feeds):  # may raise KVPoolFull: nothing recorded yet
            self._prepare_write(state, begin, begin + len(feed))
        for state, begin, feed in zip(states, starts, feeds):
            del state.cached[begin:]
            state.cached.extend(feed)
            state.valid = len(state.tokens)
        return self._run(t0, states, starts, feeds, num_logits)

    def tree_forward(self, seq_ids: Sequence[int], parents: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]
                     ) -> torch.Tensor:  # [B, 1 + max n_b, V] float; row b valid in [:1 + n_b]
        """Score each row's token tree in one forward (``runtime.token_tree``): ``parents[b]`` (-1: a child of
        the last committed token, else an earlier node) and ``tokens[b]`` of its n_b nodes. Logits [b, 0]
        follow the last committed token (they score the root's children), [b, 1 + i] follow node i.

        Like ``forward`` with drafts, each row feeds its uncached committed tail (at least the last token) and
        then its nodes, whose K/V land after the committed tokens in node order. They are not recorded as
        cached: ``commit_paths`` moves an accepted path's K/V into place; whatever it does not move is stale
        and overwritten later. From the static path the logits are a view: valid until the next forward."""
        t0 = time.perf_counter()
        self._trees = {}  # whatever an earlier tree left is about to be overwritten
        states = [self.seqs[s] for s in seq_ids]
        self._mark(states)
        feeds, starts, trees, pending = [], [], [], {}
        for seq_id, state, par, toks in zip(seq_ids, states, parents, tokens):
            committed = len(state.tokens)
            if len(par) != len(toks):
                raise ValueError(f"sequence {seq_id}: {len(par)} parents for {len(toks)} tree tokens")
            if committed == 0:
                raise ValueError(f"sequence {seq_id}: a tree needs a committed token to grow from")
            if committed + len(toks) > self.max_len:
                raise SequenceTooLong(f"{committed + len(toks)} tokens exceed max_len {self.max_len}")
            begin = min(state.valid, committed - 1)
            feeds.append(state.tokens[begin:] + list(toks))
            starts.append(begin)
            trees.append((committed - begin, list(par)))
            pending[seq_id] = (committed, list(par), list(toks))
        for state, begin, feed in zip(states, starts, feeds):  # may raise KVPoolFull: nothing recorded yet
            self._prepare_write(state, begin, begin + len(feed))
        for state, begin in zip(states, starts):
            committed = len(state.tokens)
            del state.cached[begin:]
            state.cached.extend(state.tokens[begin:])
            state.valid = committed
        logits = self._run(t0, states, starts, feeds, [len(t) + 1 for t in tokens], trees)
        self._trees = {seq_id: (self.tick, *tree) for seq_id, tree in pending.items()}
        return logits

    def commit_paths(self, seq_ids: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
        """After ``tree_forward``, before any other forward: record each row's accepted ``path`` (node indices
        from a child of the root down; [] when none was accepted) as cached after its committed tokens, moving
        the path's K/V from its nodes' columns to the columns a chain would have used, in one copy for the
        batch. The rest of the tree is left past ``cached``: rolling it back is bookkeeping."""
        bs, src, dst = self.block_size, [], []
        for seq_id, path in zip(seq_ids, paths):
            tick, committed, parents, tokens = self._trees.get(seq_id, (None, 0, [], []))
            if tick != self.tick:
                raise RuntimeError(f"sequence {seq_id}: no tree from the latest forward to commit")
            if not token_tree.is_path(parents, path):
                raise ValueError(f"sequence {seq_id}: {list(path)} is not a path down from the root")
            state = self.seqs[seq_id]
            blocks = state.blocks
            for depth, node in enumerate(path):
                if node != depth:  # a node at its own depth's position is already in place
                    a, b = committed + node, committed + depth
                    src.append(blocks[a // bs] * bs + a % bs)
                    dst.append(blocks[b // bs] * bs + b % bs)
            del state.cached[committed:]
            state.cached.extend(tokens[node] for node in path)
            del self._trees[seq_id]
        if src:
            index = torch.tensor([src, dst], dtype=torch.long).to(self.device)
            self.pool.move(index[0], index[1])

    def _run(self, t0: float, states: list[SequenceState], starts: list[int], feeds: list[list[int]],
             num_logits: Sequence[int], trees: list[tuple[int, list[int]]] | None = None) -> torch.Tensor:
        """One step's forwards over the prepared rows (``trees``: per row, committed tokens fed and the tree's
        parents): one forward, or one per group of ``ragged_groups`` (each writes only its own rows' K/V)."""
        groups = ragged_groups([len(f) for f in feeds])
        if len(groups) == 1:
            logits = self._forward_rows(states, starts, feeds, num_logits, trees)
        else:
            logits = None
            for rows in groups:
                part = self._forward_rows([states[b] for b in rows], [starts[b] for b in rows],
                                          [feeds[b] for b in rows], [num_logits[b] for b in rows],
                                          None if trees is None else [trees[b] for b in rows])
                if logits is None:  # copied out at once: a static forward's logits are a view of its buffer
                    logits = part.new_zeros((len(feeds), max(num_logits), part.shape[-1]))
                logits[torch.tensor(rows, device=part.device), : part.shape[1]] = part
        for state in states:
            self._publish(state)
        self.tick += 1
        self.stats.calls += len(groups)
        self.stats.tokens_fed += sum(len(f) for f in feeds)
        self.stats.seconds += time.perf_counter() - t0
        return logits

    def _forward_rows(self, states: list[SequenceState], starts: list[int], feeds: list[list[int]],
                      num_logits: Sequence[int], trees: list[tuple[int, list[int]]] | None) -> torch.Tensor:
        T = max(len(f) for f in feeds)
        N = max(num_logits)
        end = max(st + len(f) for st, f in zip(starts, feeds))
        if self.static and T <= STATIC_MAX_TOKENS:
            return self._forward_static(states, starts, feeds, num_logits, T, N, end, trees)
        return self._forward_dynamic(states, starts, feeds, num_logits, T, N, end, trees)

    def record(self, *, calls: int, tokens_fed: int, seconds: float) -> None:
        """Count forwards run outside ``forward`` (the draft's device loop) in the stats."""
        self.tick += 1
        self.stats.calls += calls
        self.stats.tokens_fed += tokens_fed
        self.stats.seconds += seconds

    def kv_len_bucket(self, end: int) -> int:
        """Keys read by a static step reaching position ``end``: a power of two ≥ ``kv_bucket``, so that a
        sequence passes through few shapes (the mask hides the keys beyond each row's own length)."""
        return min(self.max_len, max(self.kv_bucket, batch_bucket(end)))

    def table_width(self, kv_len: int) -> int:
        return -(-kv_len // self.block_size)

    def static_buffers(self, key: tuple, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
                       ) -> dict[str, torch.Tensor]:
        """The fixed device tensors of one static shape ``key`` (allocated on first use, then reused: a captured
        graph reads exactly these)."""
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = {name: torch.zeros(shape, dtype=dtype, device=self.device)
                                         for name, (shape, dtype) in shapes.items()}
        return bufs

    def upload(self, dst: torch.Tensor, rows: list) -> None:
        """Copy host ``rows`` (a nested list) into the device buffer ``dst``, through pinned memory on CUDA."""
        host = torch.tensor(rows, dtype=dst.dtype)
        dst.copy_(host.pin_memory() if dst.device.type == "cuda" else host, non_blocking=True)

    def _forward_static(self, states: list[SequenceState], starts: list[int], feeds: list[list[int]], num_logits,
                        T: int, N: int, end: int, trees: list[tuple[int, list[int]]] | None = None
                        ) -> torch.Tensor:  # [B, N, V]
        B = len(states)
        Bb = batch_bucket(B) if self.pad_batch else B
        kv_len = self.kv_len_bucket(end)
        NB = self.table_width(kv_len)
        key = ("step" if trees is None else "tree", Bb, T, N, kv_len)
        width = 3 + NB + T + N if trees is None else 3 + NB + T + N + T + T * T
        bufs = self.static_buffers(key, {"inputs": ((Bb, width), torch.long)})
        # One host tensor per step, one copy. Per row: [start, length, output row, block table (NB), ids (T),
        # logit columns (N)]; padded rows feed nothing (length 0: their writes go to the scratch block). Rows
        # in the order of their first block, so that tables forming one run are read as a view.
        order = sorted(range(B), key=lambda b: states[b].blocks[0])
        tables = [self.table(states[b], NB) for b in order] + [[self.pool.scratch] * NB] * (Bb - B)
        contiguous = self.table_run(tables)
        position = [0] * Bb
        for i, b in enumerate(order):
            position[b] = i
        rows = [[starts[b], len(feeds[b]), position[i], *tables[i], *feeds[b], *([0] * (T - len(feeds[b]))),
                 *range(len(feeds[b]) - num_logits[b], len(feeds[b])), *([0] * (N - num_logits[b]))]
                for i, b in enumerate(order)]
        rows += [[0, 0, i, *tables[i], *([0] * (T + N))] for i in range(B, Bb)]
        if trees is not None:  # then per row: positions (T), which fed tokens each one sees (T × T)
            layouts = [token_tree.layout(starts[b], *trees[b], T) for b in order]
            layouts += [token_tree.layout(0, 0, [], T)] * (Bb - B)  # padded rows feed nothing
            for row, (positions, visible) in zip(rows, layouts):
                row.extend(positions + [v for line in visible for v in line])
        self.upload(bufs["inputs"], rows)
        inputs = bufs["inputs"]
        ids = 3 + NB
        packed = not self.graphs.enabled and self._ragged(feeds, Bb, T)

        def step():
            tree = None
            if trees is not None:
                tree = inputs[:, ids + T + N: ids + 2 * T + N], inputs[:, ids + 2 * T + N:].view(Bb, T, T) != 0
            logits = fwd.forward(self.model, self.pool, self.windows, inputs[:, 3:ids], inputs[:, 0],
                                 inputs[:, ids: ids + T], inputs[:, 1], inputs[:, ids + T: ids + T + N], kv_len,
                                 contiguous, tree, packed=packed)
            return logits.index_select(0, inputs[:, 2])  # back to the caller's row order

        return self.graphs.run(key, step)[:B]

    @staticmethod
    def _ragged(feeds: list[list[int]], rows: int, T: int) -> bool:
        """Whether a forward of ``rows`` rows padded to ``T`` tokens runs packed (``runtime.forward``): where
        padding would be a tenth or more of its tokens (below that, packing's index copies cost about what the
        padding does: ``scripts/bench_packed_forward.py``)."""
        return 10 * (rows * T - sum(map(len, feeds))) >= rows * T

    def _forward_dynamic(self, states: list[SequenceState], starts: list[int], feeds: list[list[int]], num_logits,
                         T: int, N: int, end: int, trees: list[tuple[int, list[int]]] | None = None
                         ) -> torch.Tensor:  # [B, N, V]
        B = len(states)
        # Rows in the order of their first block, so that tables forming one run are read as a view. Built
        # from Python lists in one go: for batch-1 decoding this bookkeeping is a visible share of a small
        # model's step.
        order = sorted(range(B), key=lambda b: states[b].blocks[0])
        kv_len = min(self.max_len, -(-end // self.kv_bucket) * self.kv_bucket)
        NB = self.table_width(kv_len)
        tables = [self.table(states[b], NB) for b in order]
        ids = torch.tensor([feeds[b] + [0] * (T - len(feeds[b])) for b in order], dtype=torch.long)
        logit_index = torch.tensor([list(range(len(feeds[b]) - num_logits[b], len(feeds[b])))
                                    + [0] * (N - num_logits[b]) for b in order], dtype=torch.long)
        start = torch.tensor([starts[b] for b in order], dtype=torch.long)
        lengths = torch.tensor([len(feeds[b]) for b in order], dtype=torch.long)
        dev = self.device
        tree = None
        if trees is not None:
            layouts = [token_tree.layout(starts[b], *trees[b], T) for b in order]
            tree = (torch.tensor([p for p, _ in layouts], dtype=torch.long).to(dev),
                    torch.tensor([v for _, v in layouts], dtype=torch.bool).to(dev))
        logits = fwd.forward(self.model, self.pool, self.windows, torch.tensor(tables, dtype=torch.long, device=dev),
                             start.to(dev), ids.to(dev), lengths.to(dev), logit_index.to(dev), kv_len,
                             block_run(tables), tree, packed=self._ragged(feeds, B, T))
        if order != list(range(B)):
            inverse = [0] * B
            for i, b in enumerate(order):
                inverse[b] = i
            logits = logits[torch.tensor(inverse, device=dev)]
        return logits
