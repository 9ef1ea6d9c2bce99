"""Schedulers with the loop in them: they observe how the schedule they handed out really ran, and
hand out the next one.

A packing policy (:mod:`pipefisher.policies`) turns one profile into one schedule. A training run
drifts from its profile (K-FAC pieces interleaved with the pipeline run slower than profiled alone,
forwards and backwards jitter, a bubble overrun delays the next stage), so a :class:`Scheduler` keeps
packing while the job runs: at the end of every job cycle the trainer gives it that cycle's measured
steps (:meth:`Scheduler.observe`) and asks which schedule runs next (:meth:`Scheduler.next_schedule`).
Schedulers are plain Python, no torch: the runtime calls them on one rank, between steps (never inside
a bubble), and hands their answer to every worker.

* :class:`StaticScheduler` keeps the schedule it started with: today's behaviour, exactly.
* :class:`AdaptiveScheduler` re-packs a timeline measured over its last cycles (robust quantiles, not
  one noisy sample) when the current schedule's work overruns its bubbles, and tries more K-FAC slack
  while the measured step time improves by a margin (going back where it does not). Its cycle k follows
  a staleness curve when one is given; without one it stays the packing's k, unless the drift rule is
  asked for (``drift``, opt-in until it is validated beyond the job it was fitted on: docs/adapt.md),
  which follows the run's own curvature drift (:mod:`pipefisher.loop.drift`: longer while the curvature
  barely moves between refreshes, shorter when it moves much).
"""
from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Iterator, Sequence

from pipefisher.loop.drift import AGING_HIGH, AGING_LOW, DRIFT_MAX_CYCLE, DRIFT_MIN_REFRESHES, DriftRule, Refresh
from pipefisher.cost.measure import StepRecord, expected_step_time, unit_seconds, window_timelines
from pipefisher.schedule.problem import DEFAULT_MARGIN, NodeModel, node_model
from pipefisher.schedule.format import ScheduleData
from pipefisher.schedule.file import schedule_digest


Timelines = list[dict[str, list[tuple[int, int]]]]


@dataclass(frozen=True)
class Plan:
    """A schedule handed out: the labels every node walks, and what it was planned on.

    ``timelines``: the job (profiled format, one dict per node) its placements were planned on, None
    for a schedule file given without its timelines; ``margin``: the room rule's margin it was packed
    under; ``expected_seconds``: its expected step time on the timeline measured when it was chosen;
    ``reason``: why it was chosen, for the run's history; ``overlap``: its cycles overlap (some refresh
    pieces come before their factor's completion, :mod:`pipefisher.schedule.problem`): its checks take the
    overlapping rules; at a switch every refresh under way ends at once, whatever either schedule is
    (:meth:`pipefisher.runtime.pipeline.executor.ScheduleExecutor.switch`).
    """

    data: ScheduleData
    reason: str = "initial schedule"
    timelines: Timelines | None = None
    margin: float = DEFAULT_MARGIN
    expected_seconds: float | None = None
    overlap: bool = False
    digest: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", schedule_digest(self.data))

    @property
    def cycles(self) -> list[int]:
        """Each node's cycle k."""
        return [len(node) for node in self.data]

    @cached_property
    def models(self) -> tuple[NodeModel, ...] | None:
        """The node models of :attr:`timelines` (None without them)."""
        return None if self.timelines is None else job_models(self.timelines, self.margin)[1]

    def state(self) -> dict[str, Any]:
        """JSON-able: what a checkpoint keeps of the active plan."""
        return {"data": self.data, "reason": self.reason, "timelines": self.timelines, "margin": self.margin,
                "expected_seconds": self.expected_seconds, "overlap": self.overlap}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Plan":
        tl = state.get("timelines")
        return cls([[list(map(str, it)) for it in node] for node in state["data"]], str(state.get("reason", "")),
                   None if tl is None else [{str(k): [(a, b) for a, b in v] for k, v in d.items()} for d in tl],
                   float(state.get("margin", DEFAULT_MARGIN)), state.get("expected_seconds"),
                   bool(state.get("overlap", False)))


