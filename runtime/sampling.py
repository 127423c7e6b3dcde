"""Logits → probabilities under per-row temperature / top-k / top-p.

The same function is applied to the target's logits (p) and the draft's logits (q): exact speculative
sampling preserves the *warped* target distribution only if both sides are warped identically.
Greedy rows (temperature 0) get a one-hot distribution on the argmax, which makes the rejection rule
reduce to "accept while the draft equals the target's argmax".
"""

from __future__ import annotations

import torch


def warp_probs(
    logits: torch.Tensor,  # [B, T, V] float
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
) -> torch.Tensor:  # [B, T, V] float32, rows sum to 1
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    probs = torch.empty_like(logits)
    if bool(greedy.any()):
        g = logits[greedy]
        probs[greedy] = torch.zeros_like(g).scatter_(-1, g.argmax(-1, keepdim=True), 1.0)
    sampled = ~greedy
    if not bool(sampled.any()):
        return probs
    x = logits[sampled] / temperature[sampled].view(-1, 1, 1)
    k = top_k[sampled]
    p = top_p[sampled]
    needs_sort = bool(((k > 0) & (k < vocab)).any()) or bool((p < 1).any())
    if needs_sort:
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device).view(1, 1, vocab)
        kk = torch.where(k > 0, k, torch.full_like(k, vocab)).view(-1, 1, 1)
        drop = ranks >= kk
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        # top-p over the top-k survivors: keep the smallest prefix whose mass reaches p (the token that
        # crosses the line is kept, as in HF's TopPLogitsWarper).
        sorted_probs = sorted_x.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # Rows with top_p = 1 (off) sit in this branch when another row needs the sort; excluding them
        # explicitly matters because the cumulative sum can round up to 1.0 before the last tokens,
        # which would silently cut their tail and make a row's distribution depend on its batch.
        drop = (mass_before >= p.view(-1, 1, 1)) & (p < 1).view(-1, 1, 1)
        drop[..., 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)
    probs[sampled] = x.softmax(-1)
    return probs


def sampling_tensors(params, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k, top_p) tensors from a sequence of SamplingParams."""
    temperature = torch.tensor([s.temperature for s in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([s.top_k for s in params], dtype=torch.long, device=device)
    top_p = torch.tensor([s.top_p for s in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p
