"""From a ``ClusterConfig`` to what each replica builds: model specs, engine settings, wire limits."""

from __future__ import annotations

from cluster.config import ClusterConfig
from runtime.wire import WireLimits
from engine.assembly import EngineSettings
from runtime.models import resolve_spec, spec_vocab_size
from verifier.verify import AcceptanceConfig


def target_spec(cfg: ClusterConfig):
    return resolve_spec(cfg.target.path, "target", cfg.target.dtype)


def draft_spec(cfg: ClusterConfig):
    if cfg.draft.kind == "none":
        return None
    if cfg.draft.kind == "ngram":
        return "ngram"
    return resolve_spec(cfg.draft.path, "draft", cfg.draft.dtype)


def engine_settings(cfg: ClusterConfig, *, max_slots: int | None = None) -> EngineSettings:
    spec = cfg.speculation
    return EngineSettings(
        target=target_spec(cfg), draft=draft_spec(cfg), device=cfg.target.device, dtype=cfg.target.dtype,
        max_len=cfg.target.max_model_len, max_slots=max_slots or cfg.router.max_running,
        micro_batches=cfg.router.step_micro_batches, gamma=spec.gamma, gamma_min=spec.gamma_min,
        gamma_max=spec.gamma_max, adaptive=spec.adaptive, confidence_threshold=spec.confidence_threshold,
        q_top_k=spec.q_top_k, ngram_min=cfg.draft.ngram_min, ngram_max=cfg.draft.ngram_max,
        acceptance=AcceptanceConfig(mode=spec.acceptance, threshold=spec.threshold or 0.9,
                                    dynamic_adjust=spec.dynamic_adjust, target_rate=spec.target_acceptance),
        draft_num=spec.draft_num, tree_nodes=spec.tree_nodes,
        forced_tokens=spec.forced_tokens, kv_block_size=cfg.kv.block_size, kv_blocks=cfg.kv.num_blocks,
        prefix_cache=cfg.kv.prefix_cache)


def wire_limits(cfg: ClusterConfig) -> WireLimits:
    spec = cfg.speculation
    return WireLimits(vocab_size=spec_vocab_size(target_spec(cfg)), gamma_max=spec.gamma_max,
                      max_batch=max(cfg.router.max_running, cfg.draft_pool.max_batch_size),
                      max_seq_len=cfg.target.max_model_len,
                      tree_nodes=max(spec.tree_nodes, spec.draft_num * spec.gamma_max if spec.draft_num > 1 else 0))
