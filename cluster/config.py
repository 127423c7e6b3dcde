"""The cluster's configuration: one pydantic ``ClusterConfig``.

Contract:
- ``ClusterConfig.from_yaml(path)`` / ``ClusterConfig.from_dict(d)`` build a validated config or raise a
  ``ValueError`` — a ``pydantic.ValidationError`` or a ``ConfigError`` — whose message names the key path
  (``speculation.gamma_max``, ``speculative_decoding.draft_num``, ...). Every model forbids unknown keys.
- The alternative service-config layout (a ``speculative_decoding:`` block, both of its shapes; see
  docs/design.md#the-reference-article) is mapped onto the native fields and merged with any native
  sections; a value set in both places must agree.
- ``validate_models()`` runs ``cluster.model_files``' checks on local model paths (Hugging Face folders or
  ``.gguf`` files): the target's family, tensor parallelism against its heads, the draft's tokenizer against
  the target's. Paths that are builtin or absent on this machine are skipped (they may exist only on worker
  nodes).
  ``from_dict`` / ``from_yaml`` call it; building the model directly (``ClusterConfig(...)``) does not.
- ``to_serve_args()`` is a JSON-able dict that ``from_dict`` turns back into an equal config: the ``args``
  of ``build_app``. It carries ``http.api_key`` in clear (the ingress needs it); prefer
  ``http.api_key_file`` to keep the key out of Serve's config and of every environment.
- Ray's security rules live here: token auth by default; ``ray.auth_mode: disabled`` only when every Ray
  address is loopback (``RaySpec``) and the cluster is one node (``ClusterConfig``).
- Relative model paths are kept as written: they resolve against the loading process's working directory.

No ray or torch import: the CLI and config tooling load this without either installed.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from cluster import defaults as D
from cluster.model_files import ModelFileError, check_pair
from cluster.secret_files import SecretFileError, read_secret_file

log = logging.getLogger("specserve.config")

BUILTIN_TINY = "builtin:tiny"
GAMMA_HARD_CAP = 16  # longest chain the verifier and the wire format accept
TREE_NODES_CAP = 256  # largest token tree a config may ask for (a verify row of this many nodes)
MAX_BATCH_CAP = 1 << 16  # runtime.wire.MAX_ROWS: the most rows one frame may carry

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Threads = Annotated[int, Field(ge=1, strict=True)] | Literal["auto"]


class ConfigError(ValueError):
    """A configuration mistake; the message starts with the key path it concerns."""


def resolve_dtype(dtype: str, *, on_gpu: bool) -> str:
    """The concrete dtype name for a ``dtype`` field: ``auto`` is float32 on CPU, bfloat16 on GPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_gpu else "float32"


class _Spec(BaseModel):
    # forbid: a typo'd key must fail, naming itself, instead of silently keeping the default.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _check_model_path(path: str, where: str) -> str:
    if path.startswith("builtin:") and path != BUILTIN_TINY:
        raise ValueError(f"{where}: unknown builtin model {path!r}; the only one is {BUILTIN_TINY!r}")
    return path


def _check_resources(resources: dict[str, float], where: str) -> dict[str, float]:
    for name, amount in resources.items():
        if amount < 0:
            raise ValueError(f"{where}.resources.{name}: must be ≥ 0, got {amount}")
    return resources


class TargetSpec(_Spec):
    path: str = Field(
        min_length=1,
        description="The target: a local Hugging Face model folder, a .gguf file (or a folder holding one), or "
        f"{BUILTIN_TINY!r} for the tiny test model built from config in code (no files, no downloads).",
    )
    dtype: Dtype = Field(D.DTYPE, description="Target weights dtype; 'auto' = float32 on CPU, bfloat16 on GPU.")
    max_model_len: int = Field(
        D.MAX_MODEL_LEN, ge=2, description="Longest sequence served (prompt + generated tokens); sizes the KV slots."
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Ranks one verifier group shards the target over; must divide the target's attention "
        "and key/value heads.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        D.DEVICE, description="Where the target runs; 'auto' = CUDA when the verifier rank sees a GPU."
    )

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_model_path(v, "target.path")


