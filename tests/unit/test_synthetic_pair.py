"""The synthetic target/draft pair (scripts/build_synthetic_pair.py) at tiny scale on CPU.

The target extends the draft (shared embeddings, norm and head; the draft's layers widened and
interleaved with extra layers) and ε scales every output projection the draft does not have: ε = 0 gives
the draft's function, larger ε lower greedy agreement. Calibration finds the ε of a wanted agreement, and
the engine's greedy speculative output on the pair equals plain decoding.
"""

from __future__ import annotations

import json

import pytest
import torch

from evaluation.synthetic_pair import (TINY_DRAFT, TINY_EXTRA, DraftConfig, TargetExtra, build_draft, build_pair,
                                          build_target, calibrate_epsilon, greedy_agreement, main, param_count,
                                          random_prompts, save_pair, set_epsilon, shared_layer_map)
from tests.unit.helpers import hf_greedy, make_engine
from engine.engine import Request

pytestmark = pytest.mark.timeout(300)

NEW = 24  # generated tokens per agreement prompt


@pytest.fixture(scope="module")
def pair():
    return build_pair(TINY_DRAFT, TINY_EXTRA, epsilon=0.0, seed=0)


@pytest.fixture(scope="module")
def agreement_prompts():
    return random_prompts(TINY_DRAFT.vocab_size, 4, 16, seed=12345)


def test_shapes_and_parameter_count(pair):
    target, draft = pair
    assert type(target).__name__ == type(draft).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in draft.parameters()) == param_count(TINY_DRAFT)
    assert sum(p.numel() for p in target.parameters()) == param_count(TINY_DRAFT, TINY_EXTRA)
    assert len(target.model.layers) == TINY_DRAFT.num_layers + TINY_EXTRA.extra_layers
    assert target.config.num_attention_heads == TINY_DRAFT.num_heads + TINY_EXTRA.extra_heads
    assert target.config.head_dim == draft.config.head_dim


def test_default_sizes_are_the_benchmark_pair():
    """~1.1B draft, ~6.4B target, without building them."""
    assert 1.0e9 < param_count(DraftConfig()) < 1.2e9
    assert 6.2e9 < param_count(DraftConfig(), TargetExtra()) < 6.6e9


