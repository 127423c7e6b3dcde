"""GGUF files written from Hugging Face folders with the ``gguf`` package (no llama.cpp, no downloads).

``write_gguf(folder, out)`` writes the model in ``folder`` as one GGUF file the way llama.cpp's converter
lays it out — F32 tensors, so transformers' GGUF loader gives back the same float weights; Llama's q/k rows
in llama.cpp's interleaved RoPE order; the tokenizer.json vocabulary, merges and special ids as
``tokenizer.ggml.*`` metadata (byte-level BPE, ``gpt2``), and the fixtures' chat template.

``write_gguf(..., quantize="Q8_0")`` writes the matrices quantised instead.

``gguf_pair()`` is ``tests.fixtures_tokenizer.tiny_pair()`` written that way, each file alone in its own
folder of a temporary directory removed at interpreter exit; cached per process.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures_tokenizer import CHAT_TEMPLATE, tiny_pair

TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp's token types


@dataclass(frozen=True)
class GgufPair:
    root: Path
    target: str  # root/target/tiny-target-f32.gguf
    draft: str  # root/draft/tiny-draft-f32.gguf


@functools.lru_cache(maxsize=None)
def gguf_pair() -> GgufPair:
    pair = tiny_pair()
    root = Path(tempfile.mkdtemp(prefix="specserve-gguf-pair-"))
    atexit.register(shutil.rmtree, root, True)
    return GgufPair(root, str(write_gguf(pair.target, root / "target" / "tiny-target-f32.gguf")),
                    str(write_gguf(pair.draft, root / "draft" / "tiny-draft-f32.gguf")))


def _llama_permute(w, n_head: int):
    """llama.cpp stores Llama's q/k rows interleaved per head (its RoPE layout); transformers undoes this."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: str, out: Path, *, arch: str = "llama", quantize: str | None = None,
               tokens: list[str] | None = None, extra: dict[str, int] | None = None) -> Path:
    """The HF model in ``folder`` as one F32 GGUF file. ``quantize`` (a ggml type name such as "Q8_0")
    stores the matrices quantised instead, as llama.cpp's quantiser would (norms stay F32); ``tokens``
    replaces the vocabulary's token list; ``extra`` adds uint32 metadata keys."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch=arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    tokenizer_json = Path(folder) / "tokenizer.json"
    if tokenizer_json.is_file():
        tok = json.loads(tokenizer_json.read_text())
        table = {i: t for t, i in tok["model"]["vocab"].items()}
        table.update({a["id"]: a["content"] for a in tok["added_tokens"]})
        control = {a["id"] for a in tok["added_tokens"] if a["special"]}
        w.add_tokenizer_model("gpt2")  # byte-level BPE
        w.add_token_list(tokens or [table[i] for i in range(len(table))])
        w.add_token_types([TOKEN_CONTROL if i in control else TOKEN_NORMAL for i in range(len(table))])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_pad_token_id(cfg.pad_token_id)
        w.add_add_bos_token(False)  # the folder's tokenizer adds no BOS either
        w.add_chat_template(CHAT_TEMPLATE)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for param, tensor in model.state_dict().items():
        module, kind = param.rsplit(".", 1)
        array = tensor.numpy()
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            array = _llama_permute(array, heads)
        name = f"{names.get_name(module)}.{kind}"
        if quantize and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
