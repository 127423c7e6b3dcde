"""Draft length γ: fixed, or adaptive from measured step costs and the Leviathan et al. speed-up model.

With per-position acceptance α, a chain of γ drafts yields on average (1 − α^(γ+1)) / (1 − α) tokens per
step. Leviathan et al. price a step at (γc + 1) target steps, with c = draft step / target step, giving

    S(γ) = (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

That price assumes a verify of γ + 1 tokens per row costs what a plain step of one token costs, and
that nothing but the two forwards costs time. Neither holds once the target is compute-bound (a CPU, or
a GPU at a large batch), nor where the step's own bookkeeping is a sizeable share (small models, large
batches). The adaptive policy prices a step with what the engine measured instead, per batch-size bucket
(``CostModel``):

    S(γ) = tokens(α, γ) · T(1) / T(γ + 1),

where T(w) is the wall time of a decode step whose verify holds w tokens per row (w = γ + 1; T(1) is a
plain step), drafting and bookkeeping included. T is a low quantile over a short window of measured
steps per width, so one noisy step (a GC pause, another process on the core) cannot move it, and a
lasting change moves it after a few steps; widths not measured lie on a robust line through those that
are, and a chain width measured while the machine ran slower or faster is read at its current speed
(``WidthCosts``).
Before a bucket has measured a plain and a speculative step, the policy falls back to Leviathan's
formula with the prior ``cost_ratio``.

Per sequence the policy keeps a smoothed α (accepted / (accepted + rejections) over its last ~10 steps),
shrunk toward a prior: the recent α of every row together (``prior_alpha`` before any was seen), worth
``prior_weight`` observations. A fresh sequence starts there, and the prior keeps its weight: a row's own
evidence is a handful of steps, and a short stretch of rejections in them is mostly noise around what the
draft accepts over the text. Unshrunk, such a stretch turned speculation off where it paid (docs/results.md,
"A row's α shrunk toward the workload's").

One γ serves a whole micro-batch: its draft loop runs as many positions as its longest chain for every
row (and so does its verify where that is one captured rectangle), so every row pays for the widest, and
what one row gains the batch pays for. The policy picks the
γ in [γ_min, γ_max] that maximises the batch's S (the rows' expected tokens over the step's cost; at
batch 1 simply the sequence's S). High α favours long chains and low α short ones; the benchmark
reports what the policy actually picks. When even the best γ would not beat plain decoding (S < 1),
γ = 0 turns speculation off for the batch, and probes (every row drafts one token, in the same step)
check whether it pays again: after 2, 4, 8, … plain steps of the bucket (at most ``probe_every``). A
probe that measured a clearly cheaper step than the model believed is repeated at once, so a cost that
really came down is taken up within a few steps. A probe also pays for the draft to catch up on every
token its rows decoded plainly since they last drafted; where that makes a probe cost several plain steps
(a large draft at a large batch), the next probe waits until the probe's extra seconds are ``probe_share``
of the plain steps between the two (at most ``probe_max`` steps). The catch-up prices the probe, not its
width: a step whose draft first caught up on more than a step's tokens is no sample of the width's cost,
and a probe goes on until its width is measured (``min_samples`` fresh samples, which a width aged out in
the plain spell needs all of; at most ``min_samples`` + 1 steps). While off, a width not measured (or aged
out during the plain spell) is not tried on the model's word: only a probe's measurement turns speculation
back on. Entries are priced on their own: the draft's seconds per caught-up token (``observe_catch_up``,
prefills included). Where a step's rows would first have to be caught up (new rows, a plain spell), the
batch speculates only if the expected saving over the rows' remaining tokens exceeds that price times the
tokens they are behind (``decide``'s ``behind`` and ``remaining``), and a probe that is due waits until the
plain steps since the last one cover that price at ``probe_share``. Rows kept plain by their entry count as
off: what the bucket measured may age out meanwhile, and only a probe turns speculation on again.

The model's α is an estimate; what a step of width w really yields is measured too (tokens a row emitted per
step, Y(w), over the width's last ``yield_window`` steps: the policy turns a width off after a few steps
that yielded little, so a short window would keep exactly those, and judge the width by its worst
stretch). Where the γ the model picks was measured (fresh samples of its width) at fewer tokens per second
than a plain step, Y(w) / T(w) < (1 − ``margin``) / T(1), the policy takes the fastest measured chain
that does pay instead, and decodes plainly (probing as above) where none does: a draft whose acceptance
the model overrates, or a verify whose width costs more than the line through the measured widths says,
switches speculation off within a few steps and keeps it off while it loses. Stale measurements age out
(``max_age``), so a width that lost in one spell is tried again in another.

To know T(1) at a bucket where it speculates, the policy runs the bucket's steps plainly a few times
(``min_samples`` steps, then one every ``refresh_every`` steps), and ``min_samples`` after a probe that
reads as paying, so that it is weighed against plain steps of its own time before speculation comes on, not
against those of a slow spell that ended as it began.
Fixed γ (``adaptive=False``) ignores all of this.

``decide`` is the one decision: γ, the node budget of the step's token tree, and the room of a row's chain
where a grammar forces a run of tokens in front of its drafts (``Shape``). The engine asks it per
micro-batch and hands the shape to the proposer with the rows (``ProposeItem.nodes``). A forced run costs no
draft forward but lengthens the verify (by its own tokens where the verify runs packed, for every row where
it is one captured rectangle: ``runtime.forward``); the room is the width that maximises the step's expected
tokens over its measured cost (``_chain_room``), so a few constrained rows among many unconstrained ones on
a compute-bound device do not lengthen the step every other row pays for.

Token trees (issue 15; ``tree_nodes`` > 0). The
shape of a step is the chain of the chosen γ or a tree of n nodes grown to depth γ, for n on a ladder
(powers of two above ``gamma_max`` up to ``tree_nodes``, so a tree's verify width never equals a chain's).
Per bucket and per verify width w the policy measures, besides T(w), the tokens a row emits per step
Y(w), and it prices a shape by Y(w) / T(w): tokens per second. From the chain up, the ladder is climbed
while each size beats the one below; the first size not measured yet is tried (``min_samples`` steps),
and the climb stops at the first size that does not pay. Measurements older than ``max_age`` steps of
the bucket are forgotten, so the chain and the sizes above the chosen one are re-measured from time to
time. A tree is priced against the best chain width measured. The smallest size is tried only if γ + 1
tokens per row (every path accepted) at its cost read off the chain's line (which needs two measured
widths for a slope) would beat that, and a larger one only after the size below it paid: where a wider
verify costs about in proportion to its width (a large batch, a compute-bound target on a CPU) trees
are seldom tried and the step stays a chain. A tree step's seconds and accepted depth are kept out of
the chain's cost line and of α, so trying a tree never moves the γ the chain steps use. Sampled batches
stay chains under the adaptive policy: their drafts are verified against the true q, and a seeded
request's sample must not depend on timing. Fixed γ drafts the ``tree_nodes`` tree every step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from runtime.runner import batch_bucket


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    if gamma == 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 0.999999)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    alpha = min(max(alpha, 0.0), 0.999999)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def lower_quartile(xs: Sequence[float]) -> float:
    """The cost estimate of a set of step times: other work on the machine only ever adds time."""
    return sorted(xs)[len(xs) // 4]


class WidthCosts:
    """Measured seconds of a step at one batch bucket, by width (tokens per row).

    Per width, the lower quartile of the last ``window`` samples, trusted from ``min_samples`` on. Other
    work on the machine only ever adds time to a step, so a low quantile estimates what the step costs the
    engine itself: of 5 samples, up to 3 slow ones (a GC pause, a burst of another process) leave it
    alone, while a lasting change moves it after 4 steps (up) or 2 (down). A width not run for
    ``max_age`` samples is forgotten, so a cost measured in another spell does not linger at widths the
    policy has stopped using; width 1, the plain step every S is measured against, is kept (the policy
    re-measures it on a schedule, not by use). Widths not measured, or speculative ones whose estimate is
    more than 2× off the others', are read off a Theil–Sen line through the estimates (median of pairwise
    slopes, never negative; robust to a minority of bad widths); with one measured width the cost is flat in
    the width (Leviathan's assumption, until a second width is measured).

    A bucket holds steps of several batch sizes (bucket 16: 9 to 16 rows), and widths are measured at
    different times: the plain step on a schedule, a chain while the policy uses it. Compared as measured, a
    plain step taken at 10 rows makes every chain taken at 16 look dearer than it is. So every sample is
    scaled to the bucket's ``rows`` by T ∝ rows^β, with β the median of the slopes log(T₂/T₁) / log(r₂/r₁)
    between recent steps of one width at batch sizes at least 25 % apart (``exponent``): the width's own
    where it has such steps (a wider verify grows faster with the rows), else every width's, else 0; at
    most 1. A β is kept until recent steps give a new one: the samples it scales outlive the recent steps it
    came from (a chain measured at 9–10 rows while the rows of a group finished, then only plain steps at 16
    rows), and read unscaled they made that chain look cheap enough to turn speculation on at a loss.

    The machine's speed drifts too: on a shared host the same step can take 12 ms one second and 20 ms the
    next. Compared as measured, a chain width last run in a slow spell looks dearer than the width in use, and
    the policy keeps away from it until it ages out. So the speculative widths are kept at one ``pace``: each
    width has a base, the lower quartile of its first ``window`` steps at the bucket's batch size (a scaling's
    error is no pace) as kept, fixed until the width ages out; a step's seconds over its width's base is the pace
    it ran at, the pace is the lower quartile of the last ``window`` of those (the level's own statistic: with
    one width in use, a lasting change moves it after 4 steps as before), and a speculative sample is kept
    divided by it, so a width measured in another spell is read at this one's speed. The base is fixed because a
    pace measured against the width's running level (itself kept at the pace) has nothing to hold it: noise
    alone walks it away from the machine's speed, and a width not in use is read at that walk (docs/results.md,
    "A pace anchored to each width's first steps"). The plain step stays as measured: it is the yardstick, and
    a change in what speculating costs against it (a slower draft) must show, not pass for the machine's pace.
    In a plain spell (the latest step plain) no chain step says what pace the machine runs at, and the plain
    step would then move alone: a slower spell would make every chain look cheaper than it is, and turn
    speculation on at a loss. So there the speculative widths follow the plain step's level from where it
    stood once the spell had ``min_samples`` steps of its own: its level at the last chain step may hold only
    steps taken before the chains (plain steps are few while the bucket speculates), in a slow spell that
    ended as the chains began, and weighed from there a probe's chain read as paying where it lost.
    """

    def __init__(self, window: int, min_samples: int, max_age: int, rows: int = 1):
        self.window = window
        self.min_samples = min_samples
        self.max_age = max_age
        self.rows = rows  # the batch size every sample is scaled to
        self.count = 0  # samples added, all widths: the clock of ``max_age``
        self.samples: dict[int, deque[tuple[int, float, int]]] = {}  # width → (count, seconds, rows)
        self.recent: deque[tuple[int, int, float]] = deque(maxlen=8 * window)  # (width, rows, seconds)
        self._fit: tuple[dict[int, float], float, float] | None = None  # (levels, slope, intercept) until add
        self._exponents: dict[int, float] = {}  # width → β, the latest the recent steps gave
        self._shared_exponent = 0.0  # every width's β, for widths with none of their own
        self._exponents_current = False  # the recent steps' slopes are folded into the β above, until add
        self.pace = 1.0  # a step's seconds now over the seconds it is kept at (> 1: a slower spell; see the docstring)
        # the pace each recent step of a width with a base ran at; until steps say otherwise, the kept one
        self._paces: deque[float] = deque([1.0] * window, maxlen=window)
        self._bases: dict[int, float] = {}  # width → its base (see the docstring), once it has ``window`` steps
        self._first: dict[int, list[float]] = {}  # width → its steps so far toward a base, as kept
        self._plain_spell = False  # the latest step was plain
        self._spell_steps = 0  # plain steps in the current plain spell
        # the plain step's samples once the current plain spell had ``min_samples`` steps (see the docstring):
        # kept as samples so that its level there is read at the current scaling to the bucket's batch size
        self._plain_then: list[tuple[int, float, int]] | None = None

    def add(self, width: int, seconds: float, rows: int | None = None) -> None:
        rows = rows or self.rows
        if self._plain_spell != (width == 1):
            self._plain_spell, self._fit = width == 1, None
            self._spell_steps, self._plain_then = 0, None
        if width > 1:
            latest = self.samples.get(width)
            if latest and not self._fresh(latest[-1][0]):  # forgotten: measured anew from here
                self._bases.pop(width, None)
                self._first.pop(width, None)
            base = self._bases.get(width)
            if base and rows == self.rows:
                self._paces.append(seconds / base)
                self.pace = lower_quartile(self._paces)
            seconds /= self.pace
            if base is None and rows == self.rows:
                first = self._first.setdefault(width, [])
                first.append(seconds)
                if len(first) == self.window:
                    self._bases[width] = lower_quartile(self._first.pop(width))
        self.count += 1
        self.samples.setdefault(width, deque(maxlen=self.window)).append((self.count, seconds, rows))
        self.recent.append((width, rows, seconds))
        self._fit, self._exponents_current = None, False
        if width == 1:
            self._spell_steps += 1
            if self._spell_steps == self.min_samples:
                self._plain_then = list(self.samples[1])

    def _fresh(self, added: int) -> bool:
        """Whether the sample added at ``count`` = ``added`` is younger than ``max_age`` samples."""
        return self.count - added < self.max_age

    def exponent(self, width: int) -> float:
        """β of T ∝ rows^β for steps of this width, from the recent steps (see the class docstring)."""
        if not self._exponents_current:
            cells: dict[tuple[int, int], list[float]] = {}
            for w, rows, seconds in self.recent:
                cells.setdefault((w, rows), []).append(seconds)
            quartiles = sorted((w, r, lower_quartile(xs)) for (w, r), xs in cells.items())
            slopes: dict[int, list[float]] = {}
            for i, (w1, r1, t1) in enumerate(quartiles):
                for w2, r2, t2 in quartiles[i + 1:]:
                    if w1 == w2 and r2 >= 1.25 * r1 and t1 > 0 < t2:
                        slopes.setdefault(w1, []).append(math.log(t2 / t1) / math.log(r2 / r1))
            every = [x for xs in slopes.values() for x in xs]
            self._exponents.update({w: min(max(statistics.median(xs), 0.0), 1.0) for w, xs in slopes.items()})
            if every:
                self._shared_exponent = min(max(statistics.median(every), 0.0), 1.0)
            self._exponents_current = True
        return self._exponents.get(width, self._shared_exponent)

    def scaled(self, width: int, seconds: float, rows: int) -> float:
        """The seconds of a step of this width and ``rows`` rows, scaled to the bucket's batch size."""
        return seconds * (self.rows / rows) ** self.exponent(width) if rows != self.rows else seconds

    def level(self, width: int) -> float | None:
        """The lower quartile of the width's fresh samples, scaled, at the current pace (None below
        ``min_samples``)."""
        return self.fit()[0].get(width)

    def levels(self) -> dict[int, float]:
        return self.fit()[0]

    def fit(self) -> tuple[dict[int, float], float, float]:
        """The trusted levels by width at the current pace, and the Theil–Sen line through them (slope,
        intercept)."""
        if self._fit is None:
            known = {}
            for w, samples in sorted(self.samples.items()):
                fresh = [sample for sample in samples if w == 1 or self._fresh(sample[0])]
                if len(fresh) >= self.min_samples:
                    known[w] = self._quartile(w, fresh) * (self.pace * self._drift(known) if w > 1 else 1.0)
            ws = list(known)
            slopes = [(known[b] - known[a]) / (b - a) for i, a in enumerate(ws) for b in ws[i + 1:]]
            slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
            intercept = statistics.median(known[w] - slope * w for w in ws) if ws else 0.0
            self._fit = known, slope, intercept
        return self._fit

    def _drift(self, known: dict[int, float]) -> float:
        """In a plain spell, the plain step's level over where it stood at the spell's ``min_samples``-th step
        (else 1)."""
        if not (self._plain_spell and self._plain_then and 1 in known):
            return 1.0
        return known[1] / self._quartile(1, self._plain_then)

    def _quartile(self, width: int, samples: Sequence[tuple[int, float, int]]) -> float:
        """The lower quartile of samples (count, seconds, rows) of this width, scaled to the bucket's batch size."""
        return lower_quartile([self.scaled(width, x, r) for _, x, r in samples])

    def predict(self, width: int) -> float | None:
        known, slope, intercept = self.fit()
        if len(known) <= 1:
            return next(iter(known.values()), None)
        # Never below the cheapest measured step, nor below it scaled down in proportion to the width.
        line = max(intercept + slope * width, min(known.values()) * min(1.0, width / next(iter(known))))
        # A width's own level where it agrees with the others; one more than 2× off the line was measured
        # in a bad spell (and is rarely re-measured once the policy avoids that width): the line instead.
        # The plain step is the yardstick, measured on a schedule rather than by use: always its own level
        # (a draft can add a fixed cost to every speculative width, leaving width 1 far below their line).
        measured = known.get(width)
        if measured is not None and (width == 1 or line / 2 <= measured <= 2 * line):
            return measured
        return line


