"""Drift: how fast a run's curvature ages, measured at every K-FAC refresh, and the cycle it allows.

At a refresh K-FAC swaps a layer's inverses for fresh ones. How far that moves the preconditioned
gradient says what stale curvature costs right now: with ``P(G) = B^-1 G A^-1``, a layer's drift is
``||P_new(G) - P_old(G)||_F / ||P_new(G)||_F`` for the gradient ``G`` it preconditioned last
(:meth:`pipefisher.kfac.kfac.KFAC.inv` measures it in the inverse's own label, in a bubble). Between two
refreshes k steps apart, it is the error of the preconditioner in use at the end of a cycle of k, against
the fresh one: small, and a longer cycle loses little; large, and the curvature ages faster than it is
refreshed.

A refresh's figure aggregates its layers as ``sqrt(sum ||P_new - P_old||^2 / sum ||P_new||^2)``: the
relative change of the whole preconditioned gradient (every K-FAC layer's, stacked), the step the
optimizer receives. A layer counts by the size of its part of that step, so a layer whose gradient is
nearly zero (whose ratio is then mostly rounding) cannot swing the figure, and the figure does not depend on
how the model is cut into layers or stages. Per-layer values are kept beside it.

The closed loop turns it into a cycle length (:class:`DriftRule`, used by
:class:`pipefisher.closed_loop.AdaptiveScheduler` when no staleness curve is given): double the cycle
while the drift stays below :data:`DRIFT_LOW`, halve it when it is above :data:`DRIFT_HIGH`, hold in
between. Plain Python, no torch: the scheduler runs it on rank 0 between steps.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

DRIFT_LOW = 0.30
"""Below it (the median of :data:`DRIFT_SAMPLES` refreshes) the cycle may double. Calibrated on
``configs/small.yaml`` (2 stages, kfac runs with ``kfac.interval`` k; docs/adapt.md has the figures):
placeholder until calibrated."""
DRIFT_HIGH = 0.60
"""Above it the cycle halves. Between the two thresholds the cycle holds (hysteresis)."""
DRIFT_SAMPLES = 2
"""Refreshes at one cycle length whose median decides (one refresh is noisy)."""
DRIFT_MAX_CYCLE = 64
"""The longest cycle the rule grows to (K-FAC practice on large models refreshes every 10-100 steps)."""


@dataclass(frozen=True)
class DriftSample:
    """One layer's refresh, as a worker measured it (squared norms, so that they add up)."""

    step: int  # the training step whose ``inv`` label completed the refresh
    node: int  # the pipeline node (device) that measured it
    layer: str  # ``<stage>/<module name>``: unique in the job (a Chimera pair's two copies share it)
    change: float  # ||P_new(G) - P_old(G)||_F^2
    norm: float  # ||P_new(G)||_F^2

    def state(self) -> list[Any]:
        return [self.step, self.node, self.layer, self.change, self.norm]

    @classmethod
    def from_state(cls, x: Iterable[Any]) -> "DriftSample":
        step, node, layer, change, norm = x
        return cls(int(step), int(node), str(layer), float(change), float(norm))


def relative(change: float, norm: float) -> float:
    """``sqrt(change / norm)``; 0 where nothing was preconditioned (both 0)."""
    if norm <= 0:
        return 0.0 if change <= 0 else math.inf
    return math.sqrt(change / norm)


@dataclass(frozen=True)
class Refresh:
    """One curvature refresh of the job: its figure and every layer's drift."""

    step: int  # the step its last layer was refreshed in
    drift: float
    layers: dict[str, float] = field(default_factory=dict)

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "drift": self.drift, "layers": dict(self.layers)}


def refreshes(samples: Iterable[DriftSample], group: Callable[[int], int] = lambda step: step) -> list[Refresh]:
    """The job's refreshes from its layers' samples, in step order: samples whose steps ``group`` maps to
    the same key form one refresh (``kfac`` mode: the step; scheduled: the job cycle). A layer measured
    twice in one refresh (replicas, a Chimera pair's two copies: the same figure) counts once; one
    refreshed twice in a group (a node with a shorter cycle, without ``--adapt``) adds both."""
    seen: set[tuple[int, str, int]] = set()
    groups: dict[int, dict[str, list[float]]] = {}
    last: dict[int, int] = {}
    for s in samples:
        key = group(s.step)
        if (key, s.layer, s.step) in seen:
            continue
        seen.add((key, s.layer, s.step))
        sums = groups.setdefault(key, {}).setdefault(s.layer, [0.0, 0.0])
        sums[0] += s.change
        sums[1] += s.norm
        last[key] = max(last.get(key, s.step), s.step)
    out = []
    for key, layers in groups.items():
        change = sum(c for c, _ in layers.values())
        norm = sum(n for _, n in layers.values())
        out.append(Refresh(last[key], relative(change, norm),
                           {name: relative(c, n) for name, (c, n) in sorted(layers.items())}))
    return sorted(out, key=lambda r: r.step)


class DriftRule:
    """The cycle k the drift allows, refresh by refresh.

    It starts at ``cycle``. Once ``samples`` refreshes measured at the cycle in force are in, their
    median decides: below ``low`` the cycle doubles (up to ``max_cycle``), above ``high`` it halves
    (down to :attr:`floor`), in between it holds. Every change starts a new window, so the next decision
    is made on refreshes measured at the new length; the gap between the thresholds is the hysteresis
    that keeps it from going back and forth between two lengths whose drifts differ by less than
    ``high / low``. The caller says what it made of a proposal (:meth:`moved`, :meth:`at_floor`).
    """

    def __init__(self, cycle: int, low: float = DRIFT_LOW, high: float = DRIFT_HIGH,
                 max_cycle: int = DRIFT_MAX_CYCLE, samples: int = DRIFT_SAMPLES) -> None:
        if not (0 < low < high and math.isfinite(high)) or max_cycle < 1 or samples < 1 or cycle < 1:
            raise ValueError("the drift rule needs 0 < low < high, a cycle and max_cycle >= 1 and samples >= 1")
        self.low, self.high, self.max_cycle, self.samples = float(low), float(high), int(max_cycle), int(samples)
        self.cycle, self.floor = int(cycle), 1
        self.window: list[float] = []

    def observe(self, drift: float) -> None:
        """A refresh measured at the cycle in force (not the first after a switch: see the scheduler)."""
        self.window = (self.window + [float(drift)])[-self.samples:]

    @property
    def measured(self) -> float | None:
        """The median of the window, once it holds ``samples`` refreshes."""
        return statistics.median(self.window) if len(self.window) >= self.samples else None

    def proposal(self) -> tuple[int, str] | None:
        """``(cycle, why)`` when the drift asks for another cycle length, else None."""
        d = self.measured
        if d is None:
            return None
        told = f"drift {d:.3f} (median of {len(self.window)} refreshes at k = {self.cycle})"
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
