"""The draft's side of structured outputs (issue 31): each constrained row samples from its q masked by its
grammar, the grammar advanced through the row's own drafts.

Exactness needs the q the verifier divides by to be the q the token was drawn from: both masked by the same
grammar state. A draft cut at the first token its grammar refuses, with the unmasked q kept in the ratio, is
biased (``tests/unit/test_grammar_spec.py`` shows the χ² test catching it); masking q is not.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from runtime.grammar import Matcher, allow_all, mask_rows


class DraftMasks:
    """The matchers of one draft loop's rows (None: unconstrained), first advanced through each row's forced run
    (``prefixes``: the chain is drafted after it), then position by position; ``rollback`` restores each to its
    committed state. ``seconds``: time spent filling and applying masks."""

    def __init__(self, matchers: Sequence[Matcher | None], vocab: int, prefixes: Sequence[Sequence[int]]):
        self.matchers = list(matchers)
        self.rows = [r for r, m in enumerate(self.matchers) if m is not None]
        self.consumed = [0] * len(self.matchers)
        self.vocab = vocab
        self.seconds = 0.0
        for r in self.rows:
            if prefixes[r]:
                if not self.matchers[r].consume(prefixes[r]):
                    raise RuntimeError(f"the grammar refuses the run {list(prefixes[r])} it forced")
                self.consumed[r] = len(prefixes[r])

    def apply(self, logits: torch.Tensor,  # [Ab, V] the next position's draft logits (Ab ≥ rows)
              alive: torch.Tensor,  # [Ab] bool, rows still drafting
              ) -> torch.Tensor:  # [Ab, V], constrained live rows masked
        t0 = time.perf_counter()
        live = alive.tolist()
        rows = [r for r in self.rows if live[r]]
        if rows:
            masks = allow_all(len(rows), self.vocab)
            for j, r in enumerate(rows):
                self.matchers[r].fill_mask(masks[j : j + 1])
            logits = mask_rows(logits, rows, masks)
        self.seconds += time.perf_counter() - t0
        return logits

    def advance(self, token: torch.Tensor,  # [Ab] int64, the tokens just drafted
                alive: torch.Tensor,  # [Ab] bool, rows that drafted them
                ) -> torch.Tensor:  # [Ab] bool: also false where the grammar has finished
        t0 = time.perf_counter()
        tokens, live = token.tolist(), alive.tolist()
        done = []
        for r in self.rows:
            if not live[r]:
                continue
            matcher = self.matchers[r]
            if not matcher.consume([tokens[r]]):
                # Drawn from the masked q, the token is one the grammar allows: this is a bug, and the
                # matcher (the sequence's own) would be left in its error state.
                raise RuntimeError(f"the draft drew token {tokens[r]}, which its grammar refuses")
            self.consumed[r] += 1
            if matcher.is_stopped:
                done.append(r)  # nothing can follow (only EOS): the chain ends here
        if done:
            alive = alive.clone()
            alive[torch.tensor(done, device=alive.device)] = False
        self.seconds += time.perf_counter() - t0
        return alive

    def rollback(self) -> None:
        for r in self.rows:
            self.matchers[r].rollback(self.consumed[r])
            self.consumed[r] = 0
