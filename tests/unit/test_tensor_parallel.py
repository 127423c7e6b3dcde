"""Tensor parallelism without Ray: two ranks (torch.multiprocessing, gloo) against the single-process target.

One two-rank job per module (``tp2`` fixture) does all the distributed work and saves what each rank saw;
the tests compare it with TP = 1 computed here. Both ranks drive identical engines (same prompts, same
draft proposer, same steps), which is the lockstep contract of ``verifier.tensor_parallel``: every rank
runs every forward, with the same inputs.

The ranks are forked, not spawned: a spawned child re-imports torch, transformers and deepspeed (~25 s on
a 2-core box), a forked one inherits them. The parent runs one intra-op thread (tests/unit/conftest.py)
and no process group, which is what makes forking safe here.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from draftpool.draft_model import DraftModelProposer
from tests.unit.helpers import MAX_LEN, MAX_NEW, NOISE, NUM_PROMPTS
from engine.engine import Engine, LocalStages, Request
from engine.gamma import GammaPolicy
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import SamplingParams, SyncItem
from runtime.runner import ModelRunner
from verifier.tensor_parallel import (DistConfig, TensorParallelError, TPVerifierRank, check_tp_divides,
                                      cpu_shm_op_built, free_port, interface_of, linear_weight_numel, load_target,
                                      shm_segment, tp_grain_size_for)
from verifier.verify import VerifyStage

TP = 2
SPEC = {"tiny": {"seed": 0}}  # heads 4, kv heads 2: both divide by 2
GAMMA = 4
FORWARD_PROMPTS = [(5, 6, 7), tuple(range(3, 40)), (9,), tuple(range(50, 62))]
FORWARD_DRAFTS = [[11, 12], [], [13, 14, 15, 16], [17]]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)


def _forward_logits(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of ragged prompts with drafts, then one decode step: logits [B, N, V] of both calls."""
    for seq_id, prompt in enumerate(FORWARD_PROMPTS):
        assert runner.sync(SyncItem(seq_id, 0, prompt))
    ids = list(range(len(FORWARD_PROMPTS)))
    prefill = runner.forward(ids, FORWARD_DRAFTS, [len(d) + 1 for d in FORWARD_DRAFTS])
    for seq_id, d in zip(ids, FORWARD_DRAFTS):
        assert runner.sync(SyncItem(seq_id, len(FORWARD_PROMPTS[seq_id]), tuple(d[:1]) or (3,)))
    decode = runner.forward(ids, [[20]] * len(ids), [2] * len(ids))
    return prefill, decode


def _engine(stage: VerifyStage) -> Engine:
    # Fixed γ: the adaptive policy reads measured step times, which differ between ranks, and ranks that
    # choose different γ run different forwards (gloo aborts on the mismatched all-reduce sizes).
    proposer = DraftModelProposer(noisy_copy(tiny_llama(0), NOISE, 1), max_slots=NUM_PROMPTS, max_len=MAX_LEN)
    return Engine(LocalStages(stage, proposer), policy=GammaPolicy(gamma=GAMMA, gamma_max=8, adaptive=False),
                  max_len=MAX_LEN)


def _generate(stage: VerifyStage, prompts, sampling: SamplingParams) -> list[list[int]]:
    outputs = _engine(stage).generate([Request(p, max_tokens=MAX_NEW, sampling=sampling) for p in prompts])
    return [list(o.tokens) for o in outputs]


def _rank_main(rank: int, port: int, prompts, out_dir: str, model_dir: str) -> None:
    """One rank: join the group, shard, then the same forwards and engine runs as every other rank."""
    t0 = time.perf_counter()
    dist = DistConfig(rank=rank, world_size=TP, master_addr="127.0.0.1", master_port=port, timeout_s=60)
    tp = TPVerifierRank(SPEC, dist, device="cpu", dtype="float32", max_slots=NUM_PROMPTS, max_len=MAX_LEN,
                        threads=1)
    try:
        result = {"info": tp.info(), "kv_shape": list(tp.runner.pool.k.shape)}
        runner = ModelRunner(tp.model, max_slots=len(FORWARD_PROMPTS), max_len=MAX_LEN)  # same shards
        result["prefill"], result["decode"] = _forward_logits(runner)
        result["greedy"] = _generate(tp.stage, prompts, SamplingParams())
        result["sampled"] = _generate(tp.stage, prompts[:6], SAMPLED)
        # Per-rank shard loading: the model is built on the meta device and each rank reads only its shards
        # of the safetensors files (the process group and AutoTP's TP group are reused).
        meta_model, result["meta_load"] = load_target({"path": model_dir}, tp_size=TP, device=torch.device("cpu"),
                                                      dtype=torch.float32, load="meta")
        result["meta_linear_numel"] = linear_weight_numel(meta_model)
        meta_runner = ModelRunner(meta_model, max_slots=len(FORWARD_PROMPTS), max_len=MAX_LEN)
        result["meta_prefill"], result["meta_decode"] = _forward_logits(meta_runner)
        result["seconds"] = time.perf_counter() - t0
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        tp.shutdown()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, prompts, target):
    out = tmp_path_factory.mktemp("tp2")
    model_dir = tmp_path_factory.mktemp("tiny_target")
    target.save_pretrained(model_dir)  # safetensors, for the per-rank (meta device) loading path
    t0 = time.perf_counter()
    mp.start_processes(_rank_main, args=(free_port("127.0.0.1"), prompts, str(out), str(model_dir)), nprocs=TP,
                       join=True, start_method="fork")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(TP)]
    print(f"two-rank TP job: {time.perf_counter() - t0:.1f} s")
    return ranks


