"""Paged KV and the prefix cache (``runtime/kv_cache.py``, ``ModelRunner``, ``Engine`` admission).

- Block tables scattered over the pool give Hugging Face's logits, as a run of blocks does.
- A sequence whose prompt starts with cached blocks feeds only the rest and gets the same logits; sequences
  sharing blocks never write into them (a shared block is copied first); drafts never enter the cache.
- Greedy outputs are HF's with paging on, with the prefix cache on and off, for chains, trees, micro-batches
  and a pool too small for the load (sequences preempted and re-prefilled); seeded samples are unchanged by
  preemption; a request that can never fit is refused at admission.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Request
from runtime.kv_cache import block_run
from runtime.protocol import SamplingParams, SyncItem
from runtime.runner import ModelRunner
from tests.unit.helpers import MAX_NEW, draft_runner, hf_greedy, make_engine, make_prompts, run_to_end, target_runner

pytestmark = pytest.mark.timeout(300)


def _hf_logits(model, tokens):  # [len(tokens), V]
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_scattered_block_tables_give_hf_logits(target):
    """Three sequences prefilled one token at a time in turn take their blocks interleaved; a batched forward
    with drafts over those tables matches HF, and every block comes back when they are released."""
    runner = ModelRunner(target, max_slots=3, max_len=64, block_size=4, prefix_cache=False)
    prompts = make_prompts(31, n=3, lo=9, hi=21)
    for t in range(max(len(p) for p in prompts)):
        for i, p in enumerate(prompts):
            if t < len(p):
                assert runner.sync(SyncItem(i, t, (p[t],)))
                runner.forward([i], [[]], [1])
    tables = [runner.seqs[i].blocks for i in range(3)]
    assert block_run(tables) is None and len({b for t in tables for b in t}) == sum(map(len, tables))
    drafts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    logits = runner.forward(range(3), drafts, [len(d) + 1 for d in drafts])
    for i, p in enumerate(prompts):
        n = len(drafts[i]) + 1
        _close(logits[i, :n], _hf_logits(target, list(p) + drafts[i])[-n:])
    assert runner.pool.blocks_in_use == sum(-(-(len(p) + len(d)) // 4) for p, d in zip(prompts, drafts))
    runner.release(range(3))
    assert runner.pool.blocks_in_use == 0


def test_a_cached_prefix_is_reused_shared_and_never_written(target):
    runner = ModelRunner(target, max_slots=4, max_len=96, block_size=4)
    system = list(make_prompts(32, n=2, lo=30, hi=30)[0])  # 30 tokens: 7 full blocks
    assert runner.sync(SyncItem(0, 0, tuple(system)))
    runner.forward([0], [[]], [1])
    runner.release([0])
    assert runner.pool.blocks_in_use == 0 and runner.pool.cached_blocks == 7

    # Two sequences start from the cached 28 tokens and feed only their own rest.
    prompts = [system + [40, 41, 42, 43, 44], system + [50, 51]]
    fed = runner.stats.tokens_fed
    for i, p in enumerate(prompts, start=1):
        assert runner.sync(SyncItem(i, 0, tuple(p)))
        assert runner.seqs[i].valid == 28
    logits = runner.forward([1, 2], [[], []], [1, 1])
    assert runner.stats.tokens_fed - fed == (35 - 28) + (32 - 28)
    assert runner.seqs[1].blocks[:7] == runner.seqs[2].blocks[:7]  # the same blocks, held twice
    assert runner.pool.hit_tokens == 56
    for i, p in enumerate(prompts):
        _close(logits[i, 0], _hf_logits(target, p)[-1])

    # Sequence 2 is told its history changed inside the shared blocks: it copies them before writing.
    shared = list(runner.seqs[1].blocks[:7])
    changed = system[:10] + [60, 61, 62]
    assert runner.sync(SyncItem(2, 10, tuple(changed[10:])))
    logits = runner.forward([1, 2], [[70], []], [2, 1])
    assert runner.seqs[1].blocks[:7] == shared and runner.seqs[2].blocks[2] != shared[2]
    _close(logits[0, :2], _hf_logits(target, prompts[0] + [70])[-2:])
    _close(logits[1, 0], _hf_logits(target, changed)[-1])


def test_drafts_never_enter_the_prefix_cache(target):
    runner = ModelRunner(target, max_slots=2, max_len=64, block_size=4)
    prompt, drafts = [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]
    assert runner.sync(SyncItem(0, 0, tuple(prompt)))
    runner.forward([0], [drafts], [len(drafts) + 1])  # the drafts' K/V fill two more blocks
    assert runner.sync(SyncItem(0, 8, (30,)))  # every draft rejected
    runner.release([0])
    assert runner.sync(SyncItem(1, 0, tuple(prompt + drafts + [31])))
    assert runner.seqs[1].valid == 8  # the prompt's two blocks, not the drafts'
    _close(runner.forward([1], [[]], [1])[0, 0], _hf_logits(target, prompt + drafts + [31])[-1])


def _shared_prefix_prompts(n: int, prefix: int = 21):
    system = list(make_prompts(33, n=2, lo=prefix, hi=prefix)[0])
    return [tuple(system + list(p)) for p in make_prompts(34, n=n, lo=1, hi=12)]


@pytest.fixture(scope="module")
def shared_prompts(target):
    prompts = _shared_prefix_prompts(6)
    return prompts, [hf_greedy(target, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("case", ["chain", "chain-no-cache", "tree", "micro-batches", "ngram"])
def test_greedy_outputs_are_hf_with_paging_and_the_prefix_cache(case, target, noisy_draft, shared_prompts):
    """Two rounds over prompts sharing a 21-token prefix: the second round starts from cached blocks."""
    prompts, refs = shared_prompts
    kw = {"chain": {}, "chain-no-cache": {"kv": {"block_size": 4, "prefix_cache": False}},
          "tree": {"tree_nodes": 16}, "micro-batches": {"micro_batches": 2},
          "ngram": {}}[case]
    kw.setdefault("kv", {"block_size": 4})
    engine = make_engine(target, "ngram" if case == "ngram" else noisy_draft, gamma=4, **kw)
    for round_ in range(2):
        outputs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
        assert [o.tokens for o in outputs] == refs
        if round_ and case != "chain-no-cache":  # each response counts the prompt tokens its verifier found cached
            assert all(o.stats.cached_tokens >= 20 for o in outputs), [o.stats.cached_tokens for o in outputs]
    runners = [r for r in (target_runner(engine), draft_runner(engine)) if r is not None]
    for runner in runners:
        assert runner.slots_in_use == 0 and runner.pool.blocks_in_use == 0
        assert (runner.pool.hit_tokens > 0) == (case != "chain-no-cache")


def test_a_small_pool_preempts_and_loses_nothing(target, noisy_draft, prompts, refs):
    """A pool of 48 blocks of 4 holds about 3 of the 16 sequences at full length: the youngest are preempted
    as the others grow, re-prefilled later, and every output is still HF's."""
    engine = make_engine(target, noisy_draft, gamma=4, kv={"block_size": 4, "blocks": 48})
    outputs = engine.generate([Request(p, max_tokens=MAX_NEW) for p in prompts])
    assert [o.tokens for o in outputs] == refs
    assert engine.preemptions > 0
    assert target_runner(engine).pool.blocks_in_use == 0 and draft_runner(engine).pool.blocks_in_use == 0


