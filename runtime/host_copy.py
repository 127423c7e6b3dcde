"""Host↔device copies of a step's small tensors, through pinned memory.

``fetch`` is the one device→host read of a step: everything a step hands back to the host (emitted tokens,
counts, a draft's tokens and sparse q) is fetched at once, after one synchronisation; the rest stays on the
device. ``to_device`` uploads a step's small inputs asynchronously: a plain ``.to("cuda")`` from pageable
memory makes the host wait for the GPU work already queued (the forward), which serialises host and GPU.
"""

from __future__ import annotations

import torch


def fetch(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (returned as they are when already on the CPU), after one synchronisation."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(out, tensors):
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``: to CUDA asynchronously from pinned memory, elsewhere a plain ``.to``."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