class DraftSpec(_Spec):
    kind: Literal["model", "ngram", "none"] = Field(
        "ngram",
        description="Proposer: 'model' (a draft LM with its own KV cache), 'ngram' (prompt lookup: needs "
        "no second model), or 'none' (plain target decoding).",
    )
    path: str | None = Field(
        None,
        min_length=1,
        description="The draft model: a local Hugging Face folder, a .gguf file (or a folder holding one), or "
        f"{BUILTIN_TINY!r}; required iff kind is 'model'. It must share the target's tokenizer.",
    )
    dtype: Dtype = Field(D.DTYPE, description="Draft weights dtype; 'auto' = float32 on CPU, bfloat16 on GPU.")
    ngram_max: int = Field(D.NGRAM_MAX, ge=1, le=64, description="Longest suffix n-gram looked up (kind 'ngram').")
    ngram_min: int = Field(D.NGRAM_MIN, ge=1, le=64, description="Shortest suffix n-gram looked up (kind 'ngram').")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _check_model_path(v, "draft.path")

    @model_validator(mode="after")
    def _check(self) -> "DraftSpec":
        if self.kind == "model" and self.path is None:
            raise ValueError("draft.path: required when draft.kind is 'model'")
        if self.kind != "model" and self.path is not None:
            raise ValueError(f"draft.path: only used when draft.kind is 'model' (kind is {self.kind!r})")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"draft.ngram_min ({self.ngram_min}) must be ≤ draft.ngram_max ({self.ngram_max})")
        return self


class SpeculationSpec(_Spec):
    gamma: int = Field(D.GAMMA, ge=1, le=GAMMA_HARD_CAP, description="Draft tokens per proposal at start (γ).")
    gamma_min: int = Field(D.GAMMA_MIN, ge=1, le=GAMMA_HARD_CAP, description="Smallest γ adaptive speculation may use.")
    gamma_max: int = Field(
        D.GAMMA_MAX,
        ge=1,
        le=GAMMA_HARD_CAP,
        description="Largest γ adaptive speculation may use; also the wire format's chain cap "
        f"(≤ {GAMMA_HARD_CAP}).",
    )
    adaptive: bool = Field(D.ADAPTIVE, description="Adapt γ per sequence within [gamma_min, gamma_max] from its acceptance.")
    confidence_threshold: float = Field(
        D.CONFIDENCE_THRESHOLD,
        ge=0.0,
        lt=1.0,
        description="Stop a chain early when the draft's top probability falls below this (0 = never). "
        "Exact: it only shortens proposals.",
    )
    acceptance: Literal["exact", "threshold"] = Field(
        "exact",
        description="'exact' = rejection sampling: outputs follow the target's distribution exactly. "
        "'threshold' = lossy opt-in: accept a draft token while the target gives it at least 'threshold' "
        "probability; faster, but outputs no longer match the target's distribution.",
    )
    threshold: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Acceptance threshold in (0, 1], higher = stricter; required iff acceptance is 'threshold'.",
    )
    dynamic_adjust: bool = Field(
        False,
        description="Adjust the threshold after each verify step from that step's acceptance rate: ×1.05 "
        "(at most 1) above target_acceptance + 0.1, ×0.95 below target_acceptance − 0.1; only with "
        "acceptance 'threshold'.",
    )
    target_acceptance: float = Field(
        0.7, gt=0.0, lt=1.0, description="Acceptance rate dynamic_adjust steers the threshold toward."
    )
    q_top_k: int = Field(
        D.Q_TOP_K,
        ge=1,
        description="Support size K of the proposal distribution q sent with sampled drafts; the draft "
        "samples from its top-K-truncated distribution, so verification stays exact.",
    )
    tree_nodes: int = Field(
        D.TREE_NODES,
        ge=0,
        le=TREE_NODES_CAP,
        description="Let the draft model draft token trees of up to this many nodes (0 = chains): the most "
        "likely continuations by cumulative draft probability, verified in one target pass. With adaptive γ "
        "and the draft inside the router (router.stages 'local'), each step chooses the chain or a tree size "
        "from measured tokens per second; with a draft pool every step drafts this tree. Must exceed "
        "gamma_max with adaptive γ (tree and chain widths stay distinct). Pays where the target has spare "
        "width (GPUs at small batch); on CPU a wide verify costs about in proportion to its width.",
    )
    draft_num: int = Field(
        D.DRAFT_NUM,
        ge=1,
        le=D.DRAFT_NUM_MAX,
        description="Candidate chains drafted per sequence per step, one draft call each (with a draft pool, "
        "on different replicas at once), merged into one token tree that the target verifies in one pass. "
        "1 = a single chain. Exact for greedy and sampled requests: every tree node is verified as a "
        "deterministic proposal. Costs draft compute per candidate and a wider verify; it pays where the "
        "best chain is often rejected early and the target has spare width (small batches).",
    )
    forced_tokens: bool = Field(
        D.FORCED_TOKENS,
        description="Structured outputs: where a request's grammar allows exactly one continuation for a run of "
        "tokens (braces, quotes, a schema's key names), propose that run as the row's drafts without the draft "
        "model (q = 1, accepted whole in one target pass). Exact either way; off only to measure what it gains.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SpeculationSpec":
        if not self.gamma_min <= self.gamma <= self.gamma_max:
            raise ValueError(
                f"speculation.gamma_min ({self.gamma_min}) ≤ speculation.gamma ({self.gamma}) ≤ "
                f"speculation.gamma_max ({self.gamma_max}) does not hold"
            )
        if self.acceptance == "threshold" and self.threshold is None:
            raise ValueError("speculation.threshold: required when speculation.acceptance is 'threshold'")
        if self.acceptance == "exact" and self.threshold is not None:
            raise ValueError(
                "speculation.threshold: only used with speculation.acceptance 'threshold' (the lossy opt-in); "
                "remove it or set acceptance: threshold"
            )
        if self.adaptive and 0 < self.tree_nodes <= self.gamma_max:
            raise ValueError(f"speculation.tree_nodes ({self.tree_nodes}): with adaptive γ it must exceed "
                             f"speculation.gamma_max ({self.gamma_max}), or be 0 (chains)")
        if self.tree_nodes and self.draft_num > 1:
            raise ValueError("speculation.tree_nodes: draft_num > 1 merges several chains into one tree already; "
                             "set one of them")
        if self.dynamic_adjust and self.acceptance != "threshold":
            raise ValueError(
                "speculation.dynamic_adjust: adjusts the threshold, so needs speculation.acceptance 'threshold'"
            )
        return self


class AutoscalingSpec(_Spec):
    min_replicas: int = Field(ge=1, description="Fewest draft replicas kept running.")
    max_replicas: int = Field(ge=1, description="Most draft replicas started under load.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Draft calls in flight per replica that Serve scales the pool to hold (a call is "
        "one part of a micro-batch: draft_pool.batch_size rows at most).")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long the load must call for more replicas "
                                   "before Serve adds them.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long the load must call for fewer replicas "
                                     "before Serve removes them (a removed replica's sequences resync elsewhere).")

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"draft_pool.autoscaling.min_replicas ({self.min_replicas}) must be ≤ "
                f"draft_pool.autoscaling.max_replicas ({self.max_replicas})"
            )
        return self