def test_preemption_does_not_change_a_seeded_sample(target, noisy_draft, prompts):
    sampled = [Request(p, max_tokens=MAX_NEW, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i))
               for i, p in enumerate(prompts[:8])]
    roomy = make_engine(target, noisy_draft, gamma=4).generate(sampled)
    small = make_engine(target, noisy_draft, gamma=4, kv={"block_size": 4, "blocks": 40})
    assert [o.tokens for o in small.generate(sampled)] == [o.tokens for o in roomy]
    assert small.preemptions > 0


def test_a_request_that_can_never_fit_is_refused_at_admission(target):
    engine = make_engine(target, None, speculate=False, kv={"block_size": 4, "blocks": 8})
    with pytest.raises(ValueError, match="kv.num_blocks"):
        engine.add(Request(tuple(range(3, 23)), max_tokens=20))
    run_to_end(engine)
    engine.add(Request(tuple(range(3, 13)), max_tokens=8))  # 10 + 8 + headroom fits 8 × 4 positions


def test_a_block_taken_out_of_turn_keeps_the_free_count_and_the_heap_right():
    """``allocate(after=b)`` takes block b + 1 when it is free, so that a sequence growing past a cached prefix
    keeps one run of blocks (read as a view); the heap's stale entry for it is skipped, never handed out twice."""
    from runtime.kv_cache import KVPool
    pool = KVPool(num_layers=1, num_blocks=8, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu", prefix_cache=False)
    held = [pool.allocate() for _ in range(4)]
    assert held == [0, 1, 2, 3]
    pool.release(1)
    assert pool.allocate(after=3) == 4  # out of turn: 1 is lower
    assert pool.allocate(after=0) == 1  # 1 is free again and follows 0
    assert pool.allocate(after=2) == 5  # 3 is held: the lowest free one
    assert pool.blocks_in_use == 6
    pool.release(4)
    assert [pool.allocate() for _ in range(3)] == [4, 6, 7]  # 5's stale entry skipped, 4 queued once
    assert pool.blocks_in_use == 8
    with pytest.raises(Exception, match="in use"):
        pool.allocate()
    for b in range(8):
        pool.release(b)
    assert pool.blocks_in_use == 0 and sorted(pool.allocate() for _ in range(8)) == list(range(8))
