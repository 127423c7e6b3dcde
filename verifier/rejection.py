"""The acceptance rule: one pure function per mode (tensors and randomness in, tokens and counts out), for
chains and token trees alike.

- ``rejection_sample``: exact mode, for sampled rows (and greedy ones, with one-hot p);
- ``greedy_accept``: exact mode for all-greedy rows, from the target's argmaxes alone;
- ``threshold_accept``: the lossy threshold mode (opt-in).

Each takes the drafts as a batch of B rows padded to N positions, with ``num_draft`` per row. Without
``parents`` a row is a chain (position i's parent is i-1) and the rule runs vectorised over the positions;
with ``parents`` ([B, N], ``ROOT`` for the children of the committed prefix) a row is a token tree, walked
node by node (``verifier.tree_acceptance``, which also shows why the tree rule is exact). A chain given as
a tree (``parents`` = [ROOT, 0, 1, ...]) gets the same outputs bit for bit, only slower. Every entry point
returns ``Acceptance(output [B, N+1], num_accepted [B], path [B, N])``: row b emits
``output[b, : num_accepted[b] + 1]``, its accepted drafts (the nodes ``path[b, : num_accepted[b]]``) then
one recovered or bonus token.

Exact mode is speculative sampling (Leviathan et al. 2023, Chen et al. 2023). For draft position i with
draft token d_i ~ q_i:

    accept d_i  with probability  min(1, p_i(d_i) / q_i(d_i))

and at the first rejection emit the *recovered* token r ~ norm(max(0, p_i − q_i)). If all γ drafts are
accepted, emit the *bonus* token ~ p_γ. The emitted tokens are then distributed exactly as the target
sampled autoregressively. Greedy rows use one-hot p and q, so the rule is "accept while d_i equals the
target argmax" and the recovered/bonus token is the argmax — token-identical to greedy decoding.

Structured outputs (issue 31) use the same rule: the verifier masks the target's logits by the row's grammar
and the draft draws from its own masked q, so p and q here are both the masked distributions, and the rule
preserves the masked target law exactly (docs/design.md, "Structured outputs").

Threshold mode is a lossy rule: accept d_i when p_i(d_i) ≥ threshold. It changes the output distribution
and exists only behind an explicit config opt-in.

Categorical draws use the exponential-race trick: argmax_v(w_v / E_v) with E_v ~ Exp(1) samples v with
probability ∝ w_v. The caller supplies the noise, so the function is deterministic given its inputs and
the noise comes from counter-based per-sequence streams (``runtime.rng``: reproducible whatever the batch,
and computed on the device). Every function here is tensor ops only, with no read back to the host, so the
verify step runs it where the logits are.
"""

from __future__ import annotations

import torch

from runtime.sampling import race
from verifier.tree_acceptance import PAD, ROOT, Acceptance, _walk_exact, _walk_first

__all__ = ["PAD", "ROOT", "Acceptance", "rejection_sample", "greedy_accept", "threshold_accept", "adjust_threshold"]


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, N] int64 (values beyond num_draft ignored)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= N
    target_probs: torch.Tensor,  # [B, N+1, V] float, warped p before the first draft and after every draft
    draft_probs: torch.Tensor | None,  # [B, N, V] float, warped q of every draft; None = one-hot q on draft_tokens
    uniform: torch.Tensor,  # [B, N] float in [0, 1): the acceptance coin of every draft
    exp_noise: torch.Tensor,  # [B, V] float, Exp(1) noise for the one recovered/bonus draw per row
    *,
    parents: torch.Tensor | None = None,  # [B, N] int64, each draft's parent (< own index) or ROOT; None = chains
) -> Acceptance:
    """Exact mode (speculative sampling; over a tree, multi-draft speculative sampling). A tree node whose
    parent index is not smaller than its own is never reached."""
    if parents is not None:
        return _walk_exact(parents, draft_tokens, num_draft, target_probs, draft_probs, uniform, exp_noise)
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
    return _chain_result(safe_tokens, positions, row, num_accepted, race(weights, exp_noise))


