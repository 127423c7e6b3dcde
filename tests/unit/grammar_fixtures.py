"""Grammars over the tiny tokenizer of ``tests/fixtures_tokenizer.py`` and the reference that constrained
decoding must match: the target alone, HF forward, its logits masked by the grammar, greedy."""

from __future__ import annotations

import functools

import torch

from engine.grammar import GrammarCompiler, map_tokenizer
from runtime.grammar import allow_all, apply_mask
from tests.fixtures_tokenizer import tiny_pair, tokenizer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}}}


@functools.lru_cache(maxsize=None)
def compiler() -> GrammarCompiler:
    return GrammarCompiler(map_tokenizer(tokenizer(), tiny_pair().vocab_size))


def masked_greedy(model, prompt, grammar, max_new: int, eos: int = 1) -> tuple[int, ...]:
    """Target-only constrained greedy decoding, one token per full forward (no KV cache, no engine)."""
    matcher, tokens, out = grammar.matcher(), list(prompt), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        mask = allow_all(1, grammar.vocab_size)
        matcher.fill_mask(mask)
        token = int(apply_mask(logits, mask[0]).argmax())
        out.append(token)
        tokens.append(token)
        if token == eos:
            break
        assert matcher.consume([token])
        if matcher.is_stopped:
            break
    return tuple(out)
