"""Logits → probabilities under per-row temperature / top-k / top-p.

The same function is applied to the target's logits (p) and the draft's logits (q): exact speculative
sampling preserves the *warped* target distribution only if both sides are warped identically.
Greedy rows (temperature 0) get a one-hot distribution on the argmax, which makes the rejection rule
reduce to "accept while the draft equals the target's argmax".
"""

from __future__ import annotations

import torch

from runtime.host_copy import to_device


def warp_probs(
    logits: torch.Tensor,  # [B, T, V] float
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
    *,
    truncate: bool | None = None,  # some row has top-k or top-p; None: read it off the tensors (a host sync)
) -> torch.Tensor:  # [B, T, V] float32, rows sum to 1
    """Branch-free over rows, so that a batch runs on the device without reading anything back (the one
    data-dependent choice, whether to sort for top-k/top-p, is ``truncate``, which callers know from the
    requests' parameters); this also lets the whole warp sit inside a captured CUDA graph."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature.float()).view(-1, 1, 1)
    if truncate is None:
        truncate = bool((((top_k > 0) & (top_k < vocab)) | (top_p < 1)).any())
    if truncate:
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device).view(1, 1, vocab)
        kk = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).view(-1, 1, 1)
        sorted_x = sorted_x.masked_fill(ranks >= kk, float("-inf"))
        # top-p over the top-k survivors: keep the smallest prefix whose mass reaches p (the token that
        # crosses the line is kept, as in HF's TopPLogitsWarper).
        sorted_probs = sorted_x.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # Rows with top_p = 1 (off) must be excluded explicitly: the cumulative sum can round up to 1.0
        # before the last tokens, which would silently cut their tail and make a row's distribution depend
        # on whether another row of its batch needed the sort.
        drop = (mass_before >= top_p.view(-1, 1, 1)) & (top_p < 1).view(-1, 1, 1) & (ranks > 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)
    return torch.where(greedy.view(-1, 1, 1), one_hot, x.softmax(-1))


def race(weights: torch.Tensor,  # [..., V] non-negative, need not be normalised
         noise: torch.Tensor,  # [..., V] Exp(1) (runtime.rng.exponential)
         ) -> torch.Tensor:  # [...] int64: v with probability ∝ weights[v]
    """A categorical draw by the exponential race, argmax_v w_v / E_v: no cumulative sum, no host read."""
    return (weights / noise).argmax(-1)


def sampling_tensors(params, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k, top_p) tensors from a sequence of SamplingParams."""
    temperature = to_device(torch.tensor([s.temperature for s in params], dtype=torch.float32), device)
    top_k = to_device(torch.tensor([s.top_k for s in params], dtype=torch.long), device)
    top_p = to_device(torch.tensor([s.top_p for s in params], dtype=torch.float32), device)
    return temperature, top_k, top_p
