"""Loading target and draft models from local Hugging Face folders, and building tiny ones from config.

Only Llama-family decoders are accepted (the compact forward in ``forward.py`` implements exactly their
block: RMSNorm → GQA attention with RoPE → RMSNorm → gated MLP). Anything else is refused at load time
rather than producing wrong tokens later. Nothing here downloads: paths must be local folders.
"""

from __future__ import annotations

import json
import os
import torch

from verifier.cpu_linear import pack_linears

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class ModelLoadError(ValueError):
    pass


def resolve_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ModelLoadError(f"unknown dtype {name!r}; use one of auto, {', '.join(sorted(table))}")
    return table[name]


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def read_model_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path!r} is not a local Hugging Face model folder (no config.json); "
                             "specserve never downloads weights")
    with open(cfg_path) as f:
        return json.load(f)


def check_supported(model_type: str, path: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} is not supported; specserve serves Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})")


def load_causal_lm(path: str, dtype: str | torch.dtype = "auto", device: str | None = "auto"):
    """Load a local HF causal LM in eval mode on ``device``; refuse unsupported families up front."""
    from transformers import AutoModelForCausalLM

    cfg = read_model_config(path)
    check_supported(cfg.get("model_type", "?"), path)
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, dev), local_files_only=True)
    return model.to(dev).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def check_vocab_compatible(target_path: str, draft_path: str) -> None:
    """The draft's ids must mean the same tokens as the target's, or its proposals are noise."""
    t, d = read_model_config(target_path), read_model_config(draft_path)
    if t.get("vocab_size") != d.get("vocab_size"):
        raise ModelLoadError(
            f"draft vocab_size {d.get('vocab_size')} != target vocab_size {t.get('vocab_size')}: "
            "draft and target must share one tokenizer")
    tt, dt = _tokenizer_vocab(target_path), _tokenizer_vocab(draft_path)
    if tt is not None and dt is not None and tt != dt:
        differing = sum(1 for k, v in tt.items() if dt.get(k) != v)
        raise ModelLoadError(f"draft and target tokenizers differ ({differing} tokens map to other ids)")


def _tokenizer_vocab(path: str) -> dict | None:
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok):
        return None
    with open(tok) as f:
        return json.load(f).get("model", {}).get("vocab")


def tiny_llama(seed: int, *, vocab_size: int = 96, hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
               max_position_embeddings: int = 512, model_type: str = "llama", **extra):
    """A tiny randomly initialised Llama-family model built from config with a fixed seed (tests, demos)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[model_type]
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = model_cls(config)
    # Default init is very small: logits are near-uniform and greedy ties become likely. Larger weights give
    # peaked, tie-free distributions, which is what a greedy identity test needs.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4)
    return model.eval()


def noisy_copy(model, noise: float, seed: int):
    """A draft that is the target plus weight noise: acceptance falls as ``noise`` grows."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return draft.eval()


def build_model(spec, device: str | None = "auto", dtype: str = "auto", *, cpu_kernels: bool = True):
    """A model from a serialisable spec, so Ray workers can each build their own copy.

    With ``cpu_kernels``, a float32 model on the CPU gets oneDNN-prepacked Linear layers
    (``verifier.cpu_linear``); callers that shard or move the model afterwards pass False.

    ``spec`` is a local HF folder path, ``{"path": folder, "dtype": ...}``, or ``{"tiny": {...kwargs of
    tiny_llama}, "noise": float, "noise_seed": int}`` (a tiny model from config; with ``noise``, a noisy
    copy of it — the tests' in-between draft).
    """
    if isinstance(spec, str):
        spec = {"path": spec}
    if "path" in spec:
        model = load_causal_lm(spec["path"], spec.get("dtype", dtype), device)
    else:
        model = tiny_llama(**spec["tiny"])
        if spec.get("noise"):
            model = noisy_copy(model, spec["noise"], spec.get("noise_seed", 1))
        model = model.to(resolve_device(device))
    if cpu_kernels:
        pack_linears(model)
    return model


BUILTIN_TINY = "builtin:tiny"
# A tiny pair built from config (no files): the target, and a draft that is a slightly noisy copy of it,
# so acceptance sits in between. For tests and smoke runs; it has no tokenizer (token ids only).
TINY_TARGET = {"seed": 0, "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 2, "intermediate_size": 128, "max_position_embeddings": 2048}
TINY_DRAFT_NOISE = 0.05


def resolve_spec(path: str, role: str, dtype: str = "auto"):
    """Model spec for a config path: ``builtin:tiny`` (target, or its noisy copy as draft) or a folder."""
    if path == BUILTIN_TINY:
        return {"tiny": dict(TINY_TARGET), **({"noise": TINY_DRAFT_NOISE, "noise_seed": 1} if role == "draft" else {})}
    return {"path": path, "dtype": dtype}


def spec_vocab_size(spec) -> int:
    """Vocabulary size of a model spec without building the model."""
    if isinstance(spec, dict) and "tiny" in spec:
        return spec["tiny"].get("vocab_size", 96)
    path = spec if isinstance(spec, str) else spec["path"]
    return int(read_model_config(path)["vocab_size"])
