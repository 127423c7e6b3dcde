"""Linear layers with oneDNN-prepacked weights, for float32 inference on CPU.

Why: with stock ``nn.Linear`` on CPU, a one-row input runs as a GEMV but two or more rows run as a GEMM
that repacks the weight on every call. On a memory-bound CPU, a (γ+1)-token verify forward then costs
~1.6× a one-token step (the default pair's target, 5 tokens, on a 2-core VM). The Leviathan model, and
the whole point of speculation, assume that verifying γ+1 tokens costs about what one token costs. If
the weights are reordered once into oneDNN's blocked layout, a 2–16 row product costs about what one row
does, and the same 5-token verify costs ~1.2× a one-token step. One-row
inputs (batch-1 decoding, most draft steps) keep the stock GEMV, which is as fast or faster there.

What it costs: a second copy of each Linear weight. The original stays in place, so the module is still
a drop-in ``nn.Linear``: ``weight``, ``bias``, ``state_dict``, shape checks, deepcopy (it repacks).
The packed copy is a snapshot: it goes stale if the weight is modified after packing, so pack only
models that are done loading. GPU models and non-float32 CPU models are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose forward multiplies by a oneDNN-reordered copy of the weight."""

    packed: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        packed = cls.__new__(cls)
        packed.__dict__.update(linear.__dict__)  # same parameters, hooks and flags: only the forward changes
        packed.repack()
        return packed

    def repack(self) -> None:
        # batch_size=None: one layout for every row count (decode, verify and prefill all use it).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] → [..., out_features]
        if self.packed is None or x.numel() == x.shape[-1] or x.device.type != "cpu" or x.requires_grad:
            return F.linear(x, self.weight, self.bias)  # one row: the stock GEMV is as fast, or faster
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def __getstate__(self):
        # A oneDNN tensor has no storage, so it cannot be copied or pickled: rebuild it instead.
        state = super().__getstate__().copy()
        state.pop("packed", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.repack()


def pack_linears(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of a float32 CPU model for a ``PackedLinear``; returns how many.

    Subclasses (DeepSpeed's tensor-parallel layers, already-packed ones) are left alone, so calling this
    twice, or on a sharded model, is safe.
    """
    if not packing_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PackedLinear.from_linear(child))
                swapped += 1
    return swapped
