"""Rank-local tensor parallelism: the process group, DeepSpeed AutoTP sharding, one verify stage per rank.

Contract:
- Every rank of a group builds the same target, shards it with AutoTP (``shard_model``) and owns a
  ``ModelRunner`` whose KV pool holds only its local KV heads (``forward.local_kv_heads`` reads them off
  the sharded ``k_proj``). ``forward.forward`` runs unchanged on the sharded model: AutoTP's
  ``LinearAllreduce`` (o_proj, down_proj) and ``LmHeadLinearAllreduce`` (lm_head) all-reduce inside the
  forward, so every rank ends with the full logits.
- Lockstep: every rank must be handed the same calls, in the same order, with the same arguments
  (``TPVerifierRank.verify`` / ``release``); the driver sends each call to all ranks (as DeepSpeed-MII
  and vLLM's Ray executor do) rather than rank 0 broadcasting it. Acceptance and sampling only use the
  all-reduced logits and per-sequence seeded generators (``runtime.rng``), so every rank computes the
  same outcome and commits the same tokens; the driver returns rank 0's outcome.
- CPU uses gloo, CUDA uses NCCL: the same code but for backend and device. Rendezvous is TCP on a
  routable address of rank 0's node (never 0.0.0.0) and a free port chosen there (``free_port``).
- DeepSpeed's CPU shared-memory all-reduce op is switched off by default (``cpu_shm_allreduce=False``):
  it costs a JIT C++ build on first use and a shared-memory segment per rank in /dev/shm, and CPU ranks
  only serve tests and demos; the all-reduce then runs on gloo. See docs/tensor_parallel.md.

No ray import here: the Ray actors that host ranks live in ``deployments.verifier_group``.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import resource
import socket
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch

from cluster.model_files import inspect_model
from runtime import forward as fwd
from runtime.models import build_model, resolve_device, resolve_dtype
from runtime.protocol import ProposalBatch, VerifyItem, VerifyOutcome
from runtime.runner import ModelRunner
from verifier.verify import AcceptanceConfig, VerifyStage

SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory all-reduce op (ShareMemCommBuilder.NAME)
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"  # its /dev/shm segment: <prefix>_<uid>_<addr>_<port>_<rank>
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class TensorParallelError(RuntimeError):
    pass


# -- rendezvous ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistConfig:
    """Where and how one rank joins its group's process group."""

    rank: int
    world_size: int
    master_addr: str  # a routable address of rank 0's node
    master_port: int  # free on rank 0's node (``free_port``)
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    local_rank: int = 0  # CUDA device index on this node (0 when Ray gives each rank one visible GPU)
    timeout_s: float = 300.0  # a collective whose peer is gone fails after this long
    cpu_shm_allreduce: bool = False  # use DeepSpeed's /dev/shm all-reduce on CPU (JIT build, see module doc)
    local_addr: str | None = None  # this rank's node address as its peers reach it (the cluster's node IP)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")
        check_rendezvous_address(self.master_addr)
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a port")


