"""Acceptance over a token tree: several candidate continuations per sequence, verified in one target pass.

This module is the tree branch of the acceptance rule and the argument that it is exact; callers use the one
entry point per mode in ``verifier.rejection`` (``rejection_sample``, ``greedy_accept``, ``threshold_accept``,
each taking ``parents`` for a tree), which sends a tree here and keeps a vectorised branch for chains.

A sequence's proposal tree is three tensors over its n nodes, in topological order (a node's parent has a
smaller index, so a node comes after its ancestors):

- ``parents`` [n]: each node's parent node, ``ROOT`` (-1) for the children of the committed prefix;
- ``tokens`` [n]: each node's token;
- ``q`` [n, V]: for sampled proposals, the warped draft distribution each node's token was drawn from, given
  the path to its parent; without it q is one-hot on the token (deterministic proposals, greedy drafts).

A chain of γ drafts is the tree ``parents = [-1, 0, 1, ..., γ-2]``. One verify pass over the tree gives the
target's warped distribution after the prefix (``target_probs`` row 0) and after every node i (row i+1).
The walks take a batch of such trees padded to N nodes (``num_nodes`` per row; one sequence is a batch of
one) and are tensor ops only, with no read back to the host.

The rule is multi-draft speculative sampling (SpecInfer's "multi-step speculative sampling", Miao et al.
2024; also called recursive rejection sampling). Starting at the root with residual r = p (the target's
warped distribution there), the children of the current node are tried in index order; child c with token
x, drawn from q_c, is

    accepted  with probability  min(1, r(x) / q_c(x))   → move to c; r = the target's p after c
    rejected  otherwise                                  → r = norm(max(0, r − q_c)), try the next child

and when no child of the current node is accepted, the recovered token is drawn from the final r (the bonus
token, from p after the node, when the node has no children).

Why it is exact. At a node whose children x_1..x_k were drawn from q_1..q_k, let r_0 = p and r_i the
residual after i rejections. If x_i ~ q_i independently of what happened at children 1..i-1, then

    P(emit y at child i or later) = min(q_i(y), r_{i-1}(y)) + (1 − β_i)·r_i(y)
                                  = min(q_i(y), r_{i-1}(y)) + max(0, r_{i-1}(y) − q_i(y)) = r_{i-1}(y),

with β_i = Σ min(q_i, r_{i-1}) the chance child i is accepted; the recovered draw after the last child
emits r_k, so by induction the token emitted at the node is distributed as r_0 = p. On acceptance the
next position repeats the argument at the child, whose own children were drawn given the path to it: every
emitted token follows the target's warped distribution given the tokens before it. This holds under two
conditions on the proposal, which define the variant implemented here:

1. Each node is one draft sample: its token was drawn from its own q given the path to its parent,
   independently of the coins and of its siblings' tokens. Several independent draft chains merged into
   one tree (each node carries the q of the chain that drafted it), i.i.d. draws from one q, and
   deterministic tokens with one-hot q (top-k expansion, n-gram continuations) all qualify; siblings drawn
   *without replacement* from one q (Gumbel top-k) do not.
2. Siblings are tried in index order, and that order may depend on anything above the node but not on the
   siblings' own tokens (sorting them by their drawn token or its probability chooses which sample is
   tried first by its value, and breaks the independence of step i from steps 1..i-1).

Siblings carrying the same token: rejecting a child with token x by its coin means u·q(x) ≥ r(x), so
r(x) < q(x) and max(0, r − q) is exactly 0 at x (in floating point too) — a later sibling with the same
token is never accepted. It must still stay a node, because its rejection subtracts its own q from the
residual (skipping it changes the recovered distribution; the tests check that this fails). Since its
subtree is never reached, a proposer that merges chains may hang a duplicate's children under the first
sibling with that token (merging common prefixes) and keep the duplicate as a leaf: those children were
drawn given the same path, so condition 1 holds.

Greedy rows have one-hot p (``runtime.sampling.warp_probs`` at temperature 0): the rule accepts the first
child whose token is the target's argmax, and the recovered or bonus token is the argmax — greedy decoding.
``greedy_accept`` computes the same from the argmaxes alone.

Randomness: one acceptance coin per node (counter = node index, so a chain uses the same coins as the
chain branch) and one Exp(1) noise vector per row for the single recovered/bonus draw (the
exponential race, ``runtime.sampling.race``); the caller supplies both, so the function is deterministic
given them. The residual is kept unnormalised with its total (acceptance test u·q(x)·mass < r(x), no
division; a target row has mass 1): a width-1 tree gives the chain branch's outputs bit for bit.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from runtime.sampling import race

PAD = -1  # fills ``output`` and ``path`` past what a row emits
ROOT = -1  # the parent of the first tokens of a tree: the committed prefix


class Acceptance(NamedTuple):
    """What every acceptance entry point returns, for a chain or a tree of N positions."""

    output: torch.Tensor  # [B, N+1] int64: the accepted tokens, then the recovered/bonus token; PAD after
    num_accepted: torch.Tensor  # [B] int64: accepted drafts (a tree: the depth reached)
    path: torch.Tensor  # [B, N] int64: the accepted nodes' indices, root to leaf (a chain: 0..n-1); PAD after


def _walk_exact(
    parents: torch.Tensor,  # [B, N] int64, parent node index (< own index) or ROOT; values beyond num_nodes ignored
    tokens: torch.Tensor,  # [B, N] int64 (values beyond num_nodes ignored)
    num_nodes: torch.Tensor,  # [B] int64, 0 <= num_nodes <= N
    target_probs: torch.Tensor,  # [B, N+1, V] float, warped p after the prefix (row 0) and after node i (row i+1)
    draft_probs: torch.Tensor | None,  # [B, N, V] float, warped q of every node; None = one-hot q on tokens
    uniform: torch.Tensor,  # [B, N] float in [0, 1): the acceptance coin of every node
    exp_noise: torch.Tensor,  # [B, V] float, Exp(1) noise for the one recovered/bonus draw per row
) -> Acceptance:
    """The tree branch of ``verifier.rejection.rejection_sample``: the walk of the module docstring. A node
    whose parent index is not smaller than its own is never reached (the walk only moves to higher indices)."""
    B, N = tokens.shape
    device = tokens.device
    row = torch.arange(B, device=device)
    valid = torch.arange(N, device=device).unsqueeze(0) < num_nodes.unsqueeze(1)  # [B, N]
    safe_tokens = torch.where(valid, tokens, torch.zeros_like(tokens))

    current = torch.full((B,), ROOT, dtype=torch.long, device=device)  # the last accepted node
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    path = torch.full((B, N), PAD, dtype=torch.long, device=device)
    output = torch.full((B, N + 1), PAD, dtype=torch.long, device=device)
    residual = target_probs[:, 0]  # [B, V] unnormalised residual at the current node
    mass = torch.ones(B, dtype=residual.dtype, device=device)  # its total (a target row: 1)

    # Walking the nodes in index order tries each node's children in index order: a node's children all come
    # after it, and once a child is accepted its later siblings no longer have the current node as parent.
    for j in range(N):
        tried = valid[:, j] & (parents[:, j] == current)  # [B]
        x = safe_tokens[:, j : j + 1]  # [B, 1]
        r_x = residual.gather(-1, x).squeeze(-1)
        if draft_probs is None:
            q = torch.zeros_like(residual).scatter_(-1, x, 1.0)
            q_x = torch.ones_like(r_x)
        else:
            q = draft_probs[:, j]
            q_x = q.gather(-1, x).squeeze(-1)
        # u < r(x) / (q(x)·mass) without division; a token outside its own q's support is rejected, as in
        # the chain branch.
        accepted = tried & (uniform[:, j] * q_x * mass < r_x) & (q_x > 0)
        # Rejected: residual ← max(0, r/mass − q), kept scaled by mass. If rounding leaves nothing, the
        # rejection had probability ~0 (r = q) and the residual so far is the right fallback.
        left = (residual - mass.unsqueeze(1) * q).clamp(min=0)
        left_mass = left.sum(-1)
        shrink = tried & ~accepted & (left_mass > 0)
        residual = torch.where(shrink.unsqueeze(1), left, residual)
        mass = torch.where(shrink, left_mass, mass)
        # Accepted: the residual restarts as the target's distribution after node j.
        residual = torch.where(accepted.unsqueeze(1), target_probs[:, j + 1], residual)
        mass = torch.where(accepted, torch.ones_like(mass), mass)
        # num_accepted ≤ j here, so the write stays inside path's N columns.
        path[row, num_accepted] = torch.where(accepted, j, path[row, num_accepted])
        output[row, num_accepted] = torch.where(accepted, safe_tokens[:, j], output[row, num_accepted])
        num_accepted = num_accepted + accepted.long()
        current = torch.where(accepted, j, current)

    output[row, num_accepted] = race(residual, exp_noise)
    return Acceptance(output, num_accepted, path)


def _walk_first(
    parents: torch.Tensor,  # [B, N] int64, as in _walk_exact
    tokens: torch.Tensor,  # [B, N] int64
    num_nodes: torch.Tensor,  # [B] int64
    takes: Callable[[int, torch.Tensor], torch.Tensor],  # (node j, current [B]) → [B] bool: would accept node j
    last: Callable[[torch.Tensor], torch.Tensor],  # current [B] → [B] int64: the token after the accepted path
) -> Acceptance:
    """The deterministic walk down a tree (the tree branch of ``greedy_accept`` and ``threshold_accept``):
    from the root, the first child (in index order) that ``takes(j, current)`` is accepted; then
    ``last(current)`` is the token after the accepted path."""
    B, N = tokens.shape
    device = tokens.device
    row = torch.arange(B, device=device)
    valid = torch.arange(N, device=device).unsqueeze(0) < num_nodes.unsqueeze(1)
    current = torch.full((B,), ROOT, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    path = torch.full((B, N), PAD, dtype=torch.long, device=device)
    output = torch.full((B, N + 1), PAD, dtype=torch.long, device=device)
    for j in range(N):
        accepted = valid[:, j] & (parents[:, j] == current) & takes(j, current)
        path[row, num_accepted] = torch.where(accepted, j, path[row, num_accepted])
        output[row, num_accepted] = torch.where(accepted, tokens[:, j], output[row, num_accepted])
        num_accepted = num_accepted + accepted.long()
        current = torch.where(accepted, j, current)
    output[row, num_accepted] = last(current)
    return Acceptance(output, num_accepted, path)
