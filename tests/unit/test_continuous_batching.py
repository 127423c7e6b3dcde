"""Continuous batching and the KV cache: sequences join, leave and resync without changing any output.

- Joining and cancelling mid-generation leaves every other sequence token-identical to the reference,
  and frees the KV slots of both stages (with one and with two micro-batches).
- A stage that loses a sequence (eviction, restart) answers ``resync`` and costs a re-prefill, never a
  token.
- Rollback is bookkeeping: the pool tensors are allocated once (same ``data_ptr`` for the whole
  generation), a sync after a rejection writes nothing, and the next forward feeds only the new token
  yet matches Hugging Face's logits for the committed sequence.
"""

from __future__ import annotations

import pytest
import torch

from runtime import wire
from tests.unit.helpers import (MAX_LEN, MAX_NEW, VOCAB, draft_runner, make_engine, make_prompts, run_to_end,
                                target_runner)
from engine.engine import SEQ_ID_BLOCK, Done, Engine, LocalStages, Request, random_first_seq_id
from runtime.kv_cache import KVPoolFull
from runtime.protocol import SyncItem
from runtime.runner import ModelRunner, SequenceTooLong

pytestmark = pytest.mark.timeout(300)


def _draft(name, noisy_draft):
    return {"noisy": noisy_draft, "ngram": "ngram"}[name]


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_join_and_cancel_mid_generation(draft, micro_batches, target, noisy_draft, prompts, refs):
    engine = make_engine(target, _draft(draft, noisy_draft), gamma=4, micro_batches=micro_batches)
    runners = [r for r in (target_runner(engine), draft_runner(engine)) if r is not None]
    ids: dict[int, int] = {}

    def add(*which):
        for i in which:
            ids[i] = engine.add(Request(prompts[i], max_tokens=MAX_NEW if i != 3 else 4))

    def step():
        engine.step()
        for r in runners:  # finished and cancelled sequences give their slots back at once
            assert r.slots_in_use <= len(engine.running)

    add(0, 1, 2, 3, 4)
    for _ in range(3):
        step()
    add(5, 6, 7, 8, 9)
    step()
    step()
    engine.cancel(ids[1])  # running since the start
    engine.cancel(ids[7])  # joined two steps ago
    add(10, 11, 12, 13, 14, 15)
    engine.cancel(ids[12])  # still waiting: never admitted
    step()
    while engine.has_work:
        step()

    cancelled = {1, 7, 12}
    for i in range(len(prompts)):
        out = engine.output(ids[i])
        if i in cancelled:
            assert out.finish_reason == "cancelled"
            assert out.tokens == refs[i][: len(out.tokens)]
        else:
            expected = refs[i][:4] if i == 3 else refs[i]
            assert out.tokens == expected, f"prompt {i}"
            assert out.finish_reason == "length"
    assert not engine.running and not engine.waiting and not engine.finished
    for r in runners:
        assert r.slots_in_use == 0
        assert r.seqs == {}
    if draft == "ngram":
        assert engine.stages.proposer.histories == {}


def test_cancel_is_idempotent_and_ignores_unknown_ids(target, prompts, refs):
    engine = make_engine(target, "same", gamma=2)
    a = engine.add(Request(prompts[0], max_tokens=MAX_NEW))
    engine.step()
    engine.cancel(a)
    engine.cancel(a)
    engine.cancel(12345)
    events = run_to_end(engine)
    assert [e.finish_reason for e in events] == ["cancelled"]
    assert engine.output(a).finish_reason == "cancelled"
    assert target_runner(engine).slots_in_use == 0


def test_micro_batch_that_empties_and_refills(target, noisy_draft, prompts, refs):
    """A micro-batch whose sequences all finish, then gets new ones, while the other keeps running."""
    engine = make_engine(target, noisy_draft, gamma=3, micro_batches=2)
    long = engine.add(Request(prompts[0], max_tokens=MAX_NEW))  # micro-batch 0
    short = engine.add(Request(prompts[1], max_tokens=2))  # micro-batch 1: done after a step or two
    for _ in range(6):
        engine.step()
    assert short in engine.finished
    late = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in prompts[2:6]]
    run_to_end(engine)
    assert engine.output(long).tokens == refs[0]
    assert engine.output(short).tokens == refs[1][:2]
    for i, sid in enumerate(late):
        assert engine.output(sid).tokens == refs[2 + i]


