"""What a user pays for a schedule: the expected time to reach a target loss, relative to first-order.

The packer's own goal (the shortest cycle k at the densest packing the room rule allows) is not the
user's. A user pays ``steps(k) x step_time(k)``:

* **step time**: a schedule's expected step, averaged over its cycle: the pipeline time, plus every delay
  its K-FAC work adds to a call or to the iteration's end (:func:`pipefisher.measure.iteration_time`:
  overflow, and work that outgrows its bubble), plus the end-of-step work a profile records
  (:data:`~pipefisher.timeline.UPDATE_KEY`, :data:`~pipefisher.timeline.PRECONDITION_KEY`) where the
  node's tail bubble does not hide it. K-FAC work placed in a bubble runs slower than profiled (each
  piece is its own call, the caches are colder, the neighbour's send waits): ``slowdown`` makes every
  K-FAC item that much longer when the plan is evaluated, so a densely packed bubble costs what it costs;
* **steps**: K-FAC's steps to the target relative to first-order's, at a curvature refreshed every k
  steps (a :class:`StalenessCurve`; the default is the one measured by ``scripts/bench_staleness.py``).

First-order's step is the same pipeline with the update alone (no K-FAC work, no preconditioning). The
profile is of a ``kfac`` run, whose forwards and backwards also save K-FAC's inputs and output gradients,
which first-order does not pay; the convergence benchmark prints planned against measured for both (in
three runs first-order's plan was 0.97-1.04 of its run: the profile's own noise is larger). The choice,
made among schedules of the same profile, does not depend on it.
:func:`tradeoff` packs the candidate densities and evaluates each; the ``target`` policy
(:mod:`pipefisher.policies.target`) keeps the one with the least expected time-to-target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from pipefisher.errors import InputError
from pipefisher.measure import iteration_time, job_cycle_mean, lay_out
from pipefisher.policies.base import JobSchedule, Placement
from pipefisher.problem import NodeModel, node_model
from pipefisher.rules.format import END
from pipefisher.timeline import PRECONDITION_KEY, UPDATE_KEY, Job, NodeTimeline, inflate_kfac

DEFAULT_SLOWDOWN = 0.10
"""How much longer than profiled a K-FAC item takes when it runs in a bubble, as a fraction of its
profiled time. Measured on ``configs/small.yaml`` (2 stages, one CPU core each): single small covariance
pieces ran 1.05-1.27x their profiled time, a cycle's K-FAC work on the node that ends the pipeline 1.04x
(``pipefisher run``, 75 steps); 0.1 also covers a neighbour's call made late by it."""


@dataclass(frozen=True)
class StalenessCurve:
    """K-FAC's steps to a target loss relative to first-order's, per curvature refresh interval k.

    Between measured points the ratio is interpolated linearly in log k; below the first it is the
    first; past the last point, or at a point that never reached the target (``inf``), it is infinite:
    a staleness nobody measured reaching the target is never chosen.
    """

    points: tuple[tuple[float, float], ...]
    source: str = ""

    def __post_init__(self) -> None:
        ks = [k for k, _ in self.points]
        if not self.points or ks != sorted(ks) or len(set(ks)) != len(ks) or ks[0] < 1 \
                or any(not r > 0 for _, r in self.points):
            raise ValueError("a staleness curve needs points k:ratio with k >= 1 increasing and ratios > 0")

    def at(self, k: float) -> float:
        pts = self.points
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
            if k <= k1:
                if math.isinf(r0) or math.isinf(r1):
                    return r1 if k == k1 else math.inf
                w = math.log(k / k0) / math.log(k1 / k0)
                return r0 + (r1 - r0) * w
        return math.inf

    @classmethod
    def parse(cls, text: str) -> "StalenessCurve":
        """``"1:0.5,2:0.53,4:0.57,8:0.83,16:inf"``: k, then steps-to-target relative to first-order."""
        try:
            points = []
            for part in text.split(","):
                k, r = part.split(":")
                points.append((float(k), float(r)))
            return cls(tuple(points), source=text)
        except ValueError as e:
            why = str(e) if "staleness curve" in str(e) else "expected k:ratio pairs such as 1:0.5,4:0.57,8:0.83"
            raise InputError(None, f"staleness curve '{text}': {why}") from None


