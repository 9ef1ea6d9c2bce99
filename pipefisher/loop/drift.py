"""Drift: how fast a run's curvature ages, measured at every K-FAC refresh, and the cycle it allows.

At a refresh K-FAC swaps a layer's inverses for fresh ones. How far that moves the preconditioned
gradient says what stale curvature costs right now: with ``P(G) = B^-1 G A^-1``, a layer's **drift** is
``||P_n(G) - P_{n-1}(G)||_F / ||P_n(G)||_F``, refresh n against the refresh before, for the gradient ``G``
it preconditioned last (:class:`pipefisher.kfac.drift_meter.DriftMeter` measures it in the inverse's own label, in
a bubble). A refresh's figure aggregates its layers as ``sqrt(sum ||P_n - P_{n-1}||^2 / sum ||P_n||^2)``:
the relative change of the whole preconditioned gradient (every K-FAC layer's, stacked), the step the
optimizer receives. A layer counts by the size of its part of that step, so a layer whose gradient is
nearly zero (whose ratio is then mostly rounding) cannot swing the figure, and the figure does not depend
on how the model is cut into layers or stages. Per-layer values are kept beside it.

The drift holds two things: the curvature that moved in the k steps between the refreshes (what a longer
cycle makes worse), and the sampling noise of each refresh's factors, estimated afresh from one step's
micro-batches every time (the same at any k). Measured on ``configs/small.yaml``, the noise dominates:
refreshes every 1, 2 and 4 steps all drift by about 0.35 (docs/adapt.md). So every refresh also measures
``||P_n - P_{n-2}||``, against the refresh two back, on the same ``G``; the noise adds the same to both
in expectation, the curvature's movement more over two cycles than over one. The refresh's **aging**,

    (sum ||P_n - P_{n-2}||^2 - sum ||P_n - P_{n-1}||^2) / sum ||P_n - P_{n-1}||^2,

is how much the preconditioner's squared error would grow if the cycle were twice as long: about 0 when
the cycle is short against the curvature's pace (noise only), 1 and more when its movement dominates.

The closed loop turns it into a cycle length (:class:`DriftRule`, used by
:class:`pipefisher.loop.closed_loop.AdaptiveScheduler` when no staleness curve is given). One refresh's aging
is noisy (it spans -0.3 to 2.8 at one k) and follows the training phase more than k, so the rule judges
all the refreshes measured at the cycle in force since it last changed, and moves only on clear evidence:
it doubles the cycle when significantly more than three quarters of them aged below :data:`AGING_LOW`
(the upper quartile's one-sided confidence bound is below it), halves it when significantly more than
half aged above :data:`AGING_HIGH` (the median's bound is above it), and holds otherwise; never below the
densest packing that fits the bubbles (its floor) nor beyond its longest cycle. Plain Python, no torch:
the scheduler runs it on rank 0 between steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

AGING_LOW = 0.10
"""Below it (in clearly more than :data:`DRIFT_LONGER_SHARE` of the refreshes at one k) the cycle
doubles: twice as long a cycle would add under 10 % to the preconditioner's squared error (about 5 % to
the error). Calibrated on ``configs/small.yaml`` (2 stages, kfac runs refreshing every k = 1, 2, 4, 8
steps for 200 steps of a 300-step schedule; docs/adapt.md has the table): after the first 50 steps the
aging was -0.12 to -0.07 at k = 1, 0.01 to 0.34 at k = 2, 0.10 to 1.17 at k = 4; the staleness curve
measured at that horizon charges the doubling from k = 1 to 2 6.6 % more steps and the one from 2 to 4
6.4 %: 0.1 lets the first happen and holds k = 2 while its aging is above it."""
AGING_HIGH = 0.40
"""Above it (in clearly more than :data:`DRIFT_SHORTER_SHARE` of the refreshes at one k) the cycle
halves. The same calibration: after step 100, k = 4 aged by 0.10 and 0.21, k = 8 by 1.33 and 0.31; the
curve charges the doubling from 4 to 8 47 % more steps. Between the two thresholds the cycle holds
(hysteresis): their ratio, 4, exceeds what one doubling of k usually did to the aging in the calibration
(1.6-3.4x), so a cycle rarely goes back and forth between two lengths."""
DRIFT_MIN_REFRESHES = 8
"""Refreshes at one cycle length before the rule decides anything. One refresh's aging is noisy (in the
calibration its 10th-90th percentiles at one k spanned -0.3 to 2.8; in the validation runs a median of
three at k = 4 came out at 0.057 where all 21 refreshes there had a median of 2.1)."""
DRIFT_LONGER_SHARE = 0.75
"""The cycle doubles only when significantly more than this share of its refreshes aged below
:data:`AGING_LOW`: the upper quartile, not the median, must be low. Staleness is the expensive mistake
(the measured curves charge k = 8 and 16 18-67 % more steps, or never reach the target, where k = 4
costs 7-17 %), and a longer cycle cannot measure what it would have cost to stay."""
DRIFT_SHORTER_SHARE = 0.5
"""The cycle halves when significantly more than this share of its refreshes aged above
:data:`AGING_HIGH`: the median must be high."""
DRIFT_CONFIDENCE = 0.95
"""How sure each move must be: the binomial test of the counts (a share above the one named) at this
level, one-sided. With every refresh below :data:`AGING_LOW` that takes 11 refreshes (0.75^11 < 0.05);
with 32, 29 of them."""
DRIFT_MAX_CYCLE = 64
"""The longest cycle the rule grows to (K-FAC practice on large models refreshes every 10-100 steps)."""


def longest_cycle(steps: int) -> int:
    """The longest cycle the rule grows to in a run of ``steps`` steps: a quarter of them (so that the run
    refreshes at least four times at it), at most :data:`DRIFT_MAX_CYCLE`."""
    return max(1, min(DRIFT_MAX_CYCLE, steps // 4))


@dataclass(frozen=True)
class DriftSample:
    """One layer's refresh, as a worker measured it (squared norms, so that they add up)."""

    step: int  # the training step whose ``inv`` label completed the refresh
    node: int  # the pipeline node (device) that measured it
    layer: str  # ``<stage>/<module name>``: unique in the job (a Chimera pair's two copies share it)
    change: float  # ||P_n(G) - P_{n-1}(G)||_F^2
    change2: float | None  # ||P_n(G) - P_{n-2}(G)||_F^2 (None: no refresh two back yet)
    norm: float  # ||P_n(G)||_F^2
    lags: tuple[int, int] | None = None  # steps since refresh n-1 and since n-2 (None: not known)

    def state(self) -> list[Any]:
        return [self.step, self.node, self.layer, self.change, self.change2, self.norm,
                None if self.lags is None else list(self.lags)]

    @classmethod
    def from_state(cls, x: Iterable[Any]) -> "DriftSample":
        step, node, layer, change, change2, norm, lags = x
        return cls(int(step), int(node), str(layer), float(change), None if change2 is None else float(change2),
                   float(norm), None if lags is None else (int(lags[0]), int(lags[1])))


