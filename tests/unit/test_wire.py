"""runtime.wire: round trips of every message, and hostile frames that must raise WireError only."""

from __future__ import annotations

import math
from typing import Any, Callable

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import wire
from runtime.wire import Release, WireError, WireLimits
from runtime.protocol import (
    GREEDY,
    ProposalBatch,
    ProposeItem,
    SamplingParams,
    SyncItem,
    VerifyItem,
    VerifyOutcome,
)

LIMITS = WireLimits(vocab_size=100, gamma_max=8, max_batch=16, max_seq_len=256)
_MANY = 4096  # values in a column: more than any packed as Python numbers
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1)


def propose_items() -> list[ProposeItem]:
    return [
        ProposeItem(SyncItem(seq_id=7, base=0, tokens=(1, 2, 3, 99)), gamma=4),
        ProposeItem(SyncItem(seq_id=2**40, base=12, tokens=(5,)), gamma=8, sampling=SAMPLED, branch=2),
        ProposeItem(SyncItem(seq_id=0, base=3, tokens=()), gamma=0, sampling=SamplingParams(1.0, seed=-5)),
    ]


def greedy_proposal() -> ProposalBatch:
    return ProposalBatch(
        seq_ids=[7, 2**40, 0],
        tokens=torch.tensor([[4, 5, 6], [7, 0, 0], [0, 0, 0]]),  # [B=3, G=3]
        lengths=torch.tensor([3, 1, 0]),
        resync=[0],
        draft_seconds=0.0123,
    )


def sampled_proposal() -> ProposalBatch:
    tokens = torch.tensor([[4, 5], [7, 0]])  # [B=2, G=2]
    q_ids = torch.tensor([[[4, 9, 1], [5, 2, 3]], [[8, 7, 6], [0, 0, 0]]])  # [B, G, K=3]
    q_probs = torch.tensor([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], [[0.1, 0.6, 0.2], [0.0, 0.0, 0.0]]])
    return ProposalBatch(
        seq_ids=[3, 1], tokens=tokens, lengths=torch.tensor([2, 1]), q_ids=q_ids, q_probs=q_probs
    )


def tree_proposal(width: int = 4) -> ProposalBatch:
    """Row 0: a root child with two children, one of which has a child; row 1: two root children."""
    tokens = torch.zeros(2, width, dtype=torch.long)  # [B=2, G=width]
    tokens[0, :4], tokens[1, :2] = torch.tensor([4, 5, 6, 7]), torch.tensor([8, 9])
    parents = torch.full((2, width), -1, dtype=torch.long)  # [B, G]
    parents[0, :4] = torch.tensor([-1, 0, 0, 1])
    return ProposalBatch(seq_ids=[3, 1], tokens=tokens, lengths=torch.tensor([4, 2]), parents=parents)


def outcome() -> VerifyOutcome:
    return VerifyOutcome(
        seq_ids=[7, 2**40, 0],
        emitted=[[4, 5, 6, 11], [42], []],
        num_accepted=[3, 0, 0],
        num_proposed=[3, 1, 0],
        resync=[0],
        verify_seconds=0.5,
        cached=[0, 32, 0],
    )


def assert_same_batch(a: ProposalBatch, b: ProposalBatch) -> None:
    assert a.seq_ids == b.seq_ids and a.resync == b.resync
    assert math.isclose(a.draft_seconds, b.draft_seconds)
    assert b.tokens.dtype == b.lengths.dtype == torch.int64
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert (a.q_ids is None) == (b.q_ids is None)
    assert (a.parents is None) == (b.parents is None)
    if a.parents is not None:
        assert b.parents.dtype == torch.int64 and torch.equal(a.parents, b.parents)
    if a.q_ids is not None:
        assert b.q_ids.dtype == torch.int64 and b.q_probs.dtype == torch.float32
        assert torch.equal(a.q_ids, b.q_ids) and torch.equal(a.q_probs, b.q_probs)


# ---- round trips -------------------------------------------------------------------------------


def test_propose_round_trip() -> None:
    items = propose_items()
    assert wire.decode_propose(wire.encode_propose(items), LIMITS) == items