def job_models(timelines: Sequence[dict[str, Any]], margin: float) -> tuple[Any, tuple[NodeModel, ...]]:
    """The job of per-node timeline dicts, and its node models under the room rule's ``margin``."""
    from pipefisher.schedule.timeline import job_from_dicts

    job = job_from_dicts(list(timelines), [f"<measured node{n}>" for n in range(len(timelines))])
    return job, tuple(node_model(n, job.span, margin) for n in job.nodes)


class Scheduler(ABC):
    """Observes the measured steps of the current schedule's cycles; says which schedule runs next."""

    name: ClassVar[str]

    def __init__(self, initial: Plan) -> None:
        self.current = initial

    @abstractmethod
    def observe(self, records: Sequence[StepRecord]) -> None:
        """One job cycle of the current schedule as it ran: every node's (and replica's) step records."""

    @abstractmethod
    def next_schedule(self) -> Plan:
        """The schedule of the next job cycle: :attr:`current` to keep it, or a new one to switch to."""

    def learned(self, plan: Plan) -> None:
        """The runtime learned what a schedule handed out was planned on (its first measured cycle, for a
        schedule file given without its profile): ``plan`` is that schedule, with its timelines."""
        if plan.digest == self.current.digest:
            self.current = plan

    def observe_drift(self, refreshes: Sequence[Refresh]) -> None:
        """The curvature refreshes (:mod:`pipefisher.loop.drift`) completed in the cycle just observed, after
        :meth:`observe`; ignored unless the scheduler decides by them."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to decide as the uninterrupted one would (JSON-able)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content."""


class StaticScheduler(Scheduler):
    """The schedule it was given, for the whole run."""

    name = "static"

    def observe(self, records: Sequence[StepRecord]) -> None:
        pass

    def next_schedule(self) -> Plan:
        return self.current


def equal_cycles(data: ScheduleData, k: int | None = None) -> ScheduleData:
    """Every node's cycle made ``k`` long (default: as long as the longest): a shorter one gets
    iterations of its pipeline alone at its end, with saving turned back on at the new last one. Then
    the whole job is at a cycle boundary every k steps, where a new schedule can start on every worker
    at once (with cycles of 22 and 23 iterations that would otherwise take 506 steps). A node that
    refreshed its curvature every k_n < k steps now does so every k: a ``k`` beyond the longest cycle
    lengthens the job's cycle with pipeline-only iterations (the drift rule's way to refresh less
    often, :class:`AdaptiveScheduler`)."""
    from pipefisher.cost.measure import is_pipeline
    from pipefisher.schedule.format import END, SAVE_ON, START

    longest = max(len(node) for node in data)
    if k is None:
        k = longest
    if k < longest:
        raise ValueError(f"a cycle of {k} iterations cannot hold a node's {longest}")
    out = []
    for node in data:
        if len(node) == k:
            out.append([list(it) for it in node])
            continue
        body = [list(it) for it in node]
        body[-1] = [label for label in body[-1] if label != SAVE_ON]
        calls = [label for label in node[0] if is_pipeline(label)]
        body += [[START, *calls, END] for _ in range(k - len(node))]
        body[-1].append(SAVE_ON)
        out.append(body)
    return out


def cycle_seconds(records: Sequence[StepRecord]) -> float:
    """Mean step time of a job cycle: per step, its slowest node (the pipeline couples them)."""
    per_step: dict[int, float] = {}
    for r in records:
        per_step[r.step] = max(per_step.get(r.step, 0.0), r.seconds)
    return statistics.fmean(per_step.values()) if per_step else 0.0


SLACK_LADDER = (1.0, 1.25, 1.5, 2.0, 3.0)
"""K-FAC time factors the adaptive scheduler packs the measured timeline with (rung 0: as measured)."""


