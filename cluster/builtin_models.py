"""The builtin tiny pair (``builtin:tiny``): built from config in code, no files, no downloads.

The target, and a draft that is a slightly noisy copy of it, so acceptance sits in between. For tests and
smoke runs; it has no tokenizer (token ids only). Kept torch-free so that the memory plan can size it;
``runtime.models.tiny_llama`` builds it from these keyword arguments.
"""

TINY_TARGET = {"seed": 0, "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 2, "intermediate_size": 128, "max_position_embeddings": 2048}
TINY_DRAFT_NOISE = 0.05
