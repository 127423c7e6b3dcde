"""Speculation statistics, named as in the glossary of docs/design.md.

acceptance rate = accepted / proposed; acceptance length = emitted tokens per verify step (≥ 1);
α = accepted / (accepted + steps that ended in a rejection); per-position acceptance = P(position i
accepted | proposed).

Token trees (issue 15): ``proposed`` counts a tree's depth (the positions it proposes) and ``accepted`` the
accepted path's depth, so α and the per-position figures read the same for chains and trees; ``nodes``
counts the tokens verified (a chain's drafts, a tree's nodes): mean tree size = nodes / steps, accepted
depth per step = accepted / steps, acceptance length = emitted / steps (tokens per target pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0  # verify steps
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0  # steps that ended at a rejected draft token
    emitted: int = 0
    nodes: int = 0  # draft tokens verified: a chain's drafts, a tree's nodes
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # Structured outputs: tokens the grammar forced (proposed by the engine, not the draft; not in proposed /
    # accepted) and seconds spent filling grammar masks
    forced: int = 0
    mask_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens the verifier took from its prefix cache instead of computing them
    position_proposed: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int, emitted: int, nodes: int | None = None) -> None:
        """One row's verify step; ``nodes``: the tree's size (None: a chain, whose nodes are its drafts)."""
        self.steps += 1
        self.nodes += proposed if nodes is None else nodes
        self.proposed += proposed
        self.accepted += accepted
        self.rejections += int(accepted < proposed)
        self.emitted += emitted
        while len(self.position_proposed) < proposed:
            self.position_proposed.append(0)
            self.position_accepted.append(0)
        for i in range(proposed):
            self.position_proposed[i] += 1
            self.position_accepted[i] += int(i < accepted)

    def merge(self, other: "SpecStats") -> None:
        for name in ("steps", "proposed", "accepted", "rejections", "emitted", "nodes", "draft_seconds",
                     "verify_seconds", "forced", "mask_seconds", "cached_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.position_proposed), len(other.position_proposed))
        for lst in (self.position_proposed, self.position_accepted):
            lst.extend([0] * (n - len(lst)))
        for i in range(len(other.position_proposed)):
            self.position_proposed[i] += other.position_proposed[i]
            self.position_accepted[i] += other.position_accepted[i]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        denom = self.accepted + self.rejections
        return self.accepted / denom if denom else 0.0

    @property
    def mean_gamma(self) -> float:
        return self.proposed / self.steps if self.steps else 0.0

    @property
    def mean_nodes(self) -> float:
        """Mean tree size: draft tokens verified per step (a chain's: its γ)."""
        return self.nodes / self.steps if self.steps else 0.0

    @property
    def accepted_depth(self) -> float:
        """Mean accepted path depth per step (accepted draft tokens)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def forced_share(self) -> float:
        """Share of the emitted tokens the grammar forced."""
        return self.forced / self.emitted if self.emitted else 0.0

    def per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)]

    def as_dict(self) -> dict:
        return {"steps": self.steps, "proposed": self.proposed, "accepted": self.accepted,
                "emitted": self.emitted, "acceptance_rate": round(self.acceptance_rate, 4),
                "acceptance_length": round(self.acceptance_length, 4), "alpha": round(self.alpha, 4),
                "mean_gamma": round(self.mean_gamma, 3), "nodes": self.nodes,
                "mean_nodes": round(self.mean_nodes, 3), "accepted_depth": round(self.accepted_depth, 4),
                "per_position_acceptance":
                    [round(x, 4) for x in self.per_position()],
                "draft_seconds": round(self.draft_seconds, 6), "verify_seconds": round(self.verify_seconds, 6),
                "forced": self.forced, "forced_share": round(self.forced_share, 4),
                "mask_seconds": round(self.mask_seconds, 6), "cached_tokens": self.cached_tokens}
