"""The msgpack wire format of the step's messages between router, draft pool and verifier.

Contract:
- One frame per message: a msgpack map ``{"v": SCHEMA_VERSION, "kind": <kind>, ...}`` whose other keys
  are exactly those of that kind. Integer and float columns travel as little-endian bytes (token ids and
  lengths int32, seq ids int64, sparse q probabilities float32, sampling floats float64); sparse q is a
  ``{"k": K, "ids": …, "probs": …}`` map next to an explicit ``shape`` of the draft tokens.
- ``decode_*`` refuse a frame larger than ``MAX_FRAME_BYTES`` before unpacking, unpack with hard caps on
  every container (``unpackb`` has no ``max_buffer_size``: the size check plays its part), refuse ext
  types, and then check the message against ``WireLimits``. Every failure, whatever the bytes, raises
  ``WireError`` with a message saying what was wrong; nothing else escapes.
- ``encode_*`` take the dataclasses of ``runtime.protocol`` (and ``Release``) and raise ``WireError``
  only for values the format cannot carry (shapes that disagree, ints out of range); decoding is where
  messages are judged.
- Decoded tensors are fresh CPU tensors (int64 ids/lengths, float32 probabilities) the caller may write.

Never pickle: everything that crosses a process boundary goes through here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np
import torch

from runtime.protocol import (
    ProposalBatch,
    ProposeItem,
    SamplingParams,
    SyncItem,
    VerifyItem,
    VerifyOutcome,
)

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
MAX_ROWS = 1 << 16  # the largest batch a frame may carry; also the msgpack array cap
_MAX_MAP_LEN = 16
_MAX_STR_LEN = 64
_PROB_SUM_SLACK = 1e-3  # float32 top-k probabilities may sum a little over 1

_I32, _I64, _F32, _F64 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4"), np.dtype("<f8")


class WireError(ValueError):
    """A frame that cannot be encoded, or that failed to decode or validate."""


@dataclass(frozen=True)
class WireLimits:
    """What a valid message may contain; built from the config and the target's vocabulary."""

    vocab_size: int
    gamma_max: int
    max_batch: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "gamma_max", "max_batch", "max_seq_len"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value < 2**31:
                raise ValueError(f"WireLimits.{name} must be an int in [1, 2**31), got {value!r}")
        if self.max_batch > MAX_ROWS:
            raise ValueError(f"WireLimits.max_batch must be ≤ {MAX_ROWS}, got {self.max_batch}")


@dataclass(frozen=True)
class Release:
    """Router → stages: forget these sequences (finished or cancelled) and free their KV slots."""

    seq_ids: tuple[int, ...]


# ---- encoding ----------------------------------------------------------------------------------


def _ints(values: Any, dtype: np.dtype, what: str) -> bytes:
    if isinstance(values, torch.Tensor):
        arr = values.detach().to("cpu", torch.int64).numpy()
    else:
        try:
            arr = np.asarray(values, dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as e:
            raise WireError(f"{what}: not encodable as {dtype}: {e}") from None
    info = np.iinfo(dtype)
    if arr.size and (arr.min() < info.min or arr.max() > info.max):
        raise WireError(f"{what}: values outside {dtype}'s range [{info.min}, {info.max}]")
    return arr.astype(dtype).tobytes()


def _floats(values: Any, dtype: np.dtype, what: str) -> bytes:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float32).numpy().astype(dtype).tobytes()
    try:
        return np.asarray(values, dtype=dtype).tobytes()
    except (TypeError, ValueError) as e:
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
        "tokens": _ints([t for s in syncs for t in s.tokens], _I32, "tokens"),
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
    if batch.parents is not None:
        raise WireError("proposal: token trees (parents) are in-process only for now")
    g = batch.tokens.shape[1]
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
        "q": q,
        "resync": _ints(batch.resync, _I64, "resync"),
        "draft_seconds": float(batch.draft_seconds),
    }


