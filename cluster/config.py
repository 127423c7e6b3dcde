"""The cluster's configuration: one pydantic ``ClusterConfig``.

Contract:
- ``ClusterConfig.from_yaml(path)`` / ``ClusterConfig.from_dict(d)`` build a validated config or raise a
  ``ValueError`` — a ``pydantic.ValidationError`` or a ``ConfigError`` — whose message names the key path
  (``speculation.gamma_max``, ``speculative_decoding.draft_num``, ...). Every model forbids unknown keys.
- The seeds' service config (a ``speculative_decoding:`` block, both of its shapes) is mapped onto the
  native fields and merged with any native sections; a value set in both places must agree.
- ``validate_models()`` checks tensor parallelism against the target's heads and the draft's vocabulary
  against the target's by reading ``config.json`` / ``tokenizer.json`` of local model folders. Paths that
  are builtin or not a folder on this machine are skipped (they may exist only on worker nodes).
  ``from_dict`` / ``from_yaml`` call it; building the model directly (``ClusterConfig(...)``) does not.
- ``to_serve_args()`` is a JSON-able dict that ``from_dict`` turns back into an equal config: the ``args``
  of ``build_app``. It carries ``http.api_key`` in clear (the ingress needs it); prefer
  ``http.api_key_env`` to keep the key out of Serve's config.
- Relative model paths are kept as written: they resolve against the loading process's working directory.

No ray or torch import: the CLI and config tooling load this without either installed.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

log = logging.getLogger("specserve.config")

BUILTIN_TINY = "builtin:tiny"
GAMMA_HARD_CAP = 16  # longest chain the verifier and the wire format accept
MAX_BATCH_CAP = 1 << 16  # cluster.wire.MAX_ROWS: the most rows one frame may carry

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


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
        description=f"Local Hugging Face model folder of the target, or {BUILTIN_TINY!r} for the tiny "
        "test model built from config in code (no files, no downloads).",
    )
    dtype: Dtype = Field("auto", description="Target weights dtype; 'auto' = float32 on CPU, bfloat16 on GPU.")
    max_model_len: int = Field(
        1024, ge=2, description="Longest sequence served (prompt + generated tokens); sizes the KV slots."
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Ranks one verifier group shards the target over; must divide the target's attention "
        "and key/value heads.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the target runs; 'auto' = CUDA when the verifier rank sees a GPU."
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
        description=f"Local Hugging Face folder of the draft model, or {BUILTIN_TINY!r}; required iff "
        "kind is 'model'. It must share the target's tokenizer.",
    )
    dtype: Dtype = Field("auto", description="Draft weights dtype; 'auto' = float32 on CPU, bfloat16 on GPU.")
    ngram_max: int = Field(4, ge=1, le=64, description="Longest suffix n-gram looked up (kind 'ngram').")
    ngram_min: int = Field(1, ge=1, le=64, description="Shortest suffix n-gram looked up (kind 'ngram').")

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
    gamma: int = Field(4, ge=1, le=GAMMA_HARD_CAP, description="Draft tokens per proposal at start (γ).")
    gamma_min: int = Field(1, ge=1, le=GAMMA_HARD_CAP, description="Smallest γ adaptive speculation may use.")
    gamma_max: int = Field(
        8,
        ge=1,
        le=GAMMA_HARD_CAP,
        description="Largest γ adaptive speculation may use; also the wire format's chain cap "
        f"(≤ {GAMMA_HARD_CAP}).",
    )
    adaptive: bool = Field(True, description="Adapt γ per sequence within [gamma_min, gamma_max] from its acceptance.")
    confidence_threshold: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Stop a chain early when the draft's top probability falls below this (0 = never). "
        "Exact: it only shortens proposals.",
    )
    acceptance: Literal["exact", "threshold"] = Field(
        "exact",
        description="'exact' = rejection sampling: outputs follow the target's distribution exactly. "
        "'threshold' = the seeds' lossy opt-in rule: faster, but outputs no longer match the target's "
        "distribution.",
    )
    threshold: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Acceptance threshold in (0, 1], higher = stricter; required iff acceptance is 'threshold'.",
    )
    dynamic_adjust: bool = Field(
        False,
        description="Move the threshold toward target_acceptance at run time (the seeds' adjust_threshold); "
        "only with acceptance 'threshold'.",
    )
    target_acceptance: float = Field(
        0.7, gt=0.0, lt=1.0, description="Acceptance rate dynamic_adjust steers the threshold toward."
    )
    q_top_k: int = Field(
        64,
        ge=1,
        description="Support size K of the proposal distribution q sent with sampled drafts; the draft "
        "samples from its top-K-truncated distribution, so verification stays exact.",
    )
    goodput_guard: bool = Field(
        False,
        description="Measure committed tokens per second of speculative and of plain steps per batch-size "
        "bucket (plain probes every few steps) and decode plainly where speculation does not pay. Exact "
        "either way: plain steps are verify steps without drafts. Off by default: its probes cost batch-1 "
        "gain on short runs (scripts/bench_scenarios.py reports both); meant for long-running, "
        "high-batch services.",
    )
    max_parallel_drafts: Literal[1] = Field(
        1, description="Proposals per sequence per step; 1 until multi-draft verification exists."
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
        if self.dynamic_adjust and self.acceptance != "threshold":
            raise ValueError(
                "speculation.dynamic_adjust: adjusts the threshold, so needs speculation.acceptance 'threshold'"
            )
        return self


class AutoscalingSpec(_Spec):
    min_replicas: int = Field(ge=1, description="Fewest draft replicas kept running.")
    max_replicas: int = Field(ge=1, description="Most draft replicas started under load.")

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
    autoscaling: AutoscalingSpec | None = Field(None, description="Autoscale the draft pool between these bounds.")
    placement: Literal["offload", "colocated"] = Field(
        "offload",
        description="'offload': draft replicas are placed by num_gpus/accelerator_type/resources (cheaper "
        "GPUs); 'colocated': one draft replica per verifier group on its node, for batch-1 latency.",
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs reserved per draft replica (Ray resource).")
    num_gpus: float = Field(0.0, ge=0, le=1, description="GPUs reserved per draft replica; fractions share a GPU.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type the replicas need, e.g. 'L4'.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per draft replica.")
    max_batch_size: int = Field(
        64, ge=1, le=MAX_BATCH_CAP, description="Most sequences one draft replica call may carry."
    )
    batch_size: int = Field(32, ge=1, description="Micro-batch size the draft pool drafts in (≤ max_batch_size).")

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
        64, ge=1, le=MAX_BATCH_CAP, description="Most sequences decoding at once (holding KV slots)."
    )
    max_queue: int = Field(
        256, ge=0, description="Most requests waiting for a running slot; beyond it requests are rejected."
    )
    micro_batches: int = Field(
        2, ge=1, le=8, description="Micro-batches kept in flight so draft pool and verifier work at the same time."
    )
    request_timeout_s: float = Field(
        300.0, gt=0, description="A request still unfinished after this many seconds fails."
    )
    num_cpus: float = Field(0.25, ge=0, description="CPUs reserved per router replica (Ray resource).")


class HttpSpec(_Spec):
    host: str = Field("127.0.0.1", min_length=1, description="Address the OpenAI-compatible HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP server binds.")
    api_key: SecretStr | None = Field(
        None, description="Bearer key clients must send; never shown in repr. Prefer api_key_env."
    )
    api_key_env: str | None = Field(
        None,
        min_length=1,
        description="Name of an environment variable (in the ingress replica) holding the bearer key; "
        "keeps the key out of files and Serve's config.",
    )
    max_body_bytes: int = Field(1 << 20, ge=1, description="Largest request body accepted.")
    model_name: str = Field(
        "specserve-default", min_length=1, description="Model name the OpenAI API reports and accepts."
    )

    @model_validator(mode="after")
    def _check(self) -> "HttpSpec":
        if self.api_key is not None and not self.api_key.get_secret_value():
            raise ValueError("http.api_key: must not be empty")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("http.api_key: set either api_key or api_key_env, not both")
        return self

    def resolve_api_key(self) -> str | None:
        """The bearer key to require, or None for no authentication. Call where the key is used."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"http.api_key_env: environment variable {self.api_key_env} is unset or empty")
        return key

    @property
    def exposed(self) -> bool:
        """Whether the server listens beyond this machine."""
        if self.host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: assume it resolves off this machine
            return True


