"""Assembling an in-process engine from plain settings (CLI, benchmarks, colocated replicas).

Kept free of pydantic and ray so that a bare GPU box with only torch + transformers can build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.engine import Engine, LocalStages
from engine.gamma import GammaPolicy
from engine.goodput import GoodputController
from runtime.models import build_model, check_vocab_compatible
from runtime.runner import ModelRunner
from verifier.verify import AcceptanceConfig, VerifyStage


@dataclass(frozen=True)
class EngineSettings:
    target: Any  # model spec, see runtime.models.build_model
    draft: Any = None  # model spec, "ngram", or None (no speculation)
    device: str = "auto"
    dtype: str = "auto"
    max_len: int = 1024
    max_slots: int = 64
    micro_batches: int = 1
    gamma: int = 4
    gamma_min: int = 1
    gamma_max: int = 8
    adaptive: bool = True
    confidence_threshold: float = 0.0
    q_top_k: int | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    goodput_guard: bool = False  # measure speculative vs plain goodput; decode plainly where it does not pay


def make_proposer(settings: EngineSettings, draft_model=None):
    from draftpool.draft_model import DraftModelProposer
    from draftpool.ngram import NgramProposer

    if settings.draft is None:
        return None
    if settings.draft == "ngram":
        return NgramProposer(n_min=settings.ngram_min, n_max=settings.ngram_max)
    model = draft_model if draft_model is not None else build_model(settings.draft, settings.device, settings.dtype)
    return DraftModelProposer(model, max_slots=settings.max_slots, max_len=settings.max_len,
                              q_top_k=settings.q_top_k, confidence_threshold=settings.confidence_threshold)


def make_policy(settings: EngineSettings) -> GammaPolicy:
    return GammaPolicy(gamma=settings.gamma, gamma_min=settings.gamma_min, gamma_max=settings.gamma_max,
                       adaptive=settings.adaptive)


def make_goodput(settings: EngineSettings) -> GoodputController | None:
    """The measured guard (``engine/goodput.py``) when there is something to guard."""
    return GoodputController() if settings.goodput_guard and settings.draft is not None else None


def spec_path(spec) -> str | None:
    """The local folder behind a model spec, if it has one."""
    if isinstance(spec, str) and spec != "ngram":
        return spec
    return spec.get("path") if isinstance(spec, dict) else None


def make_engine(settings: EngineSettings, *, target_model=None, draft_model=None, eos_token_ids=(),
                detokenize=None) -> Engine:
    if spec_path(settings.target) and spec_path(settings.draft):
        check_vocab_compatible(spec_path(settings.target), spec_path(settings.draft))
    target = target_model if target_model is not None else build_model(settings.target, settings.device,
                                                                        settings.dtype)
    verifier = VerifyStage(ModelRunner(target, max_slots=settings.max_slots, max_len=settings.max_len),
                           settings.acceptance)
    proposer = make_proposer(settings, draft_model)
    return Engine(LocalStages(verifier, proposer), policy=make_policy(settings), eos_token_ids=eos_token_ids,
                  max_len=settings.max_len, max_running=settings.max_slots, micro_batches=settings.micro_batches,
                  detokenize=detokenize, speculate=proposer is not None, goodput=make_goodput(settings))
