"""Per-sequence random streams keyed by (seed, position, stream).

A sequence's draws depend only on its own seed and how far it has got, never on which other sequences
share its batch or which replica serves it, so seeded sampling is reproducible across batch mixes,
restarts and resyncs.
"""

from __future__ import annotations

import torch

_MASK = (1 << 63) - 1


def row_generator(seed: int, position: int, stream: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB)
                    & _MASK)
    return gen
