"""Structured outputs through the engine, greedy: token-identical to target-only constrained greedy decoding
(``grammar_fixtures.masked_greedy``) for every γ, proposer, batch mix and with or without forced tokens; the
grammar's forced runs count apart from model drafts; a finished grammar ends the request with "stop"."""

from __future__ import annotations

import functools
import json

import pytest

from engine.engine import Done, Request
from engine.grammar import GrammarSpec
from runtime import wire
from runtime.protocol import SamplingParams
from tests.fixtures_tokenizer import _loaded, reference, tiny_pair, tokenizer
from tests.unit.grammar_fixtures import PERSON, compiler, masked_greedy
from tests.unit.helpers import make_engine

MAX_NEW = 40
PROMPTS = ["Please convert the following record to JSON:", "The quick brown fox", "def add(a, b):"]
GRAMMARS = {"person": GrammarSpec("json_schema", PERSON),
            "date": GrammarSpec("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"),
            "choice": GrammarSpec("choice", ["yes", "no", "maybe later"])}


@functools.lru_cache(maxsize=None)
def models():
    pair = tiny_pair()
    return _loaded(pair.target)[0], _loaded(pair.draft)[0]


def ids(text: str) -> tuple[int, ...]:
    return tuple(tokenizer()(text)["input_ids"])


@functools.lru_cache(maxsize=None)
def expected(prompt: str, grammar: str | None) -> tuple[int, ...]:
    if grammar is None:
        return reference(prompt, MAX_NEW)[0]
    return masked_greedy(models()[0], ids(prompt), compiler().compile(GRAMMARS[grammar]), MAX_NEW)


# A batch mix: constrained rows of each kind beside an unconstrained one.
MIX = [(PROMPTS[0], "person"), (PROMPTS[1], "person"), (PROMPTS[2], "date"), (PROMPTS[1], "choice"), (PROMPTS[0], None)]


def requests(mix, sampling=None):
    return [Request(ids(p), max_tokens=MAX_NEW, grammar=compiler().compile(GRAMMARS[g]) if g else None,
                    sampling=sampling or SamplingParams()) for p, g in mix]


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("draft", ["model", "ngram"])
@pytest.mark.parametrize("forced", [True, False], ids=["forced", "no-forced"])
def test_constrained_speculative_greedy_is_target_only_constrained_greedy(gamma, draft, forced):
    target, draft_model = models()
    engine = make_engine(target, draft_model if draft == "model" else "ngram", gamma=gamma, max_len=256,
                         forced_tokens=forced)
    outs = engine.generate(requests(MIX))
    for (prompt, grammar), out in zip(MIX, outs):
        assert out.tokens == expected(prompt, grammar), (prompt, grammar)
    assert (engine.stats.forced > 0) == forced
    if draft == "model":
        assert engine.stats.accepted > 0, "the draft model's own drafts must be verified too"


def test_plain_micro_batched_adaptive_and_sampled_neighbours():
    """Target-only constrained decoding, two micro-batches with the adaptive γ, and greedy constrained rows
    beside sampled constrained rows: the greedy rows are the reference's tokens in every case."""
    target, draft_model = models()
    for kw in ({"speculate": False}, {"micro_batches": 2, "adaptive": True}):
        outs = make_engine(target, draft_model, gamma=4, max_len=256, **kw).generate(requests(MIX))
        assert [o.tokens for o in outs] == [expected(p, g) for p, g in MIX], kw
    engine = make_engine(target, draft_model, gamma=4, max_len=256)
    sampled = requests(MIX[:3], SamplingParams(temperature=0.8, top_k=20, seed=5))
    outs = engine.generate(requests(MIX) + sampled)
    assert [o.tokens for o in outs[: len(MIX)]] == [expected(p, g) for p, g in MIX]


def test_forced_runs_are_free_drafts_counted_apart():
    target, draft_model = models()
    engine = make_engine(target, draft_model, gamma=4, max_len=256)
    out = engine.generate(requests(MIX[:1]))[0]
    text = tokenizer().decode(list(out.tokens))
    assert text.startswith('{"name": "') and out.finish_reason == "stop"
    # {"name": " … ", "age": … ", "tags": […]}: the keys, quotes and separators are the grammar's own tokens.
    assert out.stats.forced >= 5 and out.stats.emitted == len(out.tokens) and 0 < out.stats.forced_share < 1
    # Forced tokens are neither proposed nor accepted drafts: the draft's acceptance figures exclude them.
    assert out.stats.forced + out.stats.accepted + out.stats.steps >= len(out.tokens) > out.stats.accepted


def test_a_finished_grammar_stops_and_max_tokens_stays_length():
    target, draft_model = models()
    engine = make_engine(target, draft_model, gamma=4, max_len=256)
    choice = compiler().compile(GRAMMARS["choice"])
    person = compiler().compile(GRAMMARS["person"])
    done, cut = engine.generate([Request(ids(PROMPTS[1]), max_tokens=MAX_NEW, grammar=choice),
                                 Request(ids(PROMPTS[0]), max_tokens=3, grammar=person)])
    assert done.finish_reason == "stop" and tokenizer().decode(list(done.tokens)) in GRAMMARS["choice"].value
    assert cut.finish_reason == "length" and len(cut.tokens) == 3


