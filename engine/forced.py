"""Forced tokens as free drafts (issue 31): where a row's grammar allows exactly one continuation for a run of
tokens, the engine proposes that run itself, and the draft model drafts its γ tokens after it
(``ProposeItem.forced``).

The run is deterministic given the committed tokens, so it is verified with one-hot q (q = 1 on each forced
token), which keeps the rule exact for any proposal drawn independently of the verifier's randomness; the
masked target gives each forced token probability 1 where the grammar allows nothing else, so the run is
accepted whole and the model's drafts after it are verified in the same target pass. ``WithForced`` puts each
run in front of the proposer's drafts for its row.
"""

from __future__ import annotations

import torch

from runtime.protocol import ProposalBatch


def model_drafts(proposal: ProposalBatch, pending) -> int:
    """The most tokens any row of ``proposal`` drafted with the proposer, its forced run not counted: the γ the
    step ran at, which is what the γ policy's cost model prices (a forced run costs no draft forward)."""
    forced = pending.forced if isinstance(pending, WithForced) else {}
    lengths = proposal.lengths.tolist()
    return max((n - len(forced.get(s, ())) for s, n in zip(proposal.seq_ids, lengths)), default=0)


class WithForced:
    """A pending proposal whose rows in ``forced`` (seq id → tokens) get those tokens before their drafts."""

    def __init__(self, pending, forced: dict[int, list[int]]):
        self.pending = pending
        self.forced = forced

    def result(self) -> ProposalBatch:
        return merge_forced(self.pending.result(), self.forced)


def merge_forced(batch: ProposalBatch, forced: dict[int, list[int]]) -> ProposalBatch:
    """``batch`` with each row of ``forced`` proposing its run, then the drafts the proposer made after it (a
    resync row drafts nothing: the proposer lost its history, and a forced run without it would be as good,
    but the row's sync must come first)."""
    rows = {s: b for b, s in enumerate(batch.seq_ids)}
    forced = {s: run for s, run in forced.items() if s in rows and s not in batch.resync}
    if not forced:
        return batch
    B, G = batch.tokens.shape
    shift = torch.zeros(B, dtype=torch.long)  # per row: the forced run's length
    for seq_id, run in forced.items():
        shift[rows[seq_id]] = len(run)
    N = int((batch.lengths + shift).max())
    tokens = torch.zeros((B, N), dtype=torch.long)
    # q is written out even where the proposer sent none (one-hot on its drafts, what "no q" means): a
    # sampled row with forced tokens is a drafted, sampled row, and such a row must carry q on the wire.
    K = batch.q_ids.shape[-1] if batch.q_ids is not None else 1
    q_ids = torch.zeros((B, N, K), dtype=torch.long)
    q_probs = torch.zeros((B, N, K), dtype=torch.float32)
    for b in range(B):
        f, n = int(shift[b]), int(batch.lengths[b])
        tokens[b, f : f + n] = batch.tokens[b, :n]
        if batch.q_ids is not None:
            q_ids[b, f : f + n], q_probs[b, f : f + n] = batch.q_ids[b, :n], batch.q_probs[b, :n]
        else:
            q_ids[b, f : f + n, 0], q_probs[b, f : f + n, 0] = batch.tokens[b, :n], 1.0
    for seq_id, run in forced.items():
        b, n = rows[seq_id], len(run)
        tokens[b, :n] = torch.tensor(run, dtype=torch.long)
        q_ids[b, :n, 0] = tokens[b, :n]
        q_probs[b, :n, 0] = 1.0
    lengths = batch.lengths + shift
    return ProposalBatch(seq_ids=batch.seq_ids, tokens=tokens, lengths=lengths, q_ids=q_ids, q_probs=q_probs,
                         parents=None, resync=batch.resync, draft_seconds=batch.draft_seconds,
                         mask_seconds=batch.mask_seconds)