def test_empty_batches_round_trip() -> None:
    assert wire.decode_propose(wire.encode_propose([]), LIMITS) == []
    empty = ProposalBatch.empty([])
    assert_same_batch(empty, wire.decode_proposal(wire.encode_proposal(empty), LIMITS))
    items, proposal = wire.decode_verify(wire.encode_verify([], empty), LIMITS)
    assert items == [] and proposal.seq_ids == []
    nothing = VerifyOutcome(seq_ids=[], emitted=[], num_accepted=[], num_proposed=[])
    assert wire.decode_outcome(wire.encode_outcome(nothing), LIMITS) == nothing
    assert wire.decode_release(wire.encode_release(Release(())), LIMITS) == Release(())


@pytest.mark.parametrize("make", [greedy_proposal, sampled_proposal, tree_proposal,
                                  lambda: ProposalBatch.empty([4, 5], resync=[5])])
def test_proposal_round_trip(make: Callable[[], ProposalBatch]) -> None:
    batch = make()
    decoded = wire.decode_proposal(wire.encode_proposal(batch), LIMITS)
    assert_same_batch(batch, decoded)
    decoded.tokens[0:1] = 0  # fresh tensors, not views of the frame


def test_verify_round_trip() -> None:
    items = [VerifyItem(SyncItem(3, 0, (1, 2)), SAMPLED), VerifyItem(SyncItem(1, 5, (9,)), GREEDY)]
    got_items, got_proposal = wire.decode_verify(wire.encode_verify(items, sampled_proposal()), LIMITS)
    assert got_items == items
    assert_same_batch(sampled_proposal(), got_proposal)


def test_tree_verify_round_trip() -> None:
    items = [VerifyItem(SyncItem(3, 0, (1, 2))), VerifyItem(SyncItem(1, 5, (9,)))]
    got_items, got_proposal = wire.decode_verify(wire.encode_verify(items, tree_proposal()), LIMITS)
    assert got_items == items
    assert_same_batch(tree_proposal(), got_proposal)
    got_proposal.parents[0, 0] = 2  # a fresh tensor, not a view of the frame
    assert got_proposal.row_parents(1) == [-1, -1]


def test_tree_width_is_bounded_by_tree_nodes() -> None:
    wide = tree_proposal(width=LIMITS.gamma_max + 2)
    with pytest.raises(WireError, match="tree nodes"):
        wire.decode_proposal(wire.encode_proposal(wide), LIMITS)
    trees = WireLimits(vocab_size=100, gamma_max=8, max_batch=16, max_seq_len=256, tree_nodes=LIMITS.gamma_max + 2)
    assert_same_batch(wide, wire.decode_proposal(wire.encode_proposal(wide), trees))
    # The engine's tree budget for the step travels with the propose rows, bounded by the same limit.
    items = [ProposeItem(SyncItem(1, 0, (5,)), gamma=3, nodes=trees.tree_nodes)]
    assert wire.decode_propose(wire.encode_propose(items), trees) == items
    with pytest.raises(WireError, match="propose.nodes"):
        wire.decode_propose(wire.encode_propose(items), LIMITS)
    chain = tree_proposal(width=LIMITS.gamma_max + 2)
    chain.parents = None  # a chain stays bounded by gamma_max
    with pytest.raises(WireError, match="chain length"):
        wire.decode_proposal(wire.encode_proposal(chain), trees)


def test_outcome_and_release_round_trip() -> None:
    assert wire.decode_outcome(wire.encode_outcome(outcome()), LIMITS) == outcome()
    release = Release((1, 2, 2**62))
    assert wire.decode_release(wire.encode_release(release), LIMITS) == release


def test_encode_refuses_what_the_format_cannot_carry() -> None:
    with pytest.raises(WireError, match="tokens"):
        wire.encode_propose([ProposeItem(SyncItem(1, 0, (2**31,)), gamma=1)])  # would wrap in int32
    bad = greedy_proposal()
    bad.lengths = torch.tensor([1, 1])
    with pytest.raises(WireError, match="lengths"):
        wire.encode_proposal(bad)
    with pytest.raises(WireError, match="q_ids"):
        wire.encode_proposal(ProposalBatch([1], torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                                           q_ids=torch.zeros(1, 1, 2, dtype=torch.long)))
    tree = tree_proposal()
    tree.parents = tree.parents[:, :3]
    with pytest.raises(WireError, match="parents"):
        wire.encode_proposal(tree)
    big = torch.full((1, _MANY), 2**31)  # over the size where a column is packed as an array
    with pytest.raises(WireError, match="tokens"):
        wire.encode_proposal(ProposalBatch([1], big, torch.ones(1, dtype=torch.long)))


