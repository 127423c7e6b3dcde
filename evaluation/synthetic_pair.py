#!/usr/bin/env python3
"""A synthetic target/draft pair built from config, where the target *extends* the draft.

Why and how it is used: docs/design.md#fidelity-and-test-models.

The draft is a randomly initialised ``LlamaForCausalLM``. The target shares its embeddings, final norm and
LM head, and contains every draft layer, widened (more attention heads, a wider MLP) and interleaved with
extra layers. Everything the target has beyond the draft reaches the residual stream only through output
projections — the extra heads' columns of ``o_proj``, the extra MLP channels' columns of ``down_proj``, and
the whole ``o_proj``/``down_proj`` of an extra layer — and those are scaled by the divergence knob ε:

- ε = 0: the extra parts add exactly zero, so the target computes the draft's function (greedy agreement
  1.0; logits equal up to float summation order), while its compute and memory traffic are those of the
  full target;
- larger ε: the target drifts away from the draft and the greedy agreement α falls.

``calibrate_epsilon`` finds the ε that gives a wanted α — measured as the share of positions where the
draft's argmax equals the target's along the target's own greedy continuation of random prompts, which is
what greedy speculative decoding accepts position by position. The reference article's scenarios
(docs/design.md#the-reference-article) are α ≈ 0.89 (JSON), 0.62 (code) and 0.18 (prose).

Weights are built directly on the requested device and dtype (``with torch.device(dev)`` construction,
then in-place init from per-tensor seeded generators), so a multi-billion-parameter pair on a GPU never
passes through host memory. The numbers depend on the device's generator: the same seed gives a different
(equally valid) pair on CUDA than on CPU. ``set_epsilon`` changes ε in place by regenerating the scaled
slices from their seeds, so calibration needs one target, not one per trial.

    python scripts/build_synthetic_pair.py --tiny --agreement 0.62 --out /tmp/pair   # CPU, seconds
    python scripts/build_synthetic_pair.py --device cuda --dtype bf16 --epsilon 0.3 --out /data/pair

Only torch and transformers are imported (no ray, pydantic or deepspeed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class DraftConfig:
    """The draft's shape (a Llama). The defaults give ~1.1B parameters."""

    vocab_size: int = 32000
    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 8192
    head_dim: int | None = None  # hidden_size // num_heads when None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    init_gain: float = 1.0  # std of projection weights × sqrt(fan_in)
    logit_scale: float = 8.0  # std of the logits for a unit-RMS final hidden state: peaked, tie-free greedy

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclass(frozen=True)
class TargetExtra:
    """What the target adds to the draft. The defaults on the default draft give ~6.5B parameters."""

    extra_layers: int = 10
    extra_heads: int = 48  # per layer, on top of the draft's heads
    extra_kv_heads: int = 12  # must keep the draft's query heads per KV head (GQA group size)
    extra_intermediate: int = 24576  # per layer, on top of the draft's MLP width
    placement: str = "interleave"  # where extra layers go: "interleave" (spread between draft layers) | "end"


TINY_DRAFT = DraftConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, max_position_embeddings=1024)
TINY_EXTRA = TargetExtra(extra_layers=2, extra_heads=4, extra_kv_heads=2, extra_intermediate=128)
# ~30B target over the ~1.1B draft: weight bytes give c ≈ 0.04 (--large in bench_gpu.py).
LARGE_EXTRA = TargetExtra(extra_layers=44, extra_heads=112, extra_kv_heads=28, extra_intermediate=57344)
# The 0.5B/1.5B instruct pairs' cost at batch 1: the draft has a 0.5B model's shapes (width 896, 24 layers, 14
# heads over 2 KV heads, MLP 4864, a 151,936-token vocabulary); the target, which must keep the draft's width to
# extend it, doubles the heads and the MLP and adds 23 layers, for a 1.5B model's ~1.5 G multiply-adds per
# token (c ≈ 0.32 by multiply-adds). Untied embeddings make them 630M / 1.67B parameters.
REAL_SHAPED_DRAFT = DraftConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                intermediate_size=4864, max_position_embeddings=4096)
REAL_SHAPED_EXTRA = TargetExtra(extra_layers=23, extra_heads=14, extra_kv_heads=2, extra_intermediate=4864)
PRESETS = {"tiny": (TINY_DRAFT, TINY_EXTRA), "real-shaped": (REAL_SHAPED_DRAFT, REAL_SHAPED_EXTRA)}

