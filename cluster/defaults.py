"""The defaults of the knobs that code outside the config uses too: one home for each, plain constants so
that the engine can read them without pydantic (the GPU image has torch and transformers only).
``cluster/config.py`` declares its fields with these values; ``engine.assembly.EngineSettings`` and the
CLI take theirs from here."""

DEVICE = "auto"
DTYPE = "auto"
MAX_MODEL_LEN = 1024
MAX_RUNNING = 64
GAMMA, GAMMA_MIN, GAMMA_MAX = 4, 1, 8
ADAPTIVE = True
CONFIDENCE_THRESHOLD = 0.0
Q_TOP_K = 64
NGRAM_MIN, NGRAM_MAX = 1, 4
# The draft model's token trees (issue 15): 0 drafts chains; > 0 lets the adaptive policy choose per step
# between the chain and trees of up to that many nodes (a fixed γ drafts that tree every step)
TREE_NODES = 0
TREE_TOP_K = 8  # children per expanded tree node, and nodes expanded per tree level
# Candidate chains per row and step (one propose call each, on different draft replicas in a cluster),
# merged into one token tree; 1: a single chain
DRAFT_NUM, DRAFT_NUM_MAX = 1, 8
MAX_TOKENS = 256
# Structured outputs (issue 31): a grammar whose source exceeds this many bytes, or whose compilation takes
# longer than this, is refused (HTTP 400), never a stalled batch; compiled grammars kept per tokenizer
GRAMMAR_MAX_BYTES = 256 * 1024
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
GRAMMAR_CACHE_SIZE = 256
FORCED_TOKENS = True  # a constrained row's forced runs are drafted by the grammar itself (q = 1)
# Paged KV (issue 33): positions per KV block, and whether full blocks of committed tokens are kept and reused
# by later sequences that start with the same tokens
KV_BLOCK_SIZE = 16
PREFIX_CACHE = True


def kv_blocks(slots: int, max_len: int, block_size: int) -> int:
    """The blocks a KV pool has by default: every slot's sequence at ``max_len`` (``runtime.kv_cache``)."""
    return slots * -(-max_len // block_size)
