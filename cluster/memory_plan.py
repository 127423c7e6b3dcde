"""The memory plan: what every replica of a config will hold, computed from the model configs before
anything loads, and the check that refuses a config the node cannot hold.

Per replica, in bytes:

- **weights**: the model's parameters in the serving dtype (``config.json`` or GGUF metadata give the
  shapes; ``builtin:tiny`` its config in code). A tensor-parallel rank holds its shards of the projection
  and LM-head weights and a whole embedding.
- **prepacked copy**: on CPU in float32 the Linear weights are held once, in oneDNN's packed layout
  (``runtime/cpu_linear.py``); only an LM head tied to the embedding is held twice (the embedding needs
  the dense matrix), and that second copy is this row.
- **KV cache**: the preallocated pool of blocks, ``2 × layers × (blocks + 1) × block_size × kv_heads ×
  head_dim`` (one scratch block); by default ``blocks`` holds every slot's sequence at ``max_model_len``
  (``defaults.kv_blocks``). The verifier has ``router.max_running`` slots, a draft replica ``draft_slots``.
- **workspace**: the largest step's activations. Prefill is not chunked, so the worst step is a whole
  micro-batch (``⌈max_running / micro_batches⌉`` rows) joining with prompts of ``max_model_len`` tokens:
  about ``3·intermediate + 6·hidden`` floats per token at the MLP, plus the attention mask; or, for large
  vocabularies, the logits of γ_max + 1 positions per row and the sampling warp over them (~10 copies of
  the logits for top-k/top-p rows). Measured against this formula in tests/unit/test_memory_plan.py.
- **runtime**: one replica process apart from its models — Python, torch, transformers, a Ray worker.

The node also runs Ray itself (GCS, raylet, the Serve controller and HTTP proxy): ``RAY_SYSTEM_BYTES``.
While a checkpoint loads, its file is memory-mapped: those pages are page cache, shared and reclaimable,
and not counted.

No torch or ray import: ``specserve plan`` and ``build_app``'s check run before either loads a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster import defaults as D
from cluster.builtin_models import TINY_TARGET
from cluster.model_files import ModelFileError, locate, read_gguf_metadata

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

MiB = 1 << 20
GiB = 1 << 30
# Resident memory of a replica process apart from its models (Python, torch, transformers, a Ray worker;
# shared library pages counted in every process, as RSS counts them), and of Ray's own processes on a node
# running a Serve app: peak RSS of scripts/bench_served.py's replicas (docs/measurements.md#memory-plan).
RUNTIME_BYTES = 512 * MiB
LOCAL_ROUTER_RUNTIME_BYTES = 600 * MiB
ROUTER_RUNTIME_BYTES = 420 * MiB
INGRESS_RUNTIME_BYTES = 160 * MiB
RAY_SYSTEM_BYTES = 700 * MiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FLOAT32 = 4  # activations, logits and sampling run in float32 whatever the weights' dtype
LOCAL_ROUTER = "router (local stages)"  # router.stages 'local': the router replica runs both models
WARP_COPIES = 10  # logits + the top-k/top-p warp's temporaries + dense q, in units of [rows, γ+1, vocab]


class PlanError(ValueError):
    """A config whose memory plan does not fit; the message holds the plan and what to lower."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that its memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool  # the LM head shares the embedding's matrix
    qkv_bias: bool = False
    mlp_bias: bool = False

    @property
    def layer_linear_params(self) -> int:
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def other_params(self) -> int:
        """Norms and biases: small, never packed or sharded."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = 2 * h
        if self.qkv_bias:
            per_layer += self.num_heads * self.head_dim + 2 * kv
        if self.mlp_bias:
            per_layer += 2 * self.intermediate_size + h
        return self.num_layers * per_layer + h

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return self.embedding_params + head + self.num_layers * self.layer_linear_params + self.other_params

    def kv_bytes_per_block(self, block_size: int, elem: int, tp: int = 1) -> int:
        return 2 * self.num_layers * block_size * (self.num_kv_heads // tp) * self.head_dim * elem


def read_shape(path: str, where: str) -> ModelShape:
    """The shape of the model at a config path (a folder, a .gguf file, or ``builtin:tiny``)."""
    if path.startswith("builtin:"):
        t = TINY_TARGET
        return ModelShape(t["vocab_size"], t["hidden_size"], t["intermediate_size"], t["num_layers"], t["num_heads"],
                          t["num_kv_heads"], t["hidden_size"] // t["num_heads"], tied=False)
    files = locate(path, where)
    if files.gguf_file:
        return _gguf_shape(read_gguf_metadata(files.gguf_file, where), where)
    import json

    try:
        cfg = json.loads((Path(files.folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{where}: cannot read {files.folder}/config.json: {e}") from e
    text = cfg.get("text_config")
    fields = text if "num_attention_heads" not in cfg and isinstance(text, dict) else cfg
    return _config_shape(fields, cfg.get("model_type"), where)


def _need(fields: dict[str, Any], key: str, where: str) -> int:
    value = fields.get(key)
    if type(value) is not int or value <= 0:
        raise ModelFileError(f"{where}: the model config has no positive integer {key} (needed to plan memory)")
    return value


def _config_shape(fields: dict[str, Any], model_type: str | None, where: str) -> ModelShape:
    hidden, heads = _need(fields, "hidden_size", where), _need(fields, "num_attention_heads", where)
    kv_heads = fields.get("num_key_value_heads") or heads
    return ModelShape(
        vocab_size=_need(fields, "vocab_size", where), hidden_size=hidden,
        intermediate_size=_need(fields, "intermediate_size", where),
        num_layers=_need(fields, "num_hidden_layers", where), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=fields.get("head_dim") or hidden // heads,
        # transformers' default is tied; Llama-family configs usually spell it out.
        tied=bool(fields.get("tie_word_embeddings", True)),
        qkv_bias=model_type == "qwen2" or bool(fields.get("attention_bias", False)),
        mlp_bias=bool(fields.get("mlp_bias", False)))


def _gguf_shape(meta: dict[str, Any], where: str) -> ModelShape:
    arch = meta.get("general.architecture")
    fields = {k.removeprefix(f"{arch}."): v for k, v in meta.items() if isinstance(k, str)}
    hidden = _need(fields, "embedding_length", where)
    heads = _need(fields, "attention.head_count", where)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = fields.get("vocab_size") or (tokens if type(tokens) is int else len(tokens or ()))
    return ModelShape(
        vocab_size=_need({"vocab_size": vocab}, "vocab_size", where), hidden_size=hidden,
        intermediate_size=_need(fields, "feed_forward_length", where),
        num_layers=_need(fields, "block_count", where), num_heads=heads,
        num_kv_heads=fields.get("attention.head_count_kv") or heads,
        head_dim=fields.get("attention.key_length") or hidden // heads,
        # The header does not say whether an output matrix exists; untied is the larger on a GPU (on the CPU
        # the two cost the same: a tied head is packed as a second copy).
        tied=False, qkv_bias=arch == "qwen2")


# ---- per replica -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLoad:
    """One model as a replica holds it."""

    shape: ModelShape
    device: str  # "cpu" | "cuda"
    dtype: str  # float32 | bfloat16 | float16
    slots: int
    max_len: int
    rows: int  # most rows one forward carries
    logits: int  # logit positions per row (γ_max + 1 for the verifier, 1 for a draft step)
    tp: int = 1
    block_size: int = D.KV_BLOCK_SIZE
    num_blocks: int | None = None  # None: every slot at max_len

    @property
    def packed(self) -> bool:
        return self.device == "cpu" and self.dtype == "float32" and self.tp == 1

    def weights(self) -> int:
        s, tp = self.shape, self.tp
        sharded = s.num_layers * s.layer_linear_params + (0 if s.tied and tp == 1 else s.embedding_params)
        return (s.embedding_params + sharded // tp + s.other_params) * DTYPE_BYTES[self.dtype]

    def packed_copy(self) -> int:
        return self.shape.embedding_params * FLOAT32 if self.packed and self.shape.tied else 0

    def kv_cache(self) -> int:
        blocks = (self.num_blocks or D.kv_blocks(self.slots, self.max_len, self.block_size)) + 1  # + scratch
        return blocks * self.shape.kv_bytes_per_block(self.block_size, DTYPE_BYTES[self.dtype], self.tp)

    def workspace(self) -> int:
        s, tp, K = self.shape, self.tp, self.max_len
        q, kv = s.num_heads * s.head_dim // tp, s.num_kv_heads * s.head_dim // tp
        # Floats live per token at the peak of a layer: the residual stream and norm temporaries, then the
        # MLP's three intermediate tensors or attention's projections, rotary temporaries and float mask;
        # plus the boolean causal mask (K bytes per token) for the whole forward.
        per_token = 6 * s.hidden_size + max(3 * s.intermediate_size // tp, 4 * q + 2 * kv + K) + K / FLOAT32
        forward = int(self.rows * self.max_len * per_token * FLOAT32)
        sampling = WARP_COPIES * self.rows * self.logits * s.vocab_size * FLOAT32
        return max(forward, sampling)


@dataclass(frozen=True)
class ReplicaPlan:
    role: str
    replicas: int
    device: str
    models: tuple[ModelLoad, ...] = ()
    gpu_share: float = 0.0  # the fraction of one GPU the replica reserves (num_gpus)
    runtime: int = RUNTIME_BYTES

    @property
    def weights(self) -> int:
        return sum(m.weights() for m in self.models)

    @property
    def packed_copy(self) -> int:
        return sum(m.packed_copy() for m in self.models)

    @property
    def kv_cache(self) -> int:
        return sum(m.kv_cache() for m in self.models)

    @property
    def workspace(self) -> int:
        # A replica hosting two models (colocated draft) runs one forward at a time: the larger one counts.
        return max((m.workspace() for m in self.models), default=0)

    @property
    def model_bytes(self) -> int:
        """What the models take on the replica's device: weights, packed copy, KV cache, workspace."""
        return self.weights + self.packed_copy + self.kv_cache + self.workspace

    @property
    def host_bytes(self) -> int:
        return self.runtime + (self.model_bytes if self.device == "cpu" else 0)

    @property
    def detail(self) -> str:
        parts = [f"{m.shape.params / 1e6:,.1f}M params {m.dtype}, {m.slots} slots × {m.max_len}"
                 + (f", tp {m.tp}" if m.tp > 1 else "") for m in self.models]
        return "; ".join(parts)


