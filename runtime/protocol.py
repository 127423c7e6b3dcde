"""Messages exchanged by the step's stages, and the proposer protocol.

The router (or the in-process engine) owns every sequence's committed tokens. Each stage — the proposer
and the verifier — keeps its own copy plus a KV cache, and is told per step only what changed:
``base`` (how many of the committed tokens it already holds and that are still valid) and ``tokens``
(the committed tokens after ``base``). A stage that does not hold ``base`` tokens of a sequence (it is
new, it restarted, it evicted the sequence) answers with ``resync`` and is sent the whole history. So
stage state is a cache, never a source of truth: losing a replica costs a re-prefill, never a token.

These dataclasses are plain Python + torch so that ``runtime.wire`` can encode them for msgpack and the
in-process engine can pass them by reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from runtime.grammar import Matcher


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy (then top_p/top_k are irrelevant)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class SyncItem:
    """What a stage needs to bring its copy of one sequence up to date."""

    seq_id: int
    base: int  # committed tokens the stage should already hold
    tokens: tuple[int, ...]  # committed tokens after ``base`` (the whole history when base == 0)


@dataclass(frozen=True)
class ProposeItem:
    sync: SyncItem
    gamma: int  # draft tokens wanted; 0 asks the proposer only to sync
    sampling: SamplingParams = GREEDY
    # Which of several candidate chains of the sequence this row drafts (``draft_num``: one per draft replica,
    # merged into a tree by the router). 0 is the proposer's usual chain; branch b > 0 starts elsewhere —
    # the draft's (b+1)-th most likely first token (greedy), a draw from a stream keyed by the branch
    # (sampled), the n-gram proposer's b-th distinct continuation. Branch rows are verified with one-hot q.
    branch: int = 0
    # A constrained row's grammar state at its committed tokens (in-process stages only: ``runtime.wire``
    # carries no matcher). The draft samples from its q masked by it, advanced through its own proposed
    # tokens and rolled back before the proposal returns; a batch with a constrained row drafts chains.
    matcher: Matcher | None = None
    # Tokens the row's grammar forces next (structured outputs): the engine proposes them itself; the proposer
    # drafts its ``gamma`` tokens after them and returns only those (in-process stages only, like ``matcher``).
    forced: tuple[int, ...] = ()
    # The node budget of the step's token tree (0: a chain of ``gamma``), one value for the whole proposal: the
    # γ policy's shape for the micro-batch (``GammaPolicy.decide``). Draft-model proposers only; a batch with a
    # branch or a constrained row drafts chains.
    nodes: int = 0


@dataclass
class ProposalBatch:
    """γ_b draft tokens per row, padded to G = max γ_b.

    ``q_ids``/``q_probs`` are the proposal distribution q in sparse form (K support ids per position;
    K = vocab size means dense). They are ``None`` when every row was drafted greedily: greedy drafts are
    verified against a one-hot q, which needs no data. A row drafted greedily inside a sampled batch
    carries a one-hot q (K entries, one of which holds 1.0).

    ``parents`` makes every row a token tree (issue 15, ``runtime.token_tree``): row b's ``lengths[b]`` tokens
    are nodes in topological order and ``parents[b, i]`` is node i's parent (-1: a child of the last
    committed token). A chain is the tree ``[-1, 0, 1, ...]``; ``None`` means chains (trees come from the draft
    model with ``tree_nodes`` and from the engine's merge of ``draft_num`` branches). ``runtime.wire`` carries
    trees (a tree's width is bounded by ``WireLimits.tree_nodes``).
    """

    seq_ids: list[int]
    tokens: torch.Tensor  # [B, G] int64, zero beyond lengths
    lengths: torch.Tensor  # [B] int64, 0 <= lengths[b] <= G
    q_ids: torch.Tensor | None = None  # [B, G, K] int64
    q_probs: torch.Tensor | None = None  # [B, G, K] float32
    parents: torch.Tensor | None = None  # [B, G] int64, -1 beyond lengths
    resync: list[int] = field(default_factory=list)  # seq_ids the proposer could not sync
    draft_seconds: float = 0.0  # time spent in draft forwards for this batch
    mask_seconds: float = 0.0  # of which filling grammar masks (constrained rows)

    @staticmethod
    def empty(seq_ids: Sequence[int], resync: Sequence[int] = ()) -> "ProposalBatch":
        n = len(seq_ids)
        return ProposalBatch(
            seq_ids=list(seq_ids),
            tokens=torch.zeros((n, 0), dtype=torch.long),
            lengths=torch.zeros(n, dtype=torch.long),
            resync=list(resync),
        )

    def row_tokens(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.lengths[b])].tolist()

    def row_parents(self, b: int) -> list[int]:
        """Row b's tree (for chains too: ``[-1, 0, 1, ...]``)."""
        n = int(self.lengths[b])
        return list(range(-1, n - 1)) if self.parents is None else self.parents[b, :n].tolist()

    def select(self, seq_ids: Sequence[int]) -> "ProposalBatch":
        """The rows of ``seq_ids`` (each must be a row of this batch), in that order."""
        if list(seq_ids) == self.seq_ids:
            return self
        row = {s: b for b, s in enumerate(self.seq_ids)}
        rows = torch.tensor([row[s] for s in seq_ids], dtype=torch.long)
        keep = set(seq_ids)
        return ProposalBatch(
            seq_ids=list(seq_ids),
            tokens=self.tokens[rows],
            lengths=self.lengths[rows],
            q_ids=None if self.q_ids is None else self.q_ids[rows],
            q_probs=None if self.q_probs is None else self.q_probs[rows],
            parents=None if self.parents is None else self.parents[rows],
            resync=[s for s in self.resync if s in keep],
            draft_seconds=self.draft_seconds,
            mask_seconds=self.mask_seconds,
        )

    @staticmethod
    def concat(batches: Sequence["ProposalBatch"]) -> "ProposalBatch":
        """The rows of ``batches`` (disjoint sequences) in one batch, in their order: tokens padded to the
        widest, q written out one-hot where a batch sent none while another sent q (what "no q" means), chains
        written as trees where another batch holds trees. Drafted side by side: the slowest one's seconds."""
        if len(batches) == 1:
            return batches[0]
        seq_ids = [s for b in batches for s in b.seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("ProposalBatch.concat: a sequence is in more than one batch")
        n, width = len(seq_ids), max(b.tokens.shape[1] for b in batches)
        with_q = [b for b in batches if b.q_ids is not None]
        K = max((b.q_ids.shape[-1] for b in with_q), default=0)
        trees = any(b.parents is not None for b in batches)
        tokens = torch.zeros((n, width), dtype=torch.long)
        q_ids = torch.zeros((n, width, K), dtype=torch.long) if with_q else None
        q_probs = torch.zeros((n, width, K), dtype=torch.float32) if with_q else None
        parents = torch.full((n, width), -1, dtype=torch.long) if trees else None
        row = 0
        for b in batches:
            rows, g = slice(row, row + len(b.seq_ids)), b.tokens.shape[1]
            tokens[rows, :g] = b.tokens
            if q_ids is not None and b.q_ids is not None:
                q_ids[rows, :g, : b.q_ids.shape[-1]], q_probs[rows, :g, : b.q_ids.shape[-1]] = b.q_ids, b.q_probs
            elif q_ids is not None:
                q_ids[rows, :g, 0], q_probs[rows, :g, 0] = b.tokens, 1.0
            if parents is not None:
                for i in range(len(b.seq_ids)):
                    tree = b.row_parents(i)
                    parents[row + i, : len(tree)] = torch.tensor(tree, dtype=torch.long)
            row += len(b.seq_ids)
        return ProposalBatch(seq_ids=seq_ids, tokens=tokens, lengths=torch.cat([b.lengths for b in batches]),
                             q_ids=q_ids, q_probs=q_probs, parents=parents,
                             resync=[s for b in batches for s in b.resync],
                             draft_seconds=max(b.draft_seconds for b in batches),
                             mask_seconds=max(b.mask_seconds for b in batches))


@dataclass(frozen=True)
class VerifyItem:
    sync: SyncItem
    sampling: SamplingParams = GREEDY
    # A constrained row's allowed tokens before its first draft and after each ([drafts + 1, W] int32, packed
    # as in ``runtime.grammar``; in-process stages only): applied to the target's logits before the warp.
    mask: torch.Tensor | None = None


@dataclass
class VerifyOutcome:
    """Per row: the tokens the step emitted (accepted drafts then one recovered/bonus token)."""

    seq_ids: list[int]
    emitted: list[list[int]]  # accepted draft tokens + 1 recovered or bonus token; [] for resync rows
    num_accepted: list[int]  # accepted draft tokens per row
    num_proposed: list[int]  # draft positions verified per row: the drafts of a chain, a tree's depth
    resync: list[int] = field(default_factory=list)  # seq_ids the verifier could not sync
    verify_seconds: float = 0.0
    cached: list[int] = field(default_factory=list)  # per row: tokens this step's sync took from the prefix cache


class Proposer(Protocol):
    """Anything that proposes draft tokens for a batch of sequences (draft model, n-gram, remote pool).

    Proposers know nothing about acceptance: they learn what was accepted only through the next
    ``SyncItem`` (whatever it does not match of what they drafted is rolled back).
    """

    def propose(self, items: Sequence[ProposeItem]) -> ProposalBatch: ...

    def release(self, seq_ids: Sequence[int]) -> None: ...