def encode_propose(items: Sequence[ProposeItem]) -> bytes:
    """Router → draft pool."""
    rows = _encode_rows([i.sync for i in items], [i.sampling for i in items])
    rows["gamma"] = _ints([i.gamma for i in items], _I32, "gamma")
    return _pack({"v": SCHEMA_VERSION, "kind": "propose", **rows})


def encode_proposal(batch: ProposalBatch) -> bytes:
    """Draft pool → router."""
    return _pack({"v": SCHEMA_VERSION, "kind": "proposal", **_encode_proposal_body(batch)})


def encode_verify(items: Sequence[VerifyItem], proposal: ProposalBatch) -> bytes:
    """Router → verifier: row b of ``proposal`` is the proposal for ``items[b]``."""
    rows = _encode_rows([i.sync for i in items], [i.sampling for i in items])
    return _pack({"v": SCHEMA_VERSION, "kind": "verify", "items": rows, "proposal": _encode_proposal_body(proposal)})


def encode_outcome(outcome: VerifyOutcome) -> bytes:
    """Verifier → router."""
    n = len(outcome.seq_ids)
    if not len(outcome.emitted) == len(outcome.num_accepted) == len(outcome.num_proposed) == n:
        raise WireError(f"outcome: emitted/num_accepted/num_proposed must each have {n} rows")
    return _pack(
        {
            "v": SCHEMA_VERSION,
            "kind": "outcome",
            "seq_ids": _ints(outcome.seq_ids, _I64, "seq_ids"),
            "emit_lens": _ints([len(e) for e in outcome.emitted], _I32, "emit_lens"),
            "emitted": _ints([t for e in outcome.emitted for t in e], _I32, "emitted"),
            "num_accepted": _ints(outcome.num_accepted, _I32, "num_accepted"),
            "num_proposed": _ints(outcome.num_proposed, _I32, "num_proposed"),
            "resync": _ints(outcome.resync, _I64, "resync"),
            "verify_seconds": float(outcome.verify_seconds),
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
    if set(value) != set(keys):
        missing = sorted(set(keys) - set(value))
        extra = sorted(map(repr, set(value) - set(keys)))
        raise WireError(f"{what}: wrong keys (missing {missing}, unexpected {extra})")
    return value


def _column(m: dict[str, Any], key: str, dtype: np.dtype, what: str, n: int | None = None) -> np.ndarray:
    raw = m[key]
    if type(raw) is not bytes:
        raise WireError(f"{what}.{key}: expected bytes, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:
        raise WireError(f"{what}.{key}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte values")
    arr = np.frombuffer(raw, dtype=dtype)
    if n is not None and arr.size != n:
        raise WireError(f"{what}.{key}: {arr.size} values, expected {n}")
    return arr


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise WireError(f"{what}: expected an int in [{lo}, {hi}], got {_show(value)}")
    return value


def _seconds(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise WireError(f"{what}: expected finite seconds ≥ 0, got {_show(value)}")
    return float(value)


# ---- decoding: semantics -----------------------------------------------------------------------


def _in_range(arr: np.ndarray, lo: int, hi: int, what: str) -> None:
    """All of ``arr`` in [lo, hi)."""
    bad = np.flatnonzero((arr < lo) | (arr >= hi))
    if bad.size:
        raise WireError(f"{what}: value {int(arr[bad[0]])} at index {int(bad[0])} is outside [{lo}, {hi})")


def _seq_ids(m: dict[str, Any], what: str, limits: WireLimits) -> np.ndarray:
    ids = _column(m, "seq_ids", _I64, what)
    if ids.size > limits.max_batch:
        raise WireError(f"{what}: batch of {ids.size} exceeds max_batch ({limits.max_batch})")
    _in_range(ids, 0, np.iinfo(_I64).max, f"{what}.seq_ids")
    if np.unique(ids).size != ids.size:
        raise WireError(f"{what}.seq_ids: duplicate seq ids")
    return ids


def _resync(m: dict[str, Any], what: str, seq_ids: np.ndarray) -> np.ndarray:
    resync = _column(m, "resync", _I64, what)
    if np.unique(resync).size != resync.size:
        raise WireError(f"{what}.resync: duplicate seq ids")
    if not np.isin(resync, seq_ids).all():
        raise WireError(f"{what}.resync: names seq ids that are not in the batch")
    return resync


def _token_ids(m: dict[str, Any], key: str, what: str, limits: WireLimits, n: int) -> np.ndarray:
    ids = _column(m, key, _I32, what, n)
    _in_range(ids, 0, limits.vocab_size, f"{what}.{key}")
    return ids


_ROW_KEYS = ("seq_ids", "base", "tok_lens", "tokens", "temperature", "top_p", "top_k", "seed")


def _decode_rows(
    m: dict[str, Any], what: str, limits: WireLimits
) -> tuple[np.ndarray, list[SyncItem], list[SamplingParams]]:
    seq_ids = _seq_ids(m, what, limits)
    n = seq_ids.size
    base = _column(m, "base", _I32, what, n).astype(np.int64)
    tok_lens = _column(m, "tok_lens", _I32, what, n).astype(np.int64)
    _in_range(base, 0, limits.max_seq_len + 1, f"{what}.base")
    _in_range(tok_lens, 0, limits.max_seq_len + 1, f"{what}.tok_lens")
    _in_range(base + tok_lens, 0, limits.max_seq_len + 1, f"{what}: base + len(tokens)")
    tokens = _token_ids(m, "tokens", what, limits, int(tok_lens.sum())).tolist()

    temperature = _column(m, "temperature", _F64, what, n)
    top_p = _column(m, "top_p", _F64, what, n)
    top_k = _column(m, "top_k", _I32, what, n)
    if not (np.isfinite(temperature).all() and (temperature >= 0).all()):
        raise WireError(f"{what}.temperature: must be finite and ≥ 0")
    if not (np.isfinite(top_p).all() and (top_p > 0).all() and (top_p <= 1).all()):
        raise WireError(f"{what}.top_p: must be in (0, 1]")
    _in_range(top_k, 0, 2**31 - 1, f"{what}.top_k")
    seeds = m["seed"]
    if not isinstance(seeds, list) or len(seeds) != n:
        raise WireError(f"{what}.seed: expected a list of {n} ints or nils")
    if not all(s is None or type(s) is int for s in seeds):
        raise WireError(f"{what}.seed: expected ints or nils")

    syncs, samplings, start = [], [], 0
    for b, (sid, bs, length) in enumerate(zip(seq_ids.tolist(), base.tolist(), tok_lens.tolist())):
        syncs.append(SyncItem(seq_id=sid, base=bs, tokens=tuple(tokens[start : start + length])))
        start += length
        samplings.append(
            SamplingParams(
                temperature=float(temperature[b]), top_p=float(top_p[b]), top_k=int(top_k[b]), seed=seeds[b]
            )
        )
    return seq_ids, syncs, samplings


_PROPOSAL_KEYS = ("seq_ids", "shape", "tokens", "lengths", "q", "resync", "draft_seconds")


def _decode_proposal_body(m: dict[str, Any], what: str, limits: WireLimits) -> ProposalBatch:
    seq_ids = _seq_ids(m, what, limits)
    shape = m["shape"]
    if not isinstance(shape, list) or len(shape) != 2:
        raise WireError(f"{what}.shape: expected [B, G], got {_show(shape)}")
    n = _int(shape[0], f"{what}.shape[0]", seq_ids.size, seq_ids.size)
    g = _int(shape[1], f"{what}.shape[1] (chain length)", 0, limits.gamma_max)
    tokens = _token_ids(m, "tokens", what, limits, n * g).reshape(n, g)  # [B, G]
    lengths = _column(m, "lengths", _I32, what, n)  # [B]
    _in_range(lengths, 0, g + 1, f"{what}.lengths")
    resync = _resync(m, what, seq_ids)
    if lengths[np.isin(seq_ids, resync)].any():
        raise WireError(f"{what}: a resync row carries draft tokens")

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
        seq_ids=seq_ids.tolist(),
        tokens=torch.from_numpy(tokens.astype(np.int64)),
        lengths=torch.from_numpy(lengths.astype(np.int64)),
        q_ids=q_ids_t,
        q_probs=q_probs_t,
        resync=resync.tolist(),
        draft_seconds=_seconds(m["draft_seconds"], f"{what}.draft_seconds"),
    )


def decode_propose(data: bytes, limits: WireLimits) -> list[ProposeItem]:
    frame = _unpack(data, "propose", (*_ROW_KEYS, "gamma"))
    seq_ids, syncs, samplings = _decode_rows(frame, "propose", limits)
    gamma = _column(frame, "gamma", _I32, "propose", seq_ids.size)
    _in_range(gamma, 0, limits.gamma_max + 1, "propose.gamma")
    return [ProposeItem(sync=s, gamma=int(g), sampling=p) for s, g, p in zip(syncs, gamma.tolist(), samplings)]


def decode_proposal(data: bytes, limits: WireLimits) -> ProposalBatch:
    return _decode_proposal_body(_unpack(data, "proposal", _PROPOSAL_KEYS), "proposal", limits)


def decode_verify(data: bytes, limits: WireLimits) -> tuple[list[VerifyItem], ProposalBatch]:
    frame = _unpack(data, "verify", ("items", "proposal"))
    seq_ids, syncs, samplings = _decode_rows(_map(frame["items"], "verify.items", _ROW_KEYS), "verify.items", limits)
    body = _map(frame["proposal"], "verify.proposal", _PROPOSAL_KEYS)
    proposal = _decode_proposal_body(body, "verify.proposal", limits)
    if proposal.seq_ids != seq_ids.tolist():
        raise WireError("verify: proposal rows must be the items' seq ids, in the same order")
    if proposal.q_ids is None:
        sampled = [b for b, p in enumerate(samplings) if not p.greedy and int(proposal.lengths[b])]
        if sampled:
            raise WireError(f"verify: row {sampled[0]} is sampled and drafted but the proposal has no q")
    return [VerifyItem(sync=s, sampling=p) for s, p in zip(syncs, samplings)], proposal


def decode_outcome(data: bytes, limits: WireLimits) -> VerifyOutcome:
    keys = ("seq_ids", "emit_lens", "emitted", "num_accepted", "num_proposed", "resync", "verify_seconds")
    frame = _unpack(data, "outcome", keys)
    seq_ids = _seq_ids(frame, "outcome", limits)
    n = seq_ids.size
    emit_lens = _column(frame, "emit_lens", _I32, "outcome", n)
    accepted = _column(frame, "num_accepted", _I32, "outcome", n)
    proposed = _column(frame, "num_proposed", _I32, "outcome", n)
    _in_range(proposed, 0, limits.gamma_max + 1, "outcome.num_proposed")
    _in_range(accepted, 0, limits.gamma_max + 1, "outcome.num_accepted")
    if (accepted > proposed).any():
        raise WireError("outcome: num_accepted exceeds num_proposed")
    _in_range(emit_lens, 0, limits.gamma_max + 2, "outcome.emit_lens")
    if (emit_lens > accepted.astype(np.int64) + 1).any():
        raise WireError("outcome: a row emits more than its accepted tokens plus one")
    emitted = _token_ids(frame, "emitted", "outcome", limits, int(emit_lens.sum(dtype=np.int64))).tolist()
    resync = _resync(frame, "outcome", seq_ids)
    if emit_lens[np.isin(seq_ids, resync)].any():
        raise WireError("outcome: a resync row emits tokens")
    rows, start = [], 0
    for length in emit_lens.tolist():
        rows.append(emitted[start : start + length])
        start += length
    return VerifyOutcome(
        seq_ids=seq_ids.tolist(),
        emitted=rows,
        num_accepted=accepted.tolist(),
        num_proposed=proposed.tolist(),
        resync=resync.tolist(),
        verify_seconds=_seconds(frame["verify_seconds"], "outcome.verify_seconds"),
    )


def decode_release(data: bytes, limits: WireLimits) -> Release:
    frame = _unpack(data, "release", ("seq_ids",))
    return Release(seq_ids=tuple(_seq_ids(frame, "release", limits).tolist()))