@dataclass(frozen=True)
class MemoryPlan:
    replicas: tuple[ReplicaPlan, ...]
    system: int = RAY_SYSTEM_BYTES

    @property
    def host_total(self) -> int:
        """Host memory of the whole app on one node (the local single-node case), Ray's processes included."""
        return self.system + self.replicas_host_total

    @property
    def replicas_host_total(self) -> int:
        return sum(r.replicas * r.host_bytes for r in self.replicas)

    def table(self) -> str:
        header = ("replica", "×", "device", "weights", "packed copy", "KV cache", "workspace", "runtime",
                  "each", "all", "models")
        rows = [header]
        for r in self.replicas:
            each = r.runtime + r.model_bytes
            rows.append((r.role, str(r.replicas), r.device, _size(r.weights), _size(r.packed_copy),
                         _size(r.kv_cache), _size(r.workspace), _size(r.runtime), _size(each),
                         _size(r.replicas * each), r.detail))
        rows.append(("Ray system processes", "1", "cpu", "", "", "", "", _size(self.system), _size(self.system),
                     _size(self.system), ""))
        rows.append(("host total (one node)", "", "", "", "", "", "", "", "", _size(self.host_total), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) if i in (0, 2, 10) else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def check(self, *, host_available: int | None, gpu_bytes: int | None = None,
              include_system: bool = True) -> None:
        """Raise ``PlanError`` when the app cannot fit: the host total against ``host_available`` (one
        node; without Ray's processes when they run already), and every GPU replica's models against its
        share of ``gpu_bytes`` (one GPU's memory)."""
        problems = []
        host = self.host_total if include_system else self.replicas_host_total
        if host_available is not None and host > host_available:
            problems.append(f"the app needs {_size(host)} of host memory"
                            + ("" if include_system else " (besides Ray's own processes)")
                            + f" and this node has {_size(host_available)} available")
        if gpu_bytes is not None:
            for r in self.replicas:
                share = int(r.gpu_share * gpu_bytes)
                if r.device == "cuda" and r.model_bytes > share:
                    problems.append(f"a {r.role} replica needs {_size(r.model_bytes)} of GPU memory and its GPU "
                                    f"share holds {_size(share)}")
        if problems:
            raise PlanError("; ".join(problems) + ".\n\n" + self.report())

    def report(self) -> str:
        """The table and what to lower: what a refusal shows."""
        return f"{self.table()}\n\n{self.advice()}"

    def advice(self) -> str:
        """What to lower, largest share first."""
        totals = {"kv": 0, "workspace": 0, "weights": 0, "packed": 0, "replicas": 0}
        for r in self.replicas:
            totals["kv"] += r.replicas * r.kv_cache
            totals["workspace"] += r.replicas * r.workspace
            totals["weights"] += r.replicas * r.weights
            totals["packed"] += r.replicas * r.packed_copy
            totals["replicas"] += (r.replicas - 1) * (r.runtime + r.model_bytes)
        hints = {
            "kv": "KV cache: lower router.max_running (verifier slots; a draft replica has "
                  "min(router.max_running, draft_pool.max_batch_size × router.micro_batches)) or "
                  "target.max_model_len",
            "workspace": "workspace (the largest step: a whole micro-batch prefilling max_model_len tokens): "
                         "lower router.max_running or target.max_model_len, or raise router.micro_batches",
            "weights": "weights: a smaller model, a 2-byte dtype (target.dtype / draft.dtype bfloat16; slower "
                       "on most CPUs), or target.tensor_parallel across GPUs",
            "packed": "packed copy of the tied LM head (CPU, float32): a bfloat16 dtype avoids it",
            "replicas": "replicas: fewer draft_pool replicas or verifier.num_groups on this node",
        }
        ranked = sorted((k for k in totals if totals[k] > 0), key=lambda k: -totals[k])
        return "Largest shares, and what lowers them:\n" + "\n".join(
            f"  - {hints[k]} ({_size(totals[k])})" for k in ranked)


def _size(n: int) -> str:
    if n == 0:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


# ---- from a config -----------------------------------------------------------------------------------


def draft_slots(cfg: "ClusterConfig") -> int:
    """KV slots of one draft replica: it never holds more sequences than the router runs, and holds at most
    one ``max_batch_size`` micro-batch per micro-batch slot when the pool has several replicas."""
    return min(cfg.router.max_running, cfg.draft_pool.max_batch_size * cfg.router.step_micro_batches)


def target_device(cfg: "ClusterConfig") -> str:
    """Where the target runs: 'auto' is CUDA exactly when a verifier rank reserves a GPU."""
    if cfg.target.device == "auto":
        return "cuda" if cfg.verifier.num_gpus > 0 else "cpu"
    return cfg.target.device


def draft_in_target_process(cfg: "ClusterConfig") -> bool:
    """The draft runs in the process that runs the target (colocated, or both in the router)."""
    return cfg.draft_pool.placement == "colocated" or cfg.router.stages == "local"


def draft_device(cfg: "ClusterConfig") -> str:
    if draft_in_target_process(cfg):
        return target_device(cfg)
    if cfg.target.device == "cpu":
        return "cpu"
    return "cuda" if cfg.draft_pool.num_gpus > 0 else "cpu"


def plan(cfg: "ClusterConfig") -> MemoryPlan:
    """The memory plan of ``cfg``; reads the model configs (never weights)."""
    from cluster.config import resolve_dtype

    rows = math.ceil(cfg.router.max_running / cfg.router.step_micro_batches)
    max_len, gamma_max = cfg.target.max_model_len, cfg.speculation.gamma_max
    t_dev = target_device(cfg)
    kv = {"block_size": cfg.kv.block_size, "num_blocks": cfg.kv.num_blocks}
    target = ModelLoad(read_shape(cfg.target.path, "target.path"), t_dev,
                       resolve_dtype(cfg.target.dtype, on_gpu=t_dev == "cuda"), slots=cfg.router.max_running,
                       max_len=max_len, rows=rows, logits=gamma_max + 1, tp=cfg.target.tensor_parallel, **kv)
    draft = None
    together = draft_in_target_process(cfg)
    if cfg.draft.kind == "model":
        d_dev = draft_device(cfg)
        draft = ModelLoad(read_shape(cfg.draft.path or "", "draft.path"), d_dev,
                          resolve_dtype(cfg.draft.dtype, on_gpu=d_dev == "cuda"),
                          slots=cfg.router.max_running if together else draft_slots(cfg), max_len=max_len,
                          rows=rows, logits=1, **kv)
    groups, tp, v_gpus = cfg.verifier.num_groups, cfg.target.tensor_parallel, cfg.verifier.num_gpus
    pool = cfg.draft_pool
    colocated_draft = (draft,) if draft is not None and together else ()
    ingress = ReplicaPlan("HTTP ingress", 1, "cpu", runtime=INGRESS_RUNTIME_BYTES)
    if cfg.router.stages == "local":
        local = ReplicaPlan(LOCAL_ROUTER, 1, t_dev, (target, *colocated_draft), v_gpus, LOCAL_ROUTER_RUNTIME_BYTES)
        return MemoryPlan((local, ingress))
    replicas: list[ReplicaPlan] = []
    if tp == 1:
        replicas.append(ReplicaPlan("verifier", groups, t_dev, (target, *colocated_draft), v_gpus))
    else:
        # The replica drives its rank actors (deployments/verifier_group.py); a colocated draft stays in it.
        driver_dev = draft.device if colocated_draft else "cpu"
        replicas.append(ReplicaPlan("verifier (group driver)", groups, driver_dev, colocated_draft))
        replicas.append(ReplicaPlan("verifier rank", groups * tp, t_dev, (target,), v_gpus))
    if draft is not None and pool.placement != "colocated":
        replicas.append(ReplicaPlan("draft pool", pool.max_replicas, draft.device, (draft,), pool.num_gpus))
    elif cfg.draft.kind == "ngram" and pool.placement != "colocated":
        replicas.append(ReplicaPlan("draft pool (n-gram)", pool.max_replicas, "cpu"))
    replicas.append(ReplicaPlan("router", 1, "cpu", runtime=ROUTER_RUNTIME_BYTES))
    replicas.append(ingress)
    return MemoryPlan(tuple(replicas))