MEASURED_STALENESS = StalenessCurve(
    ((1, 0.500), (2, 0.533), (4, 0.567), (8, 0.833), (16, math.inf)),
    source="measured, configs/small.yaml at 300 steps")
"""The default curve: steps-to-target of kfac with ``kfac.interval`` k relative to the tuned AdamW, measured
on the convergence benchmark (the README's staleness section has the chart and the 1000-step curve)."""


@dataclass(frozen=True)
class StepCost:
    """One schedule's expected cost per training step (in the job's time unit), averaged over its cycle."""

    cycle: int
    """k: the longest node cycle, the staleness of the curvature the slowest-refreshed layers use."""
    first_order: float
    """The first-order step on the same pipeline: pipeline time and the update's exposed part."""
    step: float
    """The schedule's step: pipeline, K-FAC delays and overflow, preconditioning and update."""

    @property
    def overhead(self) -> float:
        """Planned time per step beyond first-order's, as a fraction of it."""
        return self.step / self.first_order - 1 if self.first_order else 0.0


@dataclass(frozen=True)
class Candidate:
    """One packing density the ``target`` policy weighed: its schedule, expected cost and time-to-target."""

    margin: float
    schedule: JobSchedule
    cost: StepCost
    relative_steps: float
    """Steps to the target relative to first-order at this cycle (the staleness curve at k)."""

    @property
    def relative_time(self) -> float:
        """Expected time to the target relative to first-order: steps ratio x step ratio."""
        return self.relative_steps * (self.cost.step / self.cost.first_order if self.cost.first_order else 1.0)


def end_of_step(node: NodeTimeline) -> tuple[float, float]:
    """(update without preconditioning, preconditioning) of a node's profiled step; 0 where not recorded
    (profiles written before these keys existed, hand-made and published ones)."""
    def length(key: str) -> float:
        ivs = [iv for iv in node.intervals(key) if iv.start is not None and iv.end is not None]
        return float(ivs[-1].end - ivs[-1].start) if ivs else 0.0

    update, precondition = length(UPDATE_KEY), length(PRECONDITION_KEY)
    return max(0.0, update - precondition), precondition


def _exposed(model: NodeModel, placed: Sequence[Placement], seconds: float) -> float:
    """How much of ``seconds`` of end-of-step work adds to an iteration's time on this node: the part its
    tail bubble does not hide. The work starts when the last label before ``-- end --`` ends (``placed``:
    the iteration's :func:`pipefisher.measure.lay_out`); from there to the node's pipeline time the node
    sits idle."""
    cut = next((i for i, p in enumerate(placed) if p.label == END), len(placed))
    ready = max((p.end for p in placed[:cut]), default=0.0)
    return max(0.0, seconds - max(0.0, float(model.base) - ready))


def slowed_models(job: Job, slowdown: float = DEFAULT_SLOWDOWN) -> list[NodeModel]:
    """The node models a plan is evaluated on: every K-FAC item ``slowdown`` longer than profiled."""
    return [node_model(n, job.span) for n in inflate_kfac(job, 1 + slowdown).nodes]


def step_cost(schedule: Sequence[Sequence[Sequence[str]]], job: Job, slowdown: float = DEFAULT_SLOWDOWN,
              models: Sequence[NodeModel] | None = None) -> StepCost:
    """The expected cost per step of a schedule (file data) on ``job``, see the module docstring.

    Per step, the slowest node sets the time (the pipeline couples them): its iteration time (pipeline,
    delays, overflow; K-FAC ``slowdown`` x longer than profiled) plus whatever of its end-of-step work
    its tail bubble does not hide, averaged over the job's cycle (:func:`pipefisher.measure.job_cycle_mean`).
    ``models``: :func:`slowed_models` of the job, where the caller evaluates several schedules.
    """
    models = slowed_models(job, slowdown) if models is None else models
    ends = [end_of_step(n) for n in job.nodes]
    per_node = []
    for labels, model, (update, precondition) in zip(schedule, models, ends):
        placed = lay_out(labels, model)
        times = iteration_time(labels, model, placed)
        per_node.append([t + _exposed(model, p, update + precondition) for t, p in zip(times, placed)])
    first_order = max(float(m.base) + _exposed(m, lay_out([_first_order_labels(m)], m)[0], u)
                      for m, (u, _) in zip(models, ends))
    return StepCost(max(len(node) for node in schedule), first_order, job_cycle_mean(per_node))