SCALED = ("self_attn.o_proj", "mlp.down_proj")  # the projections whose extra columns ε scales


# -- configs and shapes ----------------------------------------------------------------------------------

def _llama_config(draft: DraftConfig, *, layers: int, heads: int, kv_heads: int, intermediate: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=draft.vocab_size, hidden_size=draft.hidden_size, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                       head_dim=draft.dim_per_head, max_position_embeddings=draft.max_position_embeddings,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       # rope_theta moved into rope_parameters in transformers 5: pass it only when it matters
                       **({} if draft.rope_theta == 10000.0 else {"rope_theta": draft.rope_theta}), **extra)


def draft_llama_config(draft: DraftConfig):
    return _llama_config(draft, layers=draft.num_layers, heads=draft.num_heads, kv_heads=draft.num_kv_heads,
                         intermediate=draft.intermediate_size)


def target_llama_config(draft: DraftConfig, extra: TargetExtra, epsilon: float = 0.0, seed: int = 0):
    """The target's LlamaConfig; ``synthetic_pair`` records how it was built (saved in config.json)."""
    check_configs(draft, extra)
    meta = {"draft": asdict(draft), "extra": asdict(extra), "epsilon": float(epsilon), "seed": int(seed),
            "layer_map": shared_layer_map(draft.num_layers, extra.extra_layers, extra.placement)}
    return _llama_config(draft, layers=draft.num_layers + extra.extra_layers,
                         heads=draft.num_heads + extra.extra_heads,
                         kv_heads=draft.num_kv_heads + extra.extra_kv_heads,
                         intermediate=draft.intermediate_size + extra.extra_intermediate, synthetic_pair=meta)


def check_configs(draft: DraftConfig, extra: TargetExtra) -> None:
    if draft.num_heads % draft.num_kv_heads:
        raise ValueError(f"num_heads {draft.num_heads} is not a multiple of num_kv_heads {draft.num_kv_heads}")
    group = draft.num_heads // draft.num_kv_heads
    heads, kv = draft.num_heads + extra.extra_heads, draft.num_kv_heads + extra.extra_kv_heads
    # Query head i reads KV head i // group; the draft's heads keep their KV heads only if group is kept.
    if kv == 0 or heads != group * kv:
        raise ValueError(f"target heads {heads} / kv heads {kv} must keep the draft's GQA group size {group}")
    if min(extra.extra_layers, extra.extra_heads, extra.extra_kv_heads, extra.extra_intermediate) < 0:
        raise ValueError("extra sizes must be >= 0")
    if extra.placement not in ("interleave", "end"):
        raise ValueError(f"placement must be 'interleave' or 'end', got {extra.placement!r}")


def shared_layer_map(num_draft_layers: int, extra_layers: int, placement: str = "interleave") -> list[int | None]:
    """Target layer j → the draft layer it extends, or None for an extra layer.

    "interleave" spreads the extra layers evenly between draft layers (the first and last target layers are
    draft layers), so the perturbation passes through later draft layers; "end" appends them.
    """
    total = num_draft_layers + extra_layers
    if placement == "end" or num_draft_layers <= 1:
        return list(range(num_draft_layers)) + [None] * extra_layers
    layer_map: list[int | None] = [None] * total
    for i in range(num_draft_layers):
        layer_map[round(i * (total - 1) / (num_draft_layers - 1))] = i
    return layer_map


def param_count(draft: DraftConfig, extra: TargetExtra | None = None) -> int:
    """Parameters of the draft (``extra`` None) or of the target, without building anything."""
    extra = extra or TargetExtra(0, 0, 0, 0)
    d, hd = draft.hidden_size, draft.dim_per_head
    heads, kv = draft.num_heads + extra.extra_heads, draft.num_kv_heads + extra.extra_kv_heads
    inter = draft.intermediate_size + extra.extra_intermediate
    per_layer = d * hd * (2 * heads + 2 * kv) + 3 * d * inter + 2 * d
    return 2 * draft.vocab_size * d + d + (draft.num_layers + extra.extra_layers) * per_layer


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- construction ----------------------------------------------------------------------------------------