def test_target_shares_the_drafts_weights(pair):
    target, draft = pair
    t, d = dict(target.named_parameters()), dict(draft.named_parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(t[name], d[name])
    layer_map = target.config.synthetic_pair["layer_map"]
    for j, i in enumerate(layer_map):
        if i is None:
            continue
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            src = d[f"model.layers.{i}.{part}.weight"]
            dst = t[f"model.layers.{j}.{part}.weight"]
            assert torch.equal(dst[: src.shape[0], : src.shape[1]], src)


def test_epsilon_zero_computes_the_drafts_function(pair, agreement_prompts):
    target, draft = pair
    ids = random_prompts(TINY_DRAFT.vocab_size, 3, 40, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, draft(ids).logits, rtol=1e-5, atol=1e-5)
    assert greedy_agreement(target, draft, agreement_prompts, NEW) == 1.0


def test_greedy_outputs_are_not_degenerate(pair, agreement_prompts):
    target, _ = pair
    out = hf_greedy(target, agreement_prompts[0].tolist(), 48)
    assert len(set(out)) > 24  # random-init models love short cycles; this init does not fall into them
    with torch.no_grad():
        probs = target(agreement_prompts).logits.softmax(-1)
    assert float(probs.max(-1).values.mean()) > 0.3  # peaked, far from uniform (1/512)


def test_agreement_falls_with_epsilon():
    target, draft = build_pair(TINY_DRAFT, TINY_EXTRA, seed=0)
    prompts = random_prompts(TINY_DRAFT.vocab_size, 4, 16, seed=12345)
    alphas = []
    for eps in (0.0, 0.05, 0.2, 0.8, 3.2):
        set_epsilon(target, eps)
        alphas.append(greedy_agreement(target, draft, prompts, NEW))
    assert alphas[0] == 1.0
    assert all(b <= a + 0.05 for a, b in zip(alphas, alphas[1:])), alphas
    assert alphas[-1] < 0.15, alphas


def test_set_epsilon_equals_building_with_it():
    """ε is changed in place by regenerating the scaled slices from their seeds: no drift, no rebuild."""
    draft = build_draft(TINY_DRAFT, seed=3)
    direct = build_target(draft, TINY_DRAFT, TINY_EXTRA, epsilon=0.37, seed=3)
    moved = build_target(draft, TINY_DRAFT, TINY_EXTRA, epsilon=0.0, seed=3)
    for eps in (1.5, 0.0, 0.37):
        set_epsilon(moved, eps)
    for (n, a), (_, b) in zip(direct.named_parameters(), moved.named_parameters()):
        assert torch.equal(a, b), n
    assert moved.config.synthetic_pair["epsilon"] == 0.37


def test_seeded_and_reproducible():
    a, _ = build_pair(TINY_DRAFT, TINY_EXTRA, epsilon=0.2, seed=11)
    b, _ = build_pair(TINY_DRAFT, TINY_EXTRA, epsilon=0.2, seed=11)
    c, _ = build_pair(TINY_DRAFT, TINY_EXTRA, epsilon=0.2, seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_builds_in_the_requested_dtype():
    target, draft = build_pair(TINY_DRAFT, TINY_EXTRA, epsilon=0.1, dtype=torch.bfloat16)
    assert {p.dtype for p in target.parameters()} == {p.dtype for p in draft.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("wanted", [0.89, 0.62, 0.18])
def test_calibration_hits_the_seeds_agreements(wanted):
    cal = calibrate_epsilon(TINY_DRAFT, TINY_EXTRA, wanted, new_tokens=NEW)
    assert abs(cal.agreement - wanted) <= 0.05, cal.as_dict()
    assert cal.epsilon > 0
    assert len(cal.trials) <= 14


def test_calibration_reuses_a_pair_and_leaves_it_at_the_result(agreement_prompts):
    target, draft = build_pair(TINY_DRAFT, TINY_EXTRA, seed=0)
    cal = calibrate_epsilon(TINY_DRAFT, TINY_EXTRA, 0.62, models=(target, draft), new_tokens=NEW)
    assert target.config.synthetic_pair["epsilon"] == cal.epsilon
    assert greedy_agreement(target, draft, agreement_prompts, NEW) == pytest.approx(cal.agreement)


def test_layer_map():
    assert shared_layer_map(4, 0) == [0, 1, 2, 3]
    assert shared_layer_map(2, 3, "end") == [0, 1, None, None, None]
    m = shared_layer_map(16, 10)
    assert len(m) == 26 and m[0] == 0 and m[-1] == 15
    assert [i for i in m if i is not None] == list(range(16))


def test_gqa_group_must_be_kept():
    with pytest.raises(ValueError, match="GQA group"):
        build_pair(TINY_DRAFT, TargetExtra(extra_layers=1, extra_heads=4, extra_kv_heads=1, extra_intermediate=0))


def test_engine_speculative_equals_plain_decoding():
    """The pair in the engine: greedy speculative output == plain decoding == HF generate."""
    target, draft = build_pair(TINY_DRAFT, TINY_EXTRA, seed=0)
    set_epsilon(target, 0.2)  # agreement ≈ 0.6: both accept and reject paths run
    prompts = [tuple(p) for p in random_prompts(TINY_DRAFT.vocab_size, 6, 12, seed=9).tolist()]
    prompts = [p[: 3 + 2 * i] for i, p in enumerate(prompts)]  # ragged
    refs = [hf_greedy(target, list(p), 20) for p in prompts]
    spec = make_engine(target, draft, gamma=4, max_slots=len(prompts))
    outs = spec.generate([Request(p, max_tokens=20) for p in prompts])
    assert [o.tokens for o in outs] == refs
    assert 0.3 < spec.stats.alpha < 0.95
    plain = make_engine(target, None, max_slots=len(prompts))
    assert [o.tokens for o in plain.generate([Request(p, max_tokens=20) for p in prompts])] == refs


def test_save_and_reload(tmp_path, pair):
    from runtime.models import load_causal_lm

    target, draft = pair
    paths = save_pair(target, draft, str(tmp_path))
    again = load_causal_lm(paths["target"], "float32", "cpu")
    ids = random_prompts(TINY_DRAFT.vocab_size, 1, 8, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, target(ids).logits)
    assert json.loads((tmp_path / "target" / "config.json").read_text())["synthetic_pair"]["epsilon"] == 0.0


def test_cli(capsys):
    assert main(["--tiny", "--epsilon", "0.1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target_params"] == param_count(TINY_DRAFT, TINY_EXTRA)
    assert 0.0 <= report["agreement"] <= 1.0