# ---- hostile frames ----------------------------------------------------------------------------


def unpacked(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)


def repack(frame: Any) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def i32(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "little", signed=True) for v in values)


def f32(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


def f64(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float64).numpy().tobytes()


def i64(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in values)


def test_structured_outputs_round_trip() -> None:
    """A propose row's forced run, and the verify frame's grammar masks of constrained rows only."""
    items = [ProposeItem(SyncItem(1, 0, (5, 6)), gamma=3, forced=(7, 8)), ProposeItem(SyncItem(2, 0, (9,)), gamma=2)]
    assert wire.decode_propose(wire.encode_propose(items), LIMITS) == items
    words = wire.mask_words(LIMITS.vocab_size)
    mask = torch.arange(3 * words, dtype=torch.int32).view(3, words) - 5  # [drafts + 1, W]: row 0 has 2 drafts
    verify = [VerifyItem(SyncItem(3, 0, (1, 2)), SAMPLED, mask), VerifyItem(SyncItem(1, 5, (9,)), GREEDY)]
    got, proposal = wire.decode_verify(wire.encode_verify(verify, sampled_proposal()), LIMITS)
    assert torch.equal(got[0].mask, mask) and got[1].mask is None
    assert [(i.sync, i.sampling) for i in got] == [(i.sync, i.sampling) for i in verify]
    assert unpacked(wire.encode_verify(verify[1:], ProposalBatch.empty([1])))["masks"] is None


def test_bad_structured_outputs() -> None:
    words = wire.mask_words(LIMITS.vocab_size)
    frame = unpacked(wire.encode_propose([ProposeItem(SyncItem(1, 0, (5,)), gamma=1, forced=(7,))]))
    with pytest.raises(WireError, match="forced.*outside"):
        wire.decode_propose(tampered(frame, forced=i32(100)), LIMITS)
    with pytest.raises(WireError, match="forced"):
        wire.decode_propose(tampered(frame, forced_lens=i32(2)), LIMITS)
    verify = [VerifyItem(SyncItem(3, 0, (1, 2)), SAMPLED, torch.zeros(2, words, dtype=torch.int32)),
              VerifyItem(SyncItem(1, 5, (9,)), GREEDY)]
    with pytest.raises(WireError, match="one more than its 2 drafts"):
        wire.decode_verify(wire.encode_verify(verify, sampled_proposal()), LIMITS)
    good = [VerifyItem(verify[0].sync, SAMPLED, torch.zeros(3, words, dtype=torch.int32)), verify[1]]
    frame = unpacked(wire.encode_verify(good, sampled_proposal()))
    with pytest.raises(WireError, match="masks.words"):
        wire.decode_verify(tampered(frame, masks=dict(frame["masks"], words=words + 1)), LIMITS)
    with pytest.raises(WireError, match="values, expected"):
        wire.decode_verify(tampered(frame, masks=dict(frame["masks"], bits=frame["masks"]["bits"][:-4])), LIMITS)
    tree = [VerifyItem(SyncItem(3, 0, (1, 2)), GREEDY, torch.zeros(4, words, dtype=torch.int32)),
            VerifyItem(SyncItem(1, 5, (9,)))]
    with pytest.raises(WireError, match="token-tree"):
        wire.decode_verify(wire.encode_verify(tree, tree_proposal()), LIMITS)
    with pytest.raises(WireError, match="int32"):
        wire.encode_verify([VerifyItem(SyncItem(3, 0, (1,)), GREEDY, torch.zeros(3, words))], sampled_proposal())


def propose_frame() -> dict[str, Any]:
    return unpacked(wire.encode_propose(propose_items()))


def proposal_frame() -> dict[str, Any]:
    return unpacked(wire.encode_proposal(sampled_proposal()))


def tree_frame() -> dict[str, Any]:
    return unpacked(wire.encode_proposal(tree_proposal()))


def outcome_frame() -> dict[str, Any]:
    return unpacked(wire.encode_outcome(outcome()))


DECODERS = [wire.decode_propose, wire.decode_proposal, wire.decode_verify, wire.decode_outcome, wire.decode_release]
VALID = {
    "propose": wire.encode_propose(propose_items()),
    "proposal": wire.encode_proposal(sampled_proposal()),
    "greedy_proposal": wire.encode_proposal(greedy_proposal()),
    "tree_proposal": wire.encode_proposal(tree_proposal()),
    "verify": wire.encode_verify([VerifyItem(SyncItem(3, 0, (1,)), SAMPLED), VerifyItem(SyncItem(1, 0, (2,)))],
                                 sampled_proposal()),
    "outcome": wire.encode_outcome(outcome()),
    "release": wire.encode_release(Release((1, 2))),
}


@pytest.mark.parametrize("name", list(VALID))
def test_truncated_frames(name: str) -> None:
    data = VALID[name]
    decode = {"propose": wire.decode_propose, "verify": wire.decode_verify, "outcome": wire.decode_outcome,
              "release": wire.decode_release}.get(name, wire.decode_proposal)
    for cut in range(len(data)):
        with pytest.raises(WireError):
            decode(data[:cut], LIMITS)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x00" * 40,
        bytes(range(256)),
        repack([1, 2, 3]),
        repack(None),
        repack({1: 2}),  # non-str map key
        repack({"v": 1, "kind": "propose", 5: b""}),
        b"\x91" * 100_000 + b"\xc0",  # nested-array bomb
        b"\x81\xa1a" * 50_000 + b"\xc0",  # nested-map bomb
        b"\xdd\xff\xff\xff\xff",  # array claiming 4G items
        b"\xdf\xff\xff\xff\xff",  # map claiming 4G pairs
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GB
        repack(msgpack.ExtType(5, b"boom")),
        repack({"v": 1, "kind": msgpack.ExtType(1, b"")}),
        msgpack.packb(msgpack.Timestamp(1, 2)),
        repack(propose_frame()) + b"\x00",  # trailing bytes
        "not bytes",
        12,
    ],
)
def test_garbage_raises_wire_error(data: Any) -> None:
    for decode in DECODERS:
        with pytest.raises(WireError):
            decode(data, LIMITS)