def test_rows_finishing_together_are_released_in_one_call_per_micro_batch(target, prompts, refs):
    """A step that finishes many rows sends each stage one release (a compiled-graph worker has a bound on
    executions in flight, and every Serve call costs milliseconds), as does a burst of cancellations."""
    engine = make_engine(target, "same", gamma=2, micro_batches=2)
    calls = []
    release = engine.stages.release
    engine.stages.release = lambda seq_ids, shard=0: (calls.append((shard, sorted(seq_ids))), release(seq_ids, shard))
    ids = [engine.add(Request(p, max_tokens=3)) for p in prompts[:8]]
    run_to_end(engine)
    assert [engine.output(i).tokens for i in ids] == [r[:3] for r in refs[:8]]
    assert sorted(i for _, seq_ids in calls for i in seq_ids) == sorted(ids)  # each released once
    assert len(calls) <= 4 and {shard for shard, _ in calls} == {0, 1}, calls  # not one call per row
    calls.clear()
    more = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in prompts[:6]]
    engine.step()
    for i in more:
        engine.cancel(i)
    engine.cancel(more[0])
    run_to_end(engine)
    assert sorted(i for _, seq_ids in calls for i in seq_ids) == sorted(more)
    assert len(calls) == 2, calls  # one per micro-batch, the repeated cancel ignored
    assert target_runner(engine).slots_in_use == 0


@pytest.mark.parametrize("distinct", [True, False], ids=["own ids", "both from 0"])
def test_two_engines_on_the_same_stages(distinct, target, noisy_draft, prompts, refs):
    """While a redeploy rolls the app, the old and the new router reach the same stage replicas, which key
    their caches by sequence id alone. Engines numbering from their own ``random_first_seq_id`` both decode
    exactly, interleaved step by step; both counting from 0 (the negative control, as routers did) verify
    one router's sequences against the other's caches."""
    firsts = (random_first_seq_id(), random_first_seq_id()) if distinct else (0, 0)
    old = make_engine(target, noisy_draft, gamma=4, first_seq_id=firsts[0])
    new = Engine(old.stages, max_len=MAX_LEN, max_running=len(prompts), first_seq_id=firsts[1])
    if distinct:
        assert firsts[0] != firsts[1] and all(f % SEQ_ID_BLOCK == 0 and f < 1 << 62 for f in firsts)
    old_ids = [old.add(Request(p, max_tokens=MAX_NEW)) for p in prompts[:8]]
    old.step()
    old.step()
    new_ids = [new.add(Request(p, max_tokens=MAX_NEW)) for p in prompts[8:]]
    while old.has_work or new.has_work:
        for engine in (old, new):
            if engine.has_work:
                engine.step()
    outputs = [old.output(i).tokens for i in old_ids] + [new.output(i).tokens for i in new_ids]
    wrong = [i for i, (o, r) in enumerate(zip(outputs, refs)) if o != r]
    assert (not wrong) if distinct else wrong, wrong


@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_stage_losing_a_sequence_resyncs(draft, target, noisy_draft, prompts, refs):
    """Drop sequences from the proposer and from the verifier mid-generation: outputs are unchanged."""
    engine = make_engine(target, _draft(draft, noisy_draft), gamma=4)
    ids = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in prompts]
    for _ in range(3):
        engine.step()
    engine.stages.proposer.release([ids[0], ids[1]])  # a draft replica restarted
    engine.stages.verifier.release([ids[1], ids[2]])  # the verifier evicted these
    engine.step()
    engine.stages.verifier.release([ids[5]])
    run_to_end(engine)
    for i, sid in enumerate(ids):
        assert engine.output(sid).tokens == refs[i], f"prompt {i}"
    assert target_runner(engine).slots_in_use == 0


def test_kv_pool_is_allocated_once(target, noisy_draft, prompts, refs):
    """Rollback after every rejection is O(1): no reallocation, no copy, for the whole generation."""
    engine = make_engine(target, noisy_draft, gamma=4)
    pools = [target_runner(engine).pool, draft_runner(engine).pool]
    before = [(p.k.data_ptr(), p.v.data_ptr(), p.k.shape, p.v.shape) for p in pools]
    ids = [engine.add(Request(p, max_tokens=MAX_NEW)) for p in prompts]
    while engine.has_work:
        engine.step()
        assert [(p.k.data_ptr(), p.v.data_ptr(), p.k.shape, p.v.shape) for p in pools] == before
    assert engine.stats.rejections > 50  # many rollbacks happened
    assert [engine.output(i).tokens for i in ids] == refs


