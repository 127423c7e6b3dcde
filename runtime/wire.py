"""The msgpack wire format of the step's messages between router, draft pool and verifier.

Contract:
- One frame per message: a msgpack map ``{"v": SCHEMA_VERSION, "kind": <kind>, ...}`` whose other keys
  are exactly those of that kind. Integer and float columns travel as little-endian bytes (token ids,
  lengths and tree parents int32, seq ids int64, sparse q probabilities float32, sampling floats float64);
  sparse q is a ``{"k": K, "ids": …, "probs": …}`` map next to an explicit ``shape`` of the draft tokens;
  a token tree's ``parents`` (``ProposalBatch.parents``) is a column of that shape too, nil for chains.
- ``decode_*`` refuse a frame larger than ``MAX_FRAME_BYTES`` before unpacking, unpack with hard caps on
  every container (``unpackb`` has no ``max_buffer_size``: the size check plays its part), refuse ext
  types, and then check the message against ``WireLimits``. Every failure, whatever the bytes, raises
  ``WireError`` with a message saying what was wrong; nothing else escapes.
- ``encode_*`` take the dataclasses of ``runtime.protocol`` (and ``Release``) and raise ``WireError``
  only for values the format cannot carry (shapes that disagree, ints out of range); decoding is where
  messages are judged.
- Decoded tensors are fresh CPU tensors (int64 ids/lengths/parents, float32 probabilities) the caller may
  write.

Cost: a step sends a few frames of a batch's worth of rows, so per-row columns (seq ids, bases, lengths,
sampling settings) are packed and checked as Python numbers with ``struct``: for a few dozen values a numpy
call's fixed cost is what dominates. Bulk columns (token ids, q, parents) are decoded as numpy arrays, and
any column of more than ``_FEW`` values is checked as one (docs/measurements.md#wire-format).

Never pickle: everything that crosses a process boundary goes through here.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any, Sequence

import msgpack
import numpy as np
import torch

from runtime.grammar import mask_words
from runtime.protocol import (
    ProposalBatch,
    ProposeItem,
    SamplingParams,
    SyncItem,
    VerifyItem,
    VerifyOutcome,
)

# 2: proposals carry ``parents`` (token trees), propose rows their ``branch``; 3: propose rows carry their
# grammar's forced run, verify frames the constrained rows' grammar masks (structured outputs); 4: propose rows carry
# their tree size (``nodes``); 5: outcomes carry each row's prefix-cache hits (``cached``)
SCHEMA_VERSION = 5
MAX_FRAME_BYTES = 64 << 20
MAX_ROWS = 1 << 16  # the largest batch a frame may carry; also the msgpack array cap
_MAX_MAP_LEN = 16
_MAX_STR_LEN = 64
_PROB_SUM_SLACK = 1e-3  # float32 top-k probabilities may sum a little over 1

_I32, _I64, _F32, _F64 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4"), np.dtype("<f8")
_STRUCT_CODE = {_I32: "i", _I64: "q", _F32: "f", _F64: "d"}
_INT_RANGE = {dt: (int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for dt in (_I32, _I64)}
# Up to this many values a column is cheaper as Python numbers (struct) than as an array: numpy's fixed cost
# per call (~1 µs) outweighs Python's per value below it.
_FEW = 256


class WireError(ValueError):
    """A frame that cannot be encoded, or that failed to decode or validate."""


@dataclass(frozen=True)
class WireLimits:
    """What a valid message may contain; built from the config and the target's vocabulary.

    ``tree_nodes`` bounds a token tree's width (its node count, ``ProposalBatch.tokens.shape[1]`` when
    ``parents`` is set) where it exceeds ``gamma_max``; chains are bounded by ``gamma_max``."""

    vocab_size: int
    gamma_max: int
    max_batch: int
    max_seq_len: int
    tree_nodes: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "gamma_max", "max_batch", "max_seq_len"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value < 2**31:
                raise ValueError(f"WireLimits.{name} must be an int in [1, 2**31), got {value!r}")
        if type(self.tree_nodes) is not int or not 0 <= self.tree_nodes < 2**31:
            raise ValueError(f"WireLimits.tree_nodes must be an int in [0, 2**31), got {self.tree_nodes!r}")
        if self.max_batch > MAX_ROWS:
            raise ValueError(f"WireLimits.max_batch must be ≤ {MAX_ROWS}, got {self.max_batch}")


@dataclass(frozen=True)
class Release:
    """Router → stages: forget these sequences (finished or cancelled) and free their KV slots."""

    seq_ids: tuple[int, ...]


# ---- encoding ----------------------------------------------------------------------------------


def _ints(values: Any, dtype: np.dtype, what: str) -> bytes:
    """A tensor (flattened) or a sequence of ints as little-endian ``dtype``."""
    if isinstance(values, torch.Tensor) and values.numel() > _FEW:
        arr = values.detach().to("cpu", torch.int64).numpy()
        lo, hi = _INT_RANGE[dtype]
        if arr.min() < lo or arr.max() > hi:
            raise WireError(f"{what}: values outside {dtype}'s range [{lo}, {hi}]")
        return arr.astype(dtype).tobytes()
    return _struct_pack(values, dtype, what)


def _floats(values: Any, dtype: np.dtype, what: str) -> bytes:
    """A tensor (flattened) or a sequence of floats as little-endian ``dtype``."""
    if isinstance(values, torch.Tensor) and values.numel() > _FEW:
        return values.detach().to("cpu", torch.float32).numpy().astype(dtype).tobytes()
    return _struct_pack(values, dtype, what)


def _struct_pack(values: Any, dtype: np.dtype, what: str) -> bytes:
    # struct checks each value's type and range as it packs it: no array to build and scan for a batch's rows.
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        return struct.pack(f"<{len(values)}{_STRUCT_CODE[dtype]}", *values)
    except (struct.error, TypeError, OverflowError) as e:
        raise WireError(f"{what}: not encodable as {dtype}: {e}") from None


def _pack(frame: dict[str, Any]) -> bytes:
    try:
        data = msgpack.packb(frame, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as e:
        raise WireError(f"{frame['kind']}: not encodable: {e}") from None
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"{frame['kind']}: frame of {len(data)} bytes exceeds MAX_FRAME_BYTES ({MAX_FRAME_BYTES})")
    return data


def _encode_rows(syncs: Sequence[SyncItem], samplings: Sequence[SamplingParams]) -> dict[str, Any]:
    return {
        "seq_ids": _ints([s.seq_id for s in syncs], _I64, "seq_ids"),
        "base": _ints([s.base for s in syncs], _I32, "base"),
        "tok_lens": _ints([len(s.tokens) for s in syncs], _I32, "tok_lens"),
        "tokens": _ints(list(chain.from_iterable(s.tokens for s in syncs)), _I32, "tokens"),
        "temperature": _floats([p.temperature for p in samplings], _F64, "temperature"),
        "top_p": _floats([p.top_p for p in samplings], _F64, "top_p"),
        "top_k": _ints([p.top_k for p in samplings], _I32, "top_k"),
        "seed": [p.seed for p in samplings],
    }


def _encode_proposal_body(batch: ProposalBatch) -> dict[str, Any]:
    n = len(batch.seq_ids)
    if batch.tokens.dim() != 2 or batch.tokens.shape[0] != n or tuple(batch.lengths.shape) != (n,):
        raise WireError(
            f"proposal: tokens {tuple(batch.tokens.shape)} and lengths {tuple(batch.lengths.shape)} "
            f"do not fit {n} seq_ids"
        )
    g = batch.tokens.shape[1]
    parents = None
    if batch.parents is not None:
        if tuple(batch.parents.shape) != (n, g):
            raise WireError(f"proposal: parents {tuple(batch.parents.shape)} must be the tokens' shape [{n}, {g}]")
        parents = _ints(batch.parents, _I32, "parents")
    q: dict[str, Any] | None = None
    if (batch.q_ids is None) != (batch.q_probs is None):
        raise WireError("proposal: q_ids and q_probs must be both set or both None")
    if batch.q_ids is not None and batch.q_probs is not None:
        shape = tuple(batch.q_ids.shape)
        if len(shape) != 3 or shape[:2] != (n, g) or tuple(batch.q_probs.shape) != shape:
            raise WireError(f"proposal: q_ids {shape} / q_probs {tuple(batch.q_probs.shape)} must be [{n}, {g}, K]")
        q = {"k": shape[2], "ids": _ints(batch.q_ids, _I32, "q_ids"), "probs": _floats(batch.q_probs, _F32, "q_probs")}
    return {
        "seq_ids": _ints(batch.seq_ids, _I64, "seq_ids"),
        "shape": [n, g],
        "tokens": _ints(batch.tokens, _I32, "tokens"),
        "lengths": _ints(batch.lengths, _I32, "lengths"),
        "parents": parents,
        "q": q,
        "resync": _ints(batch.resync, _I64, "resync"),
        "draft_seconds": float(batch.draft_seconds),
    }


def encode_propose(items: Sequence[ProposeItem]) -> bytes:
    """Router → draft pool."""
    rows = _encode_rows([i.sync for i in items], [i.sampling for i in items])
    rows["gamma"] = _ints([i.gamma for i in items], _I32, "gamma")
    rows["branch"] = _ints([i.branch for i in items], _I32, "branch")
    # A row's grammar matcher stays with the router: a remote draft drafts unmasked after the forced run,
    # which the verifier's masked p keeps exact (a refused draft is rejected like any other).
    rows["forced_lens"] = _ints([len(i.forced) for i in items], _I32, "forced_lens")
    rows["forced"] = _ints(list(chain.from_iterable(i.forced for i in items)), _I32, "forced")
    rows["nodes"] = _ints([i.nodes for i in items], _I32, "nodes")
    return _pack({"v": SCHEMA_VERSION, "kind": "propose", **rows})


def encode_proposal(batch: ProposalBatch) -> bytes:
    """Draft pool → router."""
    return _pack({"v": SCHEMA_VERSION, "kind": "proposal", **_encode_proposal_body(batch)})


def encode_verify(items: Sequence[VerifyItem], proposal: ProposalBatch) -> bytes:
    """Router → verifier: row b of ``proposal`` is the proposal for ``items[b]``."""
    rows = _encode_rows([i.sync for i in items], [i.sampling for i in items])
    return _pack({"v": SCHEMA_VERSION, "kind": "verify", "items": rows, "proposal": _encode_proposal_body(proposal),
                  "masks": _encode_masks([i.mask for i in items])})


def _encode_masks(masks: Sequence[torch.Tensor | None]) -> dict[str, Any] | None:
    """Constrained rows' masks ([rows_b, W] int32 each; None: unconstrained) as one int32 column; None when
    no row is constrained, so unconstrained batches send nothing."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    words = given[0].shape[-1]
    if any(m.dim() != 2 or m.shape[1] != words or m.dtype != torch.int32 for m in given):
        raise WireError(f"verify: masks must be [rows, {words}] int32 each")
    return {"rows": _ints([0 if m is None else m.shape[0] for m in masks], _I32, "masks.rows"), "words": words,
            "bits": b"".join(m.contiguous().numpy().astype(_I32).tobytes() for m in given)}


