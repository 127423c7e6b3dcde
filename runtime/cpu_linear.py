"""Linear layers whose weight lives only in oneDNN's prepacked layout, for float32 inference on CPU.

Why: with stock ``nn.Linear`` on CPU, two or more rows run as an MKL GEMM that repacks the weight on every
call, so a (γ+1)-token verify forward costs well over a one-token step. The Leviathan model, and the whole
point of speculation, assume that verifying γ+1 tokens costs about what one token costs. With the weight
reordered once into oneDNN's blocked layout, a 2–16 row product costs about what one row does.

One copy: the stock weight is dropped once packed, so a packed model holds its Linear weights once, as
before packing. One-row inputs use the packed weight too: there it is about as fast as stock on the thread
counts ``num_threads: auto`` gives (``cluster/threads.py``), so keeping the stock weight for them would
double the memory for next to nothing (docs/measurements.md#cpu-linear-layers). The exception is
a weight shared with another module (an LM head tied to the embedding): the embedding needs the dense
matrix, so there the packed copy is a second one, and ``cluster.memory_plan`` counts it.

What stays of ``nn.Linear``: ``in_features``, ``out_features``, ``bias``, and ``weight`` — the shared
Parameter where it is tied, otherwise a dense copy rebuilt from the packed layout on each access (for
inspection, ``state_dict`` and copies: writing to it changes nothing). Deep copies and pickles repack.
GPU models and non-float32 CPU models are left as they are.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] float32 → oneDNN tensor
    # batch_size=None: one layout for every row count (decode, verify and prefill all use it).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W held in oneDNN's blocked layout (and as the shared dense Parameter if tied)."""

    def __init__(self, linear: nn.Linear, *, keep_weight: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        if keep_weight:
            self.weight = linear.weight  # registered: the same Parameter the other module holds
        self.packed = _pack(linear.weight)

    @property
    def tied(self) -> bool:
        return "weight" in self._parameters

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "weight" and "packed" in self.__dict__:
                return self.packed.to_dense()  # [out, in]; a copy, see the module docstring
            raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] → [..., out_features]
        bias = None if self.bias is None else self.bias.detach()
        if x.device.type != "cpu" or x.requires_grad:
            return F.linear(x, self.weight, self.bias)  # outside inference the dense path is the correct one
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tied={self.tied}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.tied:
            destination[prefix + "weight"] = self.weight  # the stock key, so a state_dict still loads elsewhere

    def __getstate__(self):
        # A oneDNN tensor has no storage, so it cannot be copied or pickled: carry the dense weight instead.
        state = super().__getstate__().copy()
        packed = state.pop("packed")
        if not self.tied:
            state["_dense"] = packed.to_dense()
        return state

    def __setstate__(self, state):
        dense = state.pop("_dense", None)
        super().__setstate__(state)
        self.packed = _pack(self._parameters["weight"] if dense is None else dense)


def pack_linears(model: nn.Module) -> int:
    """Swap every plain float32 CPU ``nn.Linear`` of ``model`` for a ``PackedLinear``; returns how many.

    Each stock weight is released as soon as its layer is packed, so the peak is one layer above the final
    size. Subclasses (DeepSpeed's tensor-parallel layers) and already-packed layers are left alone, so
    calling this twice, or on a sharded model, is safe.
    """
    if not packing_available():
        return 0
    # A weight held by more than one module (tied embeddings) must stay dense for the others.
    holders = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PackedLinear(child, keep_weight=holders[id(child.weight)] > 1))
                swapped += 1
    return swapped
