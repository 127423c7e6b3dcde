"""Local model files: the one check of a target or draft path, before any weights are read.

A model path names a Hugging Face folder (``config.json``, weights, usually ``tokenizer.json``), a ``.gguf``
file, or a folder whose only model file is one ``.gguf``. ``inspect_model`` reads what the checks need — the
model family, vocabulary size, attention heads and the tokenizer's id → token table — from ``config.json`` /
``tokenizer.json`` or from the GGUF header, and refuses what the compact forward cannot run. Config validation
(``cluster.config``) and model loading (``runtime.models``) both call it, and ``check_draft_matches`` is the
one rule for whether a draft's token ids mean the target's tokens, so a pair cannot pass one and fail the other.

No torch, numpy or ``gguf`` import: the GGUF header is parsed here with ``struct``, stopping before the
tensor table (the ``gguf`` package's reader makes a numpy view of every vocabulary entry, far too slow for
a large vocabulary: docs/measurements.md#model-files).
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The families whose block the compact forward (runtime/forward.py) implements.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class ModelFileError(ValueError):
    """A model path that cannot be served; the message starts with what it concerns (a key path or the path)."""


@dataclass(frozen=True)
class ModelFiles:
    """What ``from_pretrained`` is given: ``from_pretrained(folder, gguf_file=gguf_file)``."""

    folder: str
    gguf_file: str | None = None  # absolute path of the .gguf file; None for a Hugging Face folder

    @property
    def described_by(self) -> str:
        return "GGUF metadata" if self.gguf_file else "config.json"


@dataclass(frozen=True)
class ModelInfo:
    files: ModelFiles
    model_type: str
    vocab_size: int | None  # rows of the embedding / logits
    num_attention_heads: int | None
    num_key_value_heads: int | None
    has_tokenizer: bool  # a tokenizer can be loaded from these files
    # id → token text where the files spell the vocabulary out (tokenizer.json, tokenizer.ggml.tokens);
    # None where they do not (e.g. only a sentencepiece tokenizer.model).
    tokens: dict[int, str] | None = field(default=None, repr=False, compare=False)


def is_local_model(path: str) -> bool:
    """Whether ``path`` is a model on this machine (not a builtin, and it exists here)."""
    return bool(path) and not path.startswith("builtin:") and Path(path).expanduser().exists()


def inspect_model(path: str, where: str) -> ModelInfo:
    """Read and check the model at ``path``; ``where`` starts every error message (a key path or the path)."""
    files = locate(path, where)
    stamp = tuple(_stamp(f) for f in _read_by(files))
    return _inspect(files, stamp, where)


def locate(path: str, where: str) -> ModelFiles:
    """The files behind a model path: a Hugging Face folder, a .gguf file, or a folder holding one .gguf."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelFileError(f"{where}: {path} is a file but not a .gguf file; name the model's folder instead")
        return ModelFiles(str(p.resolve().parent), str(p.resolve()))
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelFiles(str(p))
        ggufs = sorted(f.name for f in p.glob("*.gguf") if f.is_file())
        if len(ggufs) == 1:
            return ModelFiles(str(p.resolve()), str((p / ggufs[0]).resolve()))
        if ggufs:
            raise ModelFileError(f"{where}: {p} holds several .gguf files ({', '.join(ggufs)}); name one of them")
    raise ModelFileError(
        f"{where}: no config.json or .gguf file at {path} (a model path is a local Hugging Face folder or a "
        ".gguf file; specserve never downloads weights)")


def check_tensor_parallel(info: ModelInfo, tp: int, where: str = "target.tensor_parallel") -> None:
    """Each tensor-parallel rank holds whole attention and key/value heads."""
    if tp == 1:
        return
    heads, kv_heads = info.num_attention_heads, info.num_key_value_heads
    if heads is None:
        raise ModelFileError(f"{where}: cannot check it, the target's {info.files.described_by} has no "
                             "num_attention_heads")
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n is None or n % tp:
            raise ModelFileError(
                f"{where} ({tp}) must divide the target's {name} ({n}): each rank holds whole heads")


