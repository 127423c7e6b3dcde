"""The static step (fixed buffers, batch buckets, fused projections, the draft's device loop) against the
dynamic path, and what a step reads back to the host.

On the CPU the static path runs eagerly — the same code a CUDA graph captures (tests/gpu checks replay
against eager on a GPU). Greedy outputs must be token-identical to the dynamic path and to HF ``generate``;
seeded samples must be identical. The host-read hook (``host_reads``) counts every read of tensor data by
Python: on a GPU each one is a device→host copy.
"""

from __future__ import annotations

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from engine.engine import Engine, LocalStages, Request
from engine.gamma import GammaPolicy
from runtime.fusion import fuse_projections
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import ProposeItem, SamplingParams, SyncItem
from runtime import runner as runner_module
from runtime.runner import ModelRunner, batch_bucket, ragged_groups
from tests.unit.helpers import MAX_LEN, MAX_NEW, hf_greedy, make_prompts
from tests.unit.host_reads import HostReads
from verifier.verify import VerifyStage

pytestmark = pytest.mark.timeout(300)

STATIC = {"static": True, "pad_batch": True, "fuse": True}  # everything a GPU runner does but the graphs
DYNAMIC = {"static": False, "fuse": False}


@pytest.fixture(scope="module")
def pair():
    """Fresh models (fusion changes a model in place; the session fixtures stay unfused)."""
    target = tiny_llama(0)
    return target, noisy_copy(target, 0.03, 1)


def engine(target, draft, options: dict, *, gamma: int = 4, adaptive: bool = False, slots: int = 16,
           confidence: float = 0.0, q_top_k: int | None = None) -> Engine:
    proposer = DraftModelProposer(draft, max_slots=slots, max_len=MAX_LEN, confidence_threshold=confidence,
                                  q_top_k=q_top_k, **options)
    verifier = VerifyStage(ModelRunner(target, max_slots=slots, max_len=MAX_LEN, **options))
    return Engine(LocalStages(verifier, proposer), policy=GammaPolicy(gamma=gamma, gamma_max=8, adaptive=adaptive),
                  max_len=MAX_LEN)


def outputs(eng: Engine, prompts, sampling=None, max_tokens: int = MAX_NEW) -> list[tuple[int, ...]]:
    reqs = [Request(p, max_tokens=max_tokens, sampling=sampling(i) if sampling else SamplingParams())
            for i, p in enumerate(prompts)]
    return [tuple(o.tokens) for o in eng.generate(reqs)]


def test_batch_bucket():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]


@pytest.mark.parametrize("gamma,adaptive,confidence", [(4, False, 0.0), (3, True, 0.0), (6, False, 0.3)],
                         ids=["gamma4", "adaptive", "confidence-stop"])
def test_static_greedy_equals_dynamic_and_hf(pair, gamma, adaptive, confidence):
    target, draft = pair
    prompts = make_prompts(21, n=7)  # 7 rows: padded to a bucket of 8
    static = outputs(engine(target, draft, STATIC, gamma=gamma, adaptive=adaptive, confidence=confidence), prompts)
    dynamic = outputs(engine(target, draft, DYNAMIC, gamma=gamma, adaptive=adaptive, confidence=confidence),
                      prompts)
    assert static == dynamic
    assert static == [hf_greedy(target, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("q_top_k", [None, 5], ids=["dense-q", "sparse-q"])
def test_static_seeded_samples_equal_dynamic(pair, q_top_k):
    target, draft = pair
    prompts = make_prompts(22, n=6)
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=1.0, top_k=8, seed=12),
              SamplingParams(temperature=0.7, top_p=0.8, seed=13), SamplingParams(),  # a greedy row in the batch
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=14), SamplingParams(temperature=0.5, seed=15)]
    static = outputs(engine(target, draft, STATIC, q_top_k=q_top_k), prompts, lambda i: params[i])
    dynamic = outputs(engine(target, draft, DYNAMIC, q_top_k=q_top_k), prompts, lambda i: params[i])
    assert static == dynamic
    alone = [outputs(engine(target, draft, STATIC, q_top_k=q_top_k), [p], lambda _, i=i: params[i])[0]
             for i, p in enumerate(prompts[:3])]
    assert alone == static[:3]  # batch-invariant: the same draws alone as in a padded batch of 6


