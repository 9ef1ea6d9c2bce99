"""What a user pays for a schedule: its planned step time and, given the job's staleness curve, the
expected time to reach a target loss, relative to first-order.

The packer's own goal (the shortest cycle k at the densest packing the room rule allows) is not the
user's. A user pays ``steps(k) x step_time(k)``:

* **step time**: a schedule's expected step, averaged over its cycle: the pipeline time, plus every delay
  its K-FAC work adds to a call or to the iteration's end (:func:`pipefisher.cost.measure.iteration_time`:
  overflow, and work that outgrows its bubble), plus the end-of-step work a profile records
  (:data:`~pipefisher.schedule.timeline.UPDATE_KEY`, :data:`~pipefisher.schedule.timeline.PRECONDITION_KEY`) where the
  node's tail bubble does not hide it. K-FAC work placed in a bubble runs slower than profiled (each
  piece is its own call, the caches are colder, the neighbour's send waits): ``slowdown`` makes every
  K-FAC item that much longer when the plan is evaluated, so a densely packed bubble costs what it costs;
* **steps**: K-FAC's steps to the target relative to first-order's, at a curvature refreshed every k
  steps: the job's :class:`~pipefisher.cost.staleness.StalenessCurve`, measured on it
  (``scripts/bench_staleness.py``) or given. There is no default: what staleness costs depends on the
  model, the data, the learning rate and the horizon, so a curve from another job would decide with
  someone else's numbers. A measured curve is relative to the best first-order optimizer of the
  benchmark's race (AdamW or Muon, its ``relative_to``); the first-order step below stands for that
  optimizer's step, which holds while its step costs about the profiled update's (the benchmarks print
  ``muon step / adamw step``: 1.135 on ``configs/small.yaml``, docs/formats.md says what follows).

First-order's step is the same pipeline with the update alone (no K-FAC work, no preconditioning: the
profile's ``precondition`` also holds K-FAC's own optimizer, all of ``kfac.update: soap``'s end-of-step
work, :class:`pipefisher.runtime.train.update.Updater`; before it did, first-order's plan carried soap's
update and stood 19-25 % above a measured first-order step, docs/benchmarks.md). The
profile is of a ``kfac`` run, whose forwards and backwards also save K-FAC's inputs and output gradients,
which first-order does not pay; the convergence benchmark prints planned against measured for both (in
three runs first-order's plan was 0.97-1.04 of its run: the profile's own noise is larger). The choice,
made among schedules of the same profile, does not depend on it.

:func:`tradeoff` packs the candidate densities and weighs them; the ``target`` policy
(:mod:`pipefisher.policies.target`) keeps what it chooses. With a curve: the least expected
time-to-target. Without one, a rule that needs none (:func:`choose_without_curve`): the densest packing
where its planned step is within :data:`NO_CURVE_TOLERANCE` of the floor (the step no packing goes
below), else the least planned step and, within the tolerance of it, the shortest cycle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from pipefisher.cost.measure import job_cycle_mean, planned_iterations
from pipefisher.cost.staleness import StalenessCurve
from pipefisher.schedule.format import END
from pipefisher.schedule.packed import JobSchedule, KfacLayout, NodeSchedule
from pipefisher.schedule.problem import NodeModel, node_model
from pipefisher.schedule.timeline import PRECONDITION_KEY, UPDATE_KEY, Job, NodeTimeline, inflate_node_kfac

DEFAULT_SLOWDOWN = 0.10
"""How much longer than profiled a K-FAC item takes when it runs in a bubble, as a fraction of its
profiled time. Measured on ``configs/small.yaml`` (2 stages, one CPU core each): single small covariance
pieces ran 1.05-1.27x their profiled time, a cycle's K-FAC work on the node that ends the pipeline 1.04x
(``pipefisher run``, 75 steps); 0.1 also covers a neighbour's call made late by it."""

NO_CURVE_TOLERANCE = 0.02
"""Without a staleness curve, planned step times this close (as a fraction) count as equal, and the
shorter cycle (fresher curvature) decides between them."""