def _generator(device: torch.device, *key) -> torch.Generator:
    seed = zlib.crc32("/".join(str(k) for k in key).encode())
    return torch.Generator(device=device).manual_seed(seed)


def _std(name: str, fan_in: int, draft: DraftConfig) -> float:
    if "embed_tokens" in name:
        return 1.0
    if "lm_head" in name:
        return draft.logit_scale / math.sqrt(fan_in)
    return draft.init_gain / math.sqrt(fan_in)


def _empty_model(config, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=dtype).eval()


@torch.no_grad()
def build_draft(draft: DraftConfig = DraftConfig(), *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32):
    """The draft, built on ``device`` in ``dtype`` and initialised in place from ``seed``."""
    device = torch.device(device)
    model = _empty_model(draft_llama_config(draft), device, dtype)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, _std(name, p.shape[1], draft), generator=_generator(device, seed, "draft", name))
        else:
            p.fill_(1.0)  # RMSNorm weights
    return model


def _extra_slices(name: str, draft: DraftConfig, shape: torch.Size) -> tuple[slice, slice] | None:
    """(rows, cols) of a shared layer's weight that are *not* the draft's (None: all of it is the draft's)."""
    d_q = draft.num_heads * draft.dim_per_head
    d_kv = draft.num_kv_heads * draft.dim_per_head
    d_i = draft.intermediate_size
    every = slice(None)
    if name.endswith("q_proj.weight"):
        return slice(d_q, None), every
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return slice(d_kv, None), every
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return slice(d_i, None), every
    if name.endswith("o_proj.weight"):
        return every, slice(d_q, None)
    if name.endswith("down_proj.weight"):
        return every, slice(d_i, None)
    return None


def _fill_extra(name: str, p: torch.Tensor, region: tuple[slice, slice], draft: DraftConfig, seed: int,
                epsilon: float) -> None:
    """Regenerate the extra part ``p[region]`` from its seed (scaled by ε when it is an output projection)."""
    view = p[region]
    if view.numel() == 0:
        return
    std = _std(name, p.shape[1], draft)
    if any(s in name for s in SCALED):
        std *= epsilon
    if std == 0.0:
        view.zero_()
        return
    fresh = torch.empty(view.shape, dtype=p.dtype, device=p.device)
    fresh.normal_(0.0, std, generator=_generator(p.device, seed, "target", name))
    view.copy_(fresh)


@torch.no_grad()
def build_target(draft_model, draft: DraftConfig = DraftConfig(), extra: TargetExtra = TargetExtra(), *,
                 epsilon: float = 0.0, seed: int = 0):
    """The target extending ``draft_model`` (built by ``build_draft`` with the same ``draft`` config), on the
    draft's device and dtype. The draft is not modified."""
    device = next(draft_model.parameters()).device
    dtype = next(draft_model.parameters()).dtype
    config = target_llama_config(draft, extra, epsilon, seed)
    model = _empty_model(config, device, dtype)
    layer_map = config.synthetic_pair["layer_map"]
    d_params = dict(draft_model.named_parameters())
    for name, p in model.named_parameters():
        if not name.startswith("model.layers."):
            p.copy_(d_params[name])  # embeddings, final norm, LM head: shared
            continue
        j = int(name.split(".")[2])
        i = layer_map[j]
        if i is None:  # an extra layer: all of it is new
            if p.dim() == 2:
                _fill_extra(name, p, (slice(None), slice(None)), draft, seed, epsilon)
            else:
                p.fill_(1.0)
            continue
        d_name = name.replace(f"model.layers.{j}.", f"model.layers.{i}.", 1)
        src = d_params[d_name]
        p[tuple(slice(0, n) for n in src.shape)].copy_(src)
        region = _extra_slices(name, draft, p.shape)
        if region is not None:
            _fill_extra(name, p, region, draft, seed, epsilon)
    return model


@torch.no_grad()
def set_epsilon(target, epsilon: float) -> None:
    """Change ε in place: regenerate the scaled output-projection slices from their seeds."""
    meta = target.config.synthetic_pair
    draft = DraftConfig(**meta["draft"])
    seed = meta["seed"]
    for name, p in target.named_parameters():
        if not any(s in name for s in SCALED):
            continue
        j = int(name.split(".")[2])
        region = (slice(None), slice(None)) if meta["layer_map"][j] is None else _extra_slices(name, draft, p.shape)
        _fill_extra(name, p, region, draft, seed, epsilon)
    meta["epsilon"] = float(epsilon)


