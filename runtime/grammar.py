"""What both stages need of a grammar constraint (structured outputs, issue 31): the matcher protocol and
the token masks it fills.

A constrained sequence carries a ``Grammar`` (compiled once, shared by every request that asks for it); the
engine gives each sequence its own ``Matcher``, advanced only on committed tokens. The draft advances it
through its own proposed tokens and rolls it back before returning; the verifier receives the γ + 1 masks the
engine filled from it. The one backend is llguidance (``engine/grammar.py``); the protocol is narrow so that
another could be added beside it.

Masks are llguidance's packed form: int32 words, bit j of word w allows token 32·w + j, so a row is
⌈V / 32⌉ words. Applying one sets the disallowed logits to −inf *before* temperature, top-k and top-p: the
law served is then the target's masked and renormalised one, on every path (plain, greedy, sampled,
speculative), as target-only constrained decoding has it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from runtime.host_copy import to_device

BITS = 32


def mask_words(vocab: int) -> int:
    """int32 words of one mask row over ``vocab`` tokens."""
    return (vocab + BITS - 1) // BITS


def allow_all(rows: int, vocab: int) -> torch.Tensor:  # [rows, W] int32, every bit set
    return torch.full((rows, mask_words(vocab)), -1, dtype=torch.int32)


_SHIFTS: dict[torch.device, torch.Tensor] = {}  # per device: 0 … 31, the bit of each token in its word


def _shifts(device: torch.device) -> torch.Tensor:  # [32] int32
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(BITS, device=device, dtype=torch.int32)
    return shifts


def refused(mask: torch.Tensor,  # [..., W] int32 packed allowed-token bits
            vocab: int) -> torch.Tensor:  # [..., vocab] bool, True where the token is not allowed
    if mask.device.type == "cpu":
        # numpy reads the words' bytes (little-endian: token 32·w + j is bit j of word w) in one pass instead of
        # shifting every word 32 ways into temporaries; on a device the shifts run in one kernel.
        words = np.ascontiguousarray(mask.numpy(), dtype="<i4").view(np.uint8)
        return torch.from_numpy(np.unpackbits(words, axis=-1, bitorder="little")[..., :vocab] == 0)
    return ((mask.unsqueeze(-1) >> _shifts(mask.device)) & 1).flatten(-2)[..., :vocab] == 0


def unpack(mask: torch.Tensor,  # [..., W] int32 packed allowed-token bits
           vocab: int) -> torch.Tensor:  # [..., vocab] bool, True where the token is allowed
    return ~refused(mask, vocab)


def apply_mask(logits: torch.Tensor,  # [..., V] float, masked in place
               mask: torch.Tensor,  # [..., W] int32 on logits' device
               ) -> torch.Tensor:  # logits: disallowed tokens at -inf
    return logits.masked_fill_(refused(mask, logits.shape[-1]), float("-inf"))


def mask_rows(logits: torch.Tensor,  # [B, ..., V] float, masked in place
              rows: Sequence[int],  # the constrained rows of logits, ascending
              masks: torch.Tensor,  # [len(rows), ..., W] int32, CPU
              ) -> torch.Tensor:  # logits: those rows' disallowed tokens at -inf, the others as they were
    """The one place both stages mask logits: the draft per position, the verifier over γ + 1 positions. In
    place: both hand it logits of a forward that nothing else reads."""
    masks = to_device(masks, logits.device)
    with torch.inference_mode():  # the forwards' logits are inference tensors
        if len(rows) == logits.shape[0]:  # every row constrained (batch 1 among them): no gather, no scatter
            return apply_mask(logits, masks)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return logits.index_copy_(0, index, apply_mask(logits.index_select(0, index), masks))


class Matcher(Protocol):
    """One sequence's grammar state. ``consume`` advances it by tokens, ``rollback(n)`` undoes the last n;
    ``fill_mask(out, drafts)`` writes into ``out`` ([len(drafts) + 1, W] int32, CPU) the allowed tokens now and
    after each prefix of ``drafts``, leaving the matcher where it was (rows past a draft the grammar refuses
    are left as they were: nothing after a refused draft is ever read)."""

    def consume(self, tokens: Sequence[int]) -> bool: ...

    def rollback(self, n: int) -> None: ...

    def fill_mask(self, out: torch.Tensor, drafts: Sequence[int] = ()) -> None: ...

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows next with no alternative (a run of them; may be empty)."""

    @property
    def is_accepting(self) -> bool: ...

    @property
    def is_stopped(self) -> bool:
        """Accepting with no continuation: the sequence is finished (only EOS could follow)."""


class Grammar(Protocol):
    """A compiled grammar for one tokenizer; every request that asks for it shares it."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar" (metrics' label)
    vocab_size: int  # the model's logits its masks cover

    def matcher(self) -> Matcher: ...