class AdaptiveScheduler(Scheduler):
    """Re-packs the timeline measured over the last ``window`` job cycles, and keeps what measures fastest.

    The measured timeline takes the ``q``-quantile of every duration over the window
    (:func:`pipefisher.cost.measure.measured_timeline`), so a schedule packed on it fits the work as it runs.
    Packing K-FAC work densely costs more than its own time, though (it slows the forwards and
    backwards around it, a shorter cycle saves micro-batches more often), and no timeline shows that;
    so every change but a repair and a drift resize is a *trial*, kept only if the measured step time
    says so:

    * **repair**: when the schedule's work overran its planned bubbles significantly (beyond the room
      rule's margin) at the same place (node and iteration) two cycles in a row, it is re-packed from
      the measurements at its K-FAC slack; if that re-pack overruns too, at the next slack of ``ladder``
      (a schedule on trial that overruns has failed its trial instead). Without a curve a repair
      stays within its k: the re-pack at that slack if it fits, else the densest that does, else none;
    * **more slack** (a trial): packed with the next factor of ``ladder``, kept if its value (the median
      step time of ``settle`` cycles, see :meth:`value`) beats the kept schedule's by more than ``tie``,
      and then the next factor is tried; otherwise the scheduler goes back to the kept schedule and stops
      climbing;
    * **shorter cycle** (a trial, once climbing is over, with a staleness curve): a re-pack at the kept
      slack that needs fewer iterations, kept if no slower than ``tie`` (fresher curvature wins a tie).

    **Which cycle k.** Given a ``staleness`` curve (:class:`pipefisher.cost.staleness.StalenessCurve`), a
    schedule's value is its measured step time x the curve at its k, so more slack that lengthens the
    cycle must save more step time than its staler curvature costs in steps. Without one (``None``), k
    stays the initial schedule's (:attr:`fixed_k`: the rules below at a k that never moves), unless
    ``drift`` is set (opt-in: docs/adapt.md): then the run's own drift decides (:mod:`pipefisher.loop.drift`,
    :meth:`observe_drift`): a :class:`DriftRule` sets the cycle k every schedule runs at, doubling it
    when the curvature's aging over a cycle is clearly small and halving it when it is clearly large.
    Schedules are then judged by step time alone, all at that k. A packing that needs fewer iterations
    than k is lengthened to k by pipeline-only iterations appended to its cycle (:func:`equal_cycles`);
    more slack is tried only where its packing fits in k; a shorter k goes back to denser rungs (a re-pack
    at the kept slack, then at less slack) and stops at the densest packing (the rule's floor: no
    voluntary overflow). A resize is no trial: the drift says so, and it is logged with its figures.

    Re-packs let cycles overlap as ``overlap`` says (None: the policy's default, on for ``tight``); a switch
    to or from an overlapping schedule is safe because every refresh under way ends at the switch
    (:meth:`pipefisher.runtime.pipeline.executor.ScheduleExecutor.switch`).

    The ladder is the density search the ``target`` policy does on a model, done here on measurements:
    its re-packs use ``tight`` (``target`` would search again inside each rung), and the climb starts at
    the rung nearest the initial schedule's margin. Going back restores the kept schedule itself, whose
    step time was measured, never a re-pack of it.
    """

    name = "adaptive"

    def __init__(self, initial: Plan, nodes: int, *, policy: str = "tight", margin: float = DEFAULT_MARGIN,
                 window: int = 4, q: float = 0.5, settle: int = 2, tie: float = 0.04,
                 ladder: Sequence[float] = SLACK_LADDER, staleness: Any = None, aging_low: float = AGING_LOW,
                 aging_high: float = AGING_HIGH, max_cycle: int = DRIFT_MAX_CYCLE,
                 drift_min_refreshes: int = DRIFT_MIN_REFRESHES, drift: bool = False,
                 overlap: bool | None = None) -> None:
        super().__init__(initial)
        if window < 1 or settle < 1 or not 0 <= q <= 1 or not 0 <= tie < 1 or not ladder \
                or any(g < 1 for g in ladder):
            raise ValueError("window and settle must be >= 1, q in [0, 1], tie in [0, 1), and the ladder's "
                             "factors >= 1")
        self.nodes, self.margin = nodes, margin
        self.policy = "tight" if policy == "target" else policy
        self.overlap = overlap  # re-packs may overlap cycles (None: the policy's default)
        self.window, self.q, self.settle, self.tie = window, q, settle, tie
        self.ladder = tuple(ladder)
        self.staleness = staleness  # None: no curve; k is the initial packing's, or the drift rule's
        self.rule = DriftRule(max(initial.cycles), aging_low, aging_high, max_cycle, drift_min_refreshes) \
            if staleness is None and drift else None
        self.fixed_k = max(initial.cycles) if staleness is None and not drift else None
        """Without a curve or the drift rule: the cycle every schedule runs at (the packing's)."""
        self._natural: dict[str, ScheduleData] = {}  # digest of a lengthened plan -> the packing it lengthens
        self._cycles: deque[list[StepRecord]] = deque(maxlen=window)
        self._since_switch = 0
        start = min(range(len(self.ladder)),  # the initial schedule's slack, as a rung
                    key=lambda r: abs(self.ladder[r] - (1 + initial.margin) / (1 + margin)))
        self.kept, self.kept_rung = initial, start  # the schedule that measured best so far, and its slack
        self.rung = start  # the current schedule's slack (an index into ladder)
        self.trial: str | None = None  # "slack" or "cycle" while the current schedule is on trial
        self.climbing, self.shorter_tried = True, False
        self.costs: dict[str, list[float]] = {}  # schedule digest -> mean step seconds of its cycles
        self.overran: list[list[list[int]]] = []  # the current schedule's last two cycles: where it overran
        self._repaired = False  # the current schedule is a repair at its slack
        self.last_decision: dict[str, Any] = {}

    def observe(self, records: Sequence[StepRecord]) -> None:
        self._cycles.append(list(records))
        self._since_switch += 1
        self.costs.setdefault(self.current.digest, []).append(cycle_seconds(records))
        self.overran = self.overran[-1:] + [sorted(map(list, overran(records, self.current)))]

    def observe_drift(self, refreshes: Sequence[Refresh]) -> None:
        """The drift rule's input (each refresh's aging), without a staleness curve: only refreshes whose
        refreshes one and two back were k and 2k steps before them, at the k in force. Right after a
        switch they are not (the old schedule placed them, at its distances), nor at a run's start."""
        if self.rule is None:
            return
        k = max(self.current.cycles)
        for r in refreshes:
            if r.aging is not None and r.lags == (k, 2 * k):
                self.rule.observe(r.aging)

    def measured_timelines(self) -> Timelines:
        """Every node's timeline measured over the window (:func:`pipefisher.cost.measure.window_timelines`)."""
        records = [r for cycle in self._cycles for r in cycle]
        return window_timelines(records, self.nodes, self.current.models, self.q)

    def learned(self, plan: Plan) -> None:
        super().learned(plan)
        if plan.digest == self.kept.digest:
            self.kept = plan

    def cost(self, plan: Plan) -> float | None:
        """A schedule's step time: the median of its last ``settle`` cycles (None before it ran that many)."""
        c = self.costs.get(plan.digest, [])
        return statistics.median(c[-self.settle:]) if len(c) >= self.settle else None

    def value(self, plan: Plan) -> float | None:
        """What a schedule costs the user: its step time, times the staleness curve at its cycle k when
        one is given (the steps to the target relative to first-order); None before it ran ``settle``
        cycles. Without a curve every schedule compared runs at the k the drift rule set."""
        c = self.cost(plan)
        if c is None or self.staleness is None:
            return c
        return c * self.staleness.at(max(plan.cycles))

    def next_schedule(self) -> Plan:
        if not self._cycles:
            return self.current
        again = [p for p in self.overran[-1] if p in self.overran[0]] if len(self.overran) == 2 else []
        self.last_decision = {"rung": self.rung, "factor": self.ladder[self.rung], "trial": self.trial,
                              "cost": self.cost(self.current), "kept_cost": self.cost(self.kept),
                              "value": self.value(self.current), "kept_value": self.value(self.kept),
                              "overran": self.overran[-1] if self.overran else []}
        if self.rule is not None:
            self.last_decision.update(cycle=self.rule.cycle, aging=self.rule.evidence)
        elif self.fixed_k is not None:
            self.last_decision.update(cycle=self.fixed_k)
        if again:
            where = ", ".join(f"node {n} iteration {i}" for n, i in again[:3]) + (", ..." if len(again) > 3 else "")
            over = f"its K-FAC work overran its bubbles two cycles in a row ({where})"
            if self.trial is not None:  # a trial that overruns has failed
                self.climbing = self.climbing and self.trial != "slack"
                self.shorter_tried = True
                self.trial = None
                return self._restore(f"back to the kept schedule (K-FAC slack x{self.ladder[self.kept_rung]:g}): "
                                     f"the one on trial overran ({where})")
            up = self._repaired and self.rung + 1 < len(self.ladder)  # a re-pack as measured was not enough
            why = f"{over}" + (": more slack" if up else ": re-packed as measured")
            k = self._k()
            if k is None:
                plan, rung = self._pack(self.rung + up, why), self.rung + up
            else:  # within the cycle in force: at this slack, else the densest that fits
                fits = next(((p, r) for p, r in self._repacks(self.rung + up, why, k) if len(self.natural(p)[0]) <= k),
                            None)
                if fits is None:  # staler curvature is not the price of a repair: the overruns stay
                    self.overran = []
                    self.last_decision["repair_blocked"] = f"{over}, and no re-pack fits {self._k_text()}"
                    return self.current
                plan, rung = fits
                if rung != self.rung + up:
                    plan = Plan(plan.data, f"{plan.reason} (the densest re-pack that fits {self._k_text()})",
                                plan.timelines, plan.margin, plan.expected_seconds, plan.overlap)
            plan = self._hand_out(plan, rung)
            self.kept, self.kept_rung, self.trial, self._repaired, self.shorter_tried = plan, self.rung, None, True, False
            return plan
        if self._since_switch < self.settle:
            return self.current
        here, kept = self.value(self.current), self.value(self.kept)
        if self.trial is not None and here is not None and kept is not None:
            better = here < kept * (1 - self.tie) or (self.trial == "cycle" and here <= kept * (1 + self.tie))
            trial, self.trial = self.trial, None
            if better:
                self.kept, self.kept_rung = self.current, self.rung
                if trial == "slack" and self.rung + 1 < len(self.ladder):
                    return self._try_slack(self.cost(self.current))
                self.climbing = self.climbing and trial != "slack"
                return self.current
            if trial == "slack":
                self.climbing = False
            else:
                self.shorter_tried = True
            why = (f"back to the kept schedule (K-FAC slack x{self.ladder[self.kept_rung]:g}, "
                   f"{self._costs_text(self.kept)}; the {'slack' if trial == 'slack' else 'shorter cycle'} "
                   f"tried: {self._costs_text(self.current)})")
            return self._restore(why)
        if self.rule is not None:
            resized = self._follow_drift()
            if resized is not None:
                return resized
        if self.climbing and self.rung + 1 < len(self.ladder):
            return self._try_slack(self.cost(self.current))
        self.climbing = False
        if not self.shorter_tried and self.staleness is not None:  # without a curve k is set (fixed or drift)
            self.shorter_tried = True
            plan = self._pack(self.rung, "a shorter cycle, tried")
            if max(plan.cycles) < max(self.current.cycles):
                self._hand_out(plan, self.rung)
                self.trial = "cycle"
                return plan
        return self.current

    def _k(self) -> int | None:
        """The cycle every schedule runs at: the drift rule's, else the packing's where there is no curve
        (None with a staleness curve: every packing at its own k)."""
        return self.rule.cycle if self.rule is not None else self.fixed_k

    def _k_text(self) -> str:
        """The cycle in force, and what set it, in words (where there is one: no curve)."""
        return f"the k = {self._k()} " + ("the drift allows" if self.rule is not None else "of the initial packing")

    def _costs_text(self, plan: Plan) -> str:
        c, v = self.cost(plan), self.value(plan)
        if c is None or v is None:
            return "not measured"
        text = f"{c * 1e3:.1f} ms per step, k = {max(plan.cycles)}"
        return text if self.staleness is None else f"{text}, {v * 1e3:.1f} ms x steps-to-target ratio"

    def _try_slack(self, here: float | None) -> Plan:
        ms = f" ({here * 1e3:.1f} ms per step at x{self.ladder[self.rung]:g})" if here is not None else ""
        plan = self._pack(self.rung + 1, f"trying K-FAC slack x{self.ladder[self.rung + 1]:g}{ms}", self._k())
        k = self._k()
        if k is not None and len(self.natural(plan)[0]) > k:  # it needs a longer cycle than the one in force
            self.climbing = False
            self.last_decision["blocked"] = (f"K-FAC slack x{self.ladder[self.rung + 1]:g} packs into "
                                             f"{len(self.natural(plan)[0])} iterations, more than {self._k_text()}")
            return self.current
        self._hand_out(plan, self.rung + 1)
        self.trial = "slack"
        return plan

    def _follow_drift(self) -> Plan | None:
        """The schedule at the cycle the drift rule proposes (None: no proposal, or nothing to change):
        the kept packing lengthened to it, or, for a cycle shorter than that packing, the densest re-pack
        that fits it (at the kept slack first, then less)."""
        assert self.rule is not None
        proposal = self.rule.proposal()
        if proposal is None:
            return None
        want, why = proposal
        now = max(self.current.cycles)
        base, rung = self.kept, self.kept_rung
        if len(self.natural(base)[0]) > want:  # the kept packing needs more iterations: a denser one
            best: tuple[Plan, int] | None = None
            for plan, r in self._repacks(self.kept_rung, "a denser packing for a shorter cycle"):
                if best is None or max(plan.cycles) < max(best[0].cycles):
                    best = (plan, r)
                if max(plan.cycles) <= want:
                    break
            assert best is not None
            if max(best[0].cycles) >= now:  # nothing packs shorter: the densest packing is the floor
                self.rule.at_floor()
                self.last_decision["drift_floor"] = f"{why}; no packing needs fewer than {now} iterations"
                return None
            base, rung = best
        k = max(want, len(self.natural(base)[0]))
        natural = self.natural(base)
        padded = equal_cycles(natural, k)
        extra = f", {k - len(natural[0])} pipeline-only iterations appended" if k > len(natural[0]) else ""
        models = base.models
        expected = None if models is None else expected_step_time(padded, models) * unit_seconds(models[0])
        plan = Plan(padded, f"{why}: k {now} -> {k} (K-FAC slack x{self.ladder[rung]:g}{extra})", base.timelines,
                    base.margin, expected, base.overlap)
        self._natural[plan.digest] = natural
        self._hand_out(plan, rung)
        self.kept, self.kept_rung, self.trial = plan, rung, None
        self.rule.moved(k)
        if k > now:  # more slack may fit the longer cycle
            self.climbing = self.rung + 1 < len(self.ladder)
        return plan

    def _repacks(self, top: int, why: str, cycle: int | None = None) -> Iterator[tuple[Plan, int]]:
        """Re-packs of the measured timeline at rung ``top``, then at every denser one down to the densest
        (lengthened to ``cycle`` where they need fewer iterations), with their rungs, packed as asked for."""
        for r in range(top, -1, -1):
            yield self._pack(r, why, cycle), r

    def natural(self, plan: Plan) -> ScheduleData:
        """The packing a plan runs (every node's cycle equal), before pipeline-only iterations lengthened it."""
        return self._natural.get(plan.digest, plan.data)

    def _restore(self, why: str) -> Plan:
        kept = self.kept
        self.current = Plan(kept.data, why, kept.timelines, kept.margin, kept.expected_seconds, kept.overlap)
        self.rung, self._since_switch, self.overran, self._repaired = self.kept_rung, 0, [], False
        return self.current

    def _pack(self, rung: int, why: str, cycle: int | None = None) -> Plan:
        """The measured timeline packed with ``ladder[rung]``, lengthened to ``cycle`` iterations where it
        needs fewer (not handed out: :meth:`_hand_out`)."""
        from pipefisher.policies import get_policy, packs_overlapping
        from pipefisher.schedule.timeline import inflate_kfac

        timelines = self.measured_timelines()
        job, models = job_models(timelines, self.margin)
        packer = get_policy(self.policy, overlap=self.overlap if packs_overlapping(self.policy) else None)
        packed = packer.pack(inflate_kfac(job, self.ladder[rung]), self.margin)
        natural = equal_cycles(packed.to_file_data())
        k = len(natural[0])
        data = natural if cycle is None or cycle <= k else equal_cycles(natural, cycle)
        expected = expected_step_time(data, models) / 1e9  # measured timelines are in nanoseconds
        extra = f", lengthened to k = {len(data[0])}" if len(data[0]) > k else ""
        plan = Plan(data, f"measured re-pack ({self.policy}, K-FAC slack x{self.ladder[rung]:g}{extra}): {why}",
                    timelines, self.margin, expected, packed.overlap)
        if data is not natural:
            self._natural[plan.digest] = natural
        return plan

    def _hand_out(self, plan: Plan, rung: int) -> Plan:
        """``plan`` (packed at ``ladder[rung]``) runs from now on."""
        self.current, self.rung, self._since_switch, self.overran = plan, rung, 0, []
        self._repaired = False
        keep = {self.current.digest, self.kept.digest}
        self._natural = {d: n for d, n in self._natural.items() if d in keep}
        return plan

    # -- resumption -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"cycles": [[_record_state(r) for r in c] for c in self._cycles],
                "since_switch": self._since_switch, "rung": self.rung, "kept": self.kept.state(),
                "kept_rung": self.kept_rung, "trial": self.trial, "climbing": self.climbing,
                "shorter_tried": self.shorter_tried, "costs": {k: list(v) for k, v in self.costs.items()},
                "overran": self.overran, "repaired": self._repaired, "current": self.current.state(),
                "rule": self.rule.state_dict() if self.rule is not None else None,
                "natural": {d: n for d, n in self._natural.items() if d in (self.current.digest, self.kept.digest)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cycles = deque(([_record_from_state(x) for x in c] for c in state.get("cycles", [])),
                             maxlen=self.window)
        self._since_switch = int(state.get("since_switch", 0))
        self.rung, self.kept_rung = int(state.get("rung", 0)), int(state.get("kept_rung", 0))
        self.trial = state.get("trial")
        self.climbing, self.shorter_tried = bool(state.get("climbing", True)), bool(state.get("shorter_tried", False))
        self.costs = {str(k): [float(x) for x in v] for k, v in state.get("costs", {}).items()}
        self.overran = [[[int(n), int(i)] for n, i in c] for c in state.get("overran", [])]
        self._repaired = bool(state.get("repaired", False))
        if state.get("current") is not None:
            self.current = Plan.from_state(state["current"])
        if state.get("kept") is not None:
            self.kept = Plan.from_state(state["kept"])
        if self.rule is not None and state.get("rule") is not None:
            self.rule.load_state_dict(state["rule"])
        if self.fixed_k is not None:  # the cycle in force goes on (a run the drift rule resized, resumed without it)
            self.fixed_k = max(self.current.cycles)
        self._natural = {str(d): [[list(map(str, it)) for it in node] for node in n]
                         for d, n in (state.get("natural") or {}).items()}


def overran(records: Sequence[StepRecord], plan: Plan) -> set[tuple[int, int]]:
    """The (node, iteration) places of a cycle where K-FAC work overran its planned bubble significantly
    (:func:`pipefisher.cost.measure.significant`): kept the next call waiting past the plan."""
    from pipefisher.cost.measure import gap_overruns, planned_gap_seconds, significant

    if plan.models is None:
        return set()
    out = set()
    for r in records:
        gaps = planned_gap_seconds(plan.models[r.node])
        if any(significant(o, g, plan.margin) for o, g in zip(gap_overruns(r, gaps), gaps)):
            out.add((r.node, r.iteration))
    return out


def _record_state(r: StepRecord) -> list[Any]:
    return [r.node, r.replica, r.step, r.iteration, [[lt.label, lt.start, lt.end, lt.wait] for lt in r.labels]]


def _record_from_state(x: Sequence[Any]) -> StepRecord:
    from pipefisher.cost.measure import LabelTime

    node, replica, step, iteration, labels = x
    return StepRecord(int(node), int(replica), int(step), int(iteration),
                      tuple(LabelTime(str(a), float(b), float(c), float(d)) for a, b, c, d in labels))


SCHEDULERS = ("static", "adaptive")


def make_scheduler(name: str, initial: Plan, nodes: int, **options: Any) -> Scheduler:
    """A scheduler by name (:data:`SCHEDULERS`); ``options`` go to the adaptive one."""
    if name == "static":
        return StaticScheduler(initial)
    if name == "adaptive":
        return AdaptiveScheduler(initial, nodes, **options)
    raise ValueError(f"unknown scheduler {name!r} ({', '.join(SCHEDULERS)})")
