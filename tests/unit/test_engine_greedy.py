"""Greedy fidelity: speculative output is token-identical to HF ``generate`` (docs/design.md#fidelity-and-test-models).

The reference is the target alone, greedy, one prompt at a time, no padding, fp32 on CPU. The engine runs
16 ragged prompts (lengths 1..40) as one batch for every γ, with drafts that always agree (the target
itself), never agree (an unrelated model), agree sometimes (a noisy copy), the n-gram proposer and the
adaptive γ policy; plus Qwen2 (mixed sliding-window layers) and Mistral targets whose contexts exceed the
window, EOS, max_tokens, context end, stop strings, two micro-batches, and the opt-in threshold mode.
"""

from __future__ import annotations

import collections

import pytest

from tests.unit.helpers import MAX_NEW, NOISE, hf_greedy, make_engine
from engine.engine import Request
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import SamplingParams
from verifier.verify import AcceptanceConfig, VerifyStage

pytestmark = pytest.mark.timeout(300)

GAMMAS = (1, 2, 4, 8)


def _generate(engine, prompts, max_tokens=MAX_NEW, **kw):
    return engine.generate([Request(p, max_tokens=max_tokens, **kw) for p in prompts])


def _assert_identical(outs, refs):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.tokens == r, f"prompt {i}: engine {o.tokens} != reference {r}"


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("draft", ["same", "other", "noisy", "ngram"])
def test_greedy_identity(draft, gamma, target, other_draft, noisy_draft, prompts, refs):
    model = {"same": "same", "other": other_draft, "noisy": noisy_draft, "ngram": "ngram"}[draft]
    engine = make_engine(target, model, gamma=gamma)
    outs = _generate(engine, prompts)
    _assert_identical(outs, refs)
    assert all(o.finish_reason == "length" for o in outs)
    stats = engine.stats
    assert stats.emitted == sum(len(r) for r in refs)
    assert stats.proposed > 0
    if draft == "same":  # always agrees: everything accepted, γ + 1 tokens per step until max_tokens
        assert stats.acceptance_rate == 1.0
    elif draft == "other":  # agrees only by coincidence
        assert stats.acceptance_rate < 0.1
    elif draft == "noisy":  # in between, so both the accept and the reject paths run
        assert 0.3 < stats.alpha < 0.9
        assert 0.2 < stats.acceptance_rate < 0.9


@pytest.mark.parametrize("draft", ["same", "other", "noisy", "ngram"])
def test_greedy_identity_adaptive_gamma(draft, target, other_draft, noisy_draft, prompts, refs):
    """γ varies per sequence and per step (ragged proposals in one batch), and may drop to 0."""
    model = {"same": "same", "other": other_draft, "noisy": noisy_draft, "ngram": "ngram"}[draft]
    engine = make_engine(target, model, gamma=4, adaptive=True)
    _assert_identical(_generate(engine, prompts), refs)


def test_greedy_identity_two_micro_batches(target, noisy_draft, prompts, refs):
    """Two micro-batches taking turns, the next one's proposal drafted while this one is verified."""
    engine = make_engine(target, noisy_draft, gamma=4, micro_batches=2)
    ids = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in prompts]
    engine.step()
    assert {s.micro_batch for s in engine.running.values()} == {0, 1}
    while engine.has_work:
        engine.step()
    _assert_identical([engine.output(i) for i in ids], refs)


def test_greedy_without_proposer_and_with_speculation_off(target, noisy_draft, prompts, refs):
    _assert_identical(_generate(make_engine(target, None), prompts), refs)
    engine = make_engine(target, noisy_draft, speculate=False)
    _assert_identical(_generate(engine, prompts), refs)
    assert engine.stats.proposed == 0


# -- sliding-window targets ------------------------------------------------------------------------------