class WireStages:
    """In-process stages behind the wire format, as remote stages are reached: every call and answer is encoded
    and decoded (``runtime.wire``), so the draft gets no matcher (it drafts unmasked after the forced run) and
    the verifier gets the masks from the frame."""

    def __init__(self, stages, limits):
        self.stages, self.limits = stages, limits

    def submit_propose(self, items, shard=0):
        decoded = wire.decode_propose(wire.encode_propose(items), self.limits)
        assert all(it.matcher is None for it in decoded)
        proposal = self.stages.proposer.propose(decoded)
        return Done(wire.decode_proposal(wire.encode_proposal(proposal), self.limits))

    def submit_verify(self, items, proposal, shard=0):
        outcome = self.stages.verifier.verify(*wire.decode_verify(wire.encode_verify(items, proposal), self.limits))
        return Done(wire.decode_outcome(wire.encode_outcome(outcome), self.limits))

    def release(self, seq_ids, shard=0):
        self.stages.release(seq_ids, shard)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_constrained_decoding_through_the_wire_format(draft):
    target, draft_model = models()
    engine = make_engine(target, draft_model if draft == "model" else "ngram", gamma=4, max_len=256)
    engine.stages = WireStages(engine.stages, wire.WireLimits(vocab_size=tiny_pair().vocab_size, gamma_max=8,
                                                              max_batch=16, max_seq_len=256))
    # Sampled rows whose step is all forced tokens must carry q too. (The n-gram proposer sends no q at all,
    # which a verify frame refuses for sampled rows whatever the grammar: greedy rows only there.)
    sampled = requests(MIX[:3], SamplingParams(temperature=0.8, top_k=20, seed=5)) if draft == "model" else []
    outs = engine.generate(requests(MIX) + sampled)
    assert [o.tokens for o in outs[: len(MIX)]] == [expected(p, g) for p, g in MIX]
    assert engine.stats.forced > 0 and all(o.finish_reason in ("stop", "length") for o in outs)


def test_cli_generate_with_a_choice(capsys):
    from specserve import cli

    pair = tiny_pair()
    assert cli.main(["generate", "--target", pair.target, "--draft", pair.draft, "--prompt", "The quick brown fox",
                     "--choice", "yes", "--choice", "maybe later", "--max-tokens", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] in ("yes", "maybe later") and out["finish_reason"] == "stop"
    assert cli.main(["generate", "--target", pair.target, "--draft", "none", "--prompt", "x", "--regex", "[a-"]) == 2
    assert "invalid grammar" in capsys.readouterr().err


class DraftCalls:
    """A proposer that records the γ each row was asked for."""

    def __init__(self, proposer):
        self.proposer, self.gammas = proposer, []

    def propose(self, items):
        self.gammas += [(it.sync.seq_id, it.gamma) for it in items]
        return self.proposer.propose(items)

    def release(self, seq_ids):
        self.proposer.release(seq_ids)


def test_a_choice_is_not_drafted_by_the_model_only_forced():
    target, draft_model = models()
    engine = make_engine(target, draft_model, gamma=4, max_len=256)
    engine.stages.proposer = calls = DraftCalls(engine.stages.proposer)
    mix = [(PROMPTS[1], "choice"), (PROMPTS[0], "person")]
    choice, person = engine.generate(requests(mix))
    assert choice.tokens == expected(*mix[0]) and person.tokens == expected(*mix[1])
    drafted = {}
    for seq_id, gamma in calls.gammas:
        drafted[seq_id] = drafted.get(seq_id, 0) + gamma
    assert sorted(drafted.values())[0] == 0 and sorted(drafted.values())[1] > 0
    assert choice.stats.accepted == 0 and choice.stats.forced > 0  # "maybe later" after "maybe": forced


def test_the_gamma_policy_prices_model_drafts_not_forced_runs():
    # A forced run costs no draft forward: a step of γ model drafts after a run of 5 forced tokens is priced as
    # a step of γ, or the cost model would read long chains as cheap.
    target, draft_model = models()
    engine = make_engine(target, draft_model, gamma=2, max_len=256)
    seen, widths = [], []
    observe_step, verify = engine.policy.observe_step, engine.stages.submit_verify
    engine.policy.observe_step = lambda rows, drafted, seconds, **kw: (seen.append(drafted),
                                                                       observe_step(rows, drafted, seconds, **kw))
    engine.stages.submit_verify = lambda items, proposal, shard: (widths.append(int(proposal.lengths.max())),
                                                                  verify(items, proposal, shard))[1]
    out = engine.generate(requests(MIX[:1]))[0]
    assert out.tokens == expected(*MIX[0]) and out.stats.forced > 0
    assert max(widths) > 2 and seen and max(seen) <= 2
