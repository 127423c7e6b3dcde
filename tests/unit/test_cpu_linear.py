"""oneDNN-prepacked Linear layers (``runtime/cpu_linear.py``): same numbers, same module contract.

- A packed model gives the stock model's logits for one row, a (γ+1)-row verify and a ragged batch;
  greedy speculative decoding on a packed pair stays token-identical to HF greedy on the stock target.
- ``pack_linears`` swaps exactly the plain float32 CPU ``nn.Linear`` layers, once: a second call, a
  subclass (DeepSpeed's sharded layers) and a bfloat16 model are left alone; tied weights stay tied.
- One copy: a packed layer drops its stock weight (only a tied one keeps the shared matrix), yet
  ``weight`` and ``state_dict`` still give the stock values and keys.
- A packed module deep-copies and pickles (the oneDNN tensor is rebuilt, not copied), and
  ``build_model`` packs by default while ``cpu_kernels=False`` (the tensor-parallel path) does not.

Speed is the benchmark's business (scripts/bench_scenarios.py), not these tests'.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from tests.unit.helpers import MAX_NEW, hf_greedy, make_engine
from runtime.cpu_linear import PackedLinear, pack_linears, packing_available
from engine.engine import Request
from runtime.models import build_model, noisy_copy, tiny_llama
from runtime.protocol import SyncItem
from runtime.runner import ModelRunner

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")]


def _packed(model):
    packed = copy.deepcopy(model)
    assert pack_linears(packed) > 0
    return packed


def _runner_logits(model, prompt, extra):
    runner = ModelRunner(model, max_slots=1, max_len=64)
    runner.sync(SyncItem(0, 0, tuple(prompt)))
    return runner.forward([0], [extra], [len(extra) + 1])[0]


@pytest.mark.parametrize("width", [1, 2, 5, 9])
def test_packed_logits_match_stock(width):
    stock = tiny_llama(3, hidden_size=96, intermediate_size=192)
    packed = _packed(stock)
    prompt, extra = list(range(3, 20)), list(range(30, 30 + width - 1))
    torch.testing.assert_close(_runner_logits(packed, prompt, extra), _runner_logits(stock, prompt, extra),
                               rtol=1e-5, atol=1e-5)


def test_packed_ragged_batch_matches_stock():
    stock = tiny_llama(3)
    packed = _packed(stock)
    x = torch.randint(3, 96, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(x).logits, stock(x).logits, rtol=1e-5, atol=1e-5)


def test_greedy_speculation_on_packed_pair_matches_hf_on_stock(target, prompts):
    draft = noisy_copy(target, 0.03, 1)
    engine = make_engine(_packed(target), _packed(draft), gamma=4)
    outputs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts[:6]])
    for prompt, out in zip(prompts, outputs):
        assert out.tokens == hf_greedy(target, prompt, MAX_NEW)
    assert engine.stats.accepted > 0 and engine.stats.accepted < engine.stats.proposed


def test_pack_linears_swaps_plain_float32_linears_once():
    model = tiny_llama(0)
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert pack_linears(model) == len(plain) == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert all(isinstance(model.get_submodule(n), PackedLinear) for n in plain)
    assert pack_linears(model) == 0

    class Sharded(nn.Linear):  # stands for DeepSpeed's LinearLayer / LinearAllreduce
        pass

    holder = nn.Sequential(Sharded(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(holder) == 0


def test_tied_weights_stay_tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_packing_keeps_one_copy_and_the_stock_state_dict():
    model = tiny_llama(2)
    stock = {k: v.clone() for k, v in model.state_dict().items()}
    dense_before = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear)
    pack_linears(model)
    assert sum(p.numel() for p in model.parameters()) == dense_before - linear  # only the packed copies remain
    assert all("weight" not in m._parameters for m in model.modules() if isinstance(m, PackedLinear))
    packed = model.state_dict()
    assert packed.keys() == stock.keys() and all(torch.equal(packed[k], stock[k]) for k in stock)
    q = model.model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight, stock["model.layers.0.self_attn.q_proj.weight"])


def test_packed_model_deepcopies_and_pickles():
    stock = tiny_llama(5)
    packed = _packed(stock)
    x = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = packed(x).logits
        for clone in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
            assert isinstance(clone.lm_head, PackedLinear) and clone.lm_head.packed is not None
            torch.testing.assert_close(clone(x).logits, want)


def test_build_model_packs_unless_told_not_to():
    spec = {"tiny": {"seed": 0}}
    assert isinstance(build_model(spec, "cpu").lm_head, PackedLinear)
    assert type(build_model(spec, "cpu", cpu_kernels=False).lm_head) is nn.Linear