@pytest.fixture(scope="module")
def tp1(target):
    return VerifyStage(ModelRunner(target, max_slots=NUM_PROMPTS, max_len=MAX_LEN))


def test_sharded_forward_matches_single_process(tp2, target):
    prefill, decode = _forward_logits(ModelRunner(target, max_slots=len(FORWARD_PROMPTS), max_len=MAX_LEN))
    for rank in tp2:
        torch.testing.assert_close(rank["prefill"], prefill, atol=1e-5, rtol=0)
        torch.testing.assert_close(rank["decode"], decode, atol=1e-5, rtol=0)
    assert torch.equal(tp2[0]["prefill"], tp2[1]["prefill"])  # all-reduced logits: bitwise equal on all ranks


def test_per_rank_shard_loading_from_safetensors(tp2, target):
    prefill, decode = _forward_logits(ModelRunner(target, max_slots=len(FORWARD_PROMPTS), max_len=MAX_LEN))
    for rank in tp2:
        assert rank["meta_load"] == "meta"
        assert rank["meta_linear_numel"] * TP == linear_weight_numel(target)
        torch.testing.assert_close(rank["meta_prefill"], prefill, atol=1e-5, rtol=0)
        torch.testing.assert_close(rank["meta_decode"], decode, atol=1e-5, rtol=0)


def test_greedy_outputs_match_tp1_and_hf(tp2, tp1, prompts, refs):
    expected = _generate(tp1, prompts, SamplingParams())
    assert expected == [list(r) for r in refs]
    for rank in tp2:
        assert rank["greedy"] == expected


def test_ranks_agree_on_sampled_outputs(tp2):
    assert tp2[0]["sampled"] == tp2[1]["sampled"]
    assert all(len(o) == MAX_NEW for o in tp2[0]["sampled"])


def test_each_rank_holds_half_the_weights_and_kv_heads(tp2, target):
    full = linear_weight_numel(target)
    config = target.config
    for rank in tp2:
        info = rank["info"]
        assert info["linear_weight_numel"] * TP == full
        assert info["local_kv_heads"] == config.num_key_value_heads // TP
        assert info["local_attention_heads"] == config.num_attention_heads // TP
        assert rank["kv_shape"][3] == config.num_key_value_heads // TP
        assert info["backend"] == "gloo" and not info["shm_allreduce"]  # no JIT-built shm op by default
        assert info["load"] == "full" and info["torch_threads"] == 1
    single = ModelRunner(target, max_slots=NUM_PROMPTS, max_len=MAX_LEN).pool
    assert tp2[0]["info"]["kv_pool_bytes"] * TP == 2 * single.k.numel() * single.k.element_size()


def _shm_rank_main(rank: int, port: int, out_dir: str) -> None:
    dist = DistConfig(rank=rank, world_size=TP, master_addr="127.0.0.1", master_port=port, timeout_s=60,
                      cpu_shm_allreduce=True)
    tp = TPVerifierRank(SPEC, dist, device="cpu", dtype="float32", max_slots=len(FORWARD_PROMPTS), max_len=MAX_LEN,
                        threads=1)
    try:
        segment_left = os.path.exists(shm_segment(dist))
        prefill, decode = _forward_logits(tp.runner)
        torch.save({"info": tp.info(), "segment_left": segment_left, "prefill": prefill, "decode": decode},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        tp.shutdown()


@pytest.mark.skipif(not cpu_shm_op_built(), reason="DeepSpeed's CPU shm all-reduce op is not pre-built (its JIT "
                    "build takes minutes); see docs/tensor_parallel.md to build it once")
def test_opt_in_shm_allreduce_matches_and_leaves_nothing_in_dev_shm(tmp_path, target):
    mp.start_processes(_shm_rank_main, args=(free_port("127.0.0.1"), str(tmp_path)), nprocs=TP, join=True,
                       start_method="fork")
    prefill, decode = _forward_logits(ModelRunner(target, max_slots=len(FORWARD_PROMPTS), max_len=MAX_LEN))
    for r in range(TP):
        rank = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert rank["info"]["shm_allreduce"] and not rank["segment_left"]  # unlinked once every rank mapped it
        torch.testing.assert_close(rank["prefill"], prefill, atol=1e-5, rtol=0)
        torch.testing.assert_close(rank["decode"], decode, atol=1e-5, rtol=0)


def test_tp_size_must_divide_heads(target):
    check_tp_divides(target.config, 2)
    with pytest.raises(TensorParallelError, match="num_attention_heads"):
        check_tp_divides(target.config, 3)
    with pytest.raises(TensorParallelError, match="num_key_value_heads"):
        check_tp_divides(target.config, 4)


def test_grain_size_keeps_tiny_models_even():
    assert tp_grain_size_for(tiny_llama(0).config, 2) == 1  # hidden 64: grain 64 would starve rank 1

    class Big:
        hidden_size, intermediate_size = 4096, 14336

    assert tp_grain_size_for(Big, 8) == 64


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", ""])
def test_rendezvous_refuses_wildcard_addresses(addr):
    with pytest.raises(ValueError):
        DistConfig(rank=0, world_size=2, master_addr=addr, master_port=29500)


def test_interface_of_finds_the_interface_holding_an_address():
    # init_distributed points gloo at this interface: the one peers on other hosts reach the rank through.
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: held by no interface here
