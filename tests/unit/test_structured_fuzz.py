"""A fuzz of generated JSON schemas through the grammar layer: each compiles or is a ``GrammarError`` (a 400
for the caller), nothing else; a sample of the compiled ones is decoded and every finished output validates."""

from __future__ import annotations

import functools
import json
import random

import jsonschema

from engine.engine import Request
from engine.grammar import GrammarError, GrammarSpec
from tests.fixtures_tokenizer import _loaded, tiny_pair, tokenizer
from tests.unit.grammar_fixtures import compiler
from tests.unit.helpers import make_engine

# Keywords llguidance does not implement, and values of the wrong kind: the fuzz must meet refusals too.
ODD = [("uniqueItems", True), ("not", {"type": "string"}), ("if", {}), ("type", "nonsense"), ("minimum", "ten"),
       ("$ref", "#/definitions/missing"), ("pattern", "[unclosed"), ("enum", [])]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kind = rng.choice(["object", "array", "string", "integer", "number", "boolean", "enum"] if depth < 3
                      else ["string", "integer", "boolean", "enum"])
    if kind == "object":
        props = {f"k{i}_{rng.randrange(100)}": random_schema(rng, depth + 1) for i in range(rng.randint(0, 4))}
        schema = {"type": "object", "properties": props, "additionalProperties": False,
                  "required": rng.sample(sorted(props), rng.randint(0, len(props)))}
    elif kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 4)}
    elif kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(0, 12)}
        if rng.random() < 0.3:
            schema["pattern"] = rng.choice(["^[a-z]+$", "^[0-9]{3}$", "^(yes|no)$"])
    elif kind == "integer":
        lo = rng.randint(-50, 50)
        schema = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    elif kind == "number":
        schema = {"type": "number", "minimum": 0, "maximum": 10}
    elif kind == "boolean":
        schema = {"type": "boolean"}
    else:
        schema = {"enum": rng.sample(["a", "b", 1, 2.5, None, True, "long value"], rng.randint(1, 4))}
    if rng.random() < 0.1:
        key, value = rng.choice(ODD)
        schema[key] = value
    return schema


@functools.lru_cache(maxsize=None)
def target():
    return _loaded(tiny_pair().target)[0], _loaded(tiny_pair().draft)[0]


def test_500_generated_schemas_compile_or_are_grammar_errors_and_decode_valid():
    rng = random.Random(31)
    compiled, refused = [], 0
    for _ in range(500):
        schema = random_schema(rng)
        try:
            compiled.append((schema, compiler().compile(GrammarSpec("json_schema", schema))))
        except GrammarError:
            refused += 1
    assert refused >= 10 and len(compiled) >= 300  # both outcomes met
    model, draft = target()
    engine = make_engine(model, draft, gamma=4, max_len=256, max_slots=32)
    prompt = tuple(tokenizer()("Please convert the following record to JSON:")["input_ids"])
    sample = compiled[:32]
    outs = engine.generate([Request(prompt, max_tokens=120, grammar=g) for _, g in sample])
    finished = [(schema, out) for (schema, _), out in zip(sample, outs) if out.finish_reason == "stop"]
    assert len(finished) >= 16
    for schema, out in finished:
        jsonschema.validate(json.loads(tokenizer().decode(list(out.tokens), skip_special_tokens=True)), schema)
