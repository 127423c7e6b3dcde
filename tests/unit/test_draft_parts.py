"""A micro-batch's draft call in parts (``StageClient._parts``, ``draft_pool.batch_size`` rows each) and the
parts' proposals joined again (``ProposalBatch.concat``): a sequence keeps its part while it lives, so its
draft KV stays on one replica; newcomers fill the lowest part with room; a release goes to its part; the
joined batch holds every row as its part drafted it, in the micro-batch's order."""

from __future__ import annotations

import pytest
import torch

from deployments.transport.client import StageClient
from runtime import wire
from runtime.protocol import ProposalBatch, ProposeItem, SyncItem

LIMITS = wire.WireLimits(vocab_size=64, gamma_max=8, max_batch=64, max_seq_len=256)


def _client(rows: int | None) -> StageClient:
    return StageClient(LIMITS, draft=None, verifier=None, draft_timeout_s=1, verify_timeout_s=1,
                       draft_rows=rows)


def _items(*seq_ids: int) -> list[ProposeItem]:
    return [ProposeItem(SyncItem(s, 0, (1, 2)), gamma=2) for s in seq_ids]


def _parts(client: StageClient, *seq_ids: int) -> dict[int, list[int]]:
    return {part: [it.sync.seq_id for it in items] for part, items in client._parts(_items(*seq_ids))}


def test_rows_fill_parts_of_batch_size_and_keep_them_while_they_live():
    client = _client(2)
    assert _parts(client, 1, 2, 3, 4, 5) == {0: [1, 2], 1: [3, 4], 2: [5]}
    # 2 finished: 6 takes its place in part 0; the others stay where their draft KV is, whatever the order.
    assert _parts(client, 5, 6, 4, 3, 1) == {0: [6, 1], 1: [4, 3], 2: [5]}
    assert _parts(client, 7) == {0: [7]}  # a part with room takes a newcomer, though others hold nothing now


def test_without_a_row_limit_a_micro_batch_is_one_call():
    client = _client(None)
    assert _parts(client, *range(40)) == {0: list(range(40))}
    assert client._parts([]) == [(0, [])]


class _Route:
    """Records releases (the stage side of a release is a fire-and-forget call)."""

    def __init__(self):
        self.released = []

    def release(self, call: bytes, shard: int, timeout_s: float, part: int = 0) -> None:
        self.released.append((shard, part, wire.decode_release(call[len(wire.OP_RELEASE):], LIMITS).seq_ids))


def test_a_release_goes_to_each_part_that_holds_the_sequences_and_frees_their_place():
    client = _client(2)
    client.draft, client.verifier = _Route(), _Route()
    _parts(client, 1, 2, 3)
    client.release([3, 1], shard=1)
    assert client.draft.released == [(1, 0, (1,)), (1, 1, (3,))]
    assert client.verifier.released == [(1, 0, (3, 1))]
    assert _parts(client, 2, 4, 5) == {0: [2, 4], 1: [5]}


def _batch(seq_ids, tokens, q=None, parents=None, resync=(), seconds=0.0) -> ProposalBatch:
    t = torch.tensor(tokens, dtype=torch.long).view(len(seq_ids), -1)
    q_ids = q_probs = None
    if q is not None:
        q_ids = torch.tensor(q[0], dtype=torch.long)
        q_probs = torch.tensor(q[1], dtype=torch.float32)
    return ProposalBatch(list(seq_ids), t, (t != 0).sum(-1), q_ids, q_probs,
                         None if parents is None else torch.tensor(parents, dtype=torch.long),
                         resync=list(resync), draft_seconds=seconds)


def test_concat_keeps_each_row_as_drafted_and_writes_q_out_where_a_part_sent_none():
    sampled = _batch([7], [[5, 6, 9]], q=([[[5, 1], [6, 2], [9, 3]]], [[[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]]]),
                     seconds=0.2)
    greedy = _batch([3, 4], [[8, 0], [2, 4]], resync=[4], seconds=0.3)
    joined = ProposalBatch.concat([sampled, greedy]).select([3, 7, 4])
    assert joined.seq_ids == [3, 7, 4] and joined.lengths.tolist() == [1, 3, 2]
    assert [joined.row_tokens(b) for b in range(3)] == [[8], [5, 6, 9], [2, 4]]
    assert joined.q_ids[1].tolist() == sampled.q_ids[0].tolist()  # the sampled row's q as it came
    assert joined.q_probs[2, :2].tolist() == [[1.0, 0.0], [1.0, 0.0]]  # greedy: one-hot on its drafts
    assert joined.q_ids[2, :2, 0].tolist() == [2, 4]
    assert joined.resync == [4] and joined.draft_seconds == 0.3  # parts drafted side by side
    assert joined.parents is None


def test_concat_writes_chains_as_trees_next_to_a_tree():
    tree = _batch([1], [[4, 5, 6]], parents=[[-1, -1, 0]])
    chain = _batch([2], [[7, 8]])
    joined = ProposalBatch.concat([tree, chain])
    assert joined.row_parents(0) == [-1, -1, 0] and joined.row_parents(1) == [-1, 0]


def test_concat_refuses_a_sequence_in_two_parts():
    with pytest.raises(ValueError, match="more than one batch"):
        ProposalBatch.concat([_batch([1], [[4]]), _batch([1], [[5]])])
