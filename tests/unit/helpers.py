"""Helpers shared by the engine tests: ragged prompts, the greedy reference, engine factory, χ².

Every model is built from config with a fixed seed (docs/design.md#fidelity-and-test-models): no hub, no
downloads. Drafts are the target itself (always agrees), an independently initialised model
(``tiny_llama(7)``: agrees only by coincidence) and a noisy copy of the target (acceptance in between;
see ``NOISE``).
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from draftpool.draft_model import DraftModelProposer
from draftpool.ngram import NgramProposer
from engine.assembly import EngineSettings, make_verify_stage
from engine.assembly import make_engine as assemble
from engine.engine import Engine, LocalStages
from runtime.runner import ModelRunner
from runtime.token_tree import depths
from verifier.verify import AcceptanceConfig

VOCAB = 96  # tiny_llama's default; ids 0, 1, 2 are bos, eos, pad in its config
MAX_NEW = 24  # generated tokens per reference sequence
MAX_LEN = 128  # engine / runner context (prompts ≤ 40 + MAX_NEW fit)
NUM_PROMPTS = 16
NOISE = 0.03  # noisy_copy noise: α ≈ 0.7, acceptance rate ≈ 0.3–0.7 for γ = 1..8
P_MIN = 1e-3  # χ² p-value below which a distribution test fails


def make_prompts(seed: int, n: int = NUM_PROMPTS, vocab: int = VOCAB, lo: int = 1, hi: int = 40
                 ) -> list[tuple[int, ...]]:
    """``n`` prompts with lengths spread over [lo, hi] (both ends included), tokens avoiding bos/eos/pad."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [lo, hi] + torch.randint(lo, hi + 1, (n - 2,), generator=gen).tolist()
    return [tuple(torch.randint(3, vocab, (int(k),), generator=gen).tolist()) for k in lengths]


def hf_greedy(model, prompt, max_new: int, eos: int | None = None) -> tuple[int, ...]:
    """The greedy reference (docs/design.md#fidelity-and-test-models): HF generate, one prompt, no padding, fp32."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=2)
    generated = tuple(out[0, len(prompt):].tolist())
    if eos is None:  # eos_token_id=None must really mean "no EOS", not the config's default
        assert len(generated) == max_new
    return generated


def make_engine(target, draft="same", *, gamma: int = 4, adaptive: bool = False, max_slots: int = NUM_PROMPTS,
                max_len: int = MAX_LEN, acceptance: AcceptanceConfig | None = None, micro_batches: int = 1,
                speculate: bool = True, draft_num: int = 1, forced_tokens: bool = True, tree_nodes: int = 0,
                kv: dict | None = None, **engine_kw) -> Engine:
    """An in-process engine through ``engine.assembly.make_engine`` around models already built. ``draft``: a
    model, "same" (the target), "ngram", None (no proposer), or a ready proposer object; ``speculate=False``
    keeps the proposer but decodes target-only; ``kv``: ``EngineSettings``' kv_* / prefix_cache fields."""
    kv_settings = {"kv_" + k if k in ("block_size", "blocks") else k: v for k, v in (kv or {}).items()}
    runner_kv = EngineSettings(target=None, **kv_settings).kv_options()
    if isinstance(draft, str) and draft == "same":
        draft = target
    if isinstance(draft, str) and draft == "ngram":
        proposer = NgramProposer()
    elif draft is None or hasattr(draft, "propose"):
        proposer = draft
    else:
        proposer = DraftModelProposer(draft, max_slots=max_slots, max_len=max_len, **runner_kv)
    settings = EngineSettings(target=None, draft=proposer if speculate else None, max_len=max_len,
                              max_slots=max_slots, micro_batches=micro_batches, gamma=gamma,
                              gamma_max=max(gamma, 8), adaptive=adaptive, acceptance=acceptance or AcceptanceConfig(),
                              draft_num=draft_num, forced_tokens=forced_tokens, tree_nodes=tree_nodes, **kv_settings)
    return assemble(settings, stages=LocalStages(make_verify_stage(settings, target), proposer), **engine_kw)


def target_runner(engine: Engine) -> ModelRunner:
    return engine.stages.verifier.runner


def draft_runner(engine: Engine) -> ModelRunner | None:
    return getattr(engine.stages.proposer, "runner", None)


def run_to_end(engine: Engine) -> list:
    """Step until no work is left; returns every StepEvent."""
    events = []
    while engine.has_work:
        events.extend(engine.step())
    return events


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """χ² goodness of fit of integer ``samples`` [N] to the distribution ``probs`` [V].

    A sample outside the support (probs == 0) is a hard failure, not a small p-value. Cells expected
    fewer than 5 times are pooled into one so that the χ² approximation holds.
    """
    samples = samples.reshape(-1).long()
    n = samples.numel()
    assert n > 0, "no samples"
    probs = probs.double().reshape(-1)
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    outside = int(counts[probs <= 0].sum())
    assert outside == 0, f"{outside} samples fell outside the support of the expected distribution"
    expected = probs / probs.sum() * n
    big = expected >= 5
    obs, exp = counts[big].tolist(), expected[big].tolist()
    if float(expected[~big].sum()) > 0:
        obs.append(float(counts[~big].sum()))
        exp.append(float(expected[~big].sum()))
    if len(obs) < 2:
        return 1.0  # a point mass: nothing to test beyond the support check above
    return float(chisquare(obs, exp).pvalue)


class RecordingProposer:
    """A real proposer, keeping each row's tree (a chain too) and each drafting row's branch, so a test can
    see what was verified."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.runner = getattr(proposer, "runner", None)
        self.trees: list[list[int]] = []
        self.branches: list[int] = []

    def propose(self, items):
        self.branches.extend(it.branch for it in items if it.gamma)
        batch = self.proposer.propose(items)
        self.trees.extend(batch.row_parents(b) for b in range(len(batch.seq_ids)))
        return batch

    def release(self, seq_ids):
        self.proposer.release(seq_ids)


def wide(parents: list[int]) -> bool:
    """Some node of the tree has two or more children (the root counts as a node)."""
    return len(parents) > max(depths(parents), default=-1) + 1
