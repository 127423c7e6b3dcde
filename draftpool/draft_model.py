"""Draft-model proposer: γ tokens for the whole batch, one batched draft forward per drafted position.

The first forward of a step also catches the draft's KV cache up with whatever it has not seen (the
prompt of a new sequence, the bonus token after a fully accepted chain, everything after a resync); the
following forwards feed one drafted token per row. Tokens are drawn from the draft's warped
distribution q — argmax for greedy rows — and q is returned (sparse top-k when ``q_top_k`` is set: the
token is then drawn from that truncated q, which keeps verification exact). A row stops early when the
draft's confidence (its top probability) falls below ``confidence_threshold``.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from runtime.protocol import ProposalBatch, ProposeItem
from runtime.rng import row_generator
from runtime.runner import ModelRunner
from runtime.sampling import sampling_tensors, warp_probs

DRAFT_STREAM = 1


class DraftModelProposer:
    def __init__(self, model, *, max_slots: int, max_len: int, q_top_k: int | None = None,
                 confidence_threshold: float = 0.0):
        self.runner = ModelRunner(model, max_slots=max_slots, max_len=max_len)
        self.vocab_size = self.runner.vocab_size
        self.q_top_k = q_top_k if q_top_k and q_top_k < self.vocab_size else None
        self.confidence_threshold = confidence_threshold

    def release(self, seq_ids: Sequence[int]) -> None:
        self.runner.release(seq_ids)

    def propose(self, items: Sequence[ProposeItem]) -> ProposalBatch:
        t0 = time.perf_counter()
        seq_ids = [it.sync.seq_id for it in items]
        resync = [it.sync.seq_id for it in items if not self.runner.sync(it.sync)]
        # The draft stops one short of the context limit: the verifier needs room for the drafts too.
        gammas = [0 if it.sync.seq_id in resync else
                  max(0, min(it.gamma, self.runner.max_len - len(self.runner.seqs[it.sync.seq_id].tokens) - 1))
                  for it in items]
        G = max(gammas, default=0)
        batch = ProposalBatch.empty(seq_ids, resync)
        if G == 0:
            return batch
        sampled = any(not it.sampling.greedy for it, g in zip(items, gammas) if g)
        K = (self.q_top_k or self.vocab_size) if sampled else 0
        B = len(items)
        tokens = torch.zeros((B, G), dtype=torch.long)
        q_ids = torch.zeros((B, G, K), dtype=torch.long)
        q_probs = torch.zeros((B, G, K), dtype=torch.float32)
        drafts: list[list[int]] = [[] for _ in items]
        active = [b for b in range(B) if gammas[b] > 0]
        gens = {b: row_generator(items[b].sampling.seed or 0, len(self.runner.seqs[seq_ids[b]].tokens),
                                 DRAFT_STREAM) for b in active if not items[b].sampling.greedy}
        temperature, top_k, top_p = sampling_tensors([it.sampling for it in items])
        for i in range(G):
            if not active:
                break
            logits = self.runner.forward([seq_ids[b] for b in active], [drafts[b] for b in active],
                                         [1] * len(active))[:, 0].cpu()  # [A, V]
            argmax = logits.argmax(-1).tolist()  # greedy rows' tokens: argmax of one-hot q is argmax of logits
            probs = None
            if sampled:
                idx = torch.tensor(active)
                probs = warp_probs(logits.unsqueeze(1), temperature[idx], top_k[idx], top_p[idx])[:, 0]  # [A, V]
            unsure = [False] * len(active)
            if self.confidence_threshold and i > 0:
                # The draft's confidence is its top probability before warping.
                unsure = (logits.float().softmax(-1).amax(-1) < self.confidence_threshold).tolist()
            still = []
            for a, b in enumerate(active):
                if unsure[a]:
                    continue  # an unsure draft token is likely rejected: stop this chain here
                if items[b].sampling.greedy:
                    token, ids, ps = self._one_hot(argmax[a], K)
                else:
                    token, ids, ps = self._draw(probs[a], gens[b], K)
                tokens[b, i] = token
                if K:
                    q_ids[b, i], q_probs[b, i] = ids, ps
                drafts[b].append(token)
                if len(drafts[b]) < gammas[b]:
                    still.append(b)
            active = still
        batch.tokens = tokens
        batch.lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        if K:
            batch.q_ids, batch.q_probs = q_ids, q_probs
        batch.draft_seconds = time.perf_counter() - t0
        return batch

    @staticmethod
    def _one_hot(token: int, K: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """A greedy row's draft token with its one-hot q as sparse (ids [K], probs [K]) when K > 0."""
        if not K:
            return token, None, None
        ids = torch.zeros(K, dtype=torch.long)
        ps = torch.zeros(K)
        ids[0], ps[0] = token, 1.0
        return token, ids, ps

    def _draw(self, probs: torch.Tensor, gen: torch.Generator, K: int
              ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """One draft token from q = probs [V]; returns (token, q support ids [K], q probs [K])."""
        if self.q_top_k:
            ps, ids = probs.topk(K)
            ps = ps / ps.sum()
        else:
            ids, ps = torch.arange(self.vocab_size), probs
        noise = torch.empty(ps.shape[0]).exponential_(generator=gen)
        token = int(ids[(ps / noise).argmax()])
        return token, ids, ps
