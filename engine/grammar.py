"""Structured outputs' one grammar backend: llguidance (issue 31).

``GrammarCompiler`` turns a ``GrammarSpec`` (a JSON schema, ``json_object``, a regex, a list of choices or a
Lark grammar) into a ``runtime.grammar.Grammar`` for one tokenizer, and ``Grammar.matcher()`` gives each
sequence its own ``runtime.grammar.Matcher``. Compilation runs on a worker thread with a time limit and a
size limit (``cluster/defaults.py``, the config's ``structured`` section) and its result is cached by a hash
of (grammar source, tokenizer): an invalid, oversized or slow grammar is a ``GrammarError`` for the caller
(HTTP 400), never work on the step thread. llguidance's own fuel limits bound what a matcher does per token.

Tokenizers: a Hugging Face fast tokenizer, which is also what transformers makes of a GGUF file's
vocabulary; anything else cannot be mapped to llguidance's byte-level view and is refused with a
``GrammarError`` saying so.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jsonschema
import llguidance
import torch

from cluster import defaults as D

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON as json.dumps writes it: no free whitespace (a model that pads with it wastes tokens, and the fixed
# separators are tokens the grammar forces); keywords llguidance does not implement are errors, not ignored.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


class GrammarError(ValueError):
    """A grammar that cannot be served: invalid, too large, too slow to compile, or no usable tokenizer."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. ``value``: the schema (dict) for json_schema, None for
    json_object, the pattern for regex, the list of strings for choice, the Lark text for grammar."""

    kind: str
    value: Any = None

    def source(self) -> str:
        """The llguidance grammar this spec compiles to."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        if self.kind == "json_schema":
            if not isinstance(self.value, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            # llguidance skips keywords that do not apply to a type without reading them ("minimum": "ten" on
            # a string): the metaschema of the schema's own draft refuses what is not a schema at all.
            try:
                jsonschema.validators.validator_for(self.value).check_schema(self.value)
            except jsonschema.SchemaError as exc:
                where = "/".join(str(p) for p in exc.absolute_path)
                raise GrammarError(f"invalid JSON schema at /{where}: {exc.message}") from None
            return llguidance.LLMatcher.grammar_from_json_schema(self.value, JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(self.value))
        if self.kind == "choice":
            if not self.value or not all(isinstance(c, str) and c for c in self.value):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            # Lark string literals read JSON's escapes, so any string is one literal.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(str(self.value))
        raise GrammarError(f"unknown structured output kind {self.kind!r}; use one of {', '.join(KINDS)}")


def map_tokenizer(hf_tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer whose model has ``vocab_size`` logits (ids past the
    tokenizer's own vocabulary are never allowed)."""
    try:
        backend = copy.copy(hf_tokenizer.backend_tokenizer)  # what llguidance.hf reads, without its padding
        backend.no_padding()
        backend.no_truncation()
        spec = json.loads(backend.to_str())
        # transformers' GGUF reader adds special tokens past the model's logits (``<|endoftext|>``): the model
        # cannot emit them, so llguidance's view leaves them out and its masks are the logits' width.
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < vocab_size]
        return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=hf_tokenizer.eos_token_id)
    except Exception as exc:  # a slow tokenizer, or one whose vocabulary llguidance cannot read as bytes
        raise GrammarError(f"this deployment's tokenizer ({type(hf_tokenizer).__name__}) cannot be mapped for "
                           f"structured outputs: {exc}") from None


class LLGuidanceMatcher:
    """``runtime.grammar.Matcher`` over one ``llguidance.LLMatcher``."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def consume(self, tokens: Sequence[int]) -> bool:
        return self._m.consume_tokens(list(tokens))

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar matcher could not roll back {n} tokens: {self._m.get_error()}")

    def fill_mask(self, out: torch.Tensor,  # [len(drafts) + 1, W] int32, contiguous, CPU
                  drafts: Sequence[int] = ()) -> None:
        # On the calling thread, row by row (microseconds each): llguidance's executor would fill the rows in
        # one call, but hands the work to its own thread pool, and on a CPU host whose cores torch's threads
        # keep busy that hand-off cost milliseconds per step. A draft is consumed only after its row's mask
        # allows it: consuming a refused token would leave the matcher in its error state for good.
        if out.shape[0] < len(drafts) + 1 or not out.is_contiguous() or out.dtype != torch.int32:
            raise ValueError(f"mask buffer {tuple(out.shape)} {out.dtype} cannot hold {len(drafts) + 1} rows")
        row_bytes = out.shape[1] * 4
        consumed = 0
        for i in range(len(drafts) + 1):
            self._m.unsafe_compute_mask_ptr(out[i].data_ptr(), row_bytes)
            if i == len(drafts) or self._m.is_stopped():
                break
            token = drafts[i]
            if not (int(out[i, token >> 5]) >> (token & 31)) & 1 or not self._m.consume_token(token):
                break
            consumed += 1
        self.rollback(consumed)

    def forced_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class CompiledGrammar:
    """One validated grammar for one tokenizer: a fresh matcher is copied from it per sequence (a copy costs
    microseconds; building a matcher from the source recompiles it)."""

    def __init__(self, kind: str, vocab_size: int, template: llguidance.LLMatcher):
        self.kind = kind
        self.vocab_size = vocab_size
        self._template = template
        self._lock = threading.Lock()  # requests arrive on several threads; the template is one object

    def matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            return LLGuidanceMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer, with the limits and an LRU cache; ``compiled`` and
    ``cache_hits`` count for the metrics."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, max_bytes: int = D.GRAMMAR_MAX_BYTES,
                 timeout_s: float = D.GRAMMAR_COMPILE_TIMEOUT_S, cache_size: int = D.GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.max_bytes, self.timeout_s, self.cache_size = max_bytes, timeout_s, cache_size
        self.vocab_size = tokenizer.vocab_size
        # The tokenizer's part of every cache key: its whole vocabulary, as llguidance sees it.
        self._fingerprint = hashlib.sha256(
            b"\0".join(tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size))).digest()
        # Two workers: one compilation past its time limit keeps running (native code cannot be interrupted;
        # llguidance's fuel limits end it) without blocking the next request's.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[bytes, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0
        self.cache_hits = 0

    def compile(self, spec: GrammarSpec,
                outcome: Callable[[str, float | None], None] | None = None) -> CompiledGrammar:
        """The grammar of ``spec`` (cached); raises ``GrammarError``. Blocks up to the time limit: call it
        off any loop that must stay responsive. ``outcome`` hears "cache_hit" or "compiled" with the seconds
        compilation took (the metrics' labels)."""
        try:
            source = spec.source()
        except ValueError as exc:  # llguidance's own complaint about a schema that is not a JSON object
            raise GrammarError(str(exc)) from None
        if len(source.encode()) > self.max_bytes:
            raise GrammarError(f"the grammar is {len(source.encode())} bytes; the limit is {self.max_bytes}")
        key = hashlib.sha256(self._fingerprint + source.encode()).digest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
        if hit is not None:
            if outcome is not None:
                outcome("cache_hit", None)
            return hit
        started = time.perf_counter()
        future = self._pool.submit(self._build, source)
        try:
            template = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the grammar took longer than {self.timeout_s:g} s to compile") from None
        seconds = time.perf_counter() - started
        grammar = CompiledGrammar(spec.kind, self.vocab_size, template)
        with self._lock:
            self.compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if outcome is not None:
            outcome("compiled", seconds)
        return grammar

    def _build(self, source: str) -> llguidance.LLMatcher:
        error = llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
        if error:
            raise GrammarError(f"invalid grammar: {error.strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error().strip()}")
        return matcher