def check_pair(target: str, draft: str | None, *, tensor_parallel: int = 1,
               where: tuple[str, str] = ("target.path", "draft.path")) -> None:
    """The model-folder rules that config validation and engine assembly both apply: a supported target
    whose heads split over ``tensor_parallel`` ranks and, when the draft is a local model too, a draft whose
    token ids mean the target's. Builtin and absent paths are left to model loading."""
    if not is_local_model(target):
        return
    info = inspect_model(target, where[0])
    check_tensor_parallel(info, tensor_parallel)
    if draft is not None and is_local_model(draft):
        check_draft_matches(info, inspect_model(draft, where[1]), where[1])


def check_draft_matches(target: ModelInfo, draft: ModelInfo, where: str = "draft.path") -> None:
    """The draft's token ids must mean the target's tokens, and name only ids the target has a row for.

    Where both spell their vocabulary out, the id → token tables must be equal and the draft's vocab_size
    may be smaller than the target's (embedding padding differs between sizes of one family), never larger.
    Otherwise nothing shows the vocabularies agree but the sizes, which must then be equal.
    """
    if target.tokens is not None and draft.tokens is not None:
        differing = sorted(i for i in target.tokens.keys() | draft.tokens.keys()
                           if target.tokens.get(i) != draft.tokens.get(i))
        if differing:
            i = differing[0]
            raise ModelFileError(
                f"{where}: draft and target tokenizers differ ({len(differing)} token ids map to other text, "
                f"e.g. id {i}: draft {draft.tokens.get(i)!r}, target {target.tokens.get(i)!r}); draft and target "
                "must share one tokenizer")
        if None not in (target.vocab_size, draft.vocab_size) and draft.vocab_size > target.vocab_size:
            raise ModelFileError(
                f"{where}: the draft's vocab_size ({draft.vocab_size}) exceeds the target's ({target.vocab_size}): "
                "the draft could propose ids the target has no logits for")
        return
    if target.vocab_size is None or target.vocab_size != draft.vocab_size:
        raise ModelFileError(
            f"{where}: the draft's vocab_size ({draft.vocab_size}) differs from the target's ({target.vocab_size}) "
            "and their tokenizers cannot be compared (both need tokenizer.json or GGUF token lists)")


# ---- reading -----------------------------------------------------------------------------------


def _read_by(files: ModelFiles) -> list[Path]:
    if files.gguf_file:
        return [Path(files.gguf_file)]
    folder = Path(files.folder)
    return [folder / "config.json", folder / "tokenizer.json"]