def test_fusion_keeps_weights_once_and_logits_equal():
    model = tiny_llama(3, model_type="qwen2")  # q/k/v with biases
    ids = torch.tensor([[5, 9, 14, 3, 27]])
    with torch.no_grad():
        before = model(ids).logits
    params = sum(p.numel() for p in model.parameters())
    keys = set(model.state_dict())
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers  # idempotent: nothing re-fused
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_qkv.weight.data_ptr()  # a view, not a copy
    assert sum(p.numel() for p in model.parameters()) == params and set(model.state_dict()) == keys
    with torch.no_grad():
        after = model(ids).logits  # HF's own forward reads the views
    assert torch.equal(before, after)
    runner_out = {}
    for fuse in (False, True):
        runner = ModelRunner(model, max_slots=1, max_len=32, fuse=fuse)
        if not fuse:
            for layer in model.model.layers:  # the unfused run: hide the fused matrices
                layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None
        runner.sync(SyncItem(0, 0, tuple(ids[0].tolist())))
        runner_out[fuse] = runner.forward([0], [[]], [5])
    torch.testing.assert_close(runner_out[True], runner_out[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner_out[True], before, rtol=1e-4, atol=1e-4)


def test_fusion_skips_layers_it_cannot_fuse():
    from runtime.cpu_linear import pack_linears, packing_available

    model = tiny_llama(4)
    if not packing_available():
        pytest.skip("no oneDNN packing on this CPU")
    pack_linears(model)
    assert fuse_projections(model) == 0  # PackedLinear (like AutoTP's LinearLayer) is not plain nn.Linear


def _step_reads(eng: Engine, steps: int = 3) -> dict[str, list[HostReads]]:
    """Host reads of each verify and propose call over ``steps`` engine steps."""
    verifier, proposer = eng.stages.verifier, eng.stages.proposer
    seen: dict[str, list[HostReads]] = {"verify": [], "propose": []}

    def hooked(fn, name):
        def call(*args, **kwargs):
            with HostReads() as reads:
                result = fn(*args, **kwargs)
            seen[name].append(reads)
            return result
        return call

    verifier.verify, proposer.propose = hooked(verifier.verify, "verify"), hooked(proposer.propose, "propose")
    for _ in range(steps):
        eng.step()
    return seen


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_verify_reads_no_vocabulary_sized_tensor(sampled):
    """Per step only O(B·γ) integers reach the host: never [B, γ+1, V] probabilities (before: 327,680 bytes
    at B 8, γ 4, V 2048 — the fp32 warped target probabilities — now a few hundred)."""
    V, B, gamma = 2048, 8, 4
    target = tiny_llama(0, vocab_size=V)
    eng = engine(target, noisy_copy(target, 0.03, 1), STATIC, gamma=gamma, slots=B)
    for i, p in enumerate(make_prompts(23, n=B, vocab=V)):
        eng.add(Request(p, max_tokens=40, sampling=SamplingParams(temperature=0.8, seed=i) if sampled
                        else SamplingParams()))
    eng.step()  # the prefill step
    seen = _step_reads(eng)
    for reads in seen["verify"]:
        assert reads.largest <= B * (gamma + 1) * 8, reads.reads  # at most the [B, γ+1] int64 outputs
        assert reads.total_bytes <= 4 * B * (gamma + 2) * 8, reads.reads
    for reads in seen["propose"]:
        assert reads.largest <= B * gamma * 8, reads.reads  # the drafted tokens, once


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_draft_loop_reads_the_host_once_whatever_gamma(pair, sampled):
    """The draft's γ positions run on the device: the number of host reads does not grow with γ."""
    _, draft = pair
    counts = {}
    for gamma in (1, 2, 6):
        proposer = DraftModelProposer(draft, max_slots=4, max_len=MAX_LEN, **STATIC)
        sampling = SamplingParams(temperature=0.9, seed=5) if sampled else SamplingParams()
        items = [ProposeItem(SyncItem(s, 0, tuple(range(3, 12 + s))), gamma, sampling) for s in range(3)]
        proposer.propose(items)  # prefill
        items = [ProposeItem(SyncItem(s, len(it.sync.tokens), (40,)), gamma, sampling) for s, it in enumerate(items)]
        with HostReads() as reads:
            batch = proposer.propose(items)
        assert batch.lengths.tolist() == [gamma] * 3
        counts[gamma] = len(reads.reads)
    assert counts[1] == counts[2] == counts[6], counts


def test_graphs_are_off_without_cuda(pair):
    target, _ = pair
    runner = ModelRunner(target, max_slots=2, max_len=32, graphs=True)
    assert not runner.graphs.enabled and runner.pad_batch is False
    runner.sync(SyncItem(0, 0, (5, 6, 7)))
    runner.forward([0], [[]], [1])
    assert runner.graphs.eager_runs == 1 and len(runner.graphs) == 0


@pytest.mark.parametrize("live", [[3, 0, 5], [2, 1, 0], [4]], ids=["scattered", "reversed-run", "one"])
def test_static_rows_in_any_slot_order_equal_dynamic(pair, live):
    """Rows whose slots are scattered (gathered keys) or a reversed run (a view, rows reordered and put back)."""
    target, _ = pair
    out = {}
    for name, options in (("static", STATIC), ("dynamic", DYNAMIC)):
        runner = ModelRunner(target, max_slots=8, max_len=64, **{**options, "fuse": False})
        for s in range(6):  # slots 0..5 in seq-id order
            runner.sync(SyncItem(s, 0, tuple(range(3 + s, 13 + 2 * s))))
        runner.forward(list(range(6)), [[]] * 6, [1] * 6)
        for s in live:
            runner.sync(SyncItem(s, len(runner.seqs[s].tokens), (50 + s,)))
        out[name] = runner.forward(live, [[7, 8 + s] for s in live], [3] * len(live))
    torch.testing.assert_close(out["static"], out["dynamic"], rtol=1e-5, atol=1e-5)


def test_ragged_groups_split_a_prompt_off_decoding_rows_only_where_it_pays():
    assert ragged_groups([2] * 15 + [100]) == [list(range(15)), [15]]  # 1,600 padded positions vs 130
    assert ragged_groups([3, 300, 2, 2, 5]) == [[0, 2, 3, 4], [1]]  # in the caller's order
    assert ragged_groups([2, 2, 100, 100]) == [[0, 1, 2, 3]]  # saves 196 positions: below the floor
    assert ragged_groups([5, 60]) == [[0, 1]]
    assert ragged_groups([4] * 8) == [list(range(8))]
    assert ragged_groups([7]) == [[0]]


@pytest.mark.parametrize("options", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_a_join_beside_decoding_rows_runs_apart_with_the_same_logits(pair, options, monkeypatch):
    """Nine rows decoding (chains of 3) and a 60-token prompt joining: two forwards instead of one padded
    to 60 positions per row, with the logits (and so the K/V each row leaves behind) of the single forward."""
    target, _ = pair
    out, calls = {}, {}
    for name, floor in (("split", runner_module.RAGGED_MIN_SAVED), ("padded", 10**9)):
        monkeypatch.setattr(runner_module, "RAGGED_MIN_SAVED", floor)
        runner = ModelRunner(target, max_slots=12, max_len=96, **{**options, "fuse": False})
        for s in range(9):
            runner.sync(SyncItem(s, 0, tuple(range(3 + s, 13 + s))))
        runner.forward(list(range(9)), [[]] * 9, [1] * 9)
        runner.sync(SyncItem(9, 0, tuple(range(1, 61))))
        before = runner.stats.calls
        first = runner.forward(list(range(10)), [[7, 8, 9]] * 9 + [[]], [4] * 9 + [1])
        calls[name] = runner.stats.calls - before
        rows = [first[b, : 4 if b < 9 else 1].clone() for b in range(10)]
        for s in range(10):  # the next step reads every row's cached K/V
            runner.sync(SyncItem(s, len(runner.seqs[s].tokens), (40 + s,)))
        second = runner.forward(list(range(10)), [[]] * 10, [1] * 10)
        out[name] = (rows, second.clone())
    assert calls == {"split": 2, "padded": 1}
    for a, b in zip(out["split"][0], out["padded"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["split"][1], out["padded"][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [STATIC, DYNAMIC], ids=["static", "dynamic"])
@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ragged_rows_run_packed_with_the_padded_logits(pair, options, tree, monkeypatch):
    """Six rows feeding 1–6 tokens (chains cut short, a forced run on a few rows; the static path pads the
    batch to eight rows that feed nothing): packed, the GEMMs take the 17 real tokens instead of 36 or 48
    padded positions, and every row's logits and the K/V it leaves behind (read by the next step) are those
    of the padded forward."""
    target, _ = pair
    real_forward, packed_calls = runner_module.fwd.forward, []

    def counting(*args, **kwargs):
        packed_calls.append(kwargs.get("packed", False))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(runner_module.fwd, "forward", counting)
    widths = [1, 6, 2, 1, 4, 3]
    out = {}
    for name, ragged in (("packed", ModelRunner._ragged), ("padded", lambda feeds, rows, T: False)):
        monkeypatch.setattr(ModelRunner, "_ragged", staticmethod(ragged))
        runner = ModelRunner(target, max_slots=8, max_len=64, **{**options, "fuse": False})
        for s in range(6):
            runner.sync(SyncItem(s, 0, tuple(range(3 + s, 13 + 2 * s))))
        runner.forward(list(range(6)), [[]] * 6, [1] * 6)
        del packed_calls[:]
        if tree:  # node i's parent: i - 2 (two chains side by side), the first two children of the root
            parents = [[i - 2 if i > 1 else -1 for i in range(w - 1)] for w in widths]
            first = runner.tree_forward(list(range(6)), parents, [[20 + i for i in range(w - 1)] for w in widths])
            runner.commit_paths(list(range(6)), [list(range(0, w - 1, 2)) for w in widths])
        else:
            first = runner.forward(list(range(6)), [[20 + i for i in range(w - 1)] for w in widths], widths)
        assert packed_calls == [name == "packed"]
        rows = [first[b, :w].clone() for b, w in enumerate(widths)]
        for s in range(6):  # the next step reads every row's cached K/V
            runner.sync(SyncItem(s, len(runner.seqs[s].tokens), (40 + s,)))
        second = runner.forward(list(range(6)), [[]] * 6, [1] * 6)
        out[name] = (rows, second.clone())
    for a, b in zip(out["packed"][0], out["padded"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["packed"][1], out["padded"][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_rms_norm_matches_the_models_own(dtype, tol):
    """The CUDA forward's RMSNorm (``forward.rms_norm``) against the model's module, same dtype."""
    from runtime.forward import rms_norm

    model = tiny_llama(5).to(dtype)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape) + 0.5)
        x = (torch.randn(3, 7, norm.weight.shape[0]) * 3).to(dtype)
        torch.testing.assert_close(rms_norm(norm, x), norm(x), rtol=tol, atol=tol)
