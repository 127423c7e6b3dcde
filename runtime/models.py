"""Loading target and draft models from local Hugging Face folders or GGUF files, and building tiny ones.

Only Llama-family decoders are accepted (the compact forward in ``forward.py`` implements exactly their
block: RMSNorm → GQA attention with RoPE → RMSNorm → gated MLP). Anything else is refused before loading
(``cluster.model_files.inspect_model``, the same check config validation runs) rather than producing wrong
tokens later. Nothing here downloads: paths must be local. A GGUF file is read by transformers' GGUF loader
(needs the ``gguf`` and ``accelerate`` packages), its weights dequantised to the serving dtype.
"""

from __future__ import annotations

import torch

from cluster.builtin_models import TINY_DRAFT_NOISE, TINY_TARGET
from cluster.model_files import ModelFileError, ModelFiles, inspect_model
from runtime.cpu_linear import pack_linears

# One error for every model-path problem, whether config validation or loading finds it.
ModelLoadError = ModelFileError


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


def load_causal_lm(path: str, dtype: str | torch.dtype = "auto", device: str | None = "auto"):
    """Load a local HF folder or GGUF causal LM in eval mode on ``device``; refuse unsupported families up front."""
    from transformers import AutoModelForCausalLM

    files = inspect_model(path, path).files
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(files.folder, dtype=resolve_dtype(dtype, dev), local_files_only=True,
                                                 **_gguf_kwargs(files, dequantize=True))
    return model.to(dev).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    files = inspect_model(path, path).files
    return AutoTokenizer.from_pretrained(files.folder, local_files_only=True, **_gguf_kwargs(files))


def has_tokenizer(path: str) -> bool:
    """Whether ``load_tokenizer(path)`` has files to load (builtin models have none)."""
    return not path.startswith("builtin:") and inspect_model(path, path).has_tokenizer


def _gguf_kwargs(files: ModelFiles, dequantize: bool = False) -> dict:
    if files.gguf_file is None:
        return {}
    kwargs = {"gguf_file": files.gguf_file}
    if dequantize:
        # The compact forward and the CPU kernels read plain float weights: where transformers can keep GGUF
        # blocks packed (some architectures, with the `kernels` package), ask it to unpack them.
        try:
            from transformers import GgufConfig
        except ImportError:  # a transformers from before packed GGUF loading always unpacks
            return kwargs
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    return kwargs


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
    (``runtime.cpu_linear``); callers that shard or move the model afterwards pass False.

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
    vocab = inspect_model(path, path).vocab_size
    if vocab is None:
        raise ModelLoadError(f"{path}: its config gives no vocab_size")
    return vocab