def test_oversized_frame_refused_before_unpacking() -> None:
    with pytest.raises(WireError, match="MAX_FRAME_BYTES"):
        wire.decode_release(bytes(wire.MAX_FRAME_BYTES + 1), LIMITS)


def tampered(frame: dict[str, Any], **changes: Any) -> bytes:
    frame = dict(frame)
    for key, value in changes.items():
        if value is DROP:
            del frame[key]
        else:
            frame[key] = value
    return repack(frame)


DROP = object()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"v": wire.SCHEMA_VERSION + 1}, "schema version"),
        ({"v": wire.SCHEMA_VERSION - 1}, "schema version"),
        ({"v": True}, "schema version"),
        ({"kind": "proposal"}, "expected a 'propose' frame"),
        ({"extra": 1}, "unexpected"),
        ({"gamma": DROP}, "missing"),
        ({"tokens": i32(1, 2, 3, 100, 5)}, "outside"),  # id == vocab
        ({"tokens": i32(1, 2, 3, -1, 5)}, "outside"),
        ({"tokens": i32(1, 2, 3)}, "values, expected"),
        ({"tokens": b"\x00\x00\x00"}, "whole number"),
        ({"tokens": [1, 2, 3, 4, 5]}, "expected bytes"),
        ({"gamma": i32(4, 9, 0)}, "gamma"),
        ({"gamma": i32(4, -1, 0)}, "gamma"),
        ({"branch": i32(0, -1, 0)}, "branch"),
        ({"branch": i32(0, 100, 0)}, "branch"),
        ({"branch": DROP}, "missing"),
        ({"seq_ids": i64(7, 7, 0)}, "duplicate"),
        ({"seq_ids": i64(7, -3, 0)}, "seq_ids"),
        ({"base": i32(0, -1, 3)}, "base"),
        ({"base": i32(0, 256, 3)}, "base"),  # base + len(tokens) > max_seq_len
        ({"temperature": f64(0.0, -0.5, 1.0)}, "temperature"),
        ({"temperature": f64(0.0, math.nan, 1.0)}, "temperature"),
        ({"temperature": f64(0.0, math.inf, 1.0)}, "temperature"),
        ({"top_p": f64(1.0, 0.0, 1.0)}, "top_p"),
        ({"top_p": f64(1.0, 1.5, 1.0)}, "top_p"),
        ({"top_k": i32(0, -1, 0)}, "top_k"),
        ({"seed": [None, 1.5, None]}, "seed"),
        ({"seed": [None, None]}, "seed"),
    ],
)
def test_bad_propose(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode_propose(tampered(propose_frame(), **changes), LIMITS)


def test_batch_over_max_batch() -> None:
    items = [ProposeItem(SyncItem(i, 0, (1,)), gamma=1) for i in range(LIMITS.max_batch + 1)]
    with pytest.raises(WireError, match="max_batch"):
        wire.decode_propose(wire.encode_propose(items), LIMITS)


def q_with(**changes: Any) -> dict[str, Any]:
    q = dict(proposal_frame()["q"])
    q.update(changes)
    return q


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"shape": [2, 9]}, "chain length"),  # G > gamma_max
        ({"shape": [3, 2]}, "shape"),
        ({"shape": [2]}, "shape"),
        ({"shape": [2, True]}, "shape"),
        ({"tokens": i32(4, 5, 7)}, "values, expected"),
        ({"tokens": i32(4, 5, 7, 100)}, "outside"),
        ({"lengths": i32(3, 1)}, "lengths"),
        ({"lengths": i32(2, -1)}, "lengths"),
        ({"resync": i64(9)}, "resync"),
        ({"resync": i64(3)}, "resync row carries draft tokens"),
        ({"resync": i64(1, 1)}, "duplicate"),
        ({"draft_seconds": math.nan}, "draft_seconds"),
        ({"draft_seconds": -1.0}, "draft_seconds"),
        ({"draft_seconds": "fast"}, "draft_seconds"),
        ({"q": q_with(k=0)}, "q.k"),
        ({"q": q_with(k=4)}, "values, expected"),
        ({"q": q_with(extra=1)}, "unexpected"),
        ({"q": [1, 2]}, "expected a map"),
        ({"q": q_with(ids=i32(4, 9, 1, 5, 2, 3, 8, 7, 6, 0, 0, 100))}, "outside"),
        ({"q": q_with(ids=i32(4, 9, 1, 5, 2, 3, 8, 7, 6, 0, 0, -1))}, "outside"),
        ({"q": q_with(probs=f32(0.5, 0.25, 0.25, 1, 0, 0, 0.1, 0.6, 0.2, 0, 0, math.nan))}, "finite"),
        ({"q": q_with(probs=f32(0.5, 0.25, 0.25, 1, 0, 0, 0.1, 0.6, 0.2, 0, 0, math.inf))}, "finite"),
        ({"q": q_with(probs=f32(0.5, 0.25, 0.25, 1, 0, 0, 0.1, 0.6, 0.2, 0, 0, -0.1))}, "finite"),
        ({"q": q_with(probs=f32(0.5, 0.25, 0.25, 1, 0, 0, 0.1, 0.6, 0.2, 0, 0, 1.5))}, "finite"),
        ({"q": q_with(probs=f32(0.5, 0.5, 0.25, 1, 0, 0, 0.1, 0.6, 0.2, 0, 0, 0))}, "sum"),
        ({"q": q_with(probs=f32(0.5, 0.25, 0.25, 1, 0, 0, 0.1, 0.0, 0.2, 0, 0, 0))}, "no mass"),
        ({"q": q_with(ids=i32(4, 9, 1, 6, 2, 3, 8, 7, 6, 0, 0, 0))}, "no mass"),
        ({"q": q_with(probs=f32(0.5, 0.25))}, "values, expected"),
    ],
)
def test_bad_proposal(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode_proposal(tampered(proposal_frame(), **changes), LIMITS)


@pytest.mark.parametrize(
    "parents, match",
    [
        (i32(-1, 0, 0, 1, -1, -1, -1, 3), "row 1 node 3: parent 3 is not -1 beyond"),  # a node past the length
        (i32(-1, 0, 0, 3, -1, -1, -1, -1), "row 0 node 3: parent 3 is not -1 or an earlier"),  # its own parent
        (i32(-1, 0, 2, 1, -1, -1, -1, -1), "row 0 node 2: parent 2"),  # not topological
        (i32(-1, 0, 0, 1, -1, -2, -1, -1), "row 1 node 1: parent -2"),
        (i32(0, 0, 0, 1, -1, -1, -1, -1), "row 0 node 0: parent 0"),  # the first node's parent is the root
        (i32(-1, 0, 0, 1, -1, -1, -1), "values, expected"),
        ([-1, 0, 0, 1, -1, -1, -1, -1], "expected bytes"),
    ],
)
def test_bad_tree(parents: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode_proposal(tampered(tree_frame(), parents=parents), LIMITS)
    frame = unpacked(wire.encode_verify([VerifyItem(SyncItem(3, 0, (1,))), VerifyItem(SyncItem(1, 0, (2,)))],
                                        tree_proposal()))
    with pytest.raises(WireError, match=match):
        wire.decode_verify(tampered(frame, proposal=dict(frame["proposal"], parents=parents)), LIMITS)


def test_long_histories() -> None:
    """A prefill sends whole histories: round trip, and the bad token's index in the flattened column."""
    history = tuple(range(1, 99)) * 2  # 196 tokens per row: a column checked as an array, not value by value
    items = [ProposeItem(SyncItem(b, 0, history), gamma=4) for b in range(2)]
    assert wire.decode_propose(wire.encode_propose(items), LIMITS) == items
    frame = unpacked(wire.encode_propose(items))
    with pytest.raises(WireError, match="value 100 at index 300 is outside"):
        wire.decode_propose(tampered(frame, tokens=frame["tokens"][:1200] + i32(100) + frame["tokens"][1204:]), LIMITS)


def test_bad_verify() -> None:
    items = [VerifyItem(SyncItem(3, 0, (1,)), SAMPLED), VerifyItem(SyncItem(1, 0, (2,)))]
    misaligned = [items[1], items[0]]
    with pytest.raises(WireError, match="same order"):
        wire.decode_verify(wire.encode_verify(misaligned, sampled_proposal()), LIMITS)
    no_q = sampled_proposal()
    no_q.q_ids = no_q.q_probs = None
    with pytest.raises(WireError, match="no q"):
        wire.decode_verify(wire.encode_verify(items, no_q), LIMITS)
    frame = unpacked(VALID["verify"])
    with pytest.raises(WireError, match="verify.items"):
        wire.decode_verify(tampered(frame, items=dict(frame["items"], gamma=i32(1, 1))), LIMITS)
    with pytest.raises(WireError, match="verify.proposal"):
        wire.decode_verify(tampered(frame, proposal=dict(frame["proposal"], shape=[2, 99])), LIMITS)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"emitted": i32(4, 5, 6, 100, 42)}, "outside"),
        ({"emitted": i32(4, 5, 6, 11)}, "values, expected"),
        ({"num_accepted": i32(3, 2, 0)}, "exceeds num_proposed"),
        ({"num_proposed": i32(9, 1, 0)}, "num_proposed"),
        ({"emit_lens": i32(5, 0, 1), "emitted": i32(1, 2, 3, 4, 5, 6)}, "plus one"),
        ({"resync": i64(7)}, "resync row emits"),
        ({"resync": i64(99)}, "resync"),
        ({"verify_seconds": math.inf}, "verify_seconds"),
        ({"cached": i32(0, -1, 0)}, "outcome.cached"),
        ({"cached": i32(0, 0)}, "cached"),
    ],
)
def test_bad_outcome(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode_outcome(tampered(outcome_frame(), **changes), LIMITS)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        WireLimits(vocab_size=0, gamma_max=8, max_batch=1, max_seq_len=1)
    with pytest.raises(ValueError):
        WireLimits(vocab_size=10, gamma_max=8, max_batch=wire.MAX_ROWS + 1, max_seq_len=1)
    with pytest.raises(ValueError):
        WireLimits(vocab_size=10, gamma_max=8, max_batch=1, max_seq_len=1, tree_nodes=-1)


# ---- fuzzing -----------------------------------------------------------------------------------

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(0, 9), children, max_size=5),
    max_leaves=10,
)


