"""The grammar layer (``engine/grammar.py``, ``runtime/grammar.py``): compile, cache, limits, errors, and the
matcher's masks, rollback and forced tokens on the tiny tokenizer."""

from __future__ import annotations

import pytest
import torch

from engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, map_tokenizer
from runtime.grammar import allow_all, apply_mask, unpack
from tests.fixtures_tokenizer import tokenizer
from tests.unit.grammar_fixtures import PERSON, compiler

V = 384


def allowed(matcher, drafts=()) -> list[list[int]]:
    out = allow_all(len(drafts) + 1, V)
    matcher.fill_mask(out, drafts)
    return [row.nonzero().flatten().tolist() for row in unpack(out, V)]


def test_masks_follow_the_text_and_rollback_restores_the_state():
    tok = tokenizer()
    matcher = compiler().compile(GrammarSpec("json_schema", PERSON)).matcher()
    text = tok('{"name": "Ada", "age": 36, "tags": ["a"]}', add_special_tokens=False)["input_ids"]
    before = allowed(matcher)
    rows = allowed(matcher, text)  # one native call: now and after each prefix, state unchanged
    assert allowed(matcher) == before
    for i, token in enumerate(text):
        assert token in rows[i]
        assert allowed(matcher) == [rows[i]]
        assert matcher.consume([token])
    assert matcher.is_accepting and matcher.is_stopped and allowed(matcher) == [[tok.eos_token_id]]
    matcher.rollback(len(text))
    assert allowed(matcher) == before and not matcher.is_accepting


def test_forced_tokens_are_the_only_allowed_continuation():
    matcher = compiler().compile(GrammarSpec("json_schema", PERSON)).matcher()
    forced = matcher.forced_tokens()
    assert forced and allowed(matcher)[0] == [forced[0]]
    assert tokenizer().decode(forced).startswith("{")


def test_apply_mask_sets_exactly_the_disallowed_logits_to_minus_inf():
    mask = allow_all(2, 40)
    mask[0, 0] = 0b1010  # row 0: tokens 1 and 3 among the first 32, all of 32..39
    mask[1] = 0
    mask[1, 1] = 1 << 7  # row 1: token 39 only
    logits = apply_mask(torch.zeros(2, 40), mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 3, *range(32, 40)]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [39]


def test_compiled_grammars_are_cached_by_source_and_tokenizer():
    c = GrammarCompiler(map_tokenizer(tokenizer(), V))
    heard = []
    a = c.compile(GrammarSpec("regex", "[0-9]{4}"), lambda *o: heard.append(o))
    assert c.compile(GrammarSpec("regex", "[0-9]{4}"), lambda *o: heard.append(o)) is a
    assert (c.compiled, c.cache_hits) == (1, 1) and [o[0] for o in heard] == ["compiled", "cache_hit"]
    assert heard[0][1] > 0 and heard[1][1] is None
    assert c.compile(GrammarSpec("regex", "[0-9]{5}")) is not a
    # The same regex for another vocabulary size is another tokenizer: another entry in its own compiler.
    other = GrammarCompiler(map_tokenizer(tokenizer(), V + 32))
    assert other.compile(GrammarSpec("regex", "[0-9]{4}")).vocab_size == V + 32


@pytest.mark.parametrize("spec,says", [
    (GrammarSpec("json_schema", {"type": "nonsense"}), "invalid JSON schema at /type"),
    (GrammarSpec("json_schema", {"type": "string", "minimum": "ten"}), "invalid JSON schema at /minimum"),
    (GrammarSpec("json_schema", {"type": "array", "uniqueItems": True}), "Unimplemented"),
    (GrammarSpec("json_schema", {"$ref": "#/nowhere"}), "does not exist"),
    (GrammarSpec("json_schema", [1, 2]), "JSON object"),
    (GrammarSpec("regex", "[a-"), "invalid grammar"),
    (GrammarSpec("choice", []), "non-empty"),
    (GrammarSpec("grammar", "start: undefined_rule"), "invalid grammar"),
    (GrammarSpec("yaml", "x"), "unknown structured output kind"),
])
def test_bad_grammars_are_grammar_errors(spec, says):
    with pytest.raises(GrammarError, match=says):
        compiler().compile(spec)


def test_size_and_time_limits():
    tok = map_tokenizer(tokenizer(), V)
    big = {"type": "object", "properties": {f"key_{i}": {"type": "string"} for i in range(200)}}
    with pytest.raises(GrammarError, match="bytes; the limit is 1000"):
        GrammarCompiler(tok, max_bytes=1000).compile(GrammarSpec("json_schema", big))
    with pytest.raises(GrammarError, match="longer than 1e-06 s"):
        GrammarCompiler(tok, timeout_s=1e-6).compile(GrammarSpec("json_schema", big))


def test_choices_are_literal_strings():
    tok = tokenizer()
    choices = ["yes", "no", 'say "hi"\\n']
    matcher = compiler().compile(GrammarSpec("choice", choices)).matcher()
    assert matcher.consume(tok(choices[2], add_special_tokens=False)["input_ids"]) and matcher.is_stopped
    matcher.rollback(matcher_len := len(tok(choices[2], add_special_tokens=False)["input_ids"]))
    assert matcher_len and not matcher.consume(tok("maybe", add_special_tokens=False)["input_ids"])


def test_a_gguf_files_tokenizer_maps_like_its_folders():
    """transformers reads a GGUF file's vocabulary into a fast tokenizer: the grammar masks match the HF
    folder's exactly."""
    from runtime.models import load_tokenizer
    from tests.fixtures_gguf import gguf_pair

    spec = GrammarSpec("json_schema", PERSON)
    from_gguf = GrammarCompiler(map_tokenizer(load_tokenizer(gguf_pair().target), V)).compile(spec).matcher()
    from_folder = compiler().compile(spec).matcher()
    text = tokenizer()('{"name": "Ada", "age": 36, "tags": []}', add_special_tokens=False)["input_ids"]
    assert allowed(from_gguf, text) == allowed(from_folder, text)


def test_a_tokenizer_llguidance_cannot_read_is_a_grammar_error():
    from transformers import PreTrainedTokenizer

    class Slow(PreTrainedTokenizer):  # a Python ("slow") tokenizer: no byte-level vocabulary to hand over
        def get_vocab(self):
            return {}

    with pytest.raises(GrammarError, match="cannot be mapped"):
        map_tokenizer(Slow(), V)