WINDOWED = {
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "mistral": dict(model_type="mistral", sliding_window=8),
}


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, prompts):
    """(target, noisy draft, references) for a target whose contexts (up to 64) exceed its window (8)."""
    model = tiny_llama(3, **WINDOWED[request.param])
    return model, noisy_copy(model, NOISE, 2), [hf_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("draft,gamma", [("same", 4), ("noisy", 1), ("noisy", 3), ("noisy", 8), ("ngram", 4)])
def test_greedy_identity_sliding_window(windowed, draft, gamma, prompts):
    model, noisy, refs = windowed
    engine = make_engine(model, {"same": "same", "noisy": noisy, "ngram": "ngram"}[draft], gamma=gamma)
    _assert_identical(_generate(engine, prompts), refs)
    if draft == "noisy":
        assert 0 < engine.stats.acceptance_rate < 1


# -- where a sequence ends -------------------------------------------------------------------------------


def _pick_eos(refs):
    """A token the reference produces after its first position in some, but not all, sequences."""
    counts = collections.Counter(t for r in refs for t in set(r[1:]))
    for token, _ in counts.most_common():
        if sum(token in r for r in refs) < len(refs):
            return token
    raise AssertionError("no usable EOS candidate")


@pytest.fixture(scope="module")
def eos_refs(target, prompts, refs):
    """(eos, HF references generated with that eos_token_id)."""
    eos = _pick_eos(refs)
    return eos, [hf_greedy(target, p, MAX_NEW, eos=eos) for p in prompts]


@pytest.mark.parametrize("draft,gamma", [("same", 8), ("noisy", 4)])
def test_eos_stops_where_hf_generate_stops(draft, gamma, target, noisy_draft, prompts, refs, eos_refs):
    eos, eos_refs = eos_refs
    stopped = [r for r in eos_refs if r[-1] == eos]
    assert stopped and len(stopped) < len(eos_refs)  # the test covers both endings
    assert any(len(r) > 1 for r in stopped)  # and an EOS that is not the first token

    engine = make_engine(target, {"same": "same", "noisy": noisy_draft}[draft], gamma=gamma, eos_token_ids=[eos])
    outs = _generate(engine, prompts)
    _assert_identical(outs, eos_refs)
    for o in outs:
        assert o.finish_reason == ("stop" if o.tokens[-1] == eos else "length")
    # ignore_eos: the same engine runs through EOS, as if there were none
    _assert_identical(_generate(engine, prompts, ignore_eos=True), refs)


def test_max_tokens(target, prompts, refs):
    """Each request stops at its own max_tokens, even inside a fully accepted γ = 8 chain."""
    engine = make_engine(target, "same", gamma=8)
    limits = [1 + (i * 5) % MAX_NEW for i in range(len(prompts))]
    outs = engine.generate([Request(p, max_tokens=m) for p, m in zip(prompts, limits)])
    for o, r, m in zip(outs, refs, limits):
        assert o.tokens == r[:m]
        assert o.finish_reason == "length"
    assert engine.stats.proposed <= sum(m - 1 for m in limits)  # never drafts past max_tokens


def test_context_end(target, prompts, refs):
    """A sequence that reaches the context limit (max_len) stops there with finish_reason "length"."""
    max_len = 48
    engine = make_engine(target, "same", gamma=8, max_len=max_len)
    outs = _generate(engine, prompts)
    for o, p, r in zip(outs, prompts, refs):
        assert o.tokens == r[: max_len - len(p)]
        assert o.finish_reason == "length"


def _detokenize(ids):
    return " ".join(map(str, ids))


def test_stop_string(target, noisy_draft, prompts, refs):
    """Generation ends at the first token whose text completes a stop string; the text is cut before it."""
    stops = []
    for i, r in enumerate(refs):
        k = 3 + i % 7
        stops.append((f"{r[k]} {r[k + 1]}",) if i % 4 else ("no such text",))
    engine = make_engine(target, noisy_draft, gamma=4, detokenize=_detokenize)
    outs = engine.generate([Request(p, max_tokens=MAX_NEW, stop=s) for p, s in zip(prompts, stops)])
    for o, r, (stop,) in zip(outs, refs, stops):
        # spec: the shortest prefix of the reference whose text contains the stop string
        n = next((n for n in range(1, len(r) + 1) if stop in _detokenize(r[:n])), None)
        if n is None:
            assert (o.tokens, o.finish_reason, o.text) == (r, "length", None)
        else:
            text = _detokenize(r[:n])
            assert o.tokens == r[:n]
            assert o.finish_reason == "stop"
            assert o.text == text[: text.index(stop)]
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2


def test_stop_strings_need_a_tokenizer(target):
    engine = make_engine(target, "same")
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add(Request((5, 6), stop=("x",)))


def test_prompt_validation(target):
    engine = make_engine(target, "same", max_len=32)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(Request(()))
    with pytest.raises(ValueError, match="does not fit"):
        engine.add(Request(tuple(range(3, 35))))


# -- the lossy mode is opt-in ----------------------------------------------------------------------------


def test_exact_is_the_default(target):
    from runtime.runner import ModelRunner

    assert AcceptanceConfig().mode == "exact"
    assert VerifyStage(ModelRunner(target, max_slots=1, max_len=16)).acceptance.mode == "exact"
    assert make_engine(target, "same").stages.verifier.acceptance.mode == "exact"


@pytest.mark.parametrize("threshold", [0.3, 1.0])
def test_threshold_mode_greedy(threshold, target, noisy_draft, prompts, refs):
    """Greedy p is one-hot, so any threshold in (0, 1] accepts exactly the argmax: output unchanged."""
    engine = make_engine(target, noisy_draft, gamma=4, acceptance=AcceptanceConfig(mode="threshold",
                                                                                   threshold=threshold))
    _assert_identical(_generate(engine, prompts), refs)
    assert 0 < engine.stats.acceptance_rate < 1


def test_threshold_mode_is_lossy_when_sampling(target, other_draft, prompts):
    """A low threshold accepts draft tokens that exact verification would mostly reject."""
    sampling = [SamplingParams(temperature=1.0, seed=i) for i in range(len(prompts))]

    def rate(acceptance):
        engine = make_engine(target, other_draft, gamma=4, acceptance=acceptance)
        engine.generate([Request(p, max_tokens=12, sampling=s) for p, s in zip(prompts, sampling)])
        return engine.stats.acceptance_rate, engine.stages.verifier

    exact, _ = rate(None)
    lossy, _ = rate(AcceptanceConfig(mode="threshold", threshold=1e-4))
    assert lossy > exact + 0.3
    _, verifier = rate(AcceptanceConfig(mode="threshold", threshold=0.5, dynamic_adjust=True, target_rate=0.7))
    assert verifier.threshold < 0.5  # acceptance far below target → the dynamic rule loosens it