def encode_outcome(outcome: VerifyOutcome) -> bytes:
    """Verifier → router."""
    n = len(outcome.seq_ids)
    if not len(outcome.emitted) == len(outcome.num_accepted) == len(outcome.num_proposed) == n:
        raise WireError(f"outcome: emitted/num_accepted/num_proposed must each have {n} rows")
    if outcome.cached and len(outcome.cached) != n:
        raise WireError(f"outcome: cached must have {n} rows (or none)")
    return _pack(
        {
            "v": SCHEMA_VERSION,
            "kind": "outcome",
            "seq_ids": _ints(outcome.seq_ids, _I64, "seq_ids"),
            "emit_lens": _ints([len(e) for e in outcome.emitted], _I32, "emit_lens"),
            "emitted": _ints(list(chain.from_iterable(outcome.emitted)), _I32, "emitted"),
            "num_accepted": _ints(outcome.num_accepted, _I32, "num_accepted"),
            "num_proposed": _ints(outcome.num_proposed, _I32, "num_proposed"),
            "resync": _ints(outcome.resync, _I64, "resync"),
            "verify_seconds": float(outcome.verify_seconds),
            "cached": _ints(outcome.cached or [0] * n, _I32, "cached"),
        }
    )


def encode_release(release: Release) -> bytes:
    """Router → draft pool / verifier."""
    return _pack({"v": SCHEMA_VERSION, "kind": "release", "seq_ids": _ints(release.seq_ids, _I64, "seq_ids")})


