"""Drift: how fast a run's curvature ages, measured at every K-FAC refresh, and the cycle it allows.

At a refresh K-FAC swaps a layer's inverses for fresh ones. How far that moves the preconditioned
gradient says what stale curvature costs right now: with ``P(G) = B^-1 G A^-1``, a layer's **drift** is
``||P_n(G) - P_{n-1}(G)||_F / ||P_n(G)||_F``, refresh n against the refresh before, for the gradient ``G``
it preconditioned last (:meth:`pipefisher.kfac.kfac.KFAC.inv` measures it in the inverse's own label, in
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
:class:`pipefisher.closed_loop.AdaptiveScheduler` when no staleness curve is given): double the cycle
while the aging stays below :data:`AGING_LOW`, halve it when it is above :data:`AGING_HIGH`, hold in
between. Plain Python, no torch: the scheduler runs it on rank 0 between steps.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

AGING_LOW = 0.10
"""Below it (the median of :data:`DRIFT_SAMPLES` refreshes) the cycle doubles: twice as long a cycle
would add under 10 % to the preconditioner's squared error (about 5 % to the error). Calibrated on
``configs/small.yaml`` (2 stages, kfac runs refreshing every k = 1, 2, 4, 8 steps for 200 steps of a
300-step schedule; docs/adapt.md has the table): after the first 50 steps the aging was -0.12 to -0.07 at
k = 1, 0.01 to 0.34 at k = 2, 0.10 to 1.17 at k = 4; the staleness curve measured at that horizon charges
the doubling from k = 1 to 2 6.6 % more steps and the one from 2 to 4 6.4 %: 0.1 lets the first happen
and holds k = 2 while its aging is above it."""
AGING_HIGH = 0.40
"""Above it the cycle halves. The same calibration: after step 100, k = 4 aged by 0.10 and 0.21, k = 8 by
1.33 and 0.31; the curve charges the doubling from 4 to 8 47 % more steps. Between the two thresholds the
cycle holds (hysteresis): their ratio, 4, exceeds what one doubling of k usually did to the aging in the
calibration (1.6-3.4x), so a cycle rarely goes back and forth between two lengths."""
DRIFT_SAMPLES = 3
"""Refreshes at one cycle length whose median decides. One refresh's aging is noisy (in the calibration
its 10th-90th percentiles at one k spanned -0.3 to 2.8): of three, one outlying refresh cannot decide (the
median of two would be their mean)."""
DRIFT_MAX_CYCLE = 64
"""The longest cycle the rule grows to (K-FAC practice on large models refreshes every 10-100 steps)."""


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


class DriftRule:
    """The cycle k the curvature's aging allows, refresh by refresh.

    It starts at ``cycle``. Once ``samples`` refreshes measured at the cycle in force are in, the median
    of their aging decides: below ``low`` the cycle doubles (up to ``max_cycle``), above ``high`` it halves
    (down to :attr:`floor`), in between it holds. Every change starts a new window, so the next decision
    is made on refreshes measured at the new length; the gap between the thresholds is the hysteresis
    that keeps it from going back and forth between two lengths whose drifts differ by less than
    ``high / low``. The caller says what it made of a proposal (:meth:`moved`, :meth:`at_floor`).
    """

    def __init__(self, cycle: int, low: float = AGING_LOW, high: float = AGING_HIGH,
                 max_cycle: int = DRIFT_MAX_CYCLE, samples: int = DRIFT_SAMPLES) -> None:
        if not (0 < low < high and math.isfinite(high)) or max_cycle < 1 or samples < 1 or cycle < 1:
            raise ValueError("the drift rule needs 0 < low < high, a cycle and max_cycle >= 1 and samples >= 1")
        self.low, self.high, self.max_cycle, self.samples = float(low), float(high), int(max_cycle), int(samples)
        self.cycle, self.floor = int(cycle), 1
        self.window: list[float] = []

    def observe(self, aging: float) -> None:
        """A refresh's aging measured at the cycle in force: its refreshes one and two back were k and 2k
        steps before it (not so right after a switch: see the scheduler)."""
        self.window = (self.window + [float(aging)])[-self.samples:]

    @property
    def measured(self) -> float | None:
        """The median of the window, once it holds ``samples`` refreshes."""
        return statistics.median(self.window) if len(self.window) >= self.samples else None

    def proposal(self) -> tuple[int, str] | None:
        """``(cycle, why)`` when the drift asks for another cycle length, else None."""
        d = self.measured
        if d is None:
            return None
        told = f"curvature aging {d:.3f} (median of {len(self.window)} refreshes at k = {self.cycle})"
        if d < self.low and self.cycle < self.max_cycle:
            return min(2 * self.cycle, self.max_cycle), f"{told} below {self.low:g}: a longer cycle"
        if d > self.high and self.cycle > self.floor:
            return max(self.cycle // 2, self.floor), f"{told} above {self.high:g}: a shorter cycle"
        return None

    def moved(self, cycle: int) -> None:
        """The cycle in force is now ``cycle``: a new window begins."""
        self.cycle, self.window = int(cycle), []

    def at_floor(self) -> None:
        """Nothing shorter than the cycle in force can be packed: never propose below it again."""
        self.floor, self.window = self.cycle, []

    def state_dict(self) -> dict[str, Any]:
        return {"cycle": self.cycle, "floor": self.floor, "window": list(self.window)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cycle, self.floor = int(state["cycle"]), int(state.get("floor", 1))
        self.window = [float(x) for x in state.get("window", [])]