@dataclass(frozen=True)
class StepCost:
    """One schedule's expected cost per training step (in the job's time unit), averaged over its cycle."""

    cycle: int
    """k: the longest node cycle, the staleness of the curvature the slowest-refreshed layers use."""
    first_order: float
    """The first-order step on the same pipeline: pipeline time and the update's exposed part."""
    step: float
    """The schedule's step: pipeline, K-FAC delays and overflow, preconditioning and update."""
    floor: float = 0.0
    """The step no schedule of this job goes below: first-order's, with the whole end-of-step work
    (preconditioning too) exposed as far as the tail bubble leaves it, and no K-FAC delay at all."""

    @property
    def overhead(self) -> float:
        """Planned time per step beyond first-order's, as a fraction of it."""
        return self.step / self.first_order - 1 if self.first_order else 0.0

    @property
    def above_floor(self) -> float:
        """Planned time per step beyond the floor, as a fraction of the floor."""
        return self.step / self.floor - 1 if self.floor else 0.0


@dataclass(frozen=True, eq=False)
class Candidate:
    """One packing density the ``target`` policy weighed: its schedule, expected cost and time-to-target
    (compared by identity: two candidates are never the same schedule)."""

    margin: float
    schedule: JobSchedule
    cost: StepCost
    relative_steps: float | None
    """Steps to the target relative to first-order at this cycle (the staleness curve at k); None
    without a curve."""

    @property
    def relative_time(self) -> float | None:
        """Expected time to the target relative to first-order: steps ratio x step ratio (None without
        a curve)."""
        if self.relative_steps is None:
            return None
        return self.relative_steps * (self.cost.step / self.cost.first_order if self.cost.first_order else 1.0)

    @property
    def overflow_per_step(self) -> float:
        """The most time a node's overflow (work its margin lets fit no bubble) adds per step, averaged
        over its cycle, in the job's unit (profiled times)."""
        return max((n.figures.overflow / n.figures.iterations for n in self.schedule.nodes
                    if n.figures.iterations), default=0.0)


def end_of_step(node: NodeTimeline) -> tuple[float, float]:
    """(update without preconditioning, preconditioning) of a node's profiled step; 0 where not recorded
    (profiles written before these keys existed, hand-made and published ones)."""
    def length(key: str) -> float:
        ivs = [iv for iv in node.intervals(key) if iv.start is not None and iv.end is not None]
        return float(ivs[-1].end - ivs[-1].start) if ivs else 0.0

    update, precondition = length(UPDATE_KEY), length(PRECONDITION_KEY)
    return max(0.0, update - precondition), precondition


def _exposed(model: NodeModel, ready: float, seconds: float) -> float:
    """How much of ``seconds`` of end-of-step work adds to an iteration's time on this node: the part its
    tail bubble does not hide. The work starts when the last label before ``-- end --`` ends (``ready``,
    :func:`pipefisher.cost.measure.planned_iterations`); from there to the node's pipeline time the node sits
    idle."""
    return max(0.0, seconds - max(0.0, float(model.base) - ready))


def slowed_models(job: Job, slowdown: float = DEFAULT_SLOWDOWN) -> list[NodeModel]:
    """The node models a plan is evaluated on: every K-FAC item ``slowdown`` longer than profiled."""
    return [slowed_model(job, i, slowdown) for i in range(len(job.nodes))]


def slowed_model(job: Job, i: int, slowdown: float = DEFAULT_SLOWDOWN) -> NodeModel:
    """Node ``i``'s of :func:`slowed_models`."""
    return node_model(inflate_node_kfac(job.nodes[i], 1 + slowdown), job.span)


NodeTimes = dict[tuple[int, object], list[float]]
"""Per (node, its cycle's labels): the node's planned time per iteration, end-of-step work included
(a cache: densities that pack a node alike evaluate it once); the labels stand for themselves by
their :data:`~pipefisher.schedule.packed.KfacLayout` where there is one."""


