"""Draft-model proposer: γ tokens for the whole batch, drafted on the device with one read back per step.

The first forward of a step catches the draft's KV cache up with whatever it has not seen (the prompt of a
new sequence, the bonus token after a fully accepted chain, everything after a resync) and gives each row's
next-token logits. The remaining γ−1 positions run as one device loop (``_draft_loop``): choose a token
from the logits, feed it, repeat — no host involvement between positions, and on CUDA the whole loop is one
captured graph per (batch bucket, γ, KV bucket, sampling mode). Tokens are drawn from the draft's warped
distribution q — argmax for greedy rows — with counter-based noise keyed by (seed, position)
(``runtime.rng``), and q is returned (sparse top-k when ``q_top_k`` is set: the token is then drawn from
that truncated q, which keeps verification exact). A row stops early when the draft's confidence (its top
probability before warping) falls below ``confidence_threshold``; a stopped row rides along to the end of
the loop with its writes sent to the scratch column. Tokens, lengths and q come back in one copy.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from runtime import forward as fwd
from runtime import rng
from runtime.host_copy import fetch
from runtime.protocol import ProposalBatch, ProposeItem
from runtime.runner import ModelRunner, batch_bucket
from runtime.sampling import race, warp_probs


class DraftModelProposer:
    def __init__(self, model, *, max_slots: int, max_len: int, q_top_k: int | None = None,
                 confidence_threshold: float = 0.0, **runner_options):
        self.runner = ModelRunner(model, max_slots=max_slots, max_len=max_len, **runner_options)
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
        # Rows in slot order, so that a run of consecutive slots is read by attention as a view.
        active = sorted((b for b in range(len(items)) if gammas[b] > 0),
                        key=lambda b: self.runner.seqs[seq_ids[b]].slot)
        params = [items[b].sampling for b in active]
        sampled = any(not s.greedy for s in params)
        K = (self.q_top_k or self.vocab_size) if sampled else 0
        first = self.runner.forward([seq_ids[b] for b in active], [[]] * len(active), [1] * len(active))[:, 0]
        states = [self.runner.seqs[seq_ids[b]] for b in active]
        t_loop = time.perf_counter()
        out = self._draft_loop(first, [s.slot for s in states], [len(s.tokens) for s in states],
                               [gammas[b] for b in active], params, G, K)
        tokens, lengths, fed, *q = fetch(*out)  # the step's one read back
        fed_list = fed.tolist()
        for state, row, n in zip(states, tokens.tolist(), fed_list):
            state.cached.extend(row[:n])  # the drafts whose K/V the loop wrote
        self.runner.record(calls=G - 1, tokens_fed=sum(fed_list), seconds=time.perf_counter() - t_loop)

        index = torch.tensor(active, dtype=torch.long)
        batch.tokens = torch.zeros((len(items), G), dtype=torch.long).index_copy_(0, index, tokens)
        batch.lengths = torch.zeros(len(items), dtype=torch.long).index_copy_(0, index, lengths)
        if K:
            batch.q_ids = torch.zeros((len(items), G, K), dtype=torch.long).index_copy_(0, index, q[0])
            batch.q_probs = torch.zeros((len(items), G, K), dtype=torch.float32).index_copy_(0, index, q[1])
        batch.draft_seconds = time.perf_counter() - t0
        return batch

    def _draft_loop(self, first: torch.Tensor,  # [A, V] the draft's logits after each row's committed tokens
                    slots: list[int], positions: list[int], gammas: list[int], params, G: int, K: int
                    ) -> list[torch.Tensor]:  # tokens [A, G], lengths [A], fed [A] (+ q_ids, q_probs [A, G, K])
        """Draft G positions for A rows on the device: fixed input buffers, one graph on CUDA."""
        runner = self.runner
        A = len(slots)
        Ab = batch_bucket(A) if runner.pad_batch else A
        kv_len = runner.kv_len_bucket(max(positions) + G)
        truncate = any(not s.greedy and (0 < s.top_k < self.vocab_size or s.top_p < 1) for s in params)
        threshold = self.confidence_threshold
        run = slots == list(range(slots[0], slots[0] + A)) and slots[0] + Ab <= runner.pool.num_slots
        contiguous = slots[0] if run else None
        key = ("draft", Ab, G, K, kv_len, truncate, threshold, contiguous)
        bufs = runner.static_buffers(key, {"ints": ((Ab, 4 + 2 * G), torch.long),
                                           "floats": ((Ab, 2), torch.float32),
                                           "first": ((Ab, first.shape[-1]), first.dtype)})
        pad = Ab - A
        # Per row: slot, position of its first draft, γ, top-k, then the (seed, position) key of each draft.
        runner.upload(bufs["ints"], [[slot, pos, g, s.top_k,
                                      *(w for i in range(G) for w in rng.stream_key(s.seed, pos + i, rng.DRAFT_TOKEN))]
                                     for slot, pos, g, s in zip(slots, positions, gammas, params)]
                      + [[(slots[0] + A + i) if run else 0, *([0] * (3 + 2 * G))] for i in range(pad)])
        runner.upload(bufs["floats"], [[s.temperature, s.top_p] for s in params] + [[0.0, 1.0]] * pad)
        bufs["first"][:A].copy_(first)
        ints, floats = bufs["ints"], bufs["floats"]

        def loop():
            rows, pos0, gamma, top_k = ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3]
            keys = ints[:, 4:].view(Ab, G, 2)
            temperature, top_p = floats[:, 0], floats[:, 1]
            logits = bufs["first"]
            alive = gamma > 0
            lengths = torch.zeros_like(gamma)
            fed = torch.zeros_like(gamma)
            no_logit = torch.zeros((Ab, 1), dtype=torch.long, device=rows.device)
            tokens, q_ids, q_probs = [], [], []
            for i in range(G):
                if threshold and i > 0:
                    # An unsure draft token is likely rejected: the chain stops here.
                    alive = alive & (logits.float().softmax(-1).amax(-1) >= threshold)
                token, ids, ps = self._choose(logits, keys[:, i], temperature, top_k, top_p, K, truncate)
                tokens.append(torch.where(alive, token, 0))
                if K:
                    q_ids.append(torch.where(alive.unsqueeze(1), ids, 0))
                    q_probs.append(torch.where(alive.unsqueeze(1), ps, 0.0))
                lengths = lengths + alive.long()
                if i + 1 < G:
                    alive = alive & (i + 1 < gamma)
                    logits = fwd.forward(runner.model, runner.pool, runner.windows, rows, pos0 + i,
                                         token.unsqueeze(1), alive.long(), no_logit, kv_len, contiguous)[:, 0]
                    fed = fed + alive.long()
            out = [torch.stack(tokens, 1)[:A], lengths[:A], fed[:A]]
            if K:
                out += [torch.stack(q_ids, 1)[:A], torch.stack(q_probs, 1)[:A]]
            return out

        return runner.graphs.run(key, loop)

    def _choose(self, logits: torch.Tensor,  # [Ab, V]
                keys: torch.Tensor,  # [Ab, 2] this position's stream keys
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, K: int, truncate: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # token [Ab], q ids/probs [Ab, K]
        """The draft token of every row from q = warp(logits); greedy rows take the argmax (one-hot q)."""
        if not K:
            return logits.argmax(-1), None, None
        probs = warp_probs(logits.unsqueeze(1), temperature, top_k, top_p, truncate=truncate)[:, 0]  # [Ab, V]
        if self.q_top_k:
            ps, ids = probs.topk(K)
            ps = ps / ps.sum(-1, keepdim=True)
        else:
            ids = torch.arange(self.vocab_size, device=logits.device).expand_as(probs)
            ps = probs
        # Noise per vocabulary id, so a token's draw does not depend on where top-k ranked it.
        pick = race(ps, rng.exponential(keys.unsqueeze(1), ids))
        return ids.gather(1, pick.unsqueeze(1)).squeeze(1), ids, ps
