"""A compact forward for Llama-family models over ragged rows with per-row positions.

Why not Hugging Face's own forward with a custom Cache + registered attention function? Both were tried
(docs/design.md#the-forward): they give the same logits, but the HF route depends on version-specific names
(``cache_position`` vs ``position_ids``, ``past_key_values`` vs ``cache``, ``CacheLayerMixin``) that differ
between the transformers releases we run, and its Python per call is a large share of a tiny model's step
(docs/measurements.md#compact-forward). This forward calls the model's own submodules
(embeddings, norms, q/k/v/o projections, MLP, rotary embedding, LM head), so weights, biases, RoPE
scaling, and DeepSpeed AutoTP's sharded Linear layers (which change the local head count) all keep
working, while positions, masks and the KV pool are ours.

Row b feeds ``input_ids[b, :lengths[b]]`` at positions ``start[b] …`` of the sequence whose block table is
``tables[b]`` (``runtime.kv_cache``); padded tokens write their K/V to the pool's scratch block, which no
read ever covers unmasked. With ``tree`` (``runtime.token_tree``)
the tokens still write to those columns, but RoPE and the mask take each token's position (a tree node's:
prefix length + depth) and visibility (its ancestors, not its siblings) from the caller.

``packed`` runs the projections, MLPs, norms and the LM head over the rows' real tokens only, row after row,
and attention on the padded grid: rows of unequal length (chains cut short, a grammar's forced run on a few
rows, prompts of different lengths) then cost what they feed rather than the longest row times the batch, a
difference a compute-bound target (a CPU) pays in full. Its shapes depend on the data, so it is for eager
calls only.

Otherwise nothing here reads a tensor back to the host or allocates with a data-dependent shape, so a call
with fixed-shape inputs can be captured once as a CUDA graph and replayed (``runtime.cuda_graphs``,
``ModelRunner``'s static step). Where ``runtime.fusion`` has fused a layer's projections, q/k/v and
gate/up each run as one GEMM and RoPE runs once over q and k; on CUDA the RMSNorms run as fused
``F.rms_norm`` (fewer kernels per layer, issue 14 item 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kv_cache import KVPool
from runtime.token_tree import tree_masks


def layer_windows(model) -> list[int | None]:
    """Sliding-window size per layer (Mistral: all layers; Qwen2: the layers typed sliding_attention)."""
    config = model.config
    windows = []
    for layer in model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is None and config.model_type == "mistral":
            window = getattr(config, "sliding_window", None)
        windows.append(window)
    return windows


def head_dim_of(model) -> int:
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def local_kv_heads(model) -> int:
    """KV heads held by this process (fewer than the config says when AutoTP sharded k_proj)."""
    return model.model.layers[0].self_attn.k_proj.weight.shape[0] // head_dim_of(model)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:  # [..., H] → [..., H]
    """Hugging Face's Llama-family RMSNorm with the normalisation as one fused op (``F.rms_norm``): the same
    order of roundings (normalise in fp32, cast, then scale by the weight in the model's dtype), 4 kernels
    instead of 8. Used on CUDA, where kernels cost launches; the CPU runs the model's own module."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype) * norm.weight


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and hasattr(norm, "variance_epsilon") and hasattr(F, "rms_norm"):
        return rms_norm(norm, x)
    return norm(x)


def _rope(x: torch.Tensor,  # [B, T, H, D]
          cos: torch.Tensor, sin: torch.Tensor,  # [B, T, 1, D]
          ) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:  # [..., H] → [..., H]
    fused = getattr(mlp, "fused_gate_up", None)  # runtime.fusion: one GEMM for gate and up
    if fused is None:
        return mlp(x)
    gate, up = fused(x).split(fused.sizes, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _causal_masks(positions: torch.Tensor,  # [B, T] int64
                  kv_len: int, windows: list[int | None]) -> dict[int | None, torch.Tensor]:  # [B, 1, T, kv_len]
    key_pos = torch.arange(kv_len, device=positions.device).view(1, 1, kv_len)
    query_pos = positions.unsqueeze(2)  # [B, T, 1]
    causal = key_pos <= query_pos  # [B, T, kv_len]
    masks = {}
    for window in set(windows):
        masks[window] = (causal if window is None else causal & (key_pos > query_pos - window)).unsqueeze(1)
    return masks


@torch.inference_mode()
def forward(
    model,
    pool: KVPool,
    windows: list[int | None],
    tables: torch.Tensor,  # [B, NB] int64 block ids, NB × block_size ≥ kv_len
    start: torch.Tensor,  # [B] int64 position of input_ids[:, 0]
    input_ids: torch.Tensor,  # [B, T] int64, padded
    lengths: torch.Tensor,  # [B] int64 real tokens per row (≥ 1 for rows that need logits)
    logit_index: torch.Tensor,  # [B, N] int64 column indices into T whose logits are returned
    kv_len: int,  # ≥ max(start + lengths); keys read per row
    contiguous_from: int | None,  # tables == arange(contiguous_from, … + B × NB).view(B, NB) if not None
    tree: tuple[torch.Tensor, torch.Tensor] | None = None,  # positions [B, T], visible [B, T, T]: runtime.token_tree
    packed: bool = False,  # only the rows' real tokens through the GEMMs (see the module docstring)
) -> torch.Tensor:  # [B, N, V] logits
    inner = model.model
    B, T = input_ids.shape
    device = input_ids.device
    steps = torch.arange(T, device=device).unsqueeze(0)  # [1, T]
    positions = start.unsqueeze(1) + steps  # [B, T]
    real = steps < lengths.unsqueeze(1)  # [B, T]
    bs = pool.block_size
    blocks = tables.gather(1, (positions // bs).clamp(max=tables.shape[1] - 1))  # [B, T]
    write_at = torch.where(real, blocks * bs + positions % bs, torch.full_like(positions, pool.scratch * bs))
    if tree is None:
        masks = _causal_masks(positions, kv_len, windows)
    else:  # token-tree nodes: K/V still go to the positions start + t, but RoPE and the mask use prefix + depth
        positions = tree[0]
        masks = tree_masks(start, positions, tree[1], kv_len, windows)

    # The token grid the GEMMs run over: [B, T], or [1, R] of the R real tokens when packed. Attention runs on
    # [B, T] either way (per row, against its own keys).
    grid = _TokenGrid(real if packed else None, B, T)
    hidden = inner.embed_tokens(grid.pack(input_ids))
    cos, sin = inner.rotary_emb(hidden, grid.pack(positions))  # [b, t, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    write_at = grid.pack(write_at)
    head_dim = head_dim_of(model)
    b, t = hidden.shape[:2]
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = _norm(layer.input_layernorm, hidden)
        fused = getattr(attn, "fused_qkv", None)  # runtime.fusion: one GEMM for q, k and v
        if fused is not None:
            qkv = fused(x)  # [b, t, (Hq + 2 Hkv) · D]
            nq, nk = fused.sizes[0], fused.sizes[1]
            qk = _rope(qkv[..., : nq + nk].reshape(b, t, -1, head_dim), cos, sin)  # q and k heads in one pass
            q, k = qk.split([nq // head_dim, nk // head_dim], dim=2)
            v = qkv[..., nq + nk:].reshape(b, t, -1, head_dim)
        else:
            q = _rope(attn.q_proj(x).view(b, t, -1, head_dim), cos, sin)
            k = _rope(attn.k_proj(x).view(b, t, -1, head_dim), cos, sin)
            v = attn.v_proj(x).view(b, t, -1, head_dim)
        pool.write(i, write_at, k, v)
        keys, values = pool.read(i, tables, kv_len, contiguous_from)  # [B, kv_len, Hkv, D]
        out = F.scaled_dot_product_attention(
            grid.unpack(q).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=masks[windows[i]], scale=attn.scaling, enable_gqa=True)
        hidden = hidden + attn.o_proj(grid.pack(out.transpose(1, 2).reshape(B, T, -1)))
        hidden = hidden + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, hidden))
    return grid.logits(hidden, logit_index, lambda x: model.lm_head(_norm(inner.norm, x)))


class _TokenGrid:
    """Where a forward's tokens sit: the padded [B, T] grid, or (``real`` given) packed as [1, R], the R real
    tokens row after row. ``pack`` takes a [B, T, ...] tensor onto the grid, ``unpack`` puts it back (padded
    positions zero), ``logits`` applies the head at the logit columns."""

    def __init__(self, real: torch.Tensor | None,  # [B, T] bool, or None: not packed
                 B: int, T: int):
        self.B, self.T = B, T
        self.index = None if real is None else real.flatten().nonzero().squeeze(1)  # [R] into B × T

    def pack(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, ...] → [B, T, ...] or [1, R, ...]
        if self.index is None:
            return x
        return x.flatten(0, 1).index_select(0, self.index).unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:  # [b, t, ...] → [B, T, ...]
        if self.index is None:
            return x
        full = x.new_zeros((self.B * self.T, *x.shape[2:]))
        return full.index_copy_(0, self.index, x[0]).view(self.B, self.T, *x.shape[2:])

    def logits(self, hidden: torch.Tensor,  # [b, t, H]
               logit_index: torch.Tensor,  # [B, N] columns of the [B, T] grid
               head,  # [b, n, H] → [b, n, V]: the final norm and the LM head
               ) -> torch.Tensor:  # [B, N, V]
        if self.index is None:
            return head(hidden.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])))
        # Rows asking fewer logits than N repeat their first column; the head (a GEMM as wide as the
        # vocabulary) runs once per distinct token. A column of no real token (a padded row's) reads packed
        # token 0: its logits are never read.
        where = torch.zeros(self.B * self.T, dtype=torch.long, device=hidden.device)
        where[self.index] = torch.arange(self.index.shape[0], device=hidden.device)
        columns = logit_index + torch.arange(self.B, device=hidden.device).unsqueeze(1) * self.T
        tokens, inverse = torch.unique(where[columns.flatten()], return_inverse=True)
        logits = head(hidden.index_select(1, tokens))[0]  # [M, V]; the head as the model calls it, on [1, M, H]
        return logits.index_select(0, inverse).view(self.B, logit_index.shape[1], -1)