def step_cost(schedule: Sequence[Sequence[Sequence[str]]], job: Job, slowdown: float = DEFAULT_SLOWDOWN,
              models: Sequence[NodeModel] | None = None, known: NodeTimes | None = None,
              layouts: Sequence[KfacLayout | None] | None = None) -> StepCost:
    """The expected cost per step of a schedule (file data) on ``job``, see the module docstring.

    Per step, the slowest node sets the time (the pipeline couples them): its iteration time (pipeline,
    delays, overflow; K-FAC ``slowdown`` x longer than profiled) plus whatever of its end-of-step work
    its tail bubble does not hide, averaged over the job's cycle (:func:`pipefisher.cost.measure.job_cycle_mean`).
    ``models``: :func:`slowed_models` of the job, where the caller evaluates several schedules; ``known``:
    node times already worked out on them (filled in here); ``layouts``: per node, its labels'
    :data:`~pipefisher.schedule.packed.KfacLayout` where the policy gave one (the same figures, faster).
    """
    models = slowed_models(job, slowdown) if models is None else models
    ends = [end_of_step(n) for n in job.nodes]
    layouts = layouts if layouts is not None else [None] * len(schedule)
    known = {} if known is None else known
    per_node = [node_times(known, i, labels, layout, model, node)
                for i, (labels, layout, model, node) in enumerate(zip(schedule, layouts, models, job.nodes))]
    first_order, floor = 0.0, 0.0
    for m, (u, p) in zip(models, ends):
        _, (ready,) = planned_iterations([_first_order_labels(m)], m, ((),))
        first_order = max(first_order, float(m.base) + _exposed(m, ready, u))
        floor = max(floor, float(m.base) + _exposed(m, ready, u + p))
    return StepCost(max(len(node) for node in schedule), first_order, job_cycle_mean(per_node), floor)


def node_times(known: NodeTimes, i: int, labels: Sequence[Sequence[str]], layout: KfacLayout | None,
               model: NodeModel, node: NodeTimeline) -> list[float]:
    """Node ``i``'s planned time per iteration of its cycle ``labels`` (``layout``: theirs, where known)
    on its slowed ``model``, end-of-step work included: looked up in ``known``, else worked out and
    put there. :func:`step_cost` takes every node's from here; the ``target`` policy's weighing fills
    it in for each node as soon as it is packed, while the others are (the same figures: one function)."""
    key = (i, layout if layout is not None else tuple(map(tuple, labels)))
    times = known.get(key)
    if times is None:
        planned, exposed = exposed_end_of_step(labels, layout, model, node)
        times = known[key] = [t + e for t, e in zip(planned, exposed)]
    return times


def exposed_end_of_step(labels: Sequence[Sequence[str]], layout: KfacLayout | None, model: NodeModel,
                        node: NodeTimeline) -> tuple[list[float], list[float]]:
    """Per iteration of a node's cycle ``labels`` on ``model``: its planned time without end-of-step work
    (:func:`pipefisher.cost.measure.planned_iterations`), and how much the node's end-of-step work (update and
    preconditioning, :func:`end_of_step`) adds to it: the part the tail bubble left after the
    iteration's last K-FAC label does not hide. The planned step and the report take both from here."""
    update, precondition = end_of_step(node)
    planned, ready = planned_iterations(labels, model, layout)
    return planned, [_exposed(model, r, update + precondition) for r in ready]


def _first_order_labels(model: NodeModel) -> list[str]:
    """A node's first-order iteration: its pipeline calls in time order, then ``-- end --``."""
    return [key for key, _, _ in model.pipeline] + [END]


