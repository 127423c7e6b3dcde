"""A preallocated KV pool: one slot per sequence, position-indexed writes, O(1) rollback.

Keys and values for layer l live in ``k[l]``/``v[l]`` of shape [slots, max_len, kv_heads, head_dim].
A forward writes its new tokens at explicit (slot, position) pairs; nothing is concatenated or
reallocated, so a fixed-shape step can be captured once and replayed. Rollback is free: a sequence's
valid length is bookkeeping held by its owner (``runner.SequenceState.cached``); positions past it hold
stale values that the causal mask never lets a query read before they are overwritten.

Where a serving stack would keep a pool of reusable tensors, the slots are the pool.
"""

from __future__ import annotations

import torch


class KVPoolFull(RuntimeError):
    pass


class KVPool:
    def __init__(self, *, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def allocate(self) -> int:
        if not self._free:
            raise KVPoolFull(f"all {self.num_slots} KV slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
        # Low slots first keeps the running batch contiguous, so attention reads a view, not a gather.
        self._free.sort(reverse=True)

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """rows [B] int64 slots; positions [B, T] int64; k, v [B, T, kv_heads, head_dim]."""
        self.k[layer][rows.unsqueeze(1), positions] = k
        self.v[layer][rows.unsqueeze(1), positions] = v

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at (slots[i], src[i]) copied to (slots[i], dst[i]); all [M] int64. All sources are
        gathered before any destination is written, so sources and destinations may overlap."""
        self.k[:, slots, dst] = self.k[:, slots, src]
        self.v[:, slots, dst] = self.v[:, slots, src]

    def read(self, layer: int, rows: torch.Tensor, kv_len: int, contiguous_from: int | None):
        """Keys/values [B, kv_len, kv_heads, head_dim] of the given slots; a view when rows are a range."""
        if contiguous_from is not None:
            end = contiguous_from + rows.shape[0]
            return self.k[layer, contiguous_from:end, :kv_len], self.v[layer, contiguous_from:end, :kv_len]
        return self.k[layer, rows, :kv_len], self.v[layer, rows, :kv_len]
