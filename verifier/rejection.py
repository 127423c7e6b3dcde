"""The acceptance rule: one pure function per mode (tensors and randomness in, tokens and counts out).

Exact mode (``rejection_sample``) is speculative sampling (Leviathan et al. 2023, Chen et al. 2023).
For draft position i with draft token d_i ~ q_i:

    accept d_i  with probability  min(1, p_i(d_i) / q_i(d_i))

and at the first rejection emit the *recovered* token r ~ norm(max(0, p_i − q_i)). If all γ drafts are
accepted, emit the *bonus* token ~ p_γ. The emitted tokens are then distributed exactly as the target
sampled autoregressively. Greedy rows use one-hot p and q, so the rule is "accept while d_i equals the
target argmax" and the recovered/bonus token is the argmax — token-identical to greedy decoding.

Threshold mode (``threshold_accept``) is a lossy rule: accept d_i when p_i(d_i) ≥ threshold.
It changes the output distribution and exists only behind an explicit config opt-in.

Categorical draws use the exponential-race trick: argmax_v(w_v / E_v) with E_v ~ Exp(1) samples v with
probability ∝ w_v. The caller supplies the noise, so the function is deterministic given its inputs and
the noise comes from counter-based per-sequence streams (``runtime.rng``: reproducible whatever the batch,
and computed on the device). Every function here is tensor ops only, with no read back to the host, so the
verify step runs it where the logits are.
"""

from __future__ import annotations

import torch

PAD = -1


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, G] int64 (values beyond num_draft ignored)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= G
    target_probs: torch.Tensor,  # [B, G+1, V] float, warped p at every draft position plus one more
    draft_probs: torch.Tensor | None,  # [B, G, V] float, warped q; None = one-hot q on draft_tokens
    uniform: torch.Tensor,  # [B, G] float in [0, 1): the acceptance coin per position
    exp_noise: torch.Tensor,  # [B, V] float, Exp(1) noise for the one recovered/bonus draw per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(output [B, G+1] int64 padded with PAD, num_accepted [B] int64)``.

    Row b emits ``output[b, : num_accepted[b] + 1]``: its accepted draft tokens then one recovered or
    bonus token.
    """
    B, G = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(G, device=device).unsqueeze(0)  # [1, G]
    valid = positions < num_draft.unsqueeze(1)  # [B, G]
    safe_tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))

    p_draft = target_probs[:, :G].gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)  # [B, G]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)
    # u < p/q written as u*q < p: no division. A token with q = 0 lies outside its own proposal's support
    # (a broken proposer, or a sparse q that dropped it); u*q < p alone would accept it whenever p > 0, so
    # it is rejected explicitly.
    accepted = (uniform * q_draft < p_draft) & (q_draft > 0) & valid  # [B, G]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix

    # Distribution of the token emitted after the accepted prefix.
    row = torch.arange(B, device=device)
    p_next = target_probs[row, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft  # [B] stopped at a rejection (else: bonus)
    # q at the first rejected position (only read where a rejection happened, so num_accepted < G there)
    if G == 0:
        q_next = torch.zeros_like(p_next)
    else:
        at = num_accepted.clamp(max=G - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, safe_tokens[row, at].unsqueeze(1), 1.0)
        else:
            q_next = draft_probs[row, at]
    residual = (p_next - q_next).clamp(min=0)
    residual_mass = residual.sum(-1, keepdim=True)
    # p ≠ q guarantees a positive residual whenever a rejection can happen; if rounding leaves none, the
    # rejection had probability ~0 and p itself is the right fallback.
    residual = torch.where(residual_mass > 0, residual, p_next)
    weights = torch.where(rejected.unsqueeze(1), residual, p_next)  # [B, V]
    next_token = (weights / exp_noise).argmax(dim=-1)  # [B]

    output = torch.full((B, G + 1), PAD, dtype=torch.long, device=device)
    output[:, :G] = torch.where(positions < num_accepted.unsqueeze(1), safe_tokens, PAD)
    output[row, num_accepted] = next_token
    return output, num_accepted


def greedy_accept(
    draft_tokens: torch.Tensor,  # [B, G] int64 (values beyond num_draft ignored)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= G
    target_argmax: torch.Tensor,  # [B, G+1] int64, the target's argmax at every draft position plus one more
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` for greedy rows, where p and q are one-hot: the same outputs (tested against it),
    computed from the target's argmaxes alone, so a greedy step needs no softmax over the vocabulary.

    With one-hot p and q, u·q < p holds exactly when d_i is the argmax, and both the residual at the first
    mismatch and the bonus distribution are one-hot on the argmax.
    """
    B, G = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(G, device=device).unsqueeze(0)  # [1, G]
    valid = positions < num_draft.unsqueeze(1)
    accepted = (draft_tokens == target_argmax[:, :G]) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    row = torch.arange(B, device=device)
    output = torch.full((B, G + 1), PAD, dtype=torch.long, device=device)
    output[:, :G] = torch.where(positions < num_accepted.unsqueeze(1), draft_tokens, PAD)
    output[row, num_accepted] = target_argmax[row, num_accepted]
    return output, num_accepted


def threshold_accept(
    draft_tokens: torch.Tensor,  # [B, G] int64
    num_draft: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, G+1, V] float, warped p
    threshold: torch.Tensor,  # [B] float in (0, 1]
    exp_noise: torch.Tensor,  # [B, V] float, Exp(1) noise for the token after the accepted prefix
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossy acceptance: keep d_i while p_i(d_i) ≥ threshold; then one token sampled from p.

    Same output contract as ``rejection_sample``. Not distribution-preserving: opt-in only.
    """
    B, G = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(G, device=device).unsqueeze(0)
    valid = positions < num_draft.unsqueeze(1)
    safe_tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))
    p_draft = target_probs[:, :G].gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)
    accepted = (p_draft >= threshold.unsqueeze(1)) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    row = torch.arange(B, device=device)
    next_token = (target_probs[row, num_accepted] / exp_noise).argmax(dim=-1)
    output = torch.full((B, G + 1), PAD, dtype=torch.long, device=device)
    output[:, :G] = torch.where(positions < num_accepted.unsqueeze(1), safe_tokens, PAD)
    output[row, num_accepted] = next_token
    return output, num_accepted


def adjust_threshold(threshold: float, acceptance_rate: float, target_rate: float = 0.7) -> float:
    """The dynamic threshold rule: stricter (×1.05) above target+0.1, looser (×0.95) below target−0.1."""
    if acceptance_rate > target_rate + 0.1:
        return min(1.0, threshold * 1.05)
    if acceptance_rate < target_rate - 0.1:
        return threshold * 0.95
    return threshold