def decodes_or_wire_error(data: Any) -> None:
    for decode in DECODERS:
        try:
            decode(data, LIMITS)
        except WireError:
            pass


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_bytes(data: bytes) -> None:
    decodes_or_wire_error(data)


@FUZZ
@given(msgpack_values)
def test_fuzz_msgpack_objects(obj: Any) -> None:
    decodes_or_wire_error(repack(obj))


@FUZZ
@given(st.sampled_from(sorted(VALID)), st.data())
def test_fuzz_tampered_valid_frames(name: str, data: st.DataObject) -> None:
    frame = unpacked(VALID[name])
    target = frame
    for nested in ("items", "proposal", "q"):  # sometimes tamper inside a nested block
        if isinstance(target.get(nested), dict) and data.draw(st.booleans()):
            target = target[nested]
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(msgpack_values | st.binary(min_size=0, max_size=96))
    decodes_or_wire_error(repack(frame))


@FUZZ
@given(st.sampled_from(sorted(VALID)), st.integers(0, 10_000), st.integers(0, 255))
def test_fuzz_flipped_bytes(name: str, where: int, value: int) -> None:
    data = bytearray(VALID[name])
    data[where % len(data)] = value
    decodes_or_wire_error(bytes(data))


def test_config_batch_cap_matches_wire() -> None:
    from cluster.config import MAX_BATCH_CAP

    assert MAX_BATCH_CAP == wire.MAX_ROWS


