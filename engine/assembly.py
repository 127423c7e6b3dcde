"""The one assembly path: ``make_engine`` builds every ``Engine`` — the CLI's, the benchmarks', the tests',
a local-stages router's and (around its ``StageClient``) a remote router's.

Kept free of pydantic and ray so that a bare GPU box with only torch + transformers can build it. The
defaults of ``EngineSettings`` are the config's, from ``cluster/defaults.py`` (pydantic-free).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster import defaults as D
from cluster.model_files import check_pair
from engine.engine import Engine, LocalStages, Stages
from engine.gamma import GammaPolicy
from runtime.models import build_model
from runtime.runner import ModelRunner
from verifier.verify import AcceptanceConfig, VerifyStage


@dataclass(frozen=True)
class EngineSettings:
    target: Any  # model spec, see runtime.models.build_model
    draft: Any = None  # model spec, "ngram", or None (no speculation)
    device: str = D.DEVICE
    dtype: str = D.DTYPE
    max_len: int = D.MAX_MODEL_LEN
    max_slots: int = D.MAX_RUNNING
    # In-process stages answer at once, so a second micro-batch would only split the batch; a router
    # pipelines its remote stages with ``router.micro_batches`` (deployments.settings).
    micro_batches: int = 1
    gamma: int = D.GAMMA
    gamma_min: int = D.GAMMA_MIN
    gamma_max: int = D.GAMMA_MAX
    adaptive: bool = D.ADAPTIVE
    confidence_threshold: float = D.CONFIDENCE_THRESHOLD
    q_top_k: int | None = D.Q_TOP_K
    ngram_min: int = D.NGRAM_MIN
    ngram_max: int = D.NGRAM_MAX
    # > 0: the draft model drafts token trees of up to this many nodes (issue 15): with ``adaptive`` the
    # policy chooses chain or tree per step from measured tokens per second; otherwise every step drafts
    # this tree (depth γ). 0: chains
    tree_nodes: int = D.TREE_NODES
    # candidate chains per row and step, one propose call each, merged into one tree (engine.candidates)
    draft_num: int = D.DRAFT_NUM
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    # structured outputs: where the grammar forces a run of tokens, propose it without the draft (q = 1)
    forced_tokens: bool = D.FORCED_TOKENS
    kv_block_size: int = D.KV_BLOCK_SIZE
    kv_blocks: int | None = None  # per pool; None: every slot at max_len
    prefix_cache: bool = D.PREFIX_CACHE

    def kv_options(self) -> dict:
        """What each ``ModelRunner`` of these settings takes for its KV pool."""
        return {"block_size": self.kv_block_size, "num_blocks": self.kv_blocks, "prefix_cache": self.prefix_cache}


def make_proposer(settings: EngineSettings, draft_model=None):
    """The proposer ``settings`` name (the engine's policy chooses a draft model's tree shape per step)."""
    from draftpool.draft_model import DraftModelProposer
    from draftpool.ngram import NgramProposer

    if settings.draft is None:
        return None
    if settings.draft == "ngram":
        return NgramProposer(n_min=settings.ngram_min, n_max=settings.ngram_max)
    model = draft_model if draft_model is not None else build_model(settings.draft, settings.device, settings.dtype)
    return DraftModelProposer(model, max_slots=settings.max_slots, max_len=settings.max_len,
                              q_top_k=settings.q_top_k, confidence_threshold=settings.confidence_threshold,
                              **settings.kv_options())


def make_verify_stage(settings: EngineSettings, target_model=None) -> VerifyStage:
    model = target_model if target_model is not None else build_model(settings.target, settings.device,
                                                                       settings.dtype)
    return VerifyStage(ModelRunner(model, max_slots=settings.max_slots, max_len=settings.max_len,
                                   **settings.kv_options()), settings.acceptance)


def make_policy(settings: EngineSettings) -> GammaPolicy:
    return GammaPolicy(gamma=settings.gamma, gamma_min=settings.gamma_min, gamma_max=settings.gamma_max,
                       adaptive=settings.adaptive, tree_nodes=settings.tree_nodes)


def spec_path(spec) -> str | None:
    """The local folder behind a model spec, if it has one."""
    if isinstance(spec, str) and spec != "ngram":
        return spec
    return spec.get("path") if isinstance(spec, dict) else None


def make_engine(settings: EngineSettings, *, stages: Stages | None = None, target_model=None, draft_model=None,
                eos_token_ids=(), detokenize=None, first_seq_id: int = 0) -> Engine:
    """An engine on ``stages`` (a router's ``StageClient``, or stages around models already built), or on
    in-process stages built from ``settings`` (models loaded unless given). Speculates when ``settings``
    names a draft; ``first_seq_id``:
    where its sequence ids start (``engine.engine.random_first_seq_id`` where other engines share the stages)."""
    policy = make_policy(settings)
    if stages is None:
        target_path, draft_path = spec_path(settings.target), spec_path(settings.draft)
        if target_path:
            check_pair(target_path, draft_path, where=(target_path, draft_path or ""))
        stages = LocalStages(make_verify_stage(settings, target_model), make_proposer(settings, draft_model))
    return Engine(stages, policy=policy, eos_token_ids=eos_token_ids, max_len=settings.max_len,
                  max_running=settings.max_slots, micro_batches=settings.micro_batches, detokenize=detokenize,
                  speculate=settings.draft is not None,
                  draft_num=settings.draft_num, first_seq_id=first_seq_id, forced_tokens=settings.forced_tokens,
                  kv_blocks=settings.kv_blocks, kv_block_size=settings.kv_block_size)
