"""The n-gram / prompt-lookup proposer.

Contract: for the longest suffix (n_max down to n_min tokens) that occurred earlier, propose the γ tokens
that followed its most recent earlier occurrence; the incremental index must agree with a brute-force scan
of the history after any sequence of syncs (including truncations on resync). Proposals are one-hot
(``q_ids is None``), and the engine stays token-identical with them (``test_engine_greedy``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftpool.ngram import NgramProposer
from tests.unit.helpers import hf_greedy, make_engine
from engine.engine import Request
from runtime.models import tiny_llama
from runtime.protocol import ProposeItem, SyncItem

pytestmark = pytest.mark.timeout(120)


def _propose(proposer, seq_id, base, tokens, gamma):
    batch = proposer.propose([ProposeItem(SyncItem(seq_id, base, tuple(tokens)), gamma)])
    assert batch.q_ids is None and batch.q_probs is None
    return batch.row_tokens(0), batch.resync


def brute_force(tokens, gamma, n_min, n_max):
    """The spec: longest suffix first; latest earlier end position e (< len) where it also ends."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if L < n:
            continue
        suffix = tokens[L - n:]
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                return tokens[e:e + gamma]
    return []


@pytest.mark.parametrize("history,gamma,expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # continuation after the earlier [1, 2]
    ([1, 2, 3, 9, 2, 4, 1, 2], 3, [3, 9, 2]),  # the longest suffix [1, 2] wins over the later [2]
    ([1, 5, 1, 6, 1], 2, [6, 1]),  # the most recent earlier occurrence of [1]
    ([1, 2, 3], 4, []),  # no earlier occurrence: nothing (a suffix never matches itself)
    ([7], 2, []),
    ([4, 5, 4], 5, [5, 4]),  # fewer than γ tokens follow: a shorter proposal
    ([1, 1, 1], 3, [1]),  # overlapping occurrence
    ([1, 2, 1, 2], 0, []),  # γ = 0 only syncs
])
def test_lookup(history, gamma, expected):
    proposer = NgramProposer(n_min=1, n_max=4)
    drafts, resync = _propose(proposer, 0, 0, history, gamma)
    assert drafts == expected == (brute_force(history, gamma, 1, 4) if gamma else [])
    assert resync == []


def test_n_min_limits_short_matches():
    proposer = NgramProposer(n_min=2, n_max=3)
    assert _propose(proposer, 0, 0, [1, 5, 1, 6, 1], 2)[0] == []  # only a 1-gram would match
    assert _propose(proposer, 1, 0, [1, 5, 9, 1, 5], 2)[0] == [9, 1]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n_min=st.integers(1, 3), extra=st.integers(0, 2))
def test_incremental_index_matches_brute_force(data, n_min, extra):
    """Random syncs (appends and truncating resyncs) over a small alphabet: always the brute-force answer."""
    n_max = n_min + extra
    proposer = NgramProposer(n_min=n_min, n_max=n_max)
    tokens: list[int] = []
    for _ in range(data.draw(st.integers(1, 6))):
        base = data.draw(st.integers(0, len(tokens)))
        new = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=12))
        gamma = data.draw(st.integers(0, 5))
        tokens = tokens[:base] + new
        drafts, resync = _propose(proposer, 7, base, new, gamma)
        assert resync == []
        assert drafts == (brute_force(tokens, gamma, n_min, n_max) if gamma else [])
        assert proposer.histories[7].tokens == tokens


def test_resync_and_release():
    proposer = NgramProposer()
    assert _propose(proposer, 3, 2, [1], 2) == ([], [3])  # unknown sequence, base > 0
    _propose(proposer, 3, 0, [1, 2, 1], 2)
    assert _propose(proposer, 3, 5, [1], 2) == ([], [3])  # holds 3 tokens, told it holds 5
    proposer.release([3, 99])
    assert proposer.histories == {}


def test_batch_padding():
    proposer = NgramProposer()
    batch = proposer.propose([
        ProposeItem(SyncItem(0, 0, (1, 2, 3, 1, 2)), 4),
        ProposeItem(SyncItem(1, 0, (5, 6)), 4),
        ProposeItem(SyncItem(2, 0, (8, 8)), 1),
    ])
    assert batch.seq_ids == [0, 1, 2]
    assert batch.lengths.tolist() == [3, 0, 1]
    assert batch.tokens.tolist() == [[3, 1, 2], [0, 0, 0], [8, 0, 0]]


def test_invalid_n_range():
    for n_min, n_max in [(0, 2), (3, 2)]:
        with pytest.raises(ValueError):
            NgramProposer(n_min=n_min, n_max=n_max)


def test_repeated_text_is_copied_and_accepted():
    """Prompt lookup pays off when the output repeats earlier text.

    A Mistral target with window 8 and 2 layers sees at most the last 16 tokens, and RoPE is relative, so
    after prompt P + its own continuation C + P again it continues with C: the proposer copies C from the
    prompt, every draft is accepted, and 16 tokens take 4 steps of γ + 1 = 4 tokens.
    """
    model = tiny_llama(3, model_type="mistral", sliding_window=8)
    P = tuple(range(10, 30))
    C = hf_greedy(model, P, 16)
    prompt = P + C + P
    engine = make_engine(model, "ngram", gamma=3)
    out = engine.generate([Request(prompt, max_tokens=16)])[0]
    assert out.tokens == hf_greedy(model, prompt, 16) == C
    assert engine.stats.acceptance_rate == 1.0
    assert engine.stats.steps == 4