DENSITIES = (0.15, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
"""Room rule margins (:mod:`pipefisher.schedule.problem`) the ``target`` policy packs beside the one asked for:
each leaves K-FAC items that much more room than their profiled time, a sparser, longer cycle."""


# ----------------------------------------------------------------------------------------------------
# The choice


@dataclass(frozen=True)
class Choice:
    """A candidate chosen, why (one line a report prints), and warnings about the choice."""

    chosen: Candidate
    why: str
    warnings: tuple[str, ...] = ()
    within_run: bool = True
    """Whether the chosen cycle fits the run's steps (False: none does, the shortest is flagged)."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def within_run(candidates: Sequence[Candidate], max_cycle: int | None) -> list[Candidate]:
    """The candidates whose cycle the run completes (k <= ``max_cycle``, its steps; every one where no
    length is given); empty where none does (:func:`choose` then says so)."""
    return [c for c in candidates if max_cycle is None or c.cost.cycle <= max_cycle]


def aligned_from(schedule: JobSchedule) -> int | None:
    """The job's cycle before its sync groups were aligned (:mod:`pipefisher.policies.align`), where
    aligning lengthened it (a Chimera pair's members share one cycle, syncs and inverses); else None."""
    before = max((int(n.figures.extra.get("iterations_before_alignment", n.figures.iterations))
                  for n in schedule.nodes), default=0)
    after = max((n.figures.iterations for n in schedule.nodes), default=0)
    return before if before < after else None


def _none_fits(candidates: Sequence[Candidate], max_cycle: int) -> Choice:
    """No candidate's cycle fits the run: the shortest, flagged (``within_run`` False), with a line that
    says so; a run must not train it (:func:`pipefisher.runtime.launch.driver.pack_and_check` refuses)."""
    short = min(candidates, key=lambda c: (c.cost.cycle, c.cost.step, c.margin))
    before = aligned_from(short.schedule)
    stretched = "" if before is None else f", {before} before aligning its sync groups"
    return Choice(short, f"none: no packing's cycle fits the run's {max_cycle} steps; the shortest is k = "
                         f"{short.cost.cycle} at margin {short.margin:g}{stretched} (planned "
                         f"{_pct(short.cost.overhead)} over first-order)",
                  (f"warning: a run of {max_cycle} steps never completes a K-FAC cycle of {short.cost.cycle} "
                   "steps, so some layers' curvature is never refreshed: it needs at least "
                   f"{short.cost.cycle} steps",), within_run=False)


def at_the_floor(densest: Candidate, tolerance: float = NO_CURVE_TOLERANCE) -> bool:
    """Whether the densest packing's planned step is within ``tolerance`` of the floor: then no packing's
    step is lower by more than that, and the rule without a curve keeps it, unpacked ones unseen."""
    return densest.cost.step <= densest.cost.floor * (1 + tolerance)


def choose_without_curve(candidates: Sequence[Candidate], max_cycle: int | None = None,
                         tolerance: float = NO_CURVE_TOLERANCE) -> Choice:
    """The choice that needs no staleness curve, among ``candidates`` in packing order (the first is the
    densest, at the margin asked for):

    1. only cycles the run completes (k <= ``max_cycle``; where none does, the shortest);
    2. the densest packing, tight's shortest cycle at the margin asked for, where its planned step is
       within ``tolerance`` of the floor (no schedule's step is lower by more than that);
    3. else the least planned step and, among the schedules within ``tolerance`` of it, the shortest
       cycle (then the lesser step, then the denser packing), counting a schedule that overflows more
       per step than the densest one (overflow it chose by its margin) only where it has the least step.
    """
    fit = within_run(candidates, max_cycle)
    if not fit:
        assert max_cycle is not None
        return _none_fits(candidates, max_cycle)
    densest = candidates[0]
    if any(c is densest for c in fit) and at_the_floor(densest, tolerance):
        return Choice(densest, f"by planned step time alone: the densest packing (margin {densest.margin:g}, k = "
                               f"{densest.cost.cycle}, planned {_pct(densest.cost.overhead)} over first-order): "
                               f"its planned step is {_pct(densest.cost.above_floor)} above the floor no packing "
                               f"goes below, within {_pct(tolerance)}, so no sparser one could save more step "
                               "time than that")
    least = min(c.cost.step for c in fit)
    forced = densest.overflow_per_step
    eligible = [c for c in fit if c.cost.step <= least * (1 + tolerance)
                and (c.overflow_per_step <= forced or c.cost.step == least)]
    best = min(eligible, key=lambda c: (c.cost.cycle, c.cost.step, c.margin))
    return Choice(best, f"by planned step time alone: the least planned step ({_pct(min(c.cost.overhead for c in fit))} "
                        f"over first-order), then among the schedules within {_pct(tolerance)} of it the "
                        f"shortest cycle: k = {best.cost.cycle} at margin {best.margin:g} (planned "
                        f"{_pct(best.cost.overhead)} over first-order)")


def choose_with_curve(candidates: Sequence[Candidate], max_cycle: int | None = None) -> Choice | None:
    """The least expected time-to-target among the cycles the run completes (a tie goes to the shorter
    cycle, then the denser packing); None where no candidate reaches the target on the curve."""
    finite = [c for c in within_run(candidates, max_cycle)
              if c.relative_time is not None and math.isfinite(c.relative_time)]
    if not finite:
        return None
    best = min(finite, key=_curve_order)
    return Choice(best, f"the least expected time-to-target: {best.relative_time:.3f} x first-order's "
                        f"(k = {best.cost.cycle} at margin {best.margin:g}, planned {_pct(best.cost.overhead)} "
                        "over first-order)")


def _curve_order(c: Candidate) -> tuple[float, int, float]:
    return (c.relative_time if c.relative_time is not None else math.inf, c.cost.cycle, c.margin)


def choose(candidates: Sequence[Candidate], staleness: StalenessCurve | None = None,
           max_cycle: int | None = None, tolerance: float = NO_CURVE_TOLERANCE) -> Choice:
    """The whole rule on ``candidates`` (every density, in packing order): with a curve, the least
    expected time-to-target; without one, or where no candidate reaches the target on it (a warning
    says so), :func:`choose_without_curve` at ``tolerance``."""
    if not candidates:
        raise ValueError("no candidate schedules")
    if staleness is not None:
        chosen = choose_with_curve(candidates, max_cycle)
        if chosen is not None:
            return chosen
    plain = choose_without_curve(candidates, max_cycle, tolerance)
    if staleness is None or not plain.within_run:
        return plain
    never = ", ".join(str(k) for k in sorted({c.cost.cycle for c in candidates}))
    which = "no density" if max_cycle is None else f"no density whose cycle the run's {max_cycle} steps complete"
    return Choice(plain.chosen, plain.why, (f"warning: {which} reaches the target on the staleness curve "
                                            f"(k = {never}); chosen as without a curve",))


# ----------------------------------------------------------------------------------------------------
# The weighing


@dataclass(frozen=True)
class Tradeoff:
    """What the ``target`` policy weighed, carried by the schedule it chose (``JobSchedule.tradeoff``)."""

    candidates: tuple[Candidate, ...]
    chosen: Candidate
    staleness: StalenessCurve | None
    slowdown: float
    why: str = ""
    warnings: tuple[str, ...] = ()
    unpacked: tuple[str, ...] = ()
    """Densities not packed, and why they could not have been chosen."""
    max_cycle: int | None = None
    within_run: bool = True
    """Whether the chosen cycle fits the run's ``max_cycle`` steps (False: no packing's does)."""
    tolerance: float = NO_CURVE_TOLERANCE
    """The rule without a curve's tie: planned steps this close (a fraction) count as equal."""

    def lines(self) -> list[str]:
        """The table reports print: per candidate k, planned overhead and overflow per step, and with a
        curve the expected time-to-target; then why the chosen one, and what was not packed."""
        from pipefisher.schedule.timeline import format_time

        curve = self.staleness
        if curve is not None:
            head = (f"time-to-target trade-off (K-FAC items {1 + self.slowdown:g}x their profiled time; staleness "
                    f"{curve.describe()}):")
        else:
            head = (f"packing densities weighed (K-FAC items {1 + self.slowdown:g}x their profiled time; no "
                    "staleness curve for this job, so no time-to-target is predicted: --staleness gives one):")
        cols = f"  {'k':>3}  {'margin':>6}  {'overhead/step':>13}  {'overflow/step':>13}"
        if curve is not None:
            cols += f"  {'steps vs first-order':>20}  {'time-to-target vs first-order':>29}"
        out = [head, cols]
        for c in self.candidates:
            over = c.overflow_per_step
            row = (f"  {c.cost.cycle:>3}  {c.margin:>6g}  {100 * c.cost.overhead:>12.1f}%  "
                   f"{format_time(round(over) if isinstance(c.schedule.span, int) else over):>13}")
            if curve is not None:
                rel, steps = c.relative_time, c.relative_steps
                row += (f"  {'never' if steps is None or math.isinf(steps) else f'{steps:.3f}':>20}  "
                        f"{'never' if rel is None or math.isinf(rel) else f'{rel:.3f}':>29}")
            mark = "  <- chosen" if self.within_run else "  <- the shortest, longer than the run"
            out.append(row + (mark if c is self.chosen else ""))
        out.append(f"  chosen: {self.why}" + (f" (cycles up to the run's {self.max_cycle} steps)"
                                                if self.max_cycle is not None and self.within_run else ""))
        out += [f"  not packed: {u}" for u in self.unpacked]
        out += [f"  {w}" for w in self.warnings]
        return out

    def data(self) -> dict[str, object]:
        """For ``--json`` reports."""
        def num(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else round(x, 6)

        curve = self.staleness
        return {"staleness": None if curve is None else {"points": [[k, num(r)] for k, r in curve.points],
                                                          "source": curve.describe()},
                "slowdown": self.slowdown, "why": self.why, "warnings": list(self.warnings),
                "unpacked": list(self.unpacked), "max_cycle": self.max_cycle,
                "within_run": self.within_run, "tolerance": self.tolerance,
                "candidates": [{"margin": c.margin, "cycle": c.cost.cycle, "overhead": num(c.cost.overhead),
                                "overflow_per_step": num(c.overflow_per_step),
                                "relative_steps": num(c.relative_steps), "relative_time": num(c.relative_time),
                                "chosen": c is self.chosen} for c in self.candidates]}


CycleBound = Callable[[Job, float, Sequence[int]], Iterator[int]]
"""Proven lower bounds on the cycle of any valid schedule of a job at a margin (the policy's bounds): one
per node, of the nodes given in that order; their running maximum bounds the job's cycle k."""


@dataclass
class _Weighing:
    """Densities packed and evaluated on demand, each once; a schedule another density already gave is
    left out (it would tie, and the denser one wins a tie)."""

    job: Job
    pack: Callable[..., JobSchedule]
    staleness: StalenessCurve | None
    slowdown: float
    margins: list[float]
    each_node: bool = False  # ``pack`` takes a third argument, :meth:`evaluate` (see :func:`tradeoff`)
    models: list[NodeModel | None] = field(default_factory=list)  # slowed, made as nodes need them
    known: NodeTimes = field(default_factory=dict)
    done: dict[float, Candidate | None] = field(default_factory=dict)

    def model(self, i: int) -> NodeModel:
        """Node ``i``'s slowed model (:func:`slowed_model`), made once."""
        if not self.models:
            self.models = [None] * len(self.job.nodes)
        model = self.models[i]
        if model is None:
            model = self.models[i] = slowed_model(self.job, i, self.slowdown)
        return model

    def evaluate(self, i: int, node: NodeSchedule) -> None:
        """Work out node ``i``'s planned times for ``node``, its schedule as the packer has it so far (into
        ``known``, where :func:`step_cost` finds them if the packed job keeps that schedule)."""
        node_times(self.known, i, node.iterations, node.layout, self.model(i), self.job.nodes[i])

    def get(self, m: float) -> Candidate | None:
        if m not in self.done:
            packed = self.pack(self.job, m, self.evaluate) if self.each_node else self.pack(self.job, m)
            same = next((c for c in self.done.values() if c is not None and _same(c.schedule, packed)), None)
            if same is not None:
                self.done[m] = None
            else:
                models = [self.model(i) for i in range(len(self.job.nodes))]
                cost = step_cost([n.iterations for n in packed.nodes], self.job, self.slowdown, models,
                                 self.known, [n.layout for n in packed.nodes])
                steps = None if self.staleness is None else self.staleness.at(cost.cycle)
                self.done[m] = Candidate(m, packed, cost, steps)
        return self.done[m]

    def packed(self) -> list[Candidate]:
        return [c for m in self.margins if (c := self.done.get(m)) is not None]


def _same(a: JobSchedule, b: JobSchedule) -> bool:
    return len(a.nodes) == len(b.nodes) and all(x.iterations == y.iterations for x, y in zip(a.nodes, b.nodes))


def tradeoff(job: Job, pack: Callable[..., JobSchedule], margin: float,
             staleness: StalenessCurve | None = None, slowdown: float = DEFAULT_SLOWDOWN,
             max_cycle: int | None = None, bound: CycleBound | None = None, prune: bool = True,
             each_node: bool = False, tolerance: float = NO_CURVE_TOLERANCE) -> Tradeoff:
    """Pack ``job`` at ``margin`` and the sparser :data:`DENSITIES` (``pack(job, m)``), evaluate each
    distinct schedule, and choose (:func:`choose`): every density is weighed, whatever its k.

    With ``prune`` (``False`` only to test that it changes nothing), densities that cannot be chosen are
    not packed: without a curve, every one but the densest where that is at the floor
    (:func:`at_the_floor`, the rule's second step); with one, a density whose cycle is at least what
    ``bound`` proves, where the curve (at its least from there on) times the floor's step ratio cannot
    beat the best so far, or never reaches the target (packed after all where no density does and the
    rule without a curve needs them).

    With ``each_node``, ``pack(job, m, each)`` calls ``each(i, node_schedule)`` as soon as it has node
    ``i``'s schedule (``tight``'s :func:`~pipefisher.policies.tight.pack_nodes`): the node is evaluated
    then, while the packer works on the others (in worker processes, on a big job), rather than after.
    A node the packer changes after that (aligning sync groups) is evaluated again: the figures are
    looked up by the node's schedule, so they are the same either way.

    ``tolerance``: the rule without a curve's tie (:func:`choose_without_curve`).
    """
    margins = [margin, *(d for d in DENSITIES if d > margin)]
    w = _Weighing(job, pack, staleness, slowdown, margins, each_node)
    unpacked: list[str] = []
    if not prune:
        for m in margins:
            w.get(m)
    elif staleness is not None:
        densest = w.get(margins[0])
        assert densest is not None
        best = densest if _reaches(densest, max_cycle) else None
        # the nodes whose bound is likeliest to be high first: the densest packing's longest cycles
        order = sorted(range(len(densest.schedule.nodes)), key=lambda i: -densest.schedule.nodes[i].figures.iterations)
        floor = densest.cost.floor / densest.cost.first_order if densest.cost.first_order else 1.0
        upto = max_cycle if max_cycle is not None else math.inf
        never: list[float] = []  # densities no cycle of which reaches the target: needed only if none does
        for m in margins[1:]:
            why = None if bound is None else _cannot_win(staleness, bound(job, m, order), floor, upto, best)
            if why is not None:
                if math.isinf(why[0]):
                    never.append(m)
                else:
                    unpacked.append(f"margin {m:g} (cycle k >= {why[1]}, where the curve gives at best "
                                    f"{why[0]:.3f} x first-order's time)")
                continue
            c = w.get(m)
            if c is not None and _reaches(c, max_cycle) and (best is None or _curve_order(c) < _curve_order(best)):
                best = c
        if best is None:  # no finite candidate: the rule without a curve decides, over every density
            _without_curve(w, max_cycle, unpacked, tolerance)
        elif never:
            unpacked.append(f"margins {', '.join(f'{m:g}' for m in never)} (their cycles never reach the "
                            "target on the curve)")
    else:
        _without_curve(w, max_cycle, unpacked, tolerance)
    candidates = w.packed()
    choice = choose(candidates, staleness, max_cycle, tolerance)
    return Tradeoff(tuple(candidates), choice.chosen, staleness, slowdown, choice.why, choice.warnings,
                    tuple(unpacked), max_cycle, choice.within_run, tolerance)


def _reaches(c: Candidate, max_cycle: int | None) -> bool:
    """Whether a candidate can be chosen by the curve: a cycle the run completes, and a finite time."""
    return (max_cycle is None or c.cost.cycle <= max_cycle) and c.relative_time is not None \
        and math.isfinite(c.relative_time)


def _cannot_win(curve: StalenessCurve, bounds: Iterator[int], floor: float, upto: float,
                best: Candidate | None) -> tuple[float, int] | None:
    """(the least time-to-target ratio, the cycle bound proving it) where a density cannot be chosen by the
    curve: no cycle from its bound on reaches the target (ratio inf), or none beats ``best`` (the curve
    at its least from there on times the floor's step ratio, and a tie on time and cycle goes to the
    denser ``best``); None where that is not proven. Stops at the first node whose bound proves it."""
    k = 0
    for b in bounds:
        k = max(k, b)
        least = curve.least_from(k, upto) * floor
        if math.isinf(least) or (best is not None and (least, k) >= _curve_order(best)[:2]):
            return least, k
    return None


def _without_curve(w: _Weighing, max_cycle: int | None, unpacked: list[str],
                   tolerance: float = NO_CURVE_TOLERANCE) -> None:
    """Pack what :func:`choose_without_curve` at ``tolerance`` needs: the densest alone where it is at the
    floor."""
    densest = w.get(w.margins[0])
    assert densest is not None
    if (max_cycle is None or densest.cost.cycle <= max_cycle) and at_the_floor(densest, tolerance):
        rest = [m for m in w.margins[1:] if m not in w.done]
        if rest:
            unpacked.append(f"margins {', '.join(f'{m:g}' for m in rest)} (the densest packing is at the floor)")
        return
    for m in w.margins:
        w.get(m)


# ----------------------------------------------------------------------------------------------------
# The refresh's piece count (``kfac.refresh_pieces: best``)


PIECE_CHOICES = (1, 2, 4)
"""The piece counts ``kfac.refresh_pieces: best`` profiles and packs (``pipefisher run``, the convergence
benchmark). 1 is the whole refresh; 2 and 4 pieces cost 0.7-1.1x the whole in all from about 500 columns
on, their longest piece 0.2-0.6x it (docs/benchmarks.md, "A refresh in pieces"); from 8 pieces on the
pieces grow uneven (their longest 1.3-2.6x an even share at 513-1024 columns) and gain little; and each
count tried is one more profile of the run."""


@dataclass(frozen=True)
class PiecesPacked:
    """One piece count's packing, as :func:`best_pieces` weighs it."""

    pieces: int
    step_ms: float
    """The packing's planned step (ms): :func:`step_cost`, or the ``target`` policy's own choice's."""
    cycle: int
    """The packing's K-FAC cycle k (its longest node cycle)."""

    def to_dict(self) -> dict[str, float | int]:
        return {"pieces": self.pieces, "planned_step_ms": round(self.step_ms, 3), "cycle": self.cycle}


def best_pieces(packed: Sequence[PiecesPacked], tolerance: float = NO_CURVE_TOLERANCE) -> PiecesPacked:
    """The piece count to keep: among the counts whose planned step is within ``tolerance`` of the least
    (what a user pays per step, as the ``target`` policy weighs it without a staleness curve:
    :func:`choose_without_curve`), the shorter cycle (fresher curvature at the same price), then fewer
    pieces (the same refresh in fewer calls), then the shorter planned step.

    Why not the least planned step alone: the counts are profiled one after another, and their planned
    steps differ by the profiles' noise (1-2 % on a CPU); the 300-step race on 5121b1b kept 4 pieces for
    a plan 1.2 % shorter than 1 piece's, packed at k = 4 (the race before, on 7e03c37, had kept 1 piece
    at k = 2-3), and lost (docs/benchmarks.md, "The moment carried into a new basis in the refresh's label")."""
    if not packed:
        raise ValueError("no piece count was packed")
    least = min(p.step_ms for p in packed)
    near = [p for p in packed if p.step_ms <= least * (1 + tolerance)]
    return min(near, key=lambda p: (p.cycle, p.pieces, p.step_ms))


def pieces_line(packed: Sequence[PiecesPacked], kept: PiecesPacked) -> str:
    """The one line a run says about its choice: every count's planned step and the count kept."""
    return (f"refresh pieces: {', '.join(f'{p.pieces} {p.step_ms:.1f} ms' for p in packed)} planned: "
            f"{kept.pieces} kept")