def relative(change: float, norm: float) -> float:
    """``sqrt(change / norm)``; 0 where nothing was preconditioned (both 0)."""
    if norm <= 0:
        return 0.0 if change <= 0 else math.inf
    return math.sqrt(change / norm)


def aging(change: float, change2: float) -> float | None:
    """``(change2 - change) / change``: the growth of the squared drift from one refresh back to two
    (None where the refresh did not move at all)."""
    return (change2 - change) / change if change > 0 else None


@dataclass(frozen=True)
class Refresh:
    """One curvature refresh of the job: its figures and every layer's."""

    step: int  # the step its last layer was refreshed in
    drift: float
    aging: float | None = None  # None until two refreshes back exist
    layers: dict[str, float] = field(default_factory=dict)  # drift per layer
    layer_aging: dict[str, float | None] = field(default_factory=dict)
    lags: tuple[int, int] | None = None
    """Steps from the refreshes one and two back to this one, the same for every layer its aging is taken
    over (a cycle of k: (k, 2k)); None where they differ or are not known (after a switch)."""

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "drift": self.drift, "aging": self.aging, "layers": dict(self.layers),
                "layer_aging": dict(self.layer_aging), "lags": None if self.lags is None else list(self.lags)}


def refreshes(samples: Iterable[DriftSample], group: Callable[[int], int] = lambda step: step) -> list[Refresh]:
    """The job's refreshes from its layers' samples, in step order: samples whose steps ``group`` maps to
    the same key form one refresh (``kfac`` mode: the step; scheduled: the job cycle). A layer measured
    twice in one refresh (replicas, a Chimera pair's two copies: the same figure) counts once; one
    refreshed twice in a group (a node with a shorter cycle, without ``--adapt``) adds both. The aging
    is taken over the layers that have a refresh two back."""
    seen: set[tuple[int, str, int]] = set()
    groups: dict[int, dict[str, list[float]]] = {}
    last: dict[int, int] = {}
    lags: dict[int, set[tuple[int, int] | None]] = {}
    for s in samples:
        key = group(s.step)
        if (key, s.layer, s.step) in seen:
            continue
        seen.add((key, s.layer, s.step))
        sums = groups.setdefault(key, {}).setdefault(s.layer, [0.0, 0.0, 0.0, 0.0])  # change, norm, over two
        sums[0] += s.change
        sums[1] += s.norm
        if s.change2 is not None:
            sums[2] += s.change2
            sums[3] += s.change
            lags.setdefault(key, set()).add(s.lags)
        last[key] = max(last.get(key, s.step), s.step)
    out = []
    for key, layers in groups.items():
        change, norm = sum(v[0] for v in layers.values()), sum(v[1] for v in layers.values())
        two = [v for v in layers.values() if v[3] > 0]
        same = lags.get(key, set())
        out.append(Refresh(last[key], relative(change, norm),
                           aging(sum(v[3] for v in two), sum(v[2] for v in two)) if two else None,
                           {name: relative(v[0], v[1]) for name, v in sorted(layers.items())},
                           {name: aging(v[3], v[2]) for name, v in sorted(layers.items())},
                           next(iter(same)) if len(same) == 1 else None))
    return sorted(out, key=lambda r: r.step)