@dataclass
class BucketCosts:
    """What the engine measured at one batch-size bucket, and the bucket's probe schedule."""

    seconds: WidthCosts  # step wall time by verify width γ + 1 (1 = a plain step)
    # step wall time of token-tree steps by verify width (nodes + 1, all above γ_max + 1): kept apart so
    # that trying a tree never moves the line the chain's γ is chosen from
    trees: WidthCosts | None = None
    steps: int = 0  # decode steps observed
    since_plain: int = 0  # decode steps since the last plain one
    plain_run: int = 0  # consecutive plain steps (0: the last step speculated)
    next_probe: int = 2  # plain_run (≥ 1) at which the bucket's batch probes
    probing: bool = False  # a probe is under way: decided while off, not done measuring
    probe_steps: int = 0  # its drafted steps so far
    probe_extra: float = 0.0  # its seconds beyond a plain step's, so far
    measure_plain: int = 0  # steps to run plainly before the next decision, to measure T(1) (see observe_step)
    off: bool = False  # the last decision was plain (no chain pays, or its entry would not): plain steps, probes
    yields: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # width → (step, tokens per row)
    # an entry's draft seconds per token the draft caught up on (``GammaPolicy.observe_catch_up``), at the pace
    # the step costs are kept at
    catch_up: deque = field(default_factory=lambda: deque(maxlen=5))

    def catch_up_seconds(self) -> float | None:
        """The draft's seconds per caught-up token: the median of the last entries, at the current pace (None:
        none measured)."""
        return statistics.median(self.catch_up) * self.seconds.pace if self.catch_up else None

    def tokens_per_row(self, width: int, min_samples: int, max_age: int) -> float | None:
        """Mean tokens a row emitted per step at this verify width, over its fresh samples."""
        fresh = [y for n, y in self.yields.get(width, ()) if self.steps - n < max_age]
        return sum(fresh) / len(fresh) if len(fresh) >= min_samples else None

    @property
    def probe_due(self) -> bool:
        return self.plain_run >= self.next_probe

    def step_seconds(self, gamma: int) -> float | None:
        """Predicted seconds of one step with γ drafts (γ = 0: a plain step)."""
        return self.seconds.predict(gamma + 1)