class DraftPoolSpec(_Spec):
    num_replicas: int | None = Field(
        None,
        ge=1,
        description="Fixed number of draft replicas; 1 when neither this nor autoscaling is set, None "
        "when autoscaling is set (the two are exclusive, as in Ray Serve).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None, description="Autoscale the draft pool between these bounds, on the Serve requests its replicas "
        "receive (router.transport 'handles' only).")
    placement: Literal["offload", "colocated"] = Field(
        "offload",
        description="'offload': draft replicas are placed by num_gpus/accelerator_type/resources (cheaper "
        "GPUs); 'colocated': one draft replica per verifier group on its node, for batch-1 latency.",
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs reserved per draft replica (Ray resource).")
    num_threads: Threads = Field(
        1,
        description="torch CPU threads per draft replica (intra-op; applied at start, also as OMP_NUM_THREADS). "
        "An integer, at most the node's cores, or 'auto' (cluster/threads.py: on CPU one thread per 256 MiB of "
        "weights, at least 1, at most the node's cores; on GPU floor(num_cpus)). 1 suits a small draft that "
        "takes turns with the verifier.",
    )
    num_gpus: float = Field(0.0, ge=0, le=1, description="GPUs reserved per draft replica; fractions share a GPU.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type the replicas need, e.g. 'L4'.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per draft replica.")
    max_batch_size: int = Field(
        64, ge=1, le=MAX_BATCH_CAP, description="Most sequences one draft replica call may carry."
    )
    batch_size: int = Field(
        32, ge=1, description="Most rows one draft call carries (≤ max_batch_size): a micro-batch with more is "
        "drafted in parts of this size on as many draft replicas at once, each sequence staying in its part "
        "(router.transport 'handles'). With autoscaling, the parts in flight are the pool's load.")
    timeout_s: float = Field(
        10.0, gt=0, description="Longest a step waits for a live draft pool's proposal "
        "before decoding target-only (a pool marked down is not waited for at all)."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_replicas(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("autoscaling") is None and data.get("num_replicas") is None:
            data = {**data, "num_replicas": 1}
        return data

    @model_validator(mode="after")
    def _check(self) -> "DraftPoolSpec":
        if self.autoscaling is not None and self.num_replicas is not None:
            raise ValueError("draft_pool.num_replicas: set either num_replicas or autoscaling, not both")
        if self.batch_size > self.max_batch_size:
            raise ValueError(
                f"draft_pool.batch_size ({self.batch_size}) must be ≤ "
                f"draft_pool.max_batch_size ({self.max_batch_size})"
            )
        return self

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v, "draft_pool")

    @property
    def max_replicas(self) -> int:
        """Most draft replicas that can run at once (what the GPU budget must hold)."""
        if self.autoscaling is not None:
            return self.autoscaling.max_replicas
        return self.num_replicas  # type: ignore[return-value]  # set whenever autoscaling is not


class VerifierSpec(_Spec):
    num_groups: int = Field(
        1, ge=1, description="Data-parallel verifier groups, each a full tensor-parallel copy of the target."
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs reserved per verifier rank (Ray resource).")
    num_threads: Threads = Field(
        "auto",
        description="torch CPU threads per verifier rank (intra-op; applied at start, also as OMP_NUM_THREADS; "
        "a colocated draft, or both models under router.stages 'local', share them). An integer, at most the "
        "node's cores, or 'auto' (cluster/threads.py): on CPU one thread per 256 MiB of the rank's weights, at "
        "least 1, at most the node's cores divided among the ranks of a group that share it (STRICT_PACK/PACK); "
        "on GPU floor(num_cpus). Independent of num_cpus, which only reserves Ray resources.",
    )
    num_gpus: float = Field(
        0.0,
        ge=0,
        le=1,
        description="GPUs reserved per verifier rank (0 on CPU); must be > 0 when target.device is 'cuda'.",
    )
    accelerator_type: str | None = Field(None, description="Ray accelerator type the ranks need, e.g. 'H200'.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per verifier rank.")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = Field(
        "STRICT_PACK",
        description="Placement group strategy of one group's ranks; STRICT_PACK keeps a group on one node "
        "(NVLink); a group larger than a node needs PACK.",
    )

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v, "verifier")


class RouterSpec(_Spec):
    max_running: int = Field(
        D.MAX_RUNNING, ge=1, le=MAX_BATCH_CAP, description="Most sequences decoding at once (holding KV slots)."
    )
    stages: Literal["remote", "local"] = Field(
        "remote",
        description="Where the step loop's stages run. 'remote': in the verifier and draft-pool deployments, "
        "one Serve call per stage per step (verifier groups, tensor parallelism, GPU draft pools). 'local': the "
        "target and the draft run inside the router replica, no call per step: the fastest batch-1 serving on "
        "one CPU node, where a Serve call costs milliseconds against a small model's step. 'local' needs "
        "tensor_parallel 1 and one verifier group; the router replica then reserves the verifier's resources "
        "(verifier.num_cpus, num_gpus, accelerator_type, resources) on top of router.num_cpus and runs with "
        "verifier.num_threads.",
    )
    transport: Literal["handles", "compiled"] = Field(
        "handles",
        description="How the step loop reaches remote stages. 'handles': a Serve-handle call per stage per step. "
        "'compiled': each draft-pool and verifier replica runs its model in a stage worker (a plain actor on its "
        "node) and the router sends every step's frame through a Ray Compiled Graph channel to it. Serve stays "
        "the control plane and its handles the fallback (docs/transport.md). A tensor-parallel verifier's worker "
        "drives its ranks; a colocated draft stays on handles.",
    )
    max_queue: int = Field(
        256, ge=0, description="Most requests waiting for a running slot; beyond it requests are rejected."
    )
    micro_batches: int = Field(
        2, ge=1, le=8, description="Micro-batches kept in flight so draft pool and verifier work at the same time. "
        "With router.stages 'local' both run in one process and cannot overlap: the router then uses 1."
    )
    request_timeout_s: float = Field(
        300.0, gt=0, description="A request still unfinished after this many seconds fails."
    )
    verify_timeout_s: float = Field(
        60.0, gt=0, description="A verify call unanswered after this many seconds counts as "
        "lost: its sequences re-prefill (an explicit error after repeated losses)."
    )
    probe_interval_s: float = Field(
        0.25, gt=0, le=60, description="How often the router pings each stage (verifier, draft pool); /health and "
        "the draft fallback read the result."
    )
    probe_timeout_s: float = Field(
        0.5, gt=0, le=60, description="A probe no replica answers within this many seconds marks its stage down."
    )
    stall_s: float = Field(
        30.0, gt=0, description="/health is 503 when requests wait and no step has "
        "completed for this many seconds."
    )
    health_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Longest /health and the /debug routes wait for the router before "
        "answering 503."
    )
    fidelity_sample_rate: float = Field(
        0.0, ge=0, le=1, description="Share of finished greedy requests re-decoded without speculation, off the "
        "hot path, to check that the output is the same (engine/fidelity.py; 0 = off)."
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs reserved per router replica (Ray resource).")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per router and per ingress replica: a role resource that only the "
        "front node advertises keeps them there, off the hosts whose loss the router must survive.",
    )

    @property
    def step_micro_batches(self) -> int:
        """The micro-batches the step loop runs: local stages run draft and verify in one process, one after
        the other, where micro-batches taking turns overlap nothing and only split each forward in two
        (docs/measurements.md#cluster-config)."""
        return 1 if self.stages == "local" else self.micro_batches


class HttpSpec(_Spec):
    host: str = Field("127.0.0.1", min_length=1, description="Address the OpenAI-compatible HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP server binds.")
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode",
        description="Where Ray Serve runs the HTTP proxy in a Serve config rendered from this file: on every "
        "node (a load balancer in front spreads clients over them) or on the head node only.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="Bearer key clients must send, inline; never shown in repr. Prefer api_key_file: an inline "
        "key sits in the config file and, unless `specserve serve` starts the cluster, in Serve's config.",
    )
    api_key_env: str | None = Field(
        None,
        min_length=1,
        description="Name of an environment variable holding the bearer key. `specserve serve` moves it out of "
        "the environment Ray inherits; on a cluster started by `ray start` it must be in the environment of "
        "the ingress replica, i.e. of every Ray process on its node. Prefer api_key_file.",
    )
    api_key_file: str | None = Field(
        None,
        min_length=1,
        description="Path of a file holding the bearer key (one line), read by the ingress replica only; it must "
        "exist on every node that may host the ingress. Keeps the key out of environments and Serve's config.",
    )
    max_body_bytes: int = Field(1 << 20, ge=1, description="Largest request body accepted.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request's whole body must arrive within this many seconds, else 408."
    )
    max_pending_bodies: int = Field(
        1024, ge=1, description="Most requests still sending their body at once; beyond it 503 at once."
    )
    model_name: str = Field(
        "specserve-default", min_length=1, description="Model name the OpenAI API reports and accepts."
    )

    @model_validator(mode="after")
    def _check(self) -> "HttpSpec":
        if self.api_key is not None and not self.api_key.get_secret_value():
            raise ValueError("http.api_key: must not be empty")
        sources = self._key_sources()
        if len(sources) > 1:
            raise ValueError(f"http.{sources[0]}: set one of api_key, api_key_env, api_key_file, not "
                             f"{' and '.join(sources)}")
        return self

    def resolve_api_key(self) -> str | None:
        """The bearer key to require, or None for no authentication. Call where the key is used."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            try:
                return read_secret_file(self.api_key_file, "http.api_key_file")
            except SecretFileError as e:
                raise ConfigError(str(e)) from None
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"http.api_key_env: environment variable {self.api_key_env} is unset or empty")
        return key

    def _key_sources(self) -> list[str]:
        return [name for name in ("api_key", "api_key_env", "api_key_file") if getattr(self, name) is not None]

    @property
    def has_api_key(self) -> bool:
        return bool(self._key_sources())

    @property
    def exposed(self) -> bool:
        """Whether the server listens beyond this machine."""
        return not is_loopback_host(self.host)


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1, IPv4-mapped 127.x); a host name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class RaySpec(_Spec):
    auth_mode: Literal["token", "disabled"] = Field(
        "token",
        description="Ray's RAY_AUTH_MODE. 'token': every Ray RPC and HTTP endpoint (GCS, raylet, the dashboard "
        "agent's job API) needs the cluster token; `specserve serve` generates it once into "
        "$XDG_STATE_HOME/specserve/ray_token (0600) when it starts the cluster, and clients joining one take it "
        "from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (Ray's order), never from this config. "
        "'disabled' only for a cluster on loopback (address unset or a loopback host:port): any local user "
        "can then run code as the serving user.",
    )
    include_dashboard: bool = Field(False, description="Start Ray's dashboard (it shows Serve's config and args).")
    address: str | None = Field(
        None,
        description="Existing Ray cluster to join ('auto', 'host:port', 'ray://host:port'); None (or 'local') "
        "starts a local single-node cluster whose every port listens on loopback.",
    )

    @model_validator(mode="after")
    def _check(self) -> "RaySpec":
        if self.auth_mode == "disabled" and not self.loopback_only:
            raise ValueError(
                f"ray.auth_mode: 'disabled' is allowed only for a cluster on loopback (ray.address unset, or a "
                f"loopback host:port); ray.address {self.address!r} may be reachable from other machines, where "
                "anyone could run code on the cluster: use auth_mode 'token'"
            )
        return self

    @property
    def starts_local_cluster(self) -> bool:
        return self.address in (None, "local")

    @property
    def loopback_only(self) -> bool:
        """Whether every Ray address of this config is on loopback ('auto' may find any cluster: it is not)."""
        if self.starts_local_cluster:
            return True
        address = self.address if "://" in self.address else "//" + self.address  # type: ignore[operator]
        try:
            host = urllib.parse.urlsplit(address).hostname
        except ValueError:
            return False
        return host is not None and is_loopback_host(host)


class DefaultsSpec(_Spec):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for requests that set none (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass for requests that set none.")
    top_k: int = Field(0, ge=0, description="Top-k for requests that set none (0 = off).")
    max_tokens: int = Field(D.MAX_TOKENS, ge=1, description="Tokens generated for requests that set no max_tokens.")


class StructuredSpec(_Spec):
    max_grammar_bytes: int = Field(
        D.GRAMMAR_MAX_BYTES, ge=1, description="Largest compiled grammar source (a JSON schema, regex, choice list "
        "or Lark grammar, as llguidance compiles it) a request may ask for; larger is a 400."
    )
    compile_timeout_s: float = Field(
        D.GRAMMAR_COMPILE_TIMEOUT_S, gt=0, description="A grammar whose compilation takes longer fails its "
        "request with a 400 (compilation runs off the step loop, so other requests keep decoding meanwhile)."
    )
    cache_size: int = Field(
        D.GRAMMAR_CACHE_SIZE, ge=1, description="Compiled grammars kept per router replica (by a hash of grammar "
        "and tokenizer); requests that repeat a schema skip its compilation."
    )


class KVSpec(_Spec):
    block_size: int = Field(
        D.KV_BLOCK_SIZE, ge=1, le=4096, description="Positions per KV block. Each model's KV pool is a pool of "
        "blocks; a sequence holds the blocks its tokens fill, taken as it grows and returned when it ends."
    )
    num_blocks: int | None = Field(
        None, ge=1, description="Blocks in each KV pool (the target's, each draft replica's, each tensor-parallel "
        "rank's). Default: every slot's sequence at target.max_model_len, the most it can need."
    )
    prefix_cache: bool = Field(
        D.PREFIX_CACHE, description="Keep full blocks of committed tokens after a sequence ends, and start a new "
        "sequence whose prompt begins with the same tokens from them: a shared system prompt or a conversation's "
        "earlier turns are computed once, for the target and the draft. Never holds draft tokens."
    )


class ClusterBudget(_Spec):
    total_gpus: float = Field(
        ge=0, description="GPUs in the whole cluster, every node and type; Ray reservations must fit."
    )
    gpus_per_node: int | None = Field(
        None, ge=1, description="GPUs per node hosting a verifier group; a STRICT_PACK group must fit in one."
    )


class ClusterConfig(_Spec):
    target: TargetSpec = Field(description="The model whose output distribution is served.")
    draft: DraftSpec = Field(
        default_factory=DraftSpec, description="The cheap proposer (default: n-gram prompt lookup)."
    )
    speculation: SpeculationSpec = Field(
        default_factory=SpeculationSpec, description="Proposal length and acceptance rule."
    )
    draft_pool: DraftPoolSpec = Field(default_factory=DraftPoolSpec, description="Ray deployment of draft replicas.")
    verifier: VerifierSpec = Field(default_factory=VerifierSpec, description="Ray placement of the verifier groups.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The step loop's admission and batching.")
    http: HttpSpec = Field(default_factory=HttpSpec, description="The OpenAI-compatible HTTP ingress.")
    ray: RaySpec = Field(default_factory=RaySpec, description="How Ray itself is started or joined.")
    defaults: DefaultsSpec = Field(default_factory=DefaultsSpec, description="Sampling defaults for requests.")
    structured: StructuredSpec = Field(
        default_factory=StructuredSpec, description="Structured outputs (response_format, structured_outputs): "
        "limits on the grammars requests may ask for."
    )
    kv: KVSpec = Field(default_factory=KVSpec, description="The paged KV pools and the prefix cache.")
    cluster: ClusterBudget | None = Field(None, description="The cluster's GPUs, to check reservations fit (optional).")

    SEEDS_KEY: ClassVar[str] = "speculative_decoding"

    @model_validator(mode="after")
    def _check_resources_fit(self) -> "ClusterConfig":
        if self.target.device == "cuda" and self.verifier.num_gpus == 0:
            raise ValueError(
                "verifier.num_gpus: must be > 0 when target.device is 'cuda' (a rank must reserve the GPU it uses)"
            )
        if self.cluster is not None:
            self._check_gpu_budget(self.cluster)
        return self

    @model_validator(mode="after")
    def _check_kv(self) -> "ClusterConfig":
        one = D.kv_blocks(1, self.target.max_model_len, self.kv.block_size)
        if self.kv.num_blocks is not None and self.kv.num_blocks < one:
            raise ValueError(f"kv.num_blocks: {self.kv.num_blocks} blocks of {self.kv.block_size} cannot hold one "
                             f"sequence of target.max_model_len ({self.target.max_model_len} tokens); need ≥ {one}")
        return self

    @model_validator(mode="after")
    def _check_local_stages(self) -> "ClusterConfig":
        if self.router.stages == "local" and (self.target.tensor_parallel > 1 or self.verifier.num_groups > 1):
            raise ValueError(
                "router.stages: 'local' runs the one target copy inside the router replica; it needs "
                f"target.tensor_parallel 1 and verifier.num_groups 1 (got {self.target.tensor_parallel} and "
                f"{self.verifier.num_groups}): use router.stages 'remote'"
            )
        if self.speculation.draft_num > 1 and self.draft.kind == "none":
            raise ValueError("speculation.draft_num: candidates are drafted by the draft; with draft.kind "
                             "'none' leave draft_num 1")
        if self.router.stages == "local" and self.router.transport != "handles":
            raise ValueError(f"router.transport: {self.router.transport!r} reaches remote stages; with "
                             "router.stages 'local' there are none (leave transport 'handles')")
        if self.draft_pool.autoscaling is not None and "draft" in self.worker_stages:
            # Serve scales on the requests its replicas receive; these receive none (docs/transport.md).
            raise ValueError(f"draft_pool.autoscaling: with router.transport {self.router.transport!r} the router "
                             "sends every draft call to the replicas' workers, not through Serve, so Serve's "
                             "autoscaler would see an idle pool and keep it at min_replicas; set "
                             "draft_pool.num_replicas, or use transport 'handles'")
        return self

    @property
    def worker_stages(self) -> frozenset[str]:
        """The stages whose replicas run their model in a stage worker ("draft", "verifier"): all remote
        ones under a worker transport (a tensor-parallel verifier's worker drives its group of ranks),
        except with a colocated draft (a worker takes part in one compiled graph only, and that replica
        hosts both)."""
        if self.router.transport == "handles" or self.router.stages == "local" or \
                self.draft_pool.placement == "colocated":
            return frozenset()
        stages = {"verifier"}
        if self.draft.kind != "none":
            stages.add("draft")
        return frozenset(stages)

    @model_validator(mode="after")
    def _check_multi_node_auth(self) -> "ClusterConfig":
        budget = self.cluster
        if (self.ray.auth_mode != "token" and budget is not None and budget.gpus_per_node is not None
                and budget.total_gpus > budget.gpus_per_node):
            raise ValueError(
                f"ray.auth_mode: cluster describes more than one node (total_gpus {budget.total_gpus:g} > "
                f"gpus_per_node {budget.gpus_per_node}); the nodes reach each other over the network, so Ray's "
                "token authentication is required: set auth_mode 'token'"
            )
        return self

    def _check_gpu_budget(self, budget: ClusterBudget) -> None:
        tp, per_rank = self.target.tensor_parallel, self.verifier.num_gpus
        verifier = self.verifier.num_groups * tp * per_rank
        pool = self.draft_pool
        draft = pool.max_replicas * pool.num_gpus if self.draft.kind != "none" else 0.0
        if verifier + draft > budget.total_gpus + 1e-9:  # fractional GPUs add up inexactly
            raise ValueError(
                f"cluster.total_gpus ({budget.total_gpus}) is less than the GPUs reserved: verifier "
                f"{self.verifier.num_groups} groups × {tp} ranks × {per_rank} = {verifier:g} plus draft_pool "
                f"{pool.max_replicas} replicas × {pool.num_gpus} = {draft:g}"
            )
        per_group = tp * per_rank
        if (
            budget.gpus_per_node is not None
            and self.verifier.placement_strategy == "STRICT_PACK"
            and per_group > budget.gpus_per_node
        ):
            raise ValueError(
                f"target.tensor_parallel: a group reserves {tp} × {per_rank} = {per_group:g} GPUs, more than "
                f"cluster.gpus_per_node ({budget.gpus_per_node}); STRICT_PACK cannot place it — use "
                "verifier.placement_strategy PACK to span nodes"
            )

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "ClusterConfig":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config: {e}") from e
        try:
            data = _safe_load_unique(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from e
        if data is None:
            raise ConfigError(f"{p}: the config is empty")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"config: must be a mapping of sections, got {type(d).__name__}")
        native = {k: copy.deepcopy(v) for k, v in d.items() if k != cls.SEEDS_KEY}
        origins: dict[str, str] = {}
        if cls.SEEDS_KEY in d:
            origins = _merge_seeds(native, d[cls.SEEDS_KEY])
        cfg = cls.model_validate(native)
        cfg.validate_models()
        cfg._log_warnings(origins)
        return cfg

    def _log_warnings(self, origins: Mapping[str, str]) -> None:
        spec = self.speculation
        if spec.acceptance == "threshold":
            source = origins.get("speculation.threshold", "speculation.threshold")
            log.warning(
                "%s=%s opts into lossy threshold acceptance: outputs no longer match the target's "
                "distribution exactly (set speculation.acceptance: exact for exact speculative decoding)",
                source,
                spec.threshold,
            )
        if self.http.exposed and not self.http.has_api_key:
            log.warning("http.host=%s listens beyond this machine without http.api_key_file, api_key_env or "
                        "api_key", self.http.host)

    def to_serve_args(self) -> dict[str, Any]:
        """JSON-able args for ``build_app``; ``from_dict`` of them gives an equal config."""
        args = self.model_dump(mode="json")
        if self.http.api_key is not None:
            args["http"]["api_key"] = self.http.api_key.get_secret_value()
        return args

    # ---- model folders -------------------------------------------------------------------------

    def validate_models(self) -> None:
        """Check the local model paths with ``cluster.model_files.check_pair`` (engine assembly runs it too);
        raises ``ConfigError`` naming ``target.path``, ``target.tensor_parallel`` or ``draft.path``."""
        try:
            check_pair(self.target.path, self.draft.path if self.draft.kind == "model" else None,
                       tensor_parallel=self.target.tensor_parallel)
        except ModelFileError as e:
            raise ConfigError(str(e)) from None


# ---- the alternative layout: a speculative_decoding block ------------------------------------------

_SEEDS_SUBKEYS = {
    "draft_model": ("path", "batch_size"),
    "main_model": ("path", "tensor_parallel"),
    "acceptance": ("threshold", "dynamic_adjust"),
}
_SEEDS_FLAT = ("draft_num", "temperature", "verify_threshold", "batch_size")


def _merge_seeds(native: dict[str, Any], block: Any) -> dict[str, str]:
    """Map a ``speculative_decoding`` block (the alternative layout) onto ``native`` in place.

    Returns native key path → the block's key path it came from, for messages.
    """
    where = ClusterConfig.SEEDS_KEY
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where}: must be a mapping, got {type(block).__name__}")
    mapped: dict[str, tuple[Any, str]] = {}

    def put(native_key: str, value: Any, origin: str) -> None:
        if native_key in mapped and mapped[native_key][0] != value:
            other = mapped[native_key][1]
            raise ConfigError(f"{origin} ({value!r}) conflicts with {other} ({mapped[native_key][0]!r})")
        mapped[native_key] = (value, origin)

    def put_threshold(value: Any, origin: str) -> None:
        put("speculation.acceptance", "threshold", origin)
        put("speculation.threshold", value, origin)

    for key, value in block.items():
        here = f"{where}.{key}"
        if key in _SEEDS_SUBKEYS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{here}: must be a mapping, got {type(value).__name__}")
            for sub in value:
                if sub not in _SEEDS_SUBKEYS[key]:
                    known = ", ".join(_SEEDS_SUBKEYS[key])
                    raise ConfigError(f"{here}.{sub}: unknown key (known here: {known})")
        if key == "draft_model":
            if "path" in value:
                put("draft.kind", "model", f"{here}.path")
                put("draft.path", value["path"], f"{here}.path")
            if "batch_size" in value:
                put("draft_pool.max_batch_size", value["batch_size"], f"{here}.batch_size")
        elif key == "main_model":
            if "path" in value:
                put("target.path", value["path"], f"{here}.path")
            if "tensor_parallel" in value:
                put("target.tensor_parallel", value["tensor_parallel"], f"{here}.tensor_parallel")
        elif key == "acceptance":
            if "threshold" in value:
                put_threshold(value["threshold"], f"{here}.threshold")
            if "dynamic_adjust" in value:
                put("speculation.dynamic_adjust", value["dynamic_adjust"], f"{here}.dynamic_adjust")
        elif key == "verify_threshold":
            put_threshold(value, here)
        elif key == "temperature":
            put("defaults.temperature", value, here)
        elif key == "batch_size":
            put("draft_pool.batch_size", value, here)
        elif key == "draft_num":
            put("speculation.draft_num", value, here)
        else:
            known = ", ".join([*_SEEDS_SUBKEYS, *_SEEDS_FLAT])
            raise ConfigError(f"{here}: unknown key (known here: {known})")

    for native_key, (value, origin) in mapped.items():
        section_name, field = native_key.split(".")
        section = native.setdefault(section_name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{section_name}: must be a mapping, got {type(section).__name__}")
        if field in section and section[field] != value:
            raise ConfigError(
                f"{origin} ({value!r}) conflicts with {native_key} ({section[field]!r}); set it in one place"
            )
        section[field] = value
    return {native_key: origin for native_key, (_, origin) in mapped.items()}


def _safe_load_unique(text: str) -> Any:
    """``yaml.safe_load`` that also refuses duplicate keys (a SafeLoader subclass, no arbitrary objects)."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses duplicate keys: YAML keeps the last one silently, hiding mistakes."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)
