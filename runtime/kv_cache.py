"""A paged KV pool: fixed-size blocks handed out as a sequence's tokens are written, and a prefix cache of them.

Keys and values for layer l live in ``k[l]``/``v[l]`` of shape [num_blocks + 1, block_size, kv_heads, head_dim];
the last block is scratch, where padded tokens write and nothing real is ever read. A sequence owns a block
table (``runner.SequenceState.blocks``): position p of the sequence lives at row p % block_size of block
``blocks[p // block_size]``. A forward writes its new tokens at explicit flat indices (block × block_size +
row), so a fixed-shape step can still be captured once and replayed with the tables as inputs. Rollback is
bookkeeping: positions past a sequence's valid length hold stale values that the causal mask never lets a
query read before they are overwritten; whole trailing blocks go back to the pool (``ModelRunner._fit``).

The prefix cache: a full block of committed tokens is *published* under a key naming its content — the tokens
of the block and the identity of the block chain before it — so that a later sequence whose prompt starts with
the same tokens takes those blocks instead of computing them again. A key is (parent uid, the block's tokens),
compared exactly (no hash collision can alias two prefixes); each published block gets a fresh uid that its
children's keys name. Blocks are reference-counted: a published block that no sequence holds waits in an LRU
list, still findable, and is the last kind of block handed out again. A published block is never written:
a sequence about to write into one takes it back (unpublishes it) when it is the only holder, or copies it
first (``copy_block``) when others share it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Sequence

import torch


class KVPoolFull(RuntimeError):
    pass


ROOT_UID = 0  # the parent uid of a sequence's first block


class KVPool:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks ≥ 1 and block_size ≥ 1, got {num_blocks} and {block_size}")
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch = num_blocks  # the block padded tokens write to
        self.prefix_cache = prefix_cache
        # A heap: the lowest free block first, so that a sequence alone in the pool grows over a run of blocks,
        # which attention reads as a view. ``allocate(after=…)`` may take a block out of turn: its entry stays
        # in the heap (``_queued``), stale until the block is free again, and is skipped when it comes up
        # while the block is held; so ``_num_free`` counts the free blocks, and no block is queued twice.
        self._free = list(range(num_blocks))
        self._queued = [True] * num_blocks
        self._num_free = num_blocks
        self._refs = [0] * num_blocks
        self._index: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # key → (block, uid)
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # published block → its key
        self._idle: OrderedDict[int, None] = OrderedDict()  # published blocks no sequence holds, oldest first
        self._next_uid = ROOT_UID + 1
        self._gathered = [self.k.new_empty(0), self.v.new_empty(0)]  # CPU read buffers of K and V (``_gather``)
        self.lookup_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, found cached

    # -- counting ----------------------------------------------------------------------------------------

    @property
    def blocks_in_use(self) -> int:
        """Blocks some sequence holds (idle cached blocks are free to take)."""
        return self.num_blocks - self._num_free - len(self._idle)

    @property
    def cached_blocks(self) -> int:
        return len(self._key_of)

    # -- blocks ------------------------------------------------------------------------------------------

    def _is_free(self, block: int) -> bool:
        return self._refs[block] == 0 and block not in self._key_of

    def allocate(self, after: int | None = None) -> int:
        """A block for one holder: the block after ``after`` when it is free (a sequence growing after a
        cached prefix then keeps one run of blocks, which attention reads as a view instead of gathering it),
        else the lowest never-published free one, else the least recently used idle cached one."""
        while self._free and not self._is_free(self._free[0]):
            self._queued[heapq.heappop(self._free)] = False  # stale: taken out of turn
        if after is not None and after + 1 < self.num_blocks and self._is_free(after + 1):
            block = after + 1
            self._num_free -= 1
        elif self._free:
            block = heapq.heappop(self._free)
            self._queued[block] = False
            self._num_free -= 1
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            del self._index[self._key_of.pop(block)]
        else:
            raise KVPoolFull(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._idle[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None  # most recently used last
            else:
                if not self._queued[block]:
                    heapq.heappush(self._free, block)
                    self._queued[block] = True
                self._num_free += 1

    def shared(self, block: int) -> bool:
        return self._refs[block] > 1

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's K/V of block ``src`` into block ``dst``."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    # -- the prefix cache ----------------------------------------------------------------------------------

    def publish(self, block: int, parent_uid: int, tokens: Sequence[int]) -> int:
        """Offer ``block`` (full, holding the K/V of ``tokens`` after the chain ``parent_uid``) to the cache;
        the uid that names this content. When another block already holds it, ``block`` stays private."""
        key = (parent_uid, tuple(tokens))
        found = self._index.get(key)
        if found is not None:
            return found[1]
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self._index[key] = (block, uid)
        self._key_of[block] = key
        return uid

    def unpublish(self, block: int) -> None:
        """Take a block its only holder is about to write into out of the cache."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._index[key]

    def lookup(self, tokens: Sequence[int], max_blocks: int) -> list[tuple[int, int]]:
        """The longest run of cached blocks holding ``tokens[: n × block_size]`` (n ≤ ``max_blocks``), as
        (block, uid) pairs, each retained for the caller."""
        bs, uid, found = self.block_size, ROOT_UID, []
        if self.prefix_cache:
            for i in range(max_blocks):
                entry = self._index.get((uid, tuple(tokens[i * bs:(i + 1) * bs])))
                if entry is None:
                    break
                self.retain(entry[0])
                found.append(entry)
                uid = entry[1]
            self.lookup_tokens += max_blocks * bs
            self.hit_tokens += len(found) * bs
        return found

    # -- reads and writes ----------------------------------------------------------------------------------

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values as [(num_blocks + 1) × block_size, kv_heads, head_dim] views."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """index [B, T] int64 flat positions (block × block_size + row); k, v [B, T, kv_heads, head_dim]."""
        keys, values = self.flat(layer)
        keys[index] = k
        values[index] = v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at flat position src[i] copied to dst[i]; both [M] int64. All sources are gathered
        before any destination is written, so sources and destinations may overlap."""
        L = self.k.shape[0]
        k, v = self.k.view(L, -1, *self.k.shape[3:]), self.v.view(L, -1, *self.v.shape[3:])
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]

    def read(self, layer: int, tables: torch.Tensor,  # [B, NB] int64 block ids
             kv_len: int, contiguous_from: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, kv_len, kv_heads, head_dim] each
        """Keys/values of the tables' first ``kv_len`` positions: a view when the tables are the run of blocks
        ``contiguous_from …`` row after row, else a gather."""
        B, NB = tables.shape
        if contiguous_from is not None:
            keys, values = self.flat(layer)
            start, end = contiguous_from * self.block_size, (contiguous_from + B * NB) * self.block_size
            return (keys[start:end].view(B, NB * self.block_size, *keys.shape[1:])[:, :kv_len],
                    values[start:end].view(B, NB * self.block_size, *values.shape[1:])[:, :kv_len])
        blocks = tables.reshape(-1)
        k, v = self._gather(0, self.k[layer], blocks), self._gather(1, self.v[layer], blocks)
        shape = (B, NB * self.block_size, *self.k.shape[3:])
        return k.view(shape)[:, :kv_len], v.view(shape)[:, :kv_len]

    def _gather(self, which: int, layer: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
                blocks: torch.Tensor,  # [M] int64
                ) -> torch.Tensor:  # [M, block_size × kv_heads × head_dim]
        """``index_select`` (several times faster than indexing on the CPU) into a buffer kept per K/V on the CPU,
        where a fresh tensor of a megabyte or more per layer costs page faults; on CUDA into a fresh tensor,
        whose address a captured graph owns (a buffer that grew later would leave the graph a freed one)."""
        src = layer.view(layer.shape[0], -1)
        if src.is_cuda:
            return torch.index_select(src, 0, blocks)
        need = blocks.shape[0] * src.shape[1]
        if self._gathered[which].numel() < need:
            self._gathered[which] = src.new_empty(need)
        return torch.index_select(src, 0, blocks, out=self._gathered[which][:need].view(-1, src.shape[1]))


def block_run(tables: Sequence[Sequence[int]]) -> int | None:
    """The first block when ``tables`` are one run of consecutive blocks, row after row (then attention reads
    the pool as a view); else None."""
    first = tables[0][0]
    expect = first
    for table in tables:
        for block in table:
            if block != expect:
                return None
            expect += 1
    return first