def _first_order_labels(model: NodeModel) -> list[str]:
    """A node's first-order iteration: its pipeline calls in time order, then ``-- end --``."""
    return [key for key, _, _ in model.pipeline] + [END]


DENSITIES = (0.15, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
"""Room rule margins (:mod:`pipefisher.problem`) the ``target`` policy packs beside the one asked for:
each leaves K-FAC items that much more room than their profiled time, a sparser, longer cycle."""


def tradeoff(job: Job, pack: Callable[[Job, float], JobSchedule], margin: float, staleness: StalenessCurve = MEASURED_STALENESS,
             slowdown: float = DEFAULT_SLOWDOWN) -> list[Candidate]:
    """Every distinct schedule ``pack(job, m)`` gives at margin ``margin`` and the sparser :data:`DENSITIES`,
    with its expected cost and time-to-target, in order of packing density (densest first).

    Packing stops once the staleness alone makes a candidate cost at least the best so far: its step
    costs no less than first-order's, and sparser packings only lengthen the cycle (for a curve that
    grows with k, as measured ones do).
    """
    out: list[Candidate] = []
    seen: set[str] = set()
    best = math.inf
    models = slowed_models(job, slowdown)
    for m in [margin, *(d for d in DENSITIES if d > margin)]:
        packed = pack(job, m)
        data = packed.to_file_data()
        digest = repr(data)
        if digest in seen:
            continue
        seen.add(digest)
        cost = step_cost(data, job, slowdown, models)
        c = Candidate(m, packed, cost, staleness.at(cost.cycle))
        out.append(c)
        best = min(best, c.relative_time)
        if c.relative_steps >= best:
            break
    return out


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The least expected time-to-target; a tie goes to the shorter cycle (fresher curvature)."""
    if not candidates:
        raise ValueError("no candidate schedules")
    return min(candidates, key=lambda c: (c.relative_time, c.cost.cycle, -c.margin))


@dataclass(frozen=True)
class Tradeoff:
    """What the ``target`` policy weighed, carried by the schedule it chose (``JobSchedule.tradeoff``)."""

    candidates: tuple[Candidate, ...]
    chosen: Candidate
    staleness: StalenessCurve
    slowdown: float

    def lines(self) -> list[str]:
        """The table reports print: per candidate k, planned overhead per step and expected time-to-target."""
        out = [f"time-to-target trade-off (K-FAC items {1 + self.slowdown:g}x their profiled time; staleness "
               f"{self.staleness.source or 'given'}):",
               f"  {'k':>3}  {'margin':>6}  {'overhead/step':>13}  {'steps vs first-order':>20}  "
               f"{'time-to-target vs first-order':>29}"]
        for c in self.candidates:
            rel = "never" if math.isinf(c.relative_time) else f"{c.relative_time:.3f}"
            steps = "never" if math.isinf(c.relative_steps) else f"{c.relative_steps:.3f}"
            out.append(f"  {c.cost.cycle:>3}  {c.margin:>6g}  {100 * c.cost.overhead:>12.1f}%  {steps:>20}  "
                       f"{rel:>29}" + ("  <- chosen" if c is self.chosen else ""))
        return out

    def data(self) -> dict[str, object]:
        """For ``--json`` reports."""
        def num(x: float) -> float | None:
            return None if math.isinf(x) else round(x, 6)

        return {"staleness": [[k, num(r)] for k, r in self.staleness.points], "slowdown": self.slowdown,
                "candidates": [{"margin": c.margin, "cycle": c.cost.cycle, "overhead": num(c.cost.overhead),
                                "relative_steps": num(c.relative_steps), "relative_time": num(c.relative_time),
                                "chosen": c is self.chosen} for c in self.candidates]}
