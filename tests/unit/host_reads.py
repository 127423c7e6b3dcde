"""A test hook that records every read of tensor data by the host: ``.cpu()``, ``.tolist()``, ``.item()``,
``.numpy()`` and the implicit ``bool``/``int``/``float``/``index`` of a tensor.

On a CUDA device each of these is a device→host copy (and a synchronisation); on the CPU they copy nothing,
but the same calls are made, so counting them here shows what the code would move off a GPU. Bytes are
the size of the tensor read (a read of an already-host tensor counts again: an upper bound). ``.to(device)``
is not counted: on the CPU an upload cannot be told from a download, and any data Python uses is read by
one of the calls above in the end (the code's one download, ``runtime.host_copy.fetch``, is followed by
``.tolist()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


@dataclass
class HostReads(TorchFunctionMode):
    reads: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)  # (call, shape, bytes)

    def __post_init__(self):
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and func in _READS:
            self.reads.append((getattr(func, "__name__", str(func)), tuple(tensor.shape),
                               tensor.numel() * tensor.element_size()))
        return func(*args, **kwargs)

    @property
    def total_bytes(self) -> int:
        return sum(r[2] for r in self.reads)

    @property
    def largest(self) -> int:
        return max((r[2] for r in self.reads), default=0)
