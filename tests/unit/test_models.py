"""Models: loading local folders, refusing what the compact forward cannot run, and forward parity.

- ``load_causal_lm`` round-trips a ``save_pretrained`` folder; an unsupported ``model_type`` is refused
  up front with a message naming it; ``cluster.model_files.check_pair`` refuses mismatched vocabularies.
- The compact ragged forward (``runtime.forward`` through ``ModelRunner``) gives Hugging Face's logits,
  one row at a time, for Llama, Qwen2 with mixed sliding-window layers and Mistral, on contexts longer
  than the window — and the window really changes those logits, so the comparison covers it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.helpers import make_prompts
from runtime.forward import layer_windows
from cluster.model_files import check_pair
from runtime.models import (ModelLoadError, build_model, load_causal_lm, noisy_copy,
                             resolve_dtype, tiny_llama)
from runtime.protocol import SyncItem
from runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(120)

FAMILIES = {
    "llama": {},
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "mistral": dict(model_type="mistral", sliding_window=8),
}


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ragged_forward_matches_hf(family):
    model = tiny_llama(4, **FAMILIES[family])
    prompts = make_prompts(31, n=6, lo=1, hi=40)
    runner = ModelRunner(model, max_slots=6, max_len=64)
    for i, p in enumerate(prompts):
        runner.sync(SyncItem(i, 0, p))
    logits = runner.forward(range(6), [[]] * 6, [len(p) for p in prompts])  # every position of every row
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i, : len(p)], _hf_logits(model, p), atol=1e-4, rtol=1e-4)
    # A second, one-token-per-row step reads the cache written by the ragged prefill.
    logits = runner.forward(range(6), [[5]] * 6, [1] * 6)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i, 0], _hf_logits(model, list(p) + [5])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_sliding_window_matters_for_these_contexts(family):
    """Without the window, HF's own logits at long contexts change: the parity test above covers it."""
    windowed = tiny_llama(4, **FAMILIES[family])
    unwindowed = tiny_llama(4, **{**FAMILIES[family], "sliding_window": None, "use_sliding_window": False})
    tokens = list(make_prompts(31, n=2, lo=40, hi=40)[0])
    a, b = _hf_logits(windowed, tokens), _hf_logits(unwindowed, tokens)
    torch.testing.assert_close(a[:8], b[:8])  # inside the window: identical
    assert (a[20:] - b[20:]).abs().max() > 1e-2


def test_layer_windows():
    assert layer_windows(tiny_llama(0)) == [None, None]
    assert layer_windows(tiny_llama(0, **FAMILIES["qwen2"])) == [None, 8]  # layers ≥ max_window_layers slide
    assert layer_windows(tiny_llama(0, **FAMILIES["mistral"])) == [8, 8]


def test_load_saved_folder(tmp_path):
    model = tiny_llama(2)
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path))
    assert not loaded.training
    assert next(loaded.parameters()).dtype == torch.float32  # "auto" on CPU
    tokens = [5, 9, 13, 40]
    assert torch.equal(_hf_logits(loaded, tokens), _hf_logits(model, tokens))
    assert next(load_causal_lm(str(tmp_path), dtype="bf16", device="cpu").parameters()).dtype == torch.bfloat16
    # build_model may swap in prepacked Linear kernels: they sum in another order than stock nn.Linear, so
    # logits agree to rounding (last-bit differences seen on AVX-512 CPUs), not bit for bit.
    torch.testing.assert_close(_hf_logits(build_model(str(tmp_path), device="cpu"), tokens), _hf_logits(model, tokens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_load_other_supported_families(tmp_path, family):
    tiny_llama(2, **FAMILIES[family]).save_pretrained(tmp_path)
    assert load_causal_lm(str(tmp_path)).config.model_type == family


def test_unsupported_model_type_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'gpt2'") as err:
        load_causal_lm(str(tmp_path))
    assert "llama" in str(err.value)  # and says what is supported


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_causal_lm(str(tmp_path / "nowhere"))


def _folder(tmp_path, name, vocab_size, tokenizer_vocab=None):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    if tokenizer_vocab is not None:
        (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": tokenizer_vocab}}))
    return str(path)


def test_check_pair_vocabulary(tmp_path):
    target = _folder(tmp_path, "target", 96, {"a": 0, "b": 1})
    check_pair(target, _folder(tmp_path, "same", 96, {"a": 0, "b": 1}))
    check_pair(target, _folder(tmp_path, "no-tokenizer", 96))  # nothing more to compare
    with pytest.raises(ModelLoadError, match="vocab_size") as err:
        check_pair(target, _folder(tmp_path, "bigger", 128, {"a": 0, "b": 1}))
    assert "128" in str(err.value) and "96" in str(err.value)
    with pytest.raises(ModelLoadError, match="tokenizers differ"):
        check_pair(target, _folder(tmp_path, "swapped", 96, {"a": 1, "b": 0}))


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("float8", "cpu")


def test_tiny_models_are_deterministic_and_noisy_copy_is_a_copy():
    a, b, c = tiny_llama(0), tiny_llama(0), tiny_llama(1)
    tokens = [3, 4, 5]
    assert torch.equal(_hf_logits(a, tokens), _hf_logits(b, tokens))
    assert not torch.equal(_hf_logits(a, tokens), _hf_logits(c, tokens))
    before = _hf_logits(a, tokens)
    noisy = noisy_copy(a, 0.1, 1)
    assert torch.equal(_hf_logits(a, tokens), before)  # the target is untouched
    assert not torch.equal(_hf_logits(noisy, tokens), before)
    assert torch.equal(_hf_logits(noisy_copy(a, 0.0, 1), tokens), before)
    spec = build_model({"tiny": {"seed": 0}, "noise": 0.1, "noise_seed": 1}, device="cpu")
    # build_model packs the Linear layers for the CPU (runtime/cpu_linear.py): same weights, other kernels.
    torch.testing.assert_close(_hf_logits(spec, tokens), _hf_logits(noisy, tokens), rtol=1e-5, atol=1e-5)
