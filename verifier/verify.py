"""The verify stage: one target forward over every row's proposal, the acceptance rule, the commit.

For row b with committed tokens x and drafts d_1..d_γ, the target is fed the uncached tail of
x + d_1..d_γ and returns logits at the γ+1 positions that predict d_1..d_γ and the token after them.
``rejection_sample`` (or the opt-in ``threshold_accept``) picks the accepted prefix plus one
recovered/bonus token, and the verifier commits those to its copy of the sequence. Rolling the KV cache
back is implicit: the rejected drafts' K/V stay in the slot past the committed length and are
overwritten by the next forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from runtime.protocol import ProposalBatch, VerifyItem, VerifyOutcome
from verifier.rejection import adjust_threshold, rejection_sample, threshold_accept
from runtime.rng import row_generator
from runtime.runner import ModelRunner
from runtime.sampling import sampling_tensors, warp_probs

VERIFY_STREAM = 0


@dataclass
class AcceptanceConfig:
    mode: str = "exact"  # "exact" | "threshold" (lossy, opt-in)
    threshold: float = 0.9
    dynamic_adjust: bool = False
    target_rate: float = 0.7


def densify_q(proposal: ProposalBatch, rows: Sequence[int], vocab: int) -> torch.Tensor | None:
    """Sparse q of the selected proposal rows → dense [len(rows), G, V]; None for all-greedy proposals."""
    if proposal.q_ids is None:
        return None
    ids = proposal.q_ids[list(rows)]
    probs = proposal.q_probs[list(rows)].float()
    dense = torch.zeros((*ids.shape[:2], vocab), dtype=torch.float32)
    return dense.scatter_add_(-1, ids, probs)


class VerifyStage:
    def __init__(self, runner: ModelRunner, acceptance: AcceptanceConfig | None = None):
        self.runner = runner
        self.acceptance = acceptance or AcceptanceConfig()
        self.threshold = self.acceptance.threshold

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def release(self, seq_ids: Sequence[int]) -> None:
        self.runner.release(seq_ids)

    def verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch) -> VerifyOutcome:
        t0 = time.perf_counter()
        prop_row = {s: b for b, s in enumerate(proposal.seq_ids)}
        resync = [it.sync.seq_id for it in items if not self.runner.sync(it.sync)]
        live = [it for it in items if it.sync.seq_id not in resync]
        outcome = VerifyOutcome(seq_ids=[it.sync.seq_id for it in items], emitted=[[] for _ in items],
                                num_accepted=[0] * len(items), num_proposed=[0] * len(items), resync=resync)
        if not live:
            return outcome
        drafts = []
        for it in live:
            b = prop_row.get(it.sync.seq_id)
            drafts.append(proposal.row_tokens(b) if b is not None else [])
        G = max(len(d) for d in drafts)
        logits = self.runner.forward([it.sync.seq_id for it in live], drafts, [len(d) + 1 for d in drafts])
        logits = logits[:, : G + 1]  # [B, G+1, V]

        temperature, top_k, top_p = sampling_tensors([it.sampling for it in live], logits.device)
        target_probs = warp_probs(logits, temperature, top_k, top_p)
        B, V = len(live), logits.shape[-1]
        draft_tokens = torch.zeros((B, G), dtype=torch.long)
        num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        for b, d in enumerate(drafts):
            draft_tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        uniform, noise = self._randomness(live, [len(d) for d in drafts], G, V)

        if self.acceptance.mode == "threshold":
            output, accepted = threshold_accept(draft_tokens, num_draft, target_probs.cpu(),
                                                torch.full((B,), self.threshold), noise)
        else:
            rows = [prop_row.get(it.sync.seq_id, 0) for it in live]
            q = densify_q(proposal, rows, V) if G else None
            if q is not None:
                q = q[:, :G]
            output, accepted = rejection_sample(draft_tokens, num_draft, target_probs.cpu(), q, uniform, noise)

        index = {s: i for i, s in enumerate(outcome.seq_ids)}
        for b, it in enumerate(live):
            n = int(accepted[b])
            emitted = output[b, : n + 1].tolist()
            i = index[it.sync.seq_id]
            outcome.emitted[i] = emitted
            outcome.num_accepted[i] = n
            outcome.num_proposed[i] = len(drafts[b])
            self.runner.seqs[it.sync.seq_id].tokens.extend(emitted)
        if self.acceptance.mode == "threshold" and self.acceptance.dynamic_adjust and int(num_draft.sum()):
            rate = float(accepted.sum()) / float(num_draft.sum())
            self.threshold = adjust_threshold(self.threshold, rate, self.acceptance.target_rate)
        outcome.verify_seconds = time.perf_counter() - t0
        return outcome

    def _randomness(self, live: Sequence[VerifyItem], num_draft: Sequence[int], G: int, V: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row coins [B, G] and Exp(1) noise [B, V], each row from its own (seed, position) stream.

        A row draws exactly its own ``num_draft`` coins, after its noise: drawing the batch's padded G
        would shift the noise with the other rows' draft lengths and break reproducibility.
        """
        uniform = torch.zeros((len(live), G))
        noise = torch.ones((len(live), V))
        for b, (it, n) in enumerate(zip(live, num_draft)):
            if it.sampling.greedy:
                continue  # one-hot p and q: coins and noise cannot change the outcome
            gen = row_generator(it.sampling.seed or 0, len(self.runner.seqs[it.sync.seq_id].tokens),
                                VERIFY_STREAM)
            noise[b] = torch.empty(V).exponential_(generator=gen)
            uniform[b, :n] = torch.rand(n, generator=gen)
        return uniform, noise