def build_pair(draft: DraftConfig = DraftConfig(), extra: TargetExtra = TargetExtra(), *, epsilon: float = 0.0,
               seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(target, draft) as Hugging Face ``LlamaForCausalLM`` models in eval mode."""
    d = build_draft(draft, seed=seed, device=device, dtype=dtype)
    return build_target(d, draft, extra, epsilon=epsilon, seed=seed), d


def cached_pair(preset: str, *, seed: int = 0, cache_dir: str | None = None):
    """(target, draft) of a preset at ε = 0, fp32 on the CPU, built once and kept under ``cache_dir`` (default
    ``~/.cache/specserve/pairs``; outside any checkout), then loaded from there."""
    import os

    from transformers import LlamaForCausalLM

    draft_cfg, extra = PRESETS[preset]
    folder = os.path.join(cache_dir or os.path.expanduser("~/.cache/specserve/pairs"), f"{preset}-seed{seed}")
    if not os.path.exists(os.path.join(folder, "draft", "config.json")):
        target, draft = build_pair(draft_cfg, extra, seed=seed)
        tmp = folder + ".partial"
        save_pair(target, draft, tmp)
        os.replace(tmp, folder)  # whole or absent: a killed build leaves no pair that looks finished
        return target, draft
    load = {"dtype": torch.float32}
    return (LlamaForCausalLM.from_pretrained(os.path.join(folder, "target"), **load).eval(),
            LlamaForCausalLM.from_pretrained(os.path.join(folder, "draft"), **load).eval())


def save_pair(target, draft, out_dir: str) -> dict:
    """Save both as HF folders ``out_dir/target`` and ``out_dir/draft`` (safetensors); returns their paths."""
    import os

    paths = {"target": os.path.join(out_dir, "target"), "draft": os.path.join(out_dir, "draft")}
    target.save_pretrained(paths["target"])
    draft.save_pretrained(paths["draft"])
    return paths


# -- agreement and calibration ---------------------------------------------------------------------------

def random_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int = 0,
                   device: str | torch.device = "cpu") -> torch.Tensor:  # [P, L] int64
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=gen).to(device)


@torch.inference_mode()
def greedy_continuation(model, prompts: torch.Tensor,  # [P, L] int64 on the model's device
                        new_tokens: int, assistant=None) -> torch.Tensor:  # [P, L + N]
    """HF greedy ``generate`` of equal-length prompts (no padding), exactly ``new_tokens`` more tokens; with
    ``assistant``, HF's assisted generation (its own drafting defaults): the synthetic-pair benchmarks' HF runs."""
    kw = {"assistant_model": assistant} if assistant is not None else {}
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)


@torch.inference_mode()
def greedy_agreement(target, draft, prompts: torch.Tensor, new_tokens: int = 32) -> float:
    """Share of positions where the draft's argmax equals the target's, along the target's greedy path.

    ``prompts`` [P, L] int64 on the models' device. The target generates ``new_tokens`` greedily; the draft
    is run over the same sequences and its argmax before each generated token is compared with it.
    """
    seqs = greedy_continuation(target, prompts, new_tokens)
    L = prompts.shape[1]
    draft_next = draft(seqs[:, :-1]).logits[:, L - 1:].argmax(-1)  # predictions of seqs[:, L:]
    return float((draft_next == seqs[:, L:]).float().mean())


@dataclass
class Calibration:
    epsilon: float
    agreement: float
    wanted: float
    trials: list[tuple[float, float]] = field(default_factory=list)  # (ε, α) in the order measured

    def as_dict(self) -> dict:
        return {"epsilon": self.epsilon, "agreement": round(self.agreement, 4), "wanted": self.wanted,
                "trials": [[round(e, 6), round(a, 4)] for e, a in self.trials]}


def calibrate_epsilon(draft_cfg: DraftConfig, target_extra_cfg: TargetExtra, wanted_agreement: float, *,
                      seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      models: tuple | None = None, num_prompts: int = 4, prompt_len: int = 16,
                      new_tokens: int = 32, prompt_seed: int = 12345, start: float = 0.25,
                      tolerance: float = 0.02, max_trials: int = 14) -> Calibration:
    """ε whose greedy agreement is closest to ``wanted_agreement`` (bisection on log ε).

    ``models`` = (target, draft) reuses a built pair (the target's ε is changed in place and left at the
    result); otherwise one is built. The agreement is measured on ``num_prompts`` random prompts of
    ``prompt_len`` tokens with ``new_tokens`` generated each, always the same prompts, so the search sees a
    deterministic function of ε. It falls (not strictly) as ε grows: first ε is doubled from ``start``
    until the agreement drops below the wanted one, then the bracket is bisected geometrically until a
    trial is within ``tolerance`` or ``max_trials`` are spent. The closest trial wins.
    """
    if not 0.0 < wanted_agreement <= 1.0:
        raise ValueError(f"wanted_agreement must be in (0, 1], got {wanted_agreement}")
    if models is None:
        target, draft = build_pair(draft_cfg, target_extra_cfg, seed=seed, device=device, dtype=dtype)
    else:
        target, draft = models
    dev = next(target.parameters()).device
    prompts = random_prompts(draft_cfg.vocab_size, num_prompts, prompt_len, prompt_seed, dev)
    trials: list[tuple[float, float]] = []

    def measure(eps: float) -> float:
        set_epsilon(target, eps)
        alpha = greedy_agreement(target, draft, prompts, new_tokens)
        trials.append((eps, alpha))
        return alpha

    if wanted_agreement >= 1.0:
        measure(0.0)
    else:
        lo, hi = 0.0, start  # agreement(lo) > wanted >= agreement(hi) once bracketed
        alpha = measure(hi)
        while alpha > wanted_agreement and len(trials) < max_trials and abs(alpha - wanted_agreement) > tolerance:
            lo, hi = hi, hi * 2
            alpha = measure(hi)
        while len(trials) < max_trials and abs(alpha - wanted_agreement) > tolerance:
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 4
            alpha = measure(mid)
            if alpha > wanted_agreement:
                lo = mid
            else:
                hi = mid
    eps, alpha = min(trials, key=lambda t: (abs(t[1] - wanted_agreement), t[0]))
    set_epsilon(target, eps)
    return Calibration(eps, alpha, wanted_agreement, trials)


# -- CLI -------------------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny CPU-scale shapes (the unit tests' pair)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, help=f"draft {f}")
    for f in ("extra_layers", "extra_heads", "extra_kv_heads", "extra_intermediate"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, help=f"target {f}")
    ap.add_argument("--placement", choices=("interleave", "end"))
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--epsilon", type=float, default=None, help="divergence knob ε (default 0)")
    group.add_argument("--agreement", type=float, default=None, help="calibrate ε to this greedy agreement")
    ap.add_argument("--out", default=None, help="save target/ and draft/ HF folders here")
    args = ap.parse_args(argv)

    base_d, base_e = (TINY_DRAFT, TINY_EXTRA) if args.tiny else (DraftConfig(), TargetExtra())
    d_kw = {f: getattr(args, f) for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                          "intermediate_size") if getattr(args, f) is not None}
    e_kw = {f: getattr(args, f) for f in ("extra_layers", "extra_heads", "extra_kv_heads", "extra_intermediate",
                                          "placement") if getattr(args, f) is not None}
    draft_cfg = DraftConfig(**{**asdict(base_d), **d_kw})
    extra_cfg = TargetExtra(**{**asdict(base_e), **e_kw})
    dtype = DTYPES[args.dtype]
    target, draft = build_pair(draft_cfg, extra_cfg, epsilon=args.epsilon or 0.0, seed=args.seed,
                               device=args.device, dtype=dtype)
    report = {"draft_params": param_count(draft_cfg), "target_params": param_count(draft_cfg, extra_cfg),
              "device": str(args.device), "dtype": args.dtype, "epsilon": args.epsilon or 0.0}
    if args.agreement is not None:
        cal = calibrate_epsilon(draft_cfg, extra_cfg, args.agreement, models=(target, draft))
        report["calibration"] = cal.as_dict()
        report["epsilon"] = cal.epsilon
    else:
        prompts = random_prompts(draft_cfg.vocab_size, 4, 16, 12345, target.device)
        report["agreement"] = round(greedy_agreement(target, draft, prompts), 4)
    if args.out:
        report["saved"] = save_pair(target, draft, args.out)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
