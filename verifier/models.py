"""Loading target and draft models from local Hugging Face folders, and building tiny ones from config.

Only Llama-family decoders are accepted (the compact forward in ``forward.py`` implements exactly their
block: RMSNorm → GQA attention with RoPE → RMSNorm → gated MLP). Anything else is refused at load time
rather than producing wrong tokens later. Nothing here downloads: paths must be local folders.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class VocabInfo:
    vocab_size: int  # rows of the LM head
    tokenizer_vocab: dict | None  # token string → id, when a tokenizer is present


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