def check_rendezvous_address(addr: str) -> None:
    """Refuse wildcard addresses: ranks on other nodes must be able to connect to rank 0 there."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if not addr:
            raise ValueError("master_addr must not be empty") from None
        return  # a host name
    if ip.is_unspecified:
        raise ValueError(f"master_addr {addr!r} is a wildcard; use the node's routable address")


def free_port(host: str = "") -> int:
    """A TCP port that is free on this host now (the caller passes it to every rank of the group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 address ``addr`` on this host, or None (not found; not Linux)."""
    try:
        import fcntl
    except ImportError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address, at bytes 20..24 of the ifreq it fills
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == addr:
            return name
    return None


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _import_deepspeed(device: torch.device):
    # Naming the accelerator skips DeepSpeed's probing (and its "Setting accelerator to CPU" warning);
    # it only has an effect before deepspeed's first import in this process.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    import deepspeed

    return deepspeed


def shm_segment(dist: DistConfig) -> str:
    return f"/dev/shm/{SHM_BUFFER_PREFIX}_{os.getuid()}_{dist.master_addr}_{dist.master_port}_{dist.rank}"


def init_distributed(dist: DistConfig, device: torch.device) -> str:
    """Join the group's process group and DeepSpeed's comm layer; returns the backend. Blocks until all
    ``world_size`` ranks have joined (or ``timeout_s`` passes)."""
    if device.type == "cuda":
        torch.cuda.set_device(dist.local_rank)
    backend = dist.backend or default_backend(device)
    os.environ.update(MASTER_ADDR=dist.master_addr, MASTER_PORT=str(dist.master_port), RANK=str(dist.rank),
                      WORLD_SIZE=str(dist.world_size), LOCAL_RANK=str(dist.local_rank))
    # Gloo (and NCCL's socket bootstrap) otherwise pick the interface the host name resolves to, which can be
    # loopback or one the peers cannot reach (ranks on two hosts then never connect); the interface holding
    # the node's cluster address is the one they reach. An operator's own setting wins.
    if dist.local_addr and (ifname := interface_of(dist.local_addr)):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    deepspeed = _import_deepspeed(device)
    if device.type == "cpu":
        _configure_cpu_allreduce(deepspeed, dist)
    torch.distributed.init_process_group(backend, init_method=f"tcp://{dist.master_addr}:{dist.master_port}",
                                         rank=dist.rank, world_size=dist.world_size,
                                         timeout=timedelta(seconds=dist.timeout_s))
    import deepspeed.comm as dscomm

    # Created now (not lazily inside init_inference) so the all-reduce choice above is what it sees.
    dscomm.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                            dist_init_required=False, timeout=timedelta(seconds=dist.timeout_s))
    if device.type == "cpu" and dist.cpu_shm_allreduce:
        # Every rank has mapped every peer's segment once all are past this barrier; unlinking the names
        # now keeps the mappings and leaves nothing in /dev/shm, even if a rank is later SIGKILLed.
        torch.distributed.barrier()
        try:
            os.unlink(shm_segment(dist))
        except FileNotFoundError:
            pass
    return backend


def _configure_cpu_allreduce(deepspeed, dist: DistConfig) -> None:
    """Either let DeepSpeed build/load its shared-memory all-reduce op, or mark it unavailable so that
    ``inference_all_reduce`` falls back to ``torch.distributed.all_reduce`` on gloo."""
    compatible = deepspeed.ops.__compatible_ops__  # probed once per process, then cached
    if dist.cpu_shm_allreduce:
        # The op only uses shared memory when LOCAL_SIZE says every rank is on this node.
        os.environ["LOCAL_SIZE"] = str(dist.world_size)
    else:
        compatible[SHM_OP] = False
        os.environ.pop("LOCAL_SIZE", None)


def cpu_shm_op_built() -> bool:
    """Whether DeepSpeed's CPU shm all-reduce op is already in torch's extension cache, i.e. whether
    ``cpu_shm_allreduce=True`` costs a load rather than a C++ build (docs/measurements.md#tensor-parallelism).
    Pre-build it once per image/host with ``ShareMemCommBuilder().load()`` (docs/tensor_parallel.md)."""
    import sys

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "torch_extensions")
    flavour = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    folder = os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}", SHM_OP)
    return os.path.isfile(os.path.join(folder, f"{SHM_OP}.so"))


def uses_shm_allreduce() -> bool:
    """Whether DeepSpeed's comm layer in this process loaded the CPU shared-memory all-reduce op."""
    import deepspeed.comm as dscomm

    cdb = dscomm.comm.cdb
    return cdb is not None and getattr(cdb, "shm_comm_op", None) is not None


def destroy_distributed(dist: DistConfig | None = None) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if dist is not None and os.path.exists(shm_segment(dist)):  # only if we died before unlinking it
        os.unlink(shm_segment(dist))


# -- sharding ------------------------------------------------------------------------------------------


def check_tp_divides(config, tp_size: int) -> None:
    """Each rank must hold whole attention and KV heads (AutoTP would otherwise split unevenly)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % tp_size:
            raise TensorParallelError(f"tensor parallel size {tp_size} must divide the model's {name} ({n})")


def tp_grain_size_for(config, tp_size: int) -> int:
    """DeepSpeed splits MLP and LM-head widths in multiples of this (default 64, for kernel alignment).

    A real model's widths are multiples of 64·tp and keep 64; a tiny test model (hidden 64) would give
    rank 0 the whole LM head and rank 1 nothing, so such models split evenly with grain 1.
    """
    widths = (config.hidden_size, getattr(config, "intermediate_size", config.hidden_size))
    return 64 if all(w % (64 * tp_size) == 0 for w in widths) else 1


def shard_model(model, tp_size: int, *, dtype: torch.dtype | None = None, tp_grain_size: int | None = None,
                checkpoint: dict | None = None, base_dir: str | None = None):
    """AutoTP-shard ``model`` over the (already initialised) process group; returns the sharded module.

    ``deepspeed.init_inference`` returns an ``InferenceEngine`` wrapper; the HF model with its Linear
    layers replaced by ``LinearLayer``/``LinearAllreduce`` is its ``.module``, which is what the compact
    forward drives. With ``checkpoint`` (DeepSpeed's ``{"type": "ds_model", "checkpoints": [...]}``)
    the model is expected on the meta device and each rank loads only its shards from ``base_dir``.
    """
    check_tp_divides(model.config, tp_size)
    first = next(model.parameters())
    device, dtype = first.device, dtype or first.dtype  # init_inference's own default dtype is float16
    if tp_size == 1:
        return model.to(dtype=dtype)
    deepspeed = _import_deepspeed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    grain = tp_grain_size or tp_grain_size_for(model.config, tp_size)
    kwargs: dict[str, Any] = {}
    if checkpoint is not None:
        kwargs.update(checkpoint=checkpoint, base_dir=base_dir)
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": tp_size, "tp_grain_size": grain},
                                      replace_with_kernel_inject=False, dtype=dtype, **kwargs)
    sharded = engine.module.eval()
    if checkpoint is not None or device.type == "meta":
        _rebuild_rotary(sharded)
    return sharded


def _rebuild_rotary(model) -> None:
    """Meta-device loading leaves non-persistent buffers (RoPE ``inv_freq``) uninitialised: recompute."""
    inner = model.model
    device = next(model.parameters()).device
    rotary = type(inner.rotary_emb)(config=model.config)
    inner.rotary_emb = rotary.to(device)


def load_target(spec, *, tp_size: int, device: torch.device, dtype: torch.dtype, tp_grain_size: int | None = None,
                load: str = "full"):
    """Build this rank's copy of the target and shard it; returns (model, how it was loaded).

    ``load="full"`` builds the model on the CPU with ``runtime.models.build_model`` (transformers maps
    safetensors files lazily, so when the checkpoint already has the serving dtype a rank's private memory
    grows only by its shards; a dtype conversion materialises the whole model per rank for a moment) and
    lets AutoTP copy out this rank's shards. ``load="meta"`` builds the model on the meta device and has
    DeepSpeed read each safetensors file of a local folder and keep only this rank's shards (peak ≈ the
    largest checkpoint file plus the shards, whatever the loader does). See docs/tensor_parallel.md.
    """
    spec = {"path": spec} if isinstance(spec, str) else dict(spec)
    if load == "meta" and tp_size == 1:
        load = "full"  # nothing to shard
    if load == "meta":
        folder = spec.get("path")
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if folder else []
        if not files:
            raise TensorParallelError(f"meta loading needs a local folder of safetensors files, got {spec}")
        from transformers import AutoConfig, AutoModelForCausalLM

        inspect_model(folder, folder)  # refuses unsupported families before anything is built
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        check_tp_divides(config, tp_size)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        checkpoint = {"type": "ds_model", "version": 1.0, "checkpoints": [os.path.basename(f) for f in files]}
        model = shard_model(model, tp_size, dtype=dtype, tp_grain_size=tp_grain_size, checkpoint=checkpoint,
                            base_dir=folder)
        return model.to(device=device, dtype=dtype).eval(), "meta"
    if load != "full":
        raise ValueError(f"load must be 'full' or 'meta', got {load!r}")
    # Sharding happens on the host (AutoTP then moves the shards to the device): build on the CPU.
    model = build_model(spec, "cpu", dtype, cpu_kernels=False)  # AutoTP must see plain nn.Linear
    check_tp_divides(model.config, tp_size)
    model = shard_model(model.to(dtype=dtype), tp_size, dtype=dtype, tp_grain_size=tp_grain_size)
    return model.to(device=device).eval(), "full"


def linear_weight_numel(model) -> int:
    """Elements of the (sharded) projection and LM-head weights this process holds."""
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES and getattr(module, "weight", None) is not None:
            total += module.weight.numel()
    return total


def _rss_anon_bytes() -> int | None:
    """Private (anonymous) resident memory of this process; file-backed pages (mmapped checkpoints) are
    shared through the page cache and are not counted. None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- one rank --------------------------------------------------------------------------------------


class TPVerifierRank:
    """A verify stage on this rank's shard of the target; drive every rank with the same calls."""

    def __init__(self, spec, dist: DistConfig | None = None, *, device: str | None = "auto", dtype: str = "auto",
                 max_slots: int = 64, max_len: int = 1024, kv_bucket: int = 16, kv: dict | None = None,
                 acceptance: AcceptanceConfig | None = None, threads: int | None = None,
                 tp_grain_size: int | None = None, load: str = "full"):
        t0 = time.perf_counter()
        if threads is not None:
            torch.set_num_threads(threads)
        self.dist = dist
        self.tp_size = dist.world_size if dist is not None else 1
        self.rank = dist.rank if dist is not None else 0
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(spec.get("dtype", dtype) if isinstance(spec, dict) and "path" in spec else dtype,
                                   self.device)
        self.backend = None
        if self.tp_size > 1:
            self.backend = init_distributed(dist, self.device)
        self.model, self.load_mode = load_target(spec, tp_size=self.tp_size, device=self.device, dtype=self.dtype,
                                                 tp_grain_size=tp_grain_size, load=load)
        self.runner = ModelRunner(self.model, max_slots=max_slots, max_len=max_len, kv_bucket=kv_bucket, **(kv or {}))
        self.stage = VerifyStage(self.runner, acceptance)
        self.load_seconds = time.perf_counter() - t0
        self._closed = False

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch) -> VerifyOutcome:
        return self.stage.verify(items, proposal)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.stage.release(seq_ids)

    def info(self) -> dict:
        """Memory and layout of this rank (what the tests and the docs' memory table read)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        pool = self.runner.pool
        return {
            "rank": self.rank, "tp_size": self.tp_size, "backend": self.backend, "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."), "load": self.load_mode,
            "load_seconds": round(self.load_seconds, 3),
            "shm_allreduce": self.tp_size > 1 and self.device.type == "cpu" and uses_shm_allreduce(),
            "torch_threads": torch.get_num_threads(),
            "local_kv_heads": fwd.local_kv_heads(self.model),
            "local_attention_heads": self.model.model.layers[0].self_attn.q_proj.weight.shape[0]
            // fwd.head_dim_of(self.model),
            "linear_weight_numel": linear_weight_numel(self.model),
            "param_bytes": params,
            "kv_pool_bytes": 2 * pool.k.numel() * pool.k.element_size(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_anon_bytes": _rss_anon_bytes(),
            "sequences": len(self.runner.seqs), "slots_in_use": self.runner.slots_in_use,
        }

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tp_size > 1:
            destroy_distributed(self.dist)
