"""The verify stage: one target forward over every row's proposal, the acceptance rule, the commit.

For row b with committed tokens x and drafts d_1..d_γ, the target is fed the uncached tail of
x + d_1..d_γ and returns logits at the γ+1 positions that predict d_1..d_γ and the token after them.
``greedy_accept`` (all-greedy batches) or ``rejection_sample`` (or the opt-in ``threshold_accept``) picks
the accepted prefix plus one recovered/bonus token, and the verifier commits those to its copy of the
sequence. Rolling the KV cache back is implicit: the rejected drafts' K/V stay in the slot past the
committed length and are overwritten by the next forward.

A proposal that carries a token tree (``ProposalBatch.parents``, issue 15) is scored by one
``ModelRunner.tree_forward`` over every node; the same entry points, given the tree's ``parents``, pick the
accepted path plus one token, and ``ModelRunner.commit_paths`` moves the path's K/V to where a chain would
have written them. The outcome is the same as a chain's: the emitted tokens, with the tree's depth as the
positions proposed. Trees carry no draft q (one-hot q: the draft model's top-k trees, merged branch chains);
a tree with q is refused before any sync or forward.

Constrained rows (structured outputs, issue 31) come with their grammar's masks (``VerifyItem.mask``): the
target's logits are masked before anything else reads them — the argmax of greedy rows, the warp of sampled
ones — so both acceptance paths compare the masked p with the draft's masked q. Unconstrained rows pay nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from runtime import rng
from runtime.grammar import allow_all, mask_rows
from runtime.host_copy import fetch, to_device
from runtime.protocol import ProposalBatch, VerifyItem, VerifyOutcome
from runtime.runner import ModelRunner
from runtime.sampling import sampling_tensors, warp_probs
from runtime.token_tree import depths
from verifier.rejection import ROOT, Acceptance, adjust_threshold, greedy_accept, rejection_sample, threshold_accept


@dataclass
class AcceptanceConfig:
    mode: str = "exact"  # "exact" | "threshold" (lossy, opt-in)
    threshold: float = 0.9
    dynamic_adjust: bool = False
    target_rate: float = 0.7


def densify_q(proposal: ProposalBatch, rows: Sequence[int], vocab: int, device: torch.device | str = "cpu"
              ) -> torch.Tensor | None:  # [len(rows), G, V] float32 on ``device``
    """Sparse q of the selected proposal rows → dense, built on ``device``; None for all-greedy proposals."""
    if proposal.q_ids is None:
        return None
    index = torch.tensor(list(rows), dtype=torch.long)
    ids = to_device(proposal.q_ids[index], device)
    probs = to_device(proposal.q_probs[index].float(), device)
    dense = torch.zeros((*ids.shape[:2], vocab), dtype=torch.float32, device=device)
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
        self._check_tree(proposal, items)
        prop_row = {s: b for b, s in enumerate(proposal.seq_ids)}
        resync = [it.sync.seq_id for it in items if not self.runner.sync(it.sync)]
        live = [it for it in items if it.sync.seq_id not in resync]
        outcome = VerifyOutcome(seq_ids=[it.sync.seq_id for it in items], emitted=[[] for _ in items],
                                num_accepted=[0] * len(items), num_proposed=[0] * len(items), resync=resync)
        if not live:
            return outcome
        drafts, trees = [], []
        for it in live:
            b = prop_row.get(it.sync.seq_id)
            drafts.append(proposal.row_tokens(b) if b is not None else [])
            trees.append(proposal.row_parents(b) if b is not None else [])
        G = max(len(d) for d in drafts)
        ids = [it.sync.seq_id for it in live]
        prop_rows = [prop_row.get(it.sync.seq_id, 0) for it in live]
        if proposal.parents is not None and G:
            logits = self.runner.tree_forward(ids, trees, drafts)
            output, accepted, path = self._accept(live, drafts, trees, prop_rows, proposal, logits[:, : G + 1])
            # The step's one read back: emitted tokens, counts and accepted paths, O(B·nodes) integers.
            output, accepted, path = (t.tolist() for t in fetch(output, accepted, path))
            self.runner.commit_paths(ids, [p[:n] for p, n in zip(path, accepted)])
            proposed = [max(depths(t), default=-1) + 1 for t in trees]
        else:
            logits = self._masked(live, self.runner.forward(ids, drafts, [len(d) + 1 for d in drafts])[:, : G + 1])
            output, accepted, _ = self._accept(live, drafts, None, prop_rows, proposal, logits)
            # The step's one read back: emitted tokens and counts, O(B·γ) integers.
            output, accepted = fetch(output, accepted)
            output, accepted = output.tolist(), accepted.tolist()
            proposed = [len(d) for d in drafts]

        index = {s: i for i, s in enumerate(outcome.seq_ids)}
        for b, it in enumerate(live):
            n = accepted[b]
            emitted = output[b][: n + 1]
            i = index[it.sync.seq_id]
            outcome.emitted[i] = emitted
            outcome.num_accepted[i] = n
            outcome.num_proposed[i] = proposed[b]
            self.runner.seqs[it.sync.seq_id].tokens.extend(emitted)
        if self.acceptance.mode == "threshold" and self.acceptance.dynamic_adjust and sum(proposed):
            rate = sum(accepted) / sum(proposed)
            self.threshold = adjust_threshold(self.threshold, rate, self.acceptance.target_rate)
        outcome.cached = self.runner.take_hits(outcome.seq_ids)
        outcome.verify_seconds = time.perf_counter() - t0
        return outcome

    @staticmethod
    def _masked(live: Sequence[VerifyItem], logits: torch.Tensor,  # [B, G+1, V] on the runner's device
                ) -> torch.Tensor:  # [B, G+1, V], constrained rows' disallowed tokens at -inf
        """The grammar masks applied to the constrained rows only (positions past a row's drafts stay unmasked:
        nothing reads them)."""
        rows = [b for b, it in enumerate(live) if it.mask is not None]
        if not rows:
            return logits
        B, T, V = logits.shape
        masks = allow_all(len(rows) * T, V).view(len(rows), T, -1)
        for j, b in enumerate(rows):
            n = min(T, live[b].mask.shape[0])
            masks[j, :n] = live[b].mask[:n]
        return mask_rows(logits, rows, masks)

    def _check_tree(self, proposal: ProposalBatch, items: Sequence[VerifyItem]) -> None:
        """Refuse a tree this stage cannot verify exactly, before anything runs: a refused proposal costs no
        forward and leaves every cache as it was."""
        if proposal.parents is None:
            return
        if any(it.mask is not None for it in items):
            raise ValueError("a token-tree proposal cannot carry constrained rows: grammar masks follow chains")
        if proposal.q_ids is not None:
            raise ValueError("a token-tree proposal must carry no draft q (q_ids/q_probs None): trees are verified "
                             "with one-hot q, which is exact for any proposal drawn independently of the verifier")

    def _accept(self, live: Sequence[VerifyItem], drafts: list[list[int]], parents: list[list[int]] | None,
                prop_rows: list[int], proposal: ProposalBatch,
                logits: torch.Tensor,  # [B, N+1, V] on the runner's device
                ) -> Acceptance:  # output [B, N+1], num_accepted [B], path [B, N], on the device
        """The acceptance rule where the logits are: nothing of size V leaves the device. ``parents`` None:
        every row is a chain; otherwise row b is the tree ``parents[b]`` over the nodes ``drafts[b]``.

        All-greedy batches compare argmaxes (``greedy_accept``: no softmax over the vocabulary). Otherwise p is
        warped on the device and the rule draws its coins and its noise from each row's counter-based stream
        (``runtime.rng``), keyed by (seed, committed length): the same draws whatever the batch or device, and
        for a tree the same as for a chain (one coin per node, counter = node index).
        """
        B, N = len(live), logits.shape[1] - 1
        dev = logits.device

        def pad(xs: list[int], fill: int) -> list[int]:
            return xs + [fill] * (N - len(xs))

        # One host-to-device copy: per row the tokens, a tree's parents, the number of drafts.
        rows = [pad(d, 0) + [len(d)] for d in drafts] if parents is None else \
            [pad(d, 0) + pad(p, ROOT) + [len(d)] for d, p in zip(drafts, parents)]
        rows = to_device(torch.tensor(rows, dtype=torch.long).view(B, -1), dev)
        draft_tokens, num_draft = rows[:, :N], rows[:, -1]
        tree_parents = None if parents is None else rows[:, N : 2 * N]  # [B, N]
        threshold = self.acceptance.mode == "threshold"
        if all(it.sampling.greedy for it in live) and not threshold:
            return greedy_accept(draft_tokens, num_draft, logits.argmax(-1), parents=tree_parents)
        target_probs, noise, coin_keys = self._target_draws(live, logits)
        if threshold:
            return threshold_accept(draft_tokens, num_draft, target_probs,
                                    torch.full((B,), self.threshold, device=dev), noise, parents=tree_parents)
        uniform = rng.uniform(coin_keys, torch.arange(N, device=dev))
        # Trees carry no q (_check_tree refused one): densify_q gives None for them.
        q = densify_q(proposal, prop_rows, logits.shape[-1], dev) if N else None
        if q is not None:
            q = q[:, :N]
        return rejection_sample(draft_tokens, num_draft, target_probs, q, uniform, noise, parents=tree_parents)

    def _target_draws(self, live: Sequence[VerifyItem], logits: torch.Tensor,  # [B, T, V]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # p [B, T, V], noise [B, V], keys [B, 1, 2]
        """The warped target distributions, each row's Exp(1) noise and its coin keys, from the row's
        counter-based streams keyed by (seed, committed length)."""
        dev = logits.device
        params = [it.sampling for it in live]
        temperature, top_k, top_p = sampling_tensors(params, dev)
        truncate = any(not s.greedy and (0 < s.top_k < self.vocab_size or s.top_p < 1) for s in params)
        target_probs = warp_probs(logits, temperature, top_k, top_p, truncate=truncate)
        seeds = [s.seed for s in params]
        positions = [len(self.runner.seqs[it.sync.seq_id].tokens) for it in live]
        vocab = torch.arange(logits.shape[-1], device=dev)
        noise = rng.exponential(rng.stream_keys(seeds, positions, rng.VERIFY_NOISE, dev).unsqueeze(1), vocab)
        return target_probs, noise, rng.stream_keys(seeds, positions, rng.VERIFY_COIN, dev).unsqueeze(1)