@dataclass
class CostModel:
    """Measured step costs per batch-size bucket (``batch_bucket``: 1, 2, 4, 8, …)."""

    window: int = 5  # samples per width (see WidthCosts)
    yield_window: int = 16  # tokens per row of a width's last steps (see the module docstring)
    min_samples: int = 3
    max_age: int = 64  # samples after which a speculative width's old ones are dropped
    buckets: dict[int, BucketCosts] = field(default_factory=dict)
    # relative_cost per (bucket, γ) until the next sample: every step asks for every γ
    _memo: dict[tuple[int, int], float | None] = field(default_factory=dict, repr=False)

    def bucket(self, rows: int) -> BucketCosts:
        key = batch_bucket(rows)
        if key not in self.buckets:
            self.buckets[key] = BucketCosts(WidthCosts(self.window, self.min_samples, self.max_age, key))
        return self.buckets[key]

    def record(self, rows: int, drafted: int, seconds: float, tree: bool = False) -> None:
        """One decode step's wall time; ``drafted`` = 0 for a plain step, a tree's nodes for a tree step."""
        bucket = self.bucket(rows)
        if not tree:
            bucket.seconds.add(drafted + 1, seconds, rows)
            self._memo.clear()
            return
        if bucket.trees is None:
            bucket.trees = WidthCosts(self.window, self.min_samples, self.max_age, bucket.seconds.rows)
        bucket.trees.add(drafted + 1, seconds, rows)

    def relative_cost(self, rows: int, gamma: int) -> float | None:
        """Seconds of a step with γ drafts over a plain step's, at the nearest bucket that measured both."""
        key = (batch_bucket(rows), gamma)
        if key not in self._memo:
            self._memo[key] = self._relative_cost(*key)
        return self._memo[key]

    def _relative_cost(self, key: int, gamma: int) -> float | None:
        for b in sorted(self.buckets, key=lambda b: (abs(b.bit_length() - key.bit_length()), b)):
            widths = self.buckets[b].seconds.levels()
            if 1 in widths and len(widths) > 1:  # a plain and a speculative step measured
                return self.buckets[b].step_seconds(gamma) / self.buckets[b].step_seconds(0)
        return None