class _Stage:
    """Records what ``serve_call`` ran on it; drafts a proposal or verifies to a fixed outcome."""

    def __init__(self, relay: bool = False):
        self.seen: list = []
        if relay:
            self.relay = lambda body: (self.seen.append(("relay", body)), outcome())[1]

    def propose(self, items):
        self.seen.append(("propose", [it.sync.seq_id for it in items]))
        return greedy_proposal()

    def verify(self, items, proposal):
        self.seen.append(("verify", [it.sync.seq_id for it in items]))
        return outcome()

    def release(self, seq_ids):
        self.seen.append(("release", seq_ids))


def test_serve_call_runs_each_operation_on_the_stage_that_serves_it() -> None:
    draft, target = _Stage(), _Stage()
    call = wire.OP_PROPOSE + wire.encode_propose(propose_items())
    assert_same_batch(wire.decode_proposal(wire.serve_call(call, LIMITS, proposer=draft), LIMITS), greedy_proposal())
    verify = wire.encode_verify([VerifyItem(SyncItem(7, 0, (1,)))], greedy_proposal().select([7]))
    answer = wire.serve_call(wire.OP_VERIFY + verify, LIMITS, proposer=draft, verifier=target)
    assert wire.decode_outcome(answer, LIMITS).seq_ids == outcome().seq_ids
    release = wire.OP_RELEASE + wire.encode_release(Release((3, 4)))
    assert wire.serve_call(release, LIMITS, proposer=draft, verifier=target) == b""
    assert draft.seen == [("propose", [7, 2**40, 0]), ("release", [3, 4])]
    assert target.seen == [("verify", [7]), ("release", [3, 4])]
    both = _Stage()  # one object serving both operations is released once
    wire.serve_call(release, LIMITS, proposer=both, verifier=both)
    assert both.seen == [("release", [3, 4])]


def test_serve_call_relays_a_verify_as_it_came() -> None:
    group = _Stage(relay=True)
    verify = wire.encode_verify([VerifyItem(SyncItem(7, 0, (1,)))], greedy_proposal().select([7]))
    wire.serve_call(wire.OP_VERIFY + verify, LIMITS, verifier=group)
    assert group.seen == [("relay", verify)]


@pytest.mark.parametrize("call", [b"", b"x" + wire.encode_release(Release((1,))),
                                  wire.OP_VERIFY + wire.encode_propose(propose_items()),
                                  wire.OP_PROPOSE + b"\x00garbage"])
def test_serve_call_refuses_what_it_does_not_serve(call: bytes) -> None:
    with pytest.raises(WireError):
        wire.serve_call(call, LIMITS, proposer=_Stage(), verifier=None)