def greedy_accept(
    draft_tokens: torch.Tensor,  # [B, N] int64 (values beyond num_draft ignored)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= N
    target_argmax: torch.Tensor,  # [B, N+1] int64, the target's argmax before the first draft and after every draft
    *,
    parents: torch.Tensor | None = None,  # [B, N] int64, as in rejection_sample; None = chains
) -> Acceptance:
    """``rejection_sample`` for greedy rows, where p and q are one-hot: the same outputs (tested against it),
    computed from the target's argmaxes alone, so a greedy step needs no softmax over the vocabulary.

    With one-hot p and q, u·q < p holds exactly when d_i is the argmax, and both the residual at the first
    mismatch and the bonus distribution are one-hot on the argmax: a chain keeps its prefix of drafts equal
    to the argmax, a tree follows the first child that is the argmax; then the argmax there.
    """
    if parents is not None:
        row = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
        return _walk_first(parents, draft_tokens, num_draft,
                           lambda j, current: draft_tokens[:, j] == target_argmax[row, current + 1],
                           lambda current: target_argmax[row, current + 1])
    B, G = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(G, device=device).unsqueeze(0)  # [1, G]
    valid = positions < num_draft.unsqueeze(1)
    accepted = (draft_tokens == target_argmax[:, :G]) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    row = torch.arange(B, device=device)
    return _chain_result(draft_tokens, positions, row, num_accepted, target_argmax[row, num_accepted])


def threshold_accept(
    draft_tokens: torch.Tensor,  # [B, N] int64 (values beyond num_draft ignored)
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= N
    target_probs: torch.Tensor,  # [B, N+1, V] float, warped p before the first draft and after every draft
    threshold: torch.Tensor,  # [B] float in (0, 1]
    exp_noise: torch.Tensor,  # [B, V] float, Exp(1) noise for the token after the accepted drafts
    *,
    parents: torch.Tensor | None = None,  # [B, N] int64, as in rejection_sample; None = chains
) -> Acceptance:
    """Lossy acceptance: keep d_i while p_i(d_i) ≥ threshold (a tree: follow the first child whose token the
    target gives at least ``threshold`` after the current node); then one token sampled from p.

    Not distribution-preserving: opt-in only.
    """
    if parents is not None:
        row = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
        safe = draft_tokens.clamp(0, target_probs.shape[-1] - 1)

        def passes(j: int, current: torch.Tensor) -> torch.Tensor:  # current [B] → [B] bool
            return target_probs[row, current + 1].gather(-1, safe[:, j : j + 1]).squeeze(-1) >= threshold

        return _walk_first(parents, draft_tokens, num_draft, passes,
                           lambda current: race(target_probs[row, current + 1], exp_noise))
    B, G = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(G, device=device).unsqueeze(0)
    valid = positions < num_draft.unsqueeze(1)
    safe_tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))
    p_draft = target_probs[:, :G].gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)
    accepted = (p_draft >= threshold.unsqueeze(1)) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    row = torch.arange(B, device=device)
    return _chain_result(safe_tokens, positions, row, num_accepted, race(target_probs[row, num_accepted], exp_noise))


def _chain_result(
    draft_tokens: torch.Tensor,  # [B, G] int64
    positions: torch.Tensor,  # [1, G] int64, 0..G-1
    row: torch.Tensor,  # [B] int64, 0..B-1
    num_accepted: torch.Tensor,  # [B] int64, the length of the accepted prefix
    next_token: torch.Tensor,  # [B] int64, the recovered/bonus token
) -> Acceptance:
    """A chain's ``Acceptance``: the accepted prefix of drafts, then ``next_token``; the path is the prefix's
    positions."""
    B, G = draft_tokens.shape
    kept = positions < num_accepted.unsqueeze(1)  # [B, G]
    output = torch.full((B, G + 1), PAD, dtype=torch.long, device=draft_tokens.device)
    output[:, :G] = torch.where(kept, draft_tokens, PAD)
    output[row, num_accepted] = next_token
    return Acceptance(output, num_accepted, torch.where(kept, positions, PAD))


def adjust_threshold(threshold: float, acceptance_rate: float, target_rate: float = 0.7) -> float:
    """The dynamic threshold rule: stricter (×1.05) above target+0.1, looser (×0.95) below target−0.1."""
    if acceptance_rate > target_rate + 0.1:
        return min(1.0, threshold * 1.05)
    if acceptance_rate < target_rate - 0.1:
        return threshold * 0.95
    return threshold
