"""Draft length per sequence: fixed, or adaptive from the Leviathan et al. speed-up model.

With per-position acceptance α and cost ratio c (draft step / target step), a chain of γ drafts yields
on average (1 − α^(γ+1)) / (1 − α) tokens per step at a cost of (γc + 1) target steps, so the expected
speed-up over plain decoding is

    S(γ) = (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

The adaptive policy keeps a smoothed α per sequence (accepted / (accepted + rejections), with a prior so
a fresh sequence starts at a moderate γ) and picks the γ in [γ_min, γ_max] that maximises S. High α
favours *long* chains and low α short ones — the opposite of the seeds' advice (2–3 tokens for
high-acceptance text, 4–5 for low); the benchmark reports what this policy actually picks. When even the
best γ would not beat plain decoding (S < 1, e.g. α tiny or c large), γ = 0 turns speculation off for
the sequence; every ``probe_every`` steps it drafts one token to notice when speculation pays again.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    if gamma == 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 0.999999)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    alpha = min(max(alpha, 0.0), 0.999999)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class GammaState:
    accepted: float = 0.0
    rejections: float = 0.0
    prior: float = 1.0  # share of the prior's weight left; fades with the evidence (see ``observe``)
    steps_off: int = 0

    def alpha(self, prior_alpha: float, prior_weight: float) -> float:
        weight = prior_weight * self.prior
        return (self.accepted + prior_alpha * weight) / (self.accepted + self.rejections + weight)


@dataclass
class GammaPolicy:
    gamma: int = 4
    gamma_min: int = 1
    gamma_max: int = 8
    adaptive: bool = False
    allow_off: bool = True  # adaptive only: γ = 0 when speculation cannot pay
    prior_alpha: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.9  # exponential forgetting so α follows the text (JSON keys vs values, say)
    probe_every: int = 16
    cost_ratio: float = 0.1  # c; the engine refreshes it from measured stage times

    def __post_init__(self):
        if not 0 <= self.gamma_min <= self.gamma <= self.gamma_max:
            raise ValueError(f"need gamma_min <= gamma <= gamma_max, got {self.gamma_min}, {self.gamma}, "
                             f"{self.gamma_max}")

    def choose(self, state: GammaState) -> int:
        if not self.adaptive:
            return self.gamma
        alpha = state.alpha(self.prior_alpha, self.prior_weight)
        best = max(range(self.gamma_min, self.gamma_max + 1),
                   key=lambda g: expected_speedup(alpha, g, self.cost_ratio))
        if self.allow_off and expected_speedup(alpha, best, self.cost_ratio) < 1.0:
            state.steps_off += 1
            return 1 if state.steps_off % self.probe_every == 0 else 0
        state.steps_off = 0
        return best

    def observe(self, state: GammaState, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        state.accepted = state.accepted * self.decay + accepted
        state.rejections = state.rejections * self.decay + (1 if accepted < proposed else 0)
        # The prior decays like old evidence. Kept at full weight, it would outweigh the at most
        # 1 / (1 − decay) rejections the decayed counts can hold: with the defaults α could never fall
        # below ~0.17, so a draft that never agrees would keep γ ≥ 1 whenever c < 0.17.
        state.prior *= self.decay
