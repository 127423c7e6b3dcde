"""``warp_probs`` (temperature / top-k / top-p, greedy one-hot) and the per-sequence random streams.

The warping must equal Hugging Face's own warpers (temperature → top-k → top-p, as ``generate`` applies
them), be applied per row, and turn greedy rows into a one-hot on the argmax (first index on ties, like
``torch.argmax`` and HF greedy search).
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from runtime.protocol import GREEDY, SamplingParams
from runtime import rng
from runtime.sampling import sampling_tensors, warp_probs

pytestmark = pytest.mark.timeout(60)

V = 32


def _warp(logits, params):
    return warp_probs(logits, *sampling_tensors(params))


def _hf(logits_row: torch.Tensor, s: SamplingParams) -> torch.Tensor:  # [T, V] → [T, V]
    scores = TemperatureLogitsWarper(s.temperature)(None, logits_row.clone())
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    return scores.softmax(-1)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.2, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=V),  # top-k at the vocab size is off
    SamplingParams(temperature=1.0, top_k=V + 7),
]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_matches_hf_warpers(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 3, V, generator=gen) * 3
    probs = _warp(logits, [params] * 64)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(64, 3))
    for b in range(64):
        expected = _hf(logits[b], params)
        assert torch.equal(probs[b] > 0, expected > 0), "support differs from HF"
        torch.testing.assert_close(probs[b], expected, atol=1e-6, rtol=1e-5)


def test_top_k_and_top_p_support_sizes():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]])
    probs = torch.softmax(logits, -1)[0, 0]
    k = _warp(logits, [SamplingParams(temperature=1.0, top_k=3)])[0, 0]
    assert (k > 0).tolist() == [True, True, True, False, False, False]
    torch.testing.assert_close(k[:3], probs[:3] / probs[:3].sum())
    # top-p keeps the smallest prefix whose mass reaches p: the token that crosses the line stays.
    mass = probs.cumsum(0)
    for top_p, keep in [(float(mass[0]) - 1e-3, 1), (float(mass[0]) + 1e-3, 2), (float(mass[2]) + 1e-3, 4)]:
        kept = _warp(logits, [SamplingParams(temperature=1.0, top_p=top_p)])[0, 0] > 0
        assert int(kept.sum()) == keep and bool(kept[:keep].all())


def test_greedy_rows_are_one_hot_on_the_first_argmax():
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0]], [[5.0, -1.0, 5.0, 0.0]]])
    probs = _warp(logits, [GREEDY, SamplingParams(temperature=0.0, top_k=1, top_p=0.5)])
    assert probs[:, 0].tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_rows_are_warped_independently():
    """A mixed batch equals each row warped on its own (greedy, temperature, top-k, top-p side by side)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS) + 2, 4, V, generator=gen) * 2
    params = PARAMS + [GREEDY, SamplingParams(temperature=0.0)]
    mixed = _warp(logits, params)
    for b, s in enumerate(params):
        alone = _warp(logits[b: b + 1], [s])[0]
        assert torch.equal(mixed[b] > 0, alone > 0)
        # not bitwise: softmax over a different batch shape may round differently in the last ulp
        torch.testing.assert_close(mixed[b], alone, rtol=1e-6, atol=1e-9)


def test_all_greedy_batch_skips_sampling():
    logits = torch.randn(3, 2, V)
    probs = _warp(logits, [GREEDY] * 3)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3, 2))


def test_sampling_tensors():
    t, k, p = sampling_tensors([SamplingParams(0.5, 0.9, 7, seed=3), GREEDY])
    assert t.tolist() == [0.5, 0.0] and k.tolist() == [7, 0] and p.tolist() == pytest.approx([0.9, 1.0])
    assert (t.dtype, k.dtype, p.dtype) == (torch.float32, torch.long, torch.float32)


def test_greedy_property():
    assert GREEDY.greedy and SamplingParams(temperature=0.0, top_k=3).greedy
    assert not SamplingParams(temperature=0.1).greedy


def test_stream_keys_separate_seed_position_and_stream():
    """Draws depend only on (seed, position, stream): reproducible, and distinct across each of them."""
    def draw(seed, position, stream):
        return rng.uniform(rng.stream_keys([seed], [position], stream).unsqueeze(1), torch.arange(8))[0]

    assert torch.equal(draw(5, 10, 0), draw(5, 10, 0))
    others = [draw(6, 10, 0), draw(5, 11, 0), draw(5, 10, 1), draw(0, 0, 0), draw(5 + 2**32, 10, 0),
              draw(5, 10 + 2**32, 0)]
    assert all(not torch.equal(draw(5, 10, 0), o) for o in others)
    draw(2**64 - 1, 2**40, 1)  # any 64-bit seed and a long position fit
    assert torch.equal(draw(None, 3, 1), draw(0, 3, 1))
