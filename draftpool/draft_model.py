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

``ProposeItem.branch`` b > 0 drafts another candidate chain of the same sequence (``draft_num``): a greedy
row's first token is the draft's (b+1)-th most likely one, a sampled row draws every token from a stream
keyed by the branch too; the chain then continues as usual.

With a node budget (``ProposeItem.nodes`` > 0: the γ policy's shape for the step) the proposal is a token
tree instead (``ProposalBatch.parents``, issue 15), grown by ``draftpool.draft_tree.TreeGrowth``: each level
is one batched ``ModelRunner.tree_forward`` of every row's frontier and its ancestors, with one read back of
the frontier's top-k tokens. The forward re-feeds the tree drafted so far rather than only the new level:
tree_forward writes nodes after the committed tokens in node order, so a level fed alone would need a mask
over earlier calls' node columns; re-feeding costs a few dozen draft tokens per level, which on the small
draft is close to a one-token forward (the forward's fixed costs dominate), and it keeps the draft's cache
exactly the committed tokens after the step (tree_forward records nothing else as cached, so the next
``sync`` compares against what the KV columns really hold). Tree tokens are deterministic (one-hot q, no
``q_ids``), exact for greedy and sampled rows; a batch holding a branch row drafts chains.

A constrained row (``ProposeItem.matcher``, structured outputs) draws from its q masked by its grammar,
advanced through the row's own drafts (``draftpool.grammar_draft.DraftMasks``): the loop then reads each
position's tokens back to advance the matchers, so it runs eagerly instead of as a captured graph, and a
batch holding a constrained row drafts chains.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from cluster import defaults as D
from draftpool.draft_tree import TreeGrowth
from draftpool.grammar_draft import DraftMasks
from runtime import forward as fwd
from runtime import rng
from runtime.host_copy import fetch
from runtime.protocol import ProposalBatch, ProposeItem
from runtime.runner import ModelRunner, batch_bucket
from runtime.sampling import race, sampling_tensors, warp_probs


def branch_stream(branch: int) -> int:
    """The ``rng`` stream of a sampled draft row's tokens: branch 0 draws from ``rng.DRAFT_TOKEN``, branch b
    from a stream of its own (above the 8 bits the verify streams use), so branches draw independently."""
    return rng.DRAFT_TOKEN + (branch << 8)


class DraftModelProposer:
    """``tree_top_k``: children per expanded node and nodes expanded per level of a token tree."""

    def __init__(self, model, *, max_slots: int, max_len: int, q_top_k: int | None = None,
                 confidence_threshold: float = 0.0, tree_top_k: int = D.TREE_TOP_K, **runner_options):
        if tree_top_k < 1:
            raise ValueError(f"need tree_top_k >= 1, got {tree_top_k}")
        self.runner = ModelRunner(model, max_slots=max_slots, max_len=max_len, **runner_options)
        self.vocab_size = self.runner.vocab_size
        self.q_top_k = q_top_k if q_top_k and q_top_k < self.vocab_size else None
        self.confidence_threshold = confidence_threshold
        self.tree_top_k = tree_top_k

    def release(self, seq_ids: Sequence[int]) -> None:
        self.runner.release(seq_ids)

    def propose(self, items: Sequence[ProposeItem]) -> ProposalBatch:
        t0 = time.perf_counter()
        seq_ids = [it.sync.seq_id for it in items]
        resync = [it.sync.seq_id for it in items if not self.runner.sync(it.sync)]
        # The draft stops one short of the context limit: the verifier needs room for the drafts too (and for
        # a forced run before them).
        gammas = [0 if it.sync.seq_id in resync else
                  max(0, min(it.gamma, self.runner.max_len - len(self.runner.seqs[it.sync.seq_id].tokens)
                             - len(it.forced) - 1))
                  for it in items]
        G = max(gammas, default=0)
        batch = ProposalBatch.empty(seq_ids, resync)
        if G == 0:
            return batch
        active = [b for b in range(len(items)) if gammas[b] > 0]
        params = [items[b].sampling for b in active]
        sampled = any(not s.greedy for s in params)
        branches = [items[b].branch for b in active]
        matchers = [items[b].matcher for b in active]
        constrained = any(m is not None for m in matchers)
        nodes = 0 if any(branches) or constrained else max(items[b].nodes for b in active)
        # A forced run is fed with the committed tail, so the chain is drafted after it.
        prefixes = [list(items[b].forced) for b in active]
        first = self.runner.forward([seq_ids[b] for b in active], prefixes, [1] * len(active))[:, 0]
        if nodes:
            self._draft_tree(batch, active, seq_ids, first, gammas, params, nodes)
            batch.draft_seconds = time.perf_counter() - t0
            return batch
        if any(branches):
            first = self._skip_first(first, branches, params)
        K = (self.q_top_k or self.vocab_size) if sampled else 0
        states = [self.runner.seqs[seq_ids[b]] for b in active]
        t_loop = time.perf_counter()
        masks = DraftMasks(matchers, self.vocab_size, prefixes) if constrained else None
        positions = [len(s.tokens) + len(p) for s, p in zip(states, prefixes)]  # each row's first draft
        # The loop writes the K/V of every draft it feeds: the first γ − 1 of each row.
        self.runner.reserve([seq_ids[b] for b in active], positions,
                            [p + gammas[b] - 1 for p, b in zip(positions, active)])
        out = self._draft_loop(first, states, positions, [gammas[b] for b in active], params, G, K,
                               branches, masks)
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
        batch.mask_seconds = masks.seconds if masks is not None else 0.0
        return batch

    @staticmethod
    def _skip_first(first: torch.Tensor,  # [A, V]
                    branches: list[int], params) -> torch.Tensor:  # [A, V]
        """Greedy rows of branch b > 0: the b most likely first tokens masked out, so the argmax is the draft's
        (b+1)-th choice (a sampled row's branch changes its random stream instead)."""
        skip = torch.tensor([b if s.greedy else 0 for b, s in zip(branches, params)], device=first.device)
        if not int(skip.max()):
            return first
        top = first.topk(int(skip.max()), dim=-1).indices  # [A, max b]
        masked = torch.arange(top.shape[1], device=first.device).unsqueeze(0) < skip.unsqueeze(1)
        values = torch.where(masked, float("-inf"), first.gather(1, top))
        return first.scatter(1, top, values)

    def _draft_tree(self, batch: ProposalBatch, active: list[int], seq_ids: list[int],
                    first: torch.Tensor,  # [A, V] the draft's logits after each active row's committed tokens
                    gammas: list[int], params, budget: int) -> None:
        """Grow every active row's tree (``TreeGrowth``) with one draft forward per level; fill ``batch``."""
        runner = self.runner
        ids = [seq_ids[b] for b in active]
        room = [runner.max_len - len(runner.seqs[s].tokens) - 1 for s in ids]
        trees = [TreeGrowth(max(1, min(budget, r)), gammas[b], min(self.tree_top_k, budget))
                 for b, r in zip(active, room)]
        dev = first.device
        greedy = torch.tensor([s.greedy for s in params], device=dev)
        temperature, top_k, top_p = sampling_tensors(params, dev)
        truncate = any(not s.greedy and (0 < s.top_k < self.vocab_size or s.top_p < 1) for s in params)
        rows = list(range(len(active)))  # the active rows still growing
        logits = first.unsqueeze(1)  # [R, F, V]: the logits after each growing row's frontier nodes
        while True:
            # Scored by what the row samples from: the warped q for sampled rows, the softmax for greedy ones.
            logp = logits.float().log_softmax(-1)
            if not all(s.greedy for s in params):
                sel = torch.tensor(rows, device=dev)
                warped = warp_probs(logits, temperature[sel], top_k[sel], top_p[sel], truncate=truncate).log()
                logp = torch.where(greedy[sel].view(-1, 1, 1), logp, warped)
            top_logp, top_ids = fetch(*logp.topk(trees[0].top_k, dim=-1))
            top_logp, top_ids = top_logp.tolist(), top_ids.tolist()
            for r, row in enumerate(rows):
                tree = trees[row]
                tree.expand([(top_ids[r][f], top_logp[r][f]) for f in range(len(tree.frontier))])
            rows = [row for row in rows if trees[row].frontier]
            if not rows:
                break
            fed = [trees[row].fed() for row in rows]
            out = runner.tree_forward([ids[row] for row in rows], [f[0] for f in fed], [f[1] for f in fed])
            F = max(len(f[2]) for f in fed)
            index = torch.tensor([[1 + i for i in f[2]] + [0] * (F - len(f[2])) for f in fed], device=out.device)
            logits = out.gather(1, index.unsqueeze(-1).expand(-1, -1, out.shape[-1]))

        results = [tree.result() for tree in trees]
        N = max(len(t) for _, t in results)
        batch.tokens = torch.zeros((len(batch.seq_ids), N), dtype=torch.long)
        batch.parents = torch.full((len(batch.seq_ids), N), -1, dtype=torch.long)
        batch.lengths = torch.zeros(len(batch.seq_ids), dtype=torch.long)
        for b, (parents, tokens) in zip(active, results):
            batch.tokens[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            batch.parents[b, : len(parents)] = torch.tensor(parents, dtype=torch.long)
            batch.lengths[b] = len(tokens)

    def _draft_loop(self, first: torch.Tensor,  # [A, V] the draft's logits after each row's committed tokens
                    states: list, positions: list[int], gammas: list[int], params, G: int, K: int,
                    branches: list[int], masks: DraftMasks | None = None
                    ) -> list[torch.Tensor]:  # tokens [A, G], lengths [A], fed [A] (+ q_ids, q_probs [A, G, K])
        """Draft G positions for A rows on the device: fixed input buffers, one graph on CUDA (eager when
        ``masks`` constrains rows: their matchers advance on the host between positions)."""
        runner = self.runner
        A = len(states)
        Ab = batch_bucket(A) if runner.pad_batch else A
        kv_len = runner.kv_len_bucket(max(positions) + G)
        NB = runner.table_width(kv_len)
        truncate = any(not s.greedy and (0 < s.top_k < self.vocab_size or s.top_p < 1) for s in params)
        threshold = self.confidence_threshold
        key = ("draft", Ab, G, K, kv_len, truncate, threshold)
        bufs = runner.static_buffers(key, {"ints": ((Ab, 3 + NB + 2 * G), torch.long),
                                           "floats": ((Ab, 2), torch.float32),
                                           "first": ((Ab, first.shape[-1]), first.dtype)})
        pad = Ab - A
        tables = [runner.table(state, NB) for state in states] + [[runner.pool.scratch] * NB] * pad
        contiguous = runner.table_run(tables)
        # Per row: position of its first draft, γ, top-k, its block table, then the (seed, position) key of
        # each draft.
        runner.upload(bufs["ints"], [[pos, g, s.top_k, *table,
                                      *(w for i in range(G) for w in rng.stream_key(s.seed, pos + i, branch_stream(br)))]
                                     for pos, g, s, br, table in zip(positions, gammas, params, branches, tables)]
                      + [[0, 0, 0, *tables[A + i], *([0] * (2 * G))] for i in range(pad)])
        runner.upload(bufs["floats"], [[s.temperature, s.top_p] for s in params] + [[0.0, 1.0]] * pad)
        bufs["first"][:A].copy_(first)
        ints, floats = bufs["ints"], bufs["floats"]

        def loop():
            pos0, gamma, top_k, rows = ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3: 3 + NB]
            keys = ints[:, 3 + NB:].view(Ab, G, 2)
            temperature, top_p = floats[:, 0], floats[:, 1]
            logits = bufs["first"]
            alive = gamma > 0
            lengths = torch.zeros_like(gamma)
            fed = torch.zeros_like(gamma)
            no_logit = torch.zeros((Ab, 1), dtype=torch.long, device=rows.device)
            tokens, q_ids, q_probs = [], [], []
            for i in range(G):
                if masks is not None:
                    logits = masks.apply(logits, alive)
                if threshold and i > 0:
                    # An unsure draft token is likely rejected: the chain stops here.
                    alive = alive & (logits.float().softmax(-1).amax(-1) >= threshold)
                token, ids, ps = self._choose(logits, keys[:, i], temperature, top_k, top_p, K, truncate)
                tokens.append(torch.where(alive, token, 0))
                if K:
                    q_ids.append(torch.where(alive.unsqueeze(1), ids, 0))
                    q_probs.append(torch.where(alive.unsqueeze(1), ps, 0.0))
                lengths = lengths + alive.long()
                if masks is not None:
                    alive = masks.advance(token, alive)
                if i + 1 < G:
                    alive = alive & (i + 1 < gamma)
                    logits = fwd.forward(runner.model, runner.pool, runner.windows, rows, pos0 + i,
                                         token.unsqueeze(1), alive.long(), no_logit, kv_len, contiguous)[:, 0]
                    fed = fed + alive.long()
            out = [torch.stack(tokens, 1)[:A], lengths[:A], fed[:A]]
            if K:
                out += [torch.stack(q_ids, 1)[:A], torch.stack(q_probs, 1)[:A]]
            return out

        if masks is not None:
            try:
                return loop()
            finally:
                masks.rollback()
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