class RaySpec(_Spec):
    auth_mode: Literal["token", "disabled"] = Field(
        "disabled",
        description="Ray's RAY_AUTH_MODE. 'disabled' suits the default local single-user cluster: nothing "
        "but this machine's user reaches it, and token auth would need a token handed to every client "
        "(ray.init, the serve CLI) for no gain. Use 'token' whenever other users or machines can reach "
        "the cluster (multi-node, KubeRay); the token comes from Ray's token file or RAY_AUTH_TOKEN, "
        "never from this config.",
    )
    include_dashboard: bool = Field(False, description="Start Ray's dashboard (it shows Serve's config and args).")
    address: str | None = Field(
        None, description="Existing Ray cluster to join ('auto', 'host:port'); None starts a local one."
    )


class DefaultsSpec(_Spec):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for requests that set none (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass for requests that set none.")
    top_k: int = Field(0, ge=0, description="Top-k for requests that set none (0 = off).")
    max_tokens: int = Field(256, ge=1, description="Tokens generated for requests that set no max_tokens.")


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
        if self.http.exposed and self.http.api_key is None and self.http.api_key_env is None:
            log.warning("http.host=%s listens beyond this machine without http.api_key or api_key_env", self.http.host)

    def to_serve_args(self) -> dict[str, Any]:
        """JSON-able args for ``build_app``; ``from_dict`` of them gives an equal config."""
        args = self.model_dump(mode="json")
        if self.http.api_key is not None:
            args["http"]["api_key"] = self.http.api_key.get_secret_value()
        return args

    # ---- model folders -------------------------------------------------------------------------

    def validate_models(self) -> None:
        """Check TP against the target's heads and the draft's vocabulary against the target's.

        Reads only local folders; raises ``ConfigError`` naming ``target.tensor_parallel`` or
        ``draft.path``.
        """
        target = _local_folder(self.target.path)
        if target is None:
            return
        target_cfg = _read_model_config(target, "target.path")
        _check_heads(target_cfg, self.target.tensor_parallel)
        if self.draft.kind != "model":
            return
        draft = _local_folder(self.draft.path or "")
        if draft is not None:
            _check_vocab(target, target_cfg, draft, _read_model_config(draft, "draft.path"))


# ---- the seeds' config shape -------------------------------------------------------------------

_SEEDS_SUBKEYS = {
    "draft_model": ("path", "batch_size"),
    "main_model": ("path", "tensor_parallel"),
    "acceptance": ("threshold", "dynamic_adjust"),
}
_SEEDS_FLAT = ("draft_num", "temperature", "verify_threshold", "batch_size")


def _merge_seeds(native: dict[str, Any], block: Any) -> dict[str, str]:
    """Map the seeds' ``speculative_decoding`` block onto ``native`` in place.

    Returns native key path → seeds key path it came from, for messages.
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
            if type(value) is not int or value < 1:
                raise ConfigError(f"{here}: must be 1, got {value!r}")
            if value > 1:
                raise ConfigError(
                    f"{here}: draft_num > 1 (parallel drafts) needs multi-draft verification, which specserve "
                    "does not implement yet; set draft_num: 1"
                )
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


# ---- reading model folders ---------------------------------------------------------------------


def _local_folder(path: str) -> Path | None:
    if path.startswith("builtin:"):
        return None
    folder = Path(path).expanduser()
    return folder if folder.is_dir() else None


def _read_json(file: Path, where: str) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read {file}: {e}") from e


def _read_model_config(folder: Path, where: str) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{where}: {folder} has no config.json (not a Hugging Face model folder)")
    cfg = _read_json(file, where)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: {file} is not a JSON object")
    # Multimodal configs keep the language model's fields under text_config.
    text = cfg.get("text_config")
    if "num_attention_heads" not in cfg and isinstance(text, dict):
        return text
    return cfg


def _check_heads(cfg: Mapping[str, Any], tp: int) -> None:
    if tp == 1:
        return
    heads = cfg.get("num_attention_heads")
    if type(heads) is not int:
        raise ConfigError(
            "target.tensor_parallel: cannot check it, the target's config.json has no num_attention_heads"
        )
    kv_heads = cfg.get("num_key_value_heads", heads)  # absent means multi-head attention
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if type(n) is not int or n % tp:
            raise ConfigError(
                f"target.tensor_parallel ({tp}) must divide the target's {name} ({n}): each rank holds whole heads"
            )


def _tokenizer_vocab(folder: Path, where: str) -> tuple[Any, list[tuple[Any, Any]]] | None:
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    tok = _read_json(file, where)
    model = tok.get("model") if isinstance(tok, dict) else None
    added = tok.get("added_tokens") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or not isinstance(added, list):
        raise ConfigError(f"{where}: {file} has no model vocabulary / added_tokens")
    # Only id ↔ string matters for speculation; merges and normalizers may be exported differently.
    return model.get("vocab"), [(t.get("id"), t.get("content")) for t in added if isinstance(t, dict)]


def _check_vocab(target: Path, target_cfg: Mapping[str, Any], draft: Path, draft_cfg: Mapping[str, Any]) -> None:
    target_tok = _tokenizer_vocab(target, "target.path")
    draft_tok = _tokenizer_vocab(draft, "draft.path")
    if target_tok is not None and draft_tok is not None:
        if target_tok != draft_tok:
            raise ConfigError(
                "draft.path: the draft's tokenizer.json vocabulary differs from the target's; draft and target "
                "must share a tokenizer (token ids mean the same text)"
            )
        return  # identical tokenizers: vocab_size may differ only by embedding padding
    target_vocab, draft_vocab = target_cfg.get("vocab_size"), draft_cfg.get("vocab_size")
    if target_vocab is None or target_vocab != draft_vocab:
        raise ConfigError(
            f"draft.path: the draft's vocab_size ({draft_vocab}) differs from the target's ({target_vocab}) "
            "and there is no tokenizer.json in both folders to show the vocabularies are identical"
        )