# ---- decoding: structure -----------------------------------------------------------------------


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"ext type {code} is not allowed")


def _unpack(data: Any, kind: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{kind}: frame must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > MAX_FRAME_BYTES:
        raise WireError(f"{kind}: frame of {size} bytes exceeds MAX_FRAME_BYTES ({MAX_FRAME_BYTES})")
    try:
        frame = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            max_ext_len=0,
            max_str_len=_MAX_STR_LEN,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=MAX_ROWS,
            max_map_len=_MAX_MAP_LEN,
        )
    # Hostile bytes make msgpack raise several types (ValueError, FormatError, StackError, TypeError, …).
    except Exception as e:
        raise WireError(f"{kind}: malformed msgpack frame: {e}") from None
    if not isinstance(frame, dict):
        raise WireError(f"{kind}: expected a map, got {type(frame).__name__}")
    # Version and kind first: a peer on another schema should be told so, not that its keys are wrong.
    version = frame.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise WireError(f"{kind}: schema version {_show(version)} is not {SCHEMA_VERSION}")
    if frame.get("kind") != kind:
        raise WireError(f"expected a {kind!r} frame, got kind {_show(frame.get('kind'))}")
    return _map(frame, kind, ("v", "kind", *keys))


def _map(value: Any, what: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected a map, got {type(value).__name__}")
    if value.keys() != set(keys):
        missing = sorted(set(keys) - set(value))
        extra = sorted(map(repr, set(value) - set(keys)))
        raise WireError(f"{what}: wrong keys (missing {missing}, unexpected {extra})")
    return value


def _raw(m: dict[str, Any], key: str, dtype: np.dtype, what: str, n: int | None = None) -> bytes:
    """``m[key]``, checked to be bytes holding a whole number of ``dtype`` values (exactly ``n`` if given)."""
    raw = m[key]
    if type(raw) is not bytes:
        raise WireError(f"{what}.{key}: expected bytes, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:
        raise WireError(f"{what}.{key}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte values")
    if n is not None and len(raw) // dtype.itemsize != n:
        raise WireError(f"{what}.{key}: {len(raw) // dtype.itemsize} values, expected {n}")
    return raw


def _numbers(raw: bytes, dtype: np.dtype) -> tuple:
    return struct.unpack(f"<{len(raw) // dtype.itemsize}{_STRUCT_CODE[dtype]}", raw)


def _values(m: dict[str, Any], key: str, dtype: np.dtype, what: str, n: int | None = None) -> tuple:
    """A per-row column as Python numbers."""
    return _numbers(_raw(m, key, dtype, what, n), dtype)


def _column(m: dict[str, Any], key: str, dtype: np.dtype, what: str, n: int | None = None) -> np.ndarray:
    """A bulk column as a read-only array over the frame's bytes."""
    return np.frombuffer(_raw(m, key, dtype, what, n), dtype=dtype)


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise WireError(f"{what}: expected an int in [{lo}, {hi}], got {_show(value)}")
    return value


def _seconds(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise WireError(f"{what}: expected finite seconds ≥ 0, got {_show(value)}")
    return float(value)


# ---- decoding: semantics -----------------------------------------------------------------------


def _in_range(values: tuple | np.ndarray, lo: int, hi: int, what: str) -> None:
    """All of ``values`` (per-row numbers, or a flat bulk column) in [lo, hi)."""
    if not len(values):
        return
    if isinstance(values, np.ndarray) and values.size > _FEW:
        low, high = values.min(), values.max()
    else:
        few = values.tolist() if isinstance(values, np.ndarray) else values
        low, high = min(few), max(few)
    if low < lo or high >= hi:
        i = next(i for i, v in enumerate(values) if not lo <= v < hi)
        raise WireError(f"{what}: value {int(values[i])} at index {i} is outside [{lo}, {hi})")


def _seq_ids(m: dict[str, Any], what: str, limits: WireLimits) -> tuple[int, ...]:
    raw = _raw(m, "seq_ids", _I64, what)
    if len(raw) // _I64.itemsize > limits.max_batch:
        raise WireError(f"{what}: batch of {len(raw) // _I64.itemsize} exceeds max_batch ({limits.max_batch})")
    ids = _numbers(raw, _I64)
    _in_range(ids, 0, _INT_RANGE[_I64][1], f"{what}.seq_ids")
    if len(set(ids)) != len(ids):
        raise WireError(f"{what}.seq_ids: duplicate seq ids")
    return ids


def _resync(m: dict[str, Any], what: str, seq_ids: tuple[int, ...]) -> tuple[int, ...]:
    raw = _raw(m, "resync", _I64, what)
    if len(raw) // _I64.itemsize > len(seq_ids):
        raise WireError(f"{what}.resync: more seq ids than the batch has")
    resync = _numbers(raw, _I64)
    named = set(resync)
    if len(named) != len(resync):
        raise WireError(f"{what}.resync: duplicate seq ids")
    if not named <= set(seq_ids):
        raise WireError(f"{what}.resync: names seq ids that are not in the batch")
    return resync


def _token_ids(m: dict[str, Any], key: str, what: str, limits: WireLimits, n: int) -> np.ndarray:
    ids = _column(m, key, _I32, what, n)
    _in_range(ids, 0, limits.vocab_size, f"{what}.{key}")
    return ids


def _resync_rows_empty(seq_ids: Sequence[int], resync: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether every resync row has length 0 (a stage that could not sync a row drafts/emits nothing)."""
    named = set(resync)
    return not named or not any(n for s, n in zip(seq_ids, lengths) if s in named)


_ROW_KEYS = ("seq_ids", "base", "tok_lens", "tokens", "temperature", "top_p", "top_k", "seed")


def _decode_rows(
    m: dict[str, Any], what: str, limits: WireLimits
) -> tuple[tuple[int, ...], list[SyncItem], list[SamplingParams]]:
    seq_ids = _seq_ids(m, what, limits)
    n = len(seq_ids)
    base = _values(m, "base", _I32, what, n)
    tok_lens = _values(m, "tok_lens", _I32, what, n)
    _in_range(base, 0, limits.max_seq_len + 1, f"{what}.base")
    _in_range(tok_lens, 0, limits.max_seq_len + 1, f"{what}.tok_lens")
    _in_range(tuple(map(int.__add__, base, tok_lens)), 0, limits.max_seq_len + 1, f"{what}: base + len(tokens)")
    tokens = _token_ids(m, "tokens", what, limits, sum(tok_lens)).tolist()

    temperature = _values(m, "temperature", _F64, what, n)
    top_p = _values(m, "top_p", _F64, what, n)
    top_k = _values(m, "top_k", _I32, what, n)
    if not all(0.0 <= t < math.inf for t in temperature):  # NaN fails every comparison
        raise WireError(f"{what}.temperature: must be finite and ≥ 0")
    if not all(0.0 < p <= 1.0 for p in top_p):
        raise WireError(f"{what}.top_p: must be in (0, 1]")
    _in_range(top_k, 0, 2**31 - 1, f"{what}.top_k")
    seeds = m["seed"]
    if not isinstance(seeds, list) or len(seeds) != n:
        raise WireError(f"{what}.seed: expected a list of {n} ints or nils")
    if not all(s is None or type(s) is int for s in seeds):
        raise WireError(f"{what}.seed: expected ints or nils")

    ends = accumulate(tok_lens)
    syncs = [SyncItem(sid, bs, tuple(tokens[end - length : end]))
             for sid, bs, length, end in zip(seq_ids, base, tok_lens, ends)]
    shared: dict[tuple, SamplingParams] = {}  # rows mostly share one setting: one (frozen) object for them
    samplings = [shared.get(s) or shared.setdefault(s, SamplingParams(*s))  # SamplingParams' field order
                 for s in zip(temperature, top_p, top_k, seeds)]
    return seq_ids, syncs, samplings


_PROPOSAL_KEYS = ("seq_ids", "shape", "tokens", "lengths", "parents", "q", "resync", "draft_seconds")


def _decode_parents(m: dict[str, Any], what: str, lengths: np.ndarray, n: int, g: int) -> torch.Tensor:
    """A token tree's ``parents`` [B, G]: node i's parent is -1 or an earlier node; -1 beyond the row's length."""
    parents = _column(m, "parents", _I32, what, n * g).reshape(n, g)  # [B, G]
    node = np.arange(g)[None, :]  # [1, G]
    valid = np.where(node < lengths[:, None], (parents >= -1) & (parents < node), parents == -1)  # [B, G]
    bad = np.argwhere(~valid)
    if bad.size:
        b, i = (int(x) for x in bad[0])
        rule = "-1 or an earlier node" if i < lengths[b] else "-1 beyond the row's length"
        raise WireError(f"{what}.parents: row {b} node {i}: parent {int(parents[b, i])} is not {rule}")
    return torch.from_numpy(parents.astype(np.int64))


def _decode_proposal_body(m: dict[str, Any], what: str, limits: WireLimits) -> ProposalBatch:
    seq_ids = _seq_ids(m, what, limits)
    shape = m["shape"]
    if not isinstance(shape, list) or len(shape) != 2:
        raise WireError(f"{what}.shape: expected [B, G], got {_show(shape)}")
    n = _int(shape[0], f"{what}.shape[0]", len(seq_ids), len(seq_ids))
    if m["parents"] is None:
        g = _int(shape[1], f"{what}.shape[1] (chain length)", 0, limits.gamma_max)
    else:
        g = _int(shape[1], f"{what}.shape[1] (tree nodes)", 0, max(limits.gamma_max, limits.tree_nodes))
    tokens = _token_ids(m, "tokens", what, limits, n * g).reshape(n, g)  # [B, G]
    lengths = _column(m, "lengths", _I32, what, n)  # [B]
    row_lengths = lengths.tolist()
    _in_range(row_lengths, 0, g + 1, f"{what}.lengths")
    resync = _resync(m, what, seq_ids)
    if not _resync_rows_empty(seq_ids, resync, row_lengths):
        raise WireError(f"{what}: a resync row carries draft tokens")
    parents = None if m["parents"] is None else _decode_parents(m, what, lengths, n, g)

    q_ids_t = q_probs_t = None
    if m["q"] is not None:
        q = _map(m["q"], f"{what}.q", ("k", "ids", "probs"))
        k = _int(q["k"], f"{what}.q.k", 1, limits.vocab_size)
        q_ids = _token_ids(q, "ids", f"{what}.q", limits, n * g * k).reshape(n, g, k)  # [B, G, K]
        q_probs = _column(q, "probs", _F32, f"{what}.q", n * g * k).reshape(n, g, k)  # [B, G, K]
        if not (np.isfinite(q_probs).all() and (q_probs >= 0).all() and (q_probs <= 1).all()):
            raise WireError(f"{what}.q.probs: must be finite and in [0, 1]")
        if (q_probs.sum(axis=2, dtype=np.float64) > 1 + _PROB_SUM_SLACK).any():
            raise WireError(f"{what}.q.probs: a position's probabilities sum to more than 1")
        # A drafted token q gives no mass to was not sampled from q: verifying it would not be exact.
        drafted = np.arange(g)[None, :] < lengths[:, None]  # [B, G]
        covered = ((q_ids == tokens[:, :, None]) & (q_probs > 0)).any(axis=2)  # [B, G]
        missing = np.argwhere(drafted & ~covered)
        if missing.size:
            b, pos = (int(x) for x in missing[0])
            raise WireError(f"{what}.q: row {b} position {pos}: the drafted token has no mass in q")
        q_ids_t = torch.from_numpy(q_ids.astype(np.int64))
        q_probs_t = torch.from_numpy(q_probs.copy())

    return ProposalBatch(
        seq_ids=list(seq_ids),
        tokens=torch.from_numpy(tokens.astype(np.int64)),
        lengths=torch.from_numpy(lengths.astype(np.int64)),
        q_ids=q_ids_t,
        q_probs=q_probs_t,
        parents=parents,
        resync=list(resync),
        draft_seconds=_seconds(m["draft_seconds"], f"{what}.draft_seconds"),
    )


def decode_propose(data: bytes, limits: WireLimits) -> list[ProposeItem]:
    frame = _unpack(data, "propose", (*_ROW_KEYS, "gamma", "branch", "forced_lens", "forced", "nodes"))
    seq_ids, syncs, samplings = _decode_rows(frame, "propose", limits)
    gamma = _values(frame, "gamma", _I32, "propose", len(seq_ids))
    _in_range(gamma, 0, limits.gamma_max + 1, "propose.gamma")
    branch = _values(frame, "branch", _I32, "propose", len(seq_ids))
    _in_range(branch, 0, limits.vocab_size, "propose.branch")  # branch b may start at the (b+1)-th likeliest token
    forced_lens = _values(frame, "forced_lens", _I32, "propose", len(seq_ids))
    _in_range(forced_lens, 0, limits.gamma_max + 1, "propose.forced_lens")
    forced = _token_ids(frame, "forced", "propose", limits, sum(forced_lens)).tolist()
    nodes = _values(frame, "nodes", _I32, "propose", len(seq_ids))
    _in_range(nodes, 0, limits.tree_nodes + 1, "propose.nodes")
    runs, at = [], 0
    for n in forced_lens:
        runs.append(tuple(forced[at:at + n]))
        at += n
    return [ProposeItem(s, g, p, b, forced=f, nodes=n)
            for s, g, p, b, f, n in zip(syncs, gamma, samplings, branch, runs, nodes)]


def decode_proposal(data: bytes, limits: WireLimits) -> ProposalBatch:
    return _decode_proposal_body(_unpack(data, "proposal", _PROPOSAL_KEYS), "proposal", limits)


def decode_verify(data: bytes, limits: WireLimits) -> tuple[list[VerifyItem], ProposalBatch]:
    frame = _unpack(data, "verify", ("items", "proposal", "masks"))
    seq_ids, syncs, samplings = _decode_rows(_map(frame["items"], "verify.items", _ROW_KEYS), "verify.items", limits)
    body = _map(frame["proposal"], "verify.proposal", _PROPOSAL_KEYS)
    proposal = _decode_proposal_body(body, "verify.proposal", limits)
    if proposal.seq_ids != list(seq_ids):
        raise WireError("verify: proposal rows must be the items' seq ids, in the same order")
    if proposal.q_ids is None:
        sampled = [b for b, p in enumerate(samplings) if not p.greedy]
        lengths = proposal.lengths.tolist() if sampled else []
        drafted = [b for b in sampled if lengths[b]]
        if drafted:
            raise WireError(f"verify: row {drafted[0]} is sampled and drafted but the proposal has no q")
    masks = _decode_masks(frame["masks"], proposal, limits)
    return [VerifyItem(s, p, m) for s, p, m in zip(syncs, samplings, masks)], proposal


def _decode_masks(value: Any, proposal: ProposalBatch, limits: WireLimits) -> list[torch.Tensor | None]:
    """Each row's grammar masks: none, or one more than its drafts (before the first draft and after each)."""
    n = len(proposal.seq_ids)
    if value is None:
        return [None] * n
    m = _map(value, "verify.masks", ("rows", "words", "bits"))
    if proposal.parents is not None:
        raise WireError("verify.masks: a token-tree proposal cannot carry constrained rows")
    words = mask_words(limits.vocab_size)
    _int(m["words"], "verify.masks.words", words, words)
    rows = _values(m, "rows", _I32, "verify.masks", n)
    lengths = proposal.lengths.tolist()
    for b, r in enumerate(rows):
        if r and r != lengths[b] + 1:
            raise WireError(f"verify.masks: row {b} has {r} mask rows; a constrained row has one more than its "
                            f"{lengths[b]} drafts")
    bits = _column(m, "bits", _I32, "verify.masks", sum(rows) * words)
    out, at = [], 0
    for r in rows:
        out.append(torch.from_numpy(bits[at:at + r * words].reshape(r, words).copy()) if r else None)
        at += r * words
    return out


def decode_outcome(data: bytes, limits: WireLimits) -> VerifyOutcome:
    keys = ("seq_ids", "emit_lens", "emitted", "num_accepted", "num_proposed", "resync", "verify_seconds", "cached")
    frame = _unpack(data, "outcome", keys)
    seq_ids = _seq_ids(frame, "outcome", limits)
    n = len(seq_ids)
    emit_lens = _values(frame, "emit_lens", _I32, "outcome", n)
    accepted = _values(frame, "num_accepted", _I32, "outcome", n)
    proposed = _values(frame, "num_proposed", _I32, "outcome", n)
    _in_range(proposed, 0, limits.gamma_max + 1, "outcome.num_proposed")
    _in_range(accepted, 0, limits.gamma_max + 1, "outcome.num_accepted")
    if any(a > p for a, p in zip(accepted, proposed)):
        raise WireError("outcome: num_accepted exceeds num_proposed")
    _in_range(emit_lens, 0, limits.gamma_max + 2, "outcome.emit_lens")
    if any(e > a + 1 for e, a in zip(emit_lens, accepted)):
        raise WireError("outcome: a row emits more than its accepted tokens plus one")
    cached = _values(frame, "cached", _I32, "outcome", n)
    _in_range(cached, 0, limits.max_seq_len, "outcome.cached")
    emitted = _token_ids(frame, "emitted", "outcome", limits, sum(emit_lens)).tolist()
    resync = _resync(frame, "outcome", seq_ids)
    if not _resync_rows_empty(seq_ids, resync, emit_lens):
        raise WireError("outcome: a resync row emits tokens")
    rows, start = [], 0
    for length in emit_lens:
        rows.append(emitted[start : start + length])
        start += length
    return VerifyOutcome(
        seq_ids=list(seq_ids),
        emitted=rows,
        num_accepted=list(accepted),
        num_proposed=list(proposed),
        resync=list(resync),
        verify_seconds=_seconds(frame["verify_seconds"], "outcome.verify_seconds"),
        cached=list(cached),
    )


def decode_release(data: bytes, limits: WireLimits) -> Release:
    frame = _unpack(data, "release", ("seq_ids",))
    return Release(seq_ids=_seq_ids(frame, "release", limits))


# -- stage calls ---------------------------------------------------------------------------------------
# A stage call is one byte naming the operation followed by that operation's frame, so one method (a Serve
# replica's ``call``, a stage worker's, a tensor-parallel rank's) and one compiled graph per worker carry
# every operation, and a relay can pass a call on as the bytes it got.

OP_PROPOSE, OP_VERIFY, OP_RELEASE = b"p", b"v", b"r"


def serve_call(call: bytes, limits: WireLimits, *, proposer=None, verifier=None) -> bytes:
    """Answer one stage call: decode it with ``limits`` before any model sees it, run it on the stage that
    serves its operation, encode the answer. ``verifier`` with a ``relay`` method (a tensor-parallel group)
    gets a verify's frame as it came: its ranks decode it, so decoding it here too would be wasted work. A
    release reaches both stages a process hosts. Raises ``WireError`` for a malformed call or one for a stage
    this process does not host."""
    op, body = call[:1], call[1:]
    if op == OP_PROPOSE and proposer is not None:
        return encode_proposal(proposer.propose(decode_propose(body, limits)))
    if op == OP_VERIFY and verifier is not None:
        relay = getattr(verifier, "relay", None)
        return encode_outcome(relay(body) if relay is not None else verifier.verify(*decode_verify(body, limits)))
    if op == OP_RELEASE:
        seq_ids = list(decode_release(body, limits).seq_ids)
        for stage in {id(s): s for s in (proposer, verifier) if s is not None}.values():
            stage.release(seq_ids)
        return b""
    raise WireError(f"stage operation {op!r} is not served here")
