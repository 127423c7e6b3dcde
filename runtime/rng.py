"""Counter-based randomness: every draw is a hash of (seed, position, stream, counter), in integer tensor ops.

A sequence's draws depend only on its own seed and how far it has got, never on which other sequences
share its batch, which replica serves it or which device runs it, so seeded sampling is reproducible across
batch mixes, restarts, resyncs and CPU/GPU. Unlike a ``torch.Generator`` per row, the draws are computed on
the device for the whole batch at once (no host loop, no generator state), so they fit inside a captured
CUDA graph: the keys are inputs, the hash is a handful of elementwise kernels.

The hash is Wellons' ``lowbias32`` over 32-bit values held in int64 tensors. The 32×32-bit products are
split into 16-bit halves so that no intermediate exceeds 2^49: int64 never overflows, and the same code
gives the same bits on every backend and on plain Python ints (``stream_keys`` runs on the host).
A row's key is two 32-bit words derived from (seed, position, stream); element ``counter`` of the row's
draw hashes the counter under both words.
"""

from __future__ import annotations

from typing import Sequence

import torch

from runtime.host_copy import to_device

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF

# Streams: which draw of a step a key is for. Distinct streams never share a draw.
DRAFT_TOKEN = 1  # the draft's token at a position (exponential race over q)
VERIFY_COIN = 2  # the acceptance coins of a verify step (counter = draft index)
VERIFY_NOISE = 3  # the recovered/bonus token of a verify step (counter = vocabulary id)


def _mul32(x, c: int):
    """(x · c) mod 2^32 for 0 ≤ x < 2^32 (int or int64 tensor), without an intermediate above 2^49."""
    return (x * (c & _M16) + (((x * (c >> 16)) & _M16) << 16)) & _M32


def mix32(x):
    """lowbias32: a bijective avalanche hash of 32-bit values (int or int64 tensor in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int | None, position: int, stream: int) -> tuple[int, int]:
    """The two 32-bit key words of one row's draw at ``position`` in ``stream`` (host, plain ints)."""
    seed = (seed or 0) & ((1 << 64) - 1)
    k1 = mix32(mix32(mix32((seed & _M32) ^ stream) ^ (seed >> 32)) ^ (position & _M32))
    k2 = mix32(k1 ^ mix32((position >> 32) ^ 0x9E3779B9))
    return k1, k2


def stream_keys(seeds: Sequence[int | None], positions: Sequence[int], stream: int,
                device: torch.device | str = "cpu") -> torch.Tensor:  # [B, 2] int64
    keys = torch.tensor([stream_key(s, p, stream) for s, p in zip(seeds, positions)], dtype=torch.long)
    return to_device(keys.view(-1, 2), device)


def random_bits(keys: torch.Tensor,  # [..., 2] int64 key words (stream_keys), broadcast against counters
                counters: torch.Tensor,  # [...] int64 in [0, 2^32)
                ) -> torch.Tensor:  # int64 in [0, 2^32), shape of the broadcast
    return mix32(mix32(counters ^ keys[..., 0]) ^ keys[..., 1])


def uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:  # float32 in [0, 1), 24-bit grid
    return (random_bits(keys, counters) >> 8).float() * (1.0 / (1 << 24))


def exponential(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:  # float32 Exp(1), > 0 and finite
    # The uniform is taken at bin centres, (k + ½)/2^24 ∈ (0, 1): the noise is never 0 (w / 0 would be inf, or
    # NaN where w = 0, and argmax takes NaN as the largest) and never infinite.
    u = ((random_bits(keys, counters) >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)
