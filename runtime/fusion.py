"""Fused projections: q/k/v as one GEMM and gate/up as one GEMM per layer, built once per model.

Each layer's q, k and v weights (and biases, where the family has them) are concatenated into one matrix,
and q_proj/k_proj/v_proj then hold *views* of it: the weights are stored once, Hugging Face's own forward
(``generate``, the reference in the tests) keeps working on the same numbers, and the compact forward
(``runtime.forward``) runs one GEMM where it ran three. The same for the MLP's gate and up projections.
Per layer that is 5 projection kernels instead of 7 (issue 14, item 3); and since q and k then sit side
by side in one output, the forward applies RoPE to both in one pass (5 elementwise kernels fewer).

The fused matrices are plain attributes, not registered parameters: ``parameters()``, ``state_dict()``
and the memory plan see each weight once, as before. Only plain ``nn.Linear`` layers are fused: DeepSpeed
AutoTP's sharded layers (``LinearLayer``) and the CPU's oneDNN-packed ``PackedLinear`` are left alone,
so a sharded or packed model runs the separate projections exactly as before. By default the runner fuses
on CUDA only, where it saves launches; on the CPU the packed kernels already make the products cheap and
the separate path keeps the CPU numbers bit-for-bit what they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FusedLinear:
    weight: torch.Tensor  # [sum(sizes), in]
    bias: torch.Tensor | None  # [sum(sizes)]
    sizes: tuple[int, ...]  # output widths of the fused projections, in order

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., sum(sizes)]
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _still_fused(fused: FusedLinear | None, linears: list[nn.Linear]) -> bool:
    """Whether ``linears`` still read their weights out of ``fused`` (a copy or a reload breaks that)."""
    if fused is None:
        return False
    offset = 0
    for linear, size in zip(linears, fused.sizes):
        if linear.weight.data_ptr() != fused.weight[offset].data_ptr():
            return False
        offset += size
    return True


def _fuse(linears: list[nn.Linear]) -> FusedLinear | None:
    if not all(type(m) is nn.Linear for m in linears):
        return None
    first = linears[0].weight
    if any(m.weight.device != first.device or m.weight.dtype != first.dtype for m in linears):
        return None
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears]) if all(has_bias) else None
        sizes = tuple(m.out_features for m in linears)
        offset = 0
        for m, size in zip(linears, sizes):
            m.weight = nn.Parameter(weight[offset: offset + size], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[offset: offset + size], requires_grad=False)
            offset += size
    return FusedLinear(weight, bias, sizes)


def fuse_projections(model) -> int:
    """Fuse every layer's q/k/v and gate/up projections that can be; returns how many fused GEMMs exist."""
    fused = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        if not _still_fused(getattr(attn, "fused_qkv", None), qkv):
            attn.fused_qkv = _fuse(qkv)
        gate_up = [mlp.gate_proj, mlp.up_proj]
        if not _still_fused(getattr(mlp, "fused_gate_up", None), gate_up):
            mlp.fused_gate_up = _fuse(gate_up)
        fused += (attn.fused_qkv is not None) + (mlp.fused_gate_up is not None)
    return fused