@dataclass(frozen=True)
class Shape:
    """What ``GammaPolicy.decide`` chose for a micro-batch's next step."""

    gamma: int  # draft tokens per row (0: a plain step)
    nodes: int = 0  # the node budget of the draft's token tree (0: a chain of γ)
    # the most tokens a row may propose, its grammar's forced run and its drafts together (a forced run beyond
    # γ widens every row's verify; see ``GammaPolicy._chain_room``)
    room: int = 0


@dataclass
class GammaState:
    accepted: float = 0.0
    rejections: float = 0.0

    def alpha(self, prior_alpha: float, prior_weight: float) -> float:
        return (self.accepted + prior_alpha * prior_weight) / (self.accepted + self.rejections + prior_weight)


@dataclass
class GammaPolicy:
    gamma: int = 4
    gamma_min: int = 1
    gamma_max: int = 8
    adaptive: bool = False
    allow_off: bool = True  # adaptive only: γ = 0 when speculation cannot pay
    prior_alpha: float = 0.6  # a fresh sequence's α until the policy has observed any
    prior_weight: float = 8.0  # observations' worth of the prior in a row's α (see the module docstring)
    decay: float = 0.9  # exponential forgetting so α follows the text (JSON keys vs values, say)
    # forgetting of the acceptance of every row together, per row step: a fresh sequence's prior α, so rows of a
    # workload whose draft agrees well do not each start at a guess that turns speculation off at a large batch
    recent_decay: float = 0.98
    probe_first: int = 2  # steps off before the first probe; the interval doubles up to probe_every
    probe_every: int = 16
    # A probe's draft first catches up on every token its rows decoded plainly, which after a plain spell can cost
    # several plain steps (a large draft, a large batch): probes are then spaced so they take about this share
    # of the bucket's time
    probe_share: float = 0.02
    probe_max: int = 512  # the most plain steps between two probes, however costly they are
    refresh_every: int = 64  # speculative steps of a bucket between two plain steps that re-measure T(1)
    promising: float = 0.5  # a probe step this much cheaper than predicted is repeated at once
    margin: float = 0.03  # a chain measured this much slower than a plain step (relative) does not pay
    cost_ratio: float = 0.1  # prior c, used until the cost model has measured a bucket
    tree_nodes: int = 0  # the largest token tree (0: chains only)
    costs: CostModel = field(default_factory=CostModel)
    _recent: GammaState = field(default_factory=GammaState, repr=False)  # every row's acceptance, recent
    _recent_prior: float = field(default=1.0, repr=False)  # share of ``prior_weight`` left in ``_recent``
    # tokens emitted per row (accepted + 1) by ``observe``, attributed to the step's width by ``observe_step``
    _emitted: deque = field(default_factory=lambda: deque(maxlen=4096), repr=False)

    def __post_init__(self):
        if not 0 <= self.gamma_min <= self.gamma <= self.gamma_max:
            raise ValueError(f"need gamma_min <= gamma <= gamma_max, got {self.gamma_min}, {self.gamma}, "
                             f"{self.gamma_max}")
        if not 1 <= self.probe_first <= self.probe_every:
            raise ValueError(f"need 1 <= probe_first <= probe_every, got {self.probe_first}, {self.probe_every}")
        if self.tree_nodes < 0 or (self.adaptive and 0 < self.tree_nodes <= self.gamma_max):
            raise ValueError(f"tree_nodes must be 0 (chains) or, with adaptive γ, above gamma_max "
                             f"({self.gamma_max}) so that trees and chains have distinct verify widths; "
                             f"got {self.tree_nodes}")

    def tree_sizes(self) -> list[int]:
        """The ladder of tree node budgets the adaptive policy climbs (see the module docstring)."""
        sizes, n = [], 1 << self.gamma_max.bit_length()
        while n < self.tree_nodes:
            sizes.append(n)
            n *= 2
        return sizes + [self.tree_nodes] if self.tree_nodes else []

    def decide(self, states: Sequence[GammaState], sampled: bool = False, behind: Sequence[int] = (),
               remaining: Sequence[int] = (), forced: Sequence[int] = ()) -> Shape:
        """The next step of a micro-batch whose sequences hold ``states`` (at least one): γ per row (0: a plain
        step), the node budget of its token tree (0: a chain) and the room of a row's chain. ``sampled``: a row
        of it samples; per row, ``behind``: committed tokens the draft has not taken in, ``remaining``: the
        most tokens it may still emit (empty: not known, and no entry cost is weighed), ``forced``: the length
        of the run its grammar forces next (empty: none)."""
        gamma = self._chain(states, behind, remaining)
        return Shape(gamma, self._tree(len(states), gamma, sampled), self._chain_room(states, gamma, forced))

    def _alphas(self, states: Sequence[GammaState]) -> list[float]:
        """Each row's smoothed α, a fresh row's at the recent α of every row together."""
        prior = self._recent.alpha(self.prior_alpha, self.prior_weight * self._recent_prior)
        return [st.alpha(prior, self.prior_weight) for st in states]

    def _chain_room(self, states: Sequence[GammaState], gamma: int, forced: Sequence[int]) -> int:
        """The most tokens a row's chain may hold, a forced run in front of its γ drafts included. A forced run
        is nearly free to propose but not to verify. So the room is the k in [γ, γ_max] that maximises the
        step's expected tokens over its measured cost T(k + 1): a row with a run of f takes min(f, k) forced
        tokens, and drafts after a whole run up to k. On a device whose wider verify costs little (one row, a
        GPU) the runs go in whole; on a compute-bound one at a large batch, a few constrained rows do not
        lengthen the step every other row pays for. T(k + 1) is a step of k model drafts in every row, which
        costs more than forced tokens do (no draft forward; on a packed verify, only the run's own tokens):
        the room errs narrow. Where no cost was measured (or γ is fixed), runs go in whole."""
        if not any(forced) or not self.adaptive:
            return self.gamma_max
        bucket = self.costs.bucket(len(states))
        alphas = self._alphas(states)

        def tokens(k: int) -> float:
            total = 0.0
            for alpha, f in zip(alphas, forced):
                run = min(f, k)
                total += run + expected_tokens_per_step(alpha, min(gamma, k - run) if run == f else 0)
            return total

        rates = {}
        for k in range(gamma, self.gamma_max + 1):
            seconds = bucket.step_seconds(k)
            if seconds is None:
                return self.gamma_max
            rates[k] = tokens(k) / seconds
        return max(rates, key=lambda k: (rates[k], -k))

    def _tree(self, rows: int, gamma: int, sampled: bool) -> int:
        """Node budget of the next step's token tree for ``rows`` drafting rows at depth γ; 0 for a chain."""
        if not self.tree_nodes or gamma < 2:  # depth 1 gives too few candidates to fill a ladder size
            return 0
        if not self.adaptive:
            return self.tree_nodes
        if sampled:
            return 0
        bucket = self.costs.bucket(rows)
        if self._rate(bucket, gamma + 1) is None:  # the chain first: it is what every tree must beat
            return 0
        # The best chain measured, not only this γ's: γ follows α from step to step.
        chains = (self._rate(bucket, w) for w in range(2, self.gamma_max + 2))
        best, best_rate = 0, max(r for r in chains if r is not None)
        for n in self.tree_sizes():
            rate = self._rate(bucket, n + 1)
            if rate is None:
                # Tried after a smaller tree paid; the first size only where the chain's cost line (two widths
                # measured give it a slope) leaves room for γ + 1 tokens per row, the most a tree emits.
                if best:
                    return n
                if len(bucket.seconds.levels()) < 2:
                    return best
                return n if (gamma + 1) / bucket.seconds.predict(n + 1) > best_rate else best
            if rate <= best_rate:
                break
            best, best_rate = n, rate
        return best

    def _ladder_tree(self, drafted: int) -> bool:
        """Whether a step that verified ``drafted`` draft tokens per row was one of ``tree_sizes``' trees (all
        above γ_max). Not a ``draft_num`` step: its merged chains are the step's only shape, so their
        acceptance is what α and the cost line must follow."""
        return bool(self.tree_nodes) and drafted > self.gamma_max

    def _rate(self, bucket: BucketCosts, width: int) -> float | None:
        """Measured tokens per row per second of steps of this verify width (None: not measured enough)."""
        tokens = bucket.tokens_per_row(width, self.costs.min_samples, self.costs.max_age)
        costs = bucket.trees if self._ladder_tree(width - 1) else bucket.seconds
        seconds = costs.level(width) if costs is not None else None
        return None if tokens is None or seconds is None else tokens / seconds

    def _speedup(self, alphas: Sequence[float], gamma: int) -> float:
        """Expected speed-up over plain decoding of γ drafts for a micro-batch of rows with these α."""
        cost = self.costs.relative_cost(len(alphas), gamma) if gamma else 1.0
        if cost is None:
            return sum(expected_speedup(a, gamma, self.cost_ratio) for a in alphas) / len(alphas)
        return sum(expected_tokens_per_step(a, gamma) for a in alphas) / len(alphas) / cost

    def _chain(self, states: Sequence[GammaState], behind: Sequence[int] = (), remaining: Sequence[int] = ()) -> int:
        """γ for the next step of a micro-batch whose sequences hold ``states`` (``decide``'s arguments)."""
        if not self.adaptive:
            return self.gamma
        bucket = self.costs.bucket(len(states))
        alphas = self._alphas(states)
        if not self.allow_off:
            return max(range(self.gamma_min, self.gamma_max + 1), key=lambda g: self._speedup(alphas, g))
        if bucket.measure_plain:
            return 0
        best = max(range(max(1, self.gamma_min), self.gamma_max + 1), key=lambda g: self._speedup(alphas, g))
        was_off, bucket.off = bucket.off, False
        if self._speedup(alphas, best) >= 1.0:
            measured = self._measured_chains(bucket)
            # A width not measured (or aged out in a plain spell) is tried while speculating; while off, only
            # what a probe measured turns speculation on again, so probes stay as rare as they are spaced.
            gamma = 0
            if measured.get(best, 1.0) >= 1.0 - self.margin and (best in measured or not was_off):
                gamma = best
            elif paying := [g for g, r in measured.items() if r >= 1.0 - self.margin]:
                gamma = max(paying, key=measured.get)
            if gamma:
                speedup = measured.get(gamma) or self._speedup(alphas, gamma)
                if self._repays_entry(bucket, speedup, behind, remaining):
                    return gamma
        # Plain, whatever kept it so (no chain pays, or the rows' entry would not repay): what the bucket
        # measured may age out meanwhile, so only a probe's measurement turns speculation on again.
        bucket.off = True
        bucket.probing = bucket.probe_due and self._probe_affordable(bucket, behind)
        return max(1, self.gamma_min) if bucket.probing else 0

    def _entry(self, rows: int, caught_up: int) -> bool:
        """Whether a draft taking in ``caught_up`` tokens of ``rows`` rows at once is entering (rows back from a
        plain spell, new to it, resynced) rather than keeping up: more than a step emits and a plain one."""
        return caught_up > rows * (self.gamma_max + 2)

    def _entry_seconds(self, bucket: BucketCosts, behind: Sequence[int]) -> float | None:
        """Seconds the draft would take to catch up on the tokens it is ``behind``, at the bucket's measured
        seconds per token: 0 where the rows keep up (no entry), None where not priced yet (no entry measured,
        or no plain step to weigh it against)."""
        lag = sum(behind)
        if not self._entry(len(behind), lag):
            return 0.0
        per_token, plain = bucket.catch_up_seconds(), bucket.seconds.level(1)
        return None if per_token is None or plain is None else per_token * lag

    def _repays_entry(self, bucket: BucketCosts, speedup: float, behind: Sequence[int],
                      remaining: Sequence[int]) -> bool:
        """Whether speculating at ``speedup`` over the rows' remaining tokens saves more than the draft costs to
        catch up on what it is ``behind``. A short answer after a long prompt may not repay the draft's prefill
        (a large draft on a compute-bound device)."""
        if not remaining:
            return True
        entry = self._entry_seconds(bucket, behind)
        if entry is None:  # not priced yet: any gain, and the first entry prices it
            return speedup > 1.0
        return entry == 0.0 or bucket.seconds.level(1) * statistics.mean(remaining) * (1.0 - 1.0 / speedup) > entry

    def _probe_affordable(self, bucket: BucketCosts, behind: Sequence[int]) -> bool:
        """Whether the plain steps since the last probe cover what this one's entry would cost at
        ``probe_share``: a probe of rows the draft never saw, which would pay their prompts' prefill, waits as
        a costly probe's successor would."""
        entry = self._entry_seconds(bucket, behind)
        return not entry or bucket.plain_run >= entry / (self.probe_share * bucket.seconds.level(1))

    def _measured_chains(self, bucket: BucketCosts) -> dict[int, float]:
        """γ → measured tokens per second of its chain steps over a plain step's, for the fresh widths."""
        plain = bucket.seconds.level(1)
        if plain is None:
            return {}
        return {g: rate * plain for g in range(max(1, self.gamma_min), self.gamma_max + 1)
                if (rate := self._rate(bucket, g + 1)) is not None}

    def observe(self, state: GammaState, proposed: int, accepted: int, nodes: int = 0) -> None:
        """One row's verify step; ``nodes``: the drafts verified (a tree step's nodes, above γ_max)."""
        self._emitted.append(accepted + 1)
        if proposed == 0 or self._ladder_tree(nodes):  # a tree's accepted depth is not the chain's α
            return
        for st, decay in ((state, self.decay), (self._recent, self.recent_decay)):
            st.accepted = st.accepted * decay + accepted
            st.rejections = st.rejections * decay + (1 if accepted < proposed else 0)
        # ``prior_alpha`` is a guess, so in the recent α of every row together it decays like old evidence: kept
        # at full weight, it would outweigh the at most 1 / (1 − decay) rejections the decayed counts hold, and
        # a draft that never agrees would keep γ ≥ 1 where drafts are cheap. A row's prior is that measured α,
        # which follows such a draft down, so it keeps its weight.
        self._recent_prior *= self.recent_decay

    def observe_step(self, rows: int, drafted: int, seconds: float, caught_up: int = 0) -> None:
        """Feed one decode step's wall time (not a step that prefilled a prompt: that is not what a decode
        step costs). ``drafted``: the most draft tokens of any row (the verify width − 1); ``caught_up``: the
        committed tokens of all rows together that the draft took in before drafting (those decoded since it
        last drafted)."""
        bucket = self.costs.bucket(rows)
        bucket.steps += 1
        if len(self._emitted) >= rows:  # the step's rows were observed last
            recent = list(self._emitted)[-rows:]
            bucket.yields.setdefault(drafted + 1, deque(maxlen=self.costs.yield_window)).append(
                (bucket.steps, sum(recent) / rows))
        self._emitted.clear()
        # A draft more than a step behind first catches up: an entry cost, paid once per spell, that must not
        # price the steps that follow it (``observe_catch_up`` prices the entry).
        entry = drafted > 0 and self._entry(rows, caught_up)
        probe = drafted > 0 and bucket.probing
        predicted = bucket.step_seconds(drafted) if probe else None  # before this step moves it
        if seconds > 0 and not entry:
            self.costs.record(rows, drafted, seconds, tree=self._ladder_tree(drafted))
        seconds = bucket.seconds.scaled(drafted + 1, seconds, rows)  # as the bucket's levels are
        if drafted == 0:
            bucket.since_plain = 0
            bucket.plain_run += 1
        else:
            bucket.since_plain += 1
            if probe:
                self._probe_step(bucket, drafted, seconds, entry, predicted)
            else:
                if not bucket.off:  # not a second probe decided before the first was observed (micro-batches)
                    bucket.next_probe = self.probe_first
                bucket.plain_run = 0
        # T(1) is the yardstick of every S; where the bucket speculates it is measured by plain steps:
        # ``min_samples`` of them once something speculative is measured, then one per ``refresh_every``
        # (and ``min_samples`` after a probe that reads as paying: see ``_probe_step``).
        if drafted == 0 and bucket.measure_plain:
            bucket.measure_plain -= 1
        widths = bucket.seconds.levels()
        refresh = any(w > 1 for w in widths) and (1 not in widths or bucket.since_plain >= self.refresh_every)
        bucket.measure_plain = max(bucket.measure_plain, int(refresh))

    def observe_catch_up(self, rows: int, caught_up: int, draft_seconds: float) -> None:
        """A draft call for ``rows`` rows that took in ``caught_up`` committed tokens before drafting, in
        ``draft_seconds`` (its drafting included, a small share when it enters): an entry's seconds per token,
        at the bucket. Prefill steps count: a new row's draft prefill is an entry too."""
        if draft_seconds > 0 and self._entry(rows, caught_up):
            bucket = self.costs.bucket(rows)
            bucket.catch_up.append(draft_seconds / caught_up / bucket.seconds.pace)

    def _probe_step(self, bucket: BucketCosts, drafted: int, seconds: float, entry: bool,
                    predicted: float | None) -> None:
        """One drafted step of a probe. The probe goes on until it has measured its width (an entry step does
        not count; a width whose samples aged out in the plain spell needs ``min_samples`` of them), for at
        most ``min_samples`` + 1 steps; then the next one is scheduled, spaced by what this one cost, or at
        once if it measured a step clearly cheaper than ``predicted``."""
        plain = bucket.seconds.level(1)
        bucket.probe_steps += 1
        bucket.probe_extra += seconds - plain if plain else 0.0
        measured = not entry and bucket.seconds.level(drafted + 1) is not None
        if not measured and bucket.probe_steps <= self.costs.min_samples:
            return
        cheaper = not entry and predicted is not None and seconds < self.promising * predicted
        spaced = min(math.ceil(bucket.probe_extra / (self.probe_share * plain)), self.probe_max) if plain else 0
        bucket.next_probe = 1 if cheaper else max(min(2 * bucket.next_probe, self.probe_every), spaced)
        bucket.plain_run = bucket.probe_steps = 0
        bucket.probe_extra, bucket.probing = 0.0, False
        # The plain steps the probe is weighed against were taken before it, and the machine's speed may have
        # changed since: a slow spell that ends as the probe starts leaves T(1) at the slow spell's level, and
        # the probe's chain, measured at the faster speed, reads as paying where it loses. Plain steps taken
        # after the probe weigh it at its own speed before it can turn speculation on: ``min_samples`` of them
        # set the lower quartile of the last ``window``, unless older ones are lower, which errs toward plain.
        if self._measured_chains(bucket).get(drafted, 0.0) >= 1.0 - self.margin:
            bucket.measure_plain = self.costs.min_samples

    def as_dict(self) -> dict:
        """Per batch bucket: the measured plain step, and each measured chain's speed over it (router stats)."""
        out = {}
        for key, bucket in sorted(self.costs.buckets.items()):
            plain = bucket.seconds.level(1)
            out[key] = {"plain_seconds": None if plain is None else round(plain, 6),
                        "chain_over_plain": {g: round(r, 3) for g, r in self._measured_chains(bucket).items()}}
        return out
