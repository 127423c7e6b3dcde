"""Forced tokens as free drafts (issue 31): where a row's grammar allows exactly one continuation for a run of
tokens, the engine proposes that run itself instead of the draft model.

Such a proposal is deterministic given the committed tokens, so it is verified with one-hot q (q = 1 on each
forced token), which keeps the rule exact for any proposal drawn independently of the verifier's randomness;
the masked target gives each forced token probability 1 where the grammar allows nothing else, so the run is
accepted whole in one target pass. ``WithForced`` merges the runs into the proposer's batch, where those rows
asked the proposer for γ = 0 (it syncs them and drafts nothing).
"""

from __future__ import annotations

import torch

from runtime.protocol import ProposalBatch


class WithForced:
    """A pending proposal whose rows in ``forced`` (seq id → tokens) get those tokens as their drafts."""

    def __init__(self, pending, forced: dict[int, list[int]]):
        self.pending = pending
        self.forced = forced

    def result(self) -> ProposalBatch:
        return merge_forced(self.pending.result(), self.forced)


def merge_forced(batch: ProposalBatch, forced: dict[int, list[int]]) -> ProposalBatch:
    """``batch`` with each row of ``forced`` drafting its run (the proposer gave those rows nothing)."""
    rows = {s: b for b, s in enumerate(batch.seq_ids)}
    forced = {s: run for s, run in forced.items() if s in rows and s not in batch.resync}
    if not forced:
        return batch
    B, G = batch.tokens.shape
    N = max(G, max(len(run) for run in forced.values()))
    tokens = torch.zeros((B, N), dtype=torch.long)
    tokens[:, :G] = batch.tokens
    lengths = batch.lengths.clone()
    q_ids = q_probs = None
    if batch.q_ids is not None:  # a sampled batch: forced rows carry an explicit one-hot q
        K = batch.q_ids.shape[-1]
        q_ids = torch.zeros((B, N, K), dtype=torch.long)
        q_probs = torch.zeros((B, N, K), dtype=torch.float32)
        q_ids[:, :G], q_probs[:, :G] = batch.q_ids, batch.q_probs
    for seq_id, run in forced.items():
        b, n = rows[seq_id], len(run)
        tokens[b, :n] = torch.tensor(run, dtype=torch.long)
        lengths[b] = n
        if q_ids is not None:
            q_ids[b, :n, 0] = tokens[b, :n]
            q_probs[b, :n, 0] = 1.0
    return ProposalBatch(seq_ids=batch.seq_ids, tokens=tokens, lengths=lengths, q_ids=q_ids, q_probs=q_probs,
                         parents=None, resync=batch.resync, draft_seconds=batch.draft_seconds,
                         mask_seconds=batch.mask_seconds)