def _stamp(file: Path) -> tuple[str, int, int] | None:
    try:
        st = file.stat()
    except FileNotFoundError:
        return None
    return str(file), st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _inspect(files: ModelFiles, stamp: tuple, where: str) -> ModelInfo:
    # Cached per file version (``stamp``): config validation, engine assembly and the wire limits of one
    # process all ask, and a large vocabulary takes a noticeable fraction of a second to read.
    info = _inspect_gguf(files, where) if files.gguf_file else _inspect_folder(files, where)
    if info.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(
            f"{where}: model_type {info.model_type!r} is not supported; specserve serves Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    return info


def _inspect_folder(files: ModelFiles, where: str) -> ModelInfo:
    folder = Path(files.folder)
    cfg = _read_json(folder / "config.json", where)
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{where}: {folder / 'config.json'} is not a JSON object")
    text = cfg.get("text_config")
    # Multimodal configs keep the language model's fields under text_config.
    fields = text if "num_attention_heads" not in cfg and isinstance(text, dict) else cfg
    heads = _int_or_none(fields.get("num_attention_heads"))
    kv_heads = fields.get("num_key_value_heads", heads)  # absent means multi-head attention
    tokenizer_json = folder / "tokenizer.json"
    tokens = _tokenizer_json_tokens(tokenizer_json, where) if tokenizer_json.is_file() else None
    if "model_type" not in cfg:
        raise ModelFileError(f"{where}: {folder / 'config.json'} names no model_type")
    return ModelInfo(files, str(cfg["model_type"]), _int_or_none(fields.get("vocab_size")), heads,
                     _int_or_none(kv_heads),
                     has_tokenizer=tokens is not None or (folder / "tokenizer_config.json").is_file(), tokens=tokens)


def _read_json(file: Path, where: str) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{where}: cannot read {file}: {e}") from e


def _tokenizer_json_tokens(file: Path, where: str) -> dict[int, str]:
    tok = _read_json(file, where)
    model = tok.get("model") if isinstance(tok, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, dict):
        raise ModelFileError(f"{where}: {file} has no model vocabulary")
    tokens = {i: t for t, i in vocab.items() if type(i) is int}
    for added in tok.get("added_tokens") or ():
        if isinstance(added, dict) and type(added.get("id")) is int:
            tokens[added["id"]] = added.get("content")
    return tokens


def _inspect_gguf(files: ModelFiles, where: str) -> ModelInfo:
    meta = read_gguf_metadata(files.gguf_file, where, keep_strings=("tokenizer.ggml.tokens",))
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{where}: {files.gguf_file} has no general.architecture in its metadata")
    if meta.get("split.count", 1) > 1:
        raise ModelFileError(
            f"{where}: {files.gguf_file} is one part of a split GGUF ({meta['split.count']} parts); merge the "
            "parts into one file first (llama.cpp: llama-gguf-split --merge)")
    # transformers' own rule: llama.cpp writes Mistral models with the llama architecture.
    model_type = "mistral" if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower() else arch
    raw = meta.get("tokenizer.ggml.tokens")
    # llama.cpp pads a vocabulary to the embedding size with "[PAD<id>]" entries: ids no tokenizer produces.
    tokens = {i: t for i, t in enumerate(raw) if t != f"[PAD{i}]"} if isinstance(raw, list) else None
    heads = _int_or_none(meta.get(f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    # transformers takes the vocabulary size from here, or else from the token count.
    vocab = meta.get(f"{arch}.vocab_size", len(raw) if isinstance(raw, list) else None)
    return ModelInfo(files, model_type, _int_or_none(vocab), heads, _int_or_none(kv_heads),
                     has_tokenizer=tokens is not None, tokens=tokens)


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


# ---- the GGUF header (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) ------------------

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str, where: str, keep_strings: tuple[str, ...] = ()) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3, little-endian); tensors are not read.

    String arrays (vocabularies, merges) are kept only for the keys in ``keep_strings``, else their length.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _read_metadata(blob, keep_strings)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelFileError(f"{where}: cannot read {path} as a GGUF file: {e}") from e


def _read_metadata(blob: mmap.mmap, keep_strings: tuple[str, ...]) -> dict[str, Any]:
    if blob[:4] != b"GGUF":
        raise ValueError("no GGUF magic bytes at the start")
    version, _tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):  # a big-endian file reads as a huge version number
        raise ValueError(f"GGUF version {version} (readable: 2 and 3, little-endian)")
    pos, meta = 24, {}
    for _ in range(kv_count):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        meta[key], pos = _read_value(blob, pos + 4, value_type, key in keep_strings)
    return meta


def _read_value(blob: mmap.mmap, pos: int, value_type: int, keep: bool) -> tuple[Any, int]:
    if value_type in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _GGUF_STRING:
        return _read_string(blob, pos)
    if value_type != _GGUF_ARRAY:
        raise ValueError(f"unknown metadata value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element_type in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[element_type]
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos))
        return values, pos + count * struct.calcsize(fmt)
    if element_type != _GGUF_STRING:
        raise ValueError(f"metadata array of type {element_type}")
    if keep:
        values = []
        for _ in range(count):
            value, pos = _read_string(blob, pos)
            values.append(value)
        return values, pos
    for _ in range(count):  # strings vary in length: walk past them
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return count, pos


def _read_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    pos += 8
    return blob[pos: pos + length].decode("utf-8"), pos + length