def _hf_last_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_runner_rollback_is_bookkeeping_and_exact(target):
    """Feed prompts + drafts, commit only part of the drafts plus another token, feed again.

    The sync writes nothing to the pool, the next forward feeds one token per row (the accepted drafts'
    K/V are reused, the rejected ones overwritten), and its logits equal HF's on the committed sequence.
    """
    runner = ModelRunner(target, max_slots=4, max_len=64)
    prompts = make_prompts(21, n=4, hi=20)
    gen = torch.Generator().manual_seed(0)
    drafts = [torch.randint(3, 96, (5,), generator=gen).tolist() for _ in prompts]
    for i, p in enumerate(prompts):
        assert runner.sync(SyncItem(i, 0, p))
    logits = runner.forward(range(4), drafts, [6] * 4)  # [4, 6, V]
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], _hf_last_logits(target, list(p) + drafts[i])[-6:], atol=1e-4, rtol=1e-4)

    kept = [0, 2, 5, 3]  # accepted drafts per row (5 = all of them: the bonus follows)
    extra = [7, 8, 9, 10]  # the recovered / bonus token
    committed = []
    pool_k, pool_v = runner.pool.k.clone(), runner.pool.v.clone()
    for i, p in enumerate(prompts):
        new = tuple(drafts[i][: kept[i]]) + (extra[i],)
        assert runner.sync(SyncItem(i, len(p), new))
        assert runner.seqs[i].valid == len(p) + kept[i]
        committed.append(list(p) + list(new))
    assert torch.equal(runner.pool.k, pool_k) and torch.equal(runner.pool.v, pool_v)

    fed = runner.stats.tokens_fed
    logits = runner.forward(range(4), [[]] * 4, [1] * 4)
    assert runner.stats.tokens_fed - fed == 4
    for i in range(4):
        torch.testing.assert_close(logits[i, 0], _hf_last_logits(target, committed[i])[-1], atol=1e-4, rtol=1e-4)


def test_runner_limits_and_resync(target):
    runner = ModelRunner(target, max_slots=2, max_len=16)
    assert not runner.sync(SyncItem(0, 3, (5,)))  # unknown sequence with base > 0: needs the whole history
    assert runner.sync(SyncItem(0, 0, (5, 6, 7)))
    assert not runner.sync(SyncItem(0, 4, (8,)))  # holds 3 tokens, told it holds 4
    assert runner.sync(SyncItem(1, 0, (5,)))
    with pytest.raises(KVPoolFull):
        runner.sync(SyncItem(2, 0, (5,)))
    with pytest.raises(SequenceTooLong):
        runner.sync(SyncItem(0, 3, tuple(range(3, 17))))
    runner.release([0, 1, 99])
    assert runner.slots_in_use == 0 and not runner.holds(0)


class WireStages(LocalStages):
    """In-process stages whose frames go through the real wire codec, so a verify whose rows differ from
    its proposal's is refused exactly as the verifier deployment refuses it."""

    def __init__(self, engine: Engine, limits: wire.WireLimits):
        super().__init__(engine.stages.verifier, engine.stages.proposer)
        self.limits = limits

    def submit_propose(self, items, shard=0):
        items = wire.decode_propose(wire.encode_propose(items), self.limits)
        return Done(wire.decode_proposal(wire.encode_proposal(super().submit_propose(items, shard).result()),
                                         self.limits))

    def submit_verify(self, items, proposal, shard=0):
        items, proposal = wire.decode_verify(wire.encode_verify(items, proposal), self.limits)
        return super().submit_verify(items, proposal, shard)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_joins_never_meet_a_proposal_in_flight(micro_batches, target, noisy_draft, prompts, refs):
    """Sequences that join while their micro-batch's proposal is in flight wait for the group's next turn:
    no verify is refused, nothing re-prefills, every output is the reference."""
    engine = make_engine(target, noisy_draft, gamma=4, micro_batches=micro_batches)
    engine.stages = WireStages(engine, wire.WireLimits(vocab_size=VOCAB, gamma_max=8, max_batch=64, max_seq_len=MAX_LEN))
    ids = {}
    for i in range(len(prompts)):  # one arrival per step: every join lands while a proposal is in flight
        ids[i] = engine.add(Request(prompts[i], max_tokens=MAX_NEW))
        engine.step()
        if i == 9:
            engine.cancel(ids[4])  # a row of an in-flight proposal leaves
    run_to_end(engine)
    for i in range(len(prompts)):
        out = engine.output(ids[i])
        expected = refs[i][: len(out.tokens)] if i == 4 else refs[i]
        assert out.tokens == expected, f"prompt {i}"
    assert engine.verifier_resyncs == 0