def binomial_tail(n: int, count: int, share: float) -> float:
    """``P(X >= count)`` for ``X ~ Binomial(n, share)``: how likely a stream in which each refresh falls on
    one side of a threshold with probability ``share`` puts ``count`` or more of ``n`` there."""
    if count <= 0 or share >= 1:
        return 1.0
    if count > n or share <= 0:
        return 0.0
    term = math.exp(math.lgamma(n + 1) - math.lgamma(count + 1) - math.lgamma(n - count + 1)
                    + count * math.log(share) + (n - count) * math.log1p(-share))
    total, odds = 0.0, share / (1 - share)
    for i in range(count, n + 1):
        total += term
        term *= (n - i) / (i + 1) * odds
    return min(1.0, total)


def clearly_more(count: int, n: int, share: float, confidence: float = DRIFT_CONFIDENCE) -> bool:
    """Whether ``count`` of ``n`` refreshes on one side of a threshold is clearly more than ``share`` of
    them: the one-sided binomial test at ``confidence``, the same as the ``share``-quantile's confidence
    bound lying on that side of the threshold (distribution-free: the aging's spread and skew do not
    matter, only how many refreshes fall where)."""
    return n > 0 and count > share * n and binomial_tail(n, count, share) <= 1 - confidence


class DriftRule:
    """The cycle k the curvature's aging allows, refresh by refresh.

    It starts at ``cycle`` and counts the refreshes measured at the cycle in force since it last changed:
    how many, how many aged below ``low``, how many above ``high``. Once ``min_refreshes`` are in, it
    proposes to double the cycle (up to ``max_cycle``) when clearly more than ``longer_share`` of them
    aged below ``low``, to halve it (down to :attr:`floor`, the densest packing's cycle) when clearly more
    than ``shorter_share`` aged above ``high`` (:func:`clearly_more` at ``confidence``), and nothing
    otherwise. All the refreshes since the last change count, not the last few: a few lucky ones cannot
    move it, and a phase of fast aging at this k keeps weighing after it. Every change starts afresh, so
    the next decision is made on refreshes measured at the new length. The caller says what it made of a
    proposal (:meth:`moved`, :meth:`at_floor`).
    """

    def __init__(self, cycle: int, low: float = AGING_LOW, high: float = AGING_HIGH,
                 max_cycle: int = DRIFT_MAX_CYCLE, min_refreshes: int = DRIFT_MIN_REFRESHES, *, floor: int = 1,
                 longer_share: float = DRIFT_LONGER_SHARE, shorter_share: float = DRIFT_SHORTER_SHARE,
                 confidence: float = DRIFT_CONFIDENCE) -> None:
        if not (0 < low < high and math.isfinite(high)) or max_cycle < 1 or min_refreshes < 1 or cycle < 1 \
                or floor < 1 or not (0 < longer_share < 1 and 0 < shorter_share < 1 and 0.5 <= confidence < 1):
            raise ValueError("the drift rule needs 0 < low < high, a cycle, floor and max_cycle >= 1, min_refreshes "
                             ">= 1, shares in (0, 1) and a confidence in [0.5, 1)")
        self.low, self.high, self.max_cycle = float(low), float(high), int(max_cycle)
        self.min_refreshes, self.confidence = int(min_refreshes), float(confidence)
        self.longer_share, self.shorter_share = float(longer_share), float(shorter_share)
        self.cycle, self.floor = int(cycle), min(int(floor), int(cycle))
        self.refreshes = self.below = self.above = 0  # since the cycle in force began

    def observe(self, aging: float) -> None:
        """A refresh's aging measured at the cycle in force: its refreshes one and two back were k and 2k
        steps before it (not so right after a switch: see the scheduler)."""
        self.refreshes += 1
        self.below += aging < self.low
        self.above += aging > self.high

    @property
    def evidence(self) -> str:
        """What the refreshes at the cycle in force say, in words."""
        return (f"curvature aging below {self.low:g} in {self.below} and above {self.high:g} in {self.above} of "
                f"{self.refreshes} refreshes at k = {self.cycle}")

    def proposal(self) -> tuple[int, str] | None:
        """``(cycle, why)`` when the drift clearly asks for another cycle length, else None."""
        if self.refreshes < self.min_refreshes:
            return None
        told, sure = self.evidence, f"at {self.confidence:.0%} confidence"
        if self.cycle < self.max_cycle and clearly_more(self.below, self.refreshes, self.longer_share,
                                                        self.confidence):
            return (min(2 * self.cycle, self.max_cycle),
                    f"{told}: below in clearly more than {self.longer_share:.0%} ({sure}): a longer cycle")
        if self.cycle > self.floor and clearly_more(self.above, self.refreshes, self.shorter_share, self.confidence):
            return (max(self.cycle // 2, self.floor),
                    f"{told}: above in clearly more than {self.shorter_share:.0%} ({sure}): a shorter cycle")
        return None

    def moved(self, cycle: int) -> None:
        """The cycle in force is now ``cycle``: its refreshes are counted afresh."""
        self.cycle, self.refreshes, self.below, self.above = int(cycle), 0, 0, 0

    def at_floor(self) -> None:
        """Nothing shorter than the cycle in force can be packed: never propose below it again. The
        refreshes counted so far still stand (they say what this cycle does, and may yet lengthen it)."""
        self.floor = self.cycle

    def state_dict(self) -> dict[str, Any]:
        return {"cycle": self.cycle, "floor": self.floor, "refreshes": self.refreshes, "below": self.below,
                "above": self.above}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cycle, self.floor = int(state["cycle"]), int(state.get("floor", 1))
        if "window" in state:  # a checkpoint of the earlier rule, which kept the last few agings
            window = [float(x) for x in state["window"]]
            self.refreshes, self.below = len(window), sum(x < self.low for x in window)
            self.above = sum(x > self.high for x in window)
        else:
            self.refreshes, self.below, self.above = (int(state.get(key, 0)) for key in ("refreshes", "below", "above"))
