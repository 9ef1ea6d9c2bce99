"""The closed loop on one worker: measure every scheduled step, and switch schedules safely.

Every worker records its steps (:mod:`pipefisher.runtime.train.recorder`). Every k steps (the longest
node's cycle; without ``adapt``, every whole number of cycles near :data:`STATIC_GATHER_STEPS` steps)
the workers all-gather those steps' records. Under ``adapt`` every node's cycle is k
(:func:`pipefisher.loop.closed_loop.equal_cycles`), so these are the steps at which every node has finished
its cycle, with saving on, nothing saved and every factor inverted: the only safe place to switch. Rank 0 hands them to the scheduler (:mod:`pipefisher.loop.closed_loop`) and broadcasts its answer;
a new schedule is checked on every worker as a schedule file is (node count, collective order, saved
micro-batches), all workers must agree on its digest, and it takes effect from the next step on all of
them. This happens between two steps, never inside a bubble.

Files (with an output prefix ``P``), written by rank 0:

* ``P_measurements.csv``: per instruction: node, replica, step, iteration, label, planned start/end,
  measured start/end, wait (:data:`pipefisher.cost.measure.CSV_COLUMNS`); planned times are the plan's
  placements shifted so that the step's first forward or backward gets its input at the same time;
* ``P_cycles.jsonl``: per gather (a cycle under ``adapt``) and node, a summary
  (:func:`pipefisher.cost.measure.cycle_summary`): mean step time, each K-FAC label's time, each bubble as
  it really was, each bubble's largest overrun; and the curvature refreshes completed in it
  (``drift``: the job's drift and aging, and this node's layers', :mod:`pipefisher.loop.drift`), which the
  workers gather with their records;
* ``P_measured/``: the timelines measured over the last cycles, one pickle per node, in the profiled
  format (``pipefisher schedule P_measured/*.pickle`` packs them);
* ``P_schedules/``: every schedule the run used, ``step-<first step>.pickle`` (with ``.meta.json``),
  and ``history.json``: when each took over, its digest, cycle k per node and why.
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from pipefisher.loop.closed_loop import Plan, Scheduler, _record_from_state, _record_state
from pipefisher.loop.drift import DriftSample, Refresh, refreshes
from pipefisher.runtime.job.files import RunPaths
from pipefisher.runtime.train.recorder import resolved
from pipefisher.cost.measure import (StepRecord, append_csv, cycle_summary, instruction_rows, lay_out,
                                     planned_gap_seconds, step_overrun, unit_seconds, window_timelines)

MEASURED_WINDOW = 4
"""Gathers (job cycles, under ``adapt``) the exported measured timelines are built from."""
STATIC_GATHER_STEPS = 64
"""Without ``adapt``, the measurements are gathered about this often (in whole cycles) and at the end."""


@dataclass(frozen=True)
class Switch:
    """A schedule taking over at ``step`` (the first step it runs)."""

    step: int
    plan: Plan
    decide_seconds: float = 0.0


class ScheduleLoop:
    """One worker's part of the closed loop (every worker has one; only rank 0 has a scheduler).

    ``collective``: ``(gather, broadcast, barrier)`` over every worker, the first two of picklable
    objects (None: one process);
    ``check(plan)`` refuses a schedule this job cannot run (raises); ``agree(text)`` fails unless every
    worker passes the same text; ``switch(plan, first_step)`` makes the executor run it. ``drift`` hands
    over this worker's drift samples not gathered yet (:meth:`pipefisher.runtime.train.drift_log.DriftLog.drain`):
    they travel with its records, and every worker learns the job's refreshes (:attr:`refreshes`).
    """

    def __init__(self, plan: Plan, *, node: int, rank: int, nodes: int, scheduler: Scheduler | None,
                 adapt: bool, first_step: int = 1, prefix: str | None = None,
                 collective: tuple[Callable[[Any], list[Any]], Callable[[Any], Any], Callable[[], None]] | None = None,
                 check: Callable[[Plan], None] = lambda plan: None,
                 agree: Callable[[str], None] = lambda text: None,
                 switch: Callable[[Plan, int], None] = lambda plan, step: None,
                 echo: Callable[[str], None] | None = None,
                 drift: Callable[[], list[DriftSample]] | None = None) -> None:
        if adapt and len(set(plan.cycles)) > 1:
            raise ValueError("adapting needs one cycle length on every node (pipefisher.loop.closed_loop.equal_cycles)")
        self.plan, self.node, self.rank, self.nodes = plan, node, rank, nodes
        self.scheduler, self.adapt = scheduler, adapt
        self.first_step = first_step
        self.prefix = prefix if rank == 0 else None
        self._gather, self._broadcast, self._barrier = (collective if collective is not None else
                                                        ((lambda x: [x]), (lambda x: x), (lambda: None)))
        self._check, self._agree, self._switch, self._echo = check, agree, switch, echo
        self._drift = drift or (lambda: [])
        self.refreshes: dict[int, Refresh] = {}  # the job's curvature refreshes gathered so far, by step
        self._fresh: list[Refresh] = []  # those of the last gather
        self.last_step: int | None = None  # the last step this worker ran
        self.pending: list[StepRecord] = []  # this worker's records of the current job cycle
        self.recent: deque[list[StepRecord]] = deque(maxlen=MEASURED_WINDOW)  # every node's, last cycles
        self.overruns: dict[int, float] = {}  # step -> seconds (the slowest node's), once its cycle is in
        self.history: list[Switch] = [Switch(first_step, plan)]
        self.gather_seconds: list[float] = []  # what the loop costs, per gather and per decision
        self.decide_seconds: list[float] = []
        self._placed: dict[str, Any] = {}

    @property
    def cycle(self) -> int:
        """Steps between gathers: the longest node's cycle k (under ``adapt`` every node's, see
        :func:`pipefisher.loop.closed_loop.equal_cycles`: a new schedule can start on all of them then)."""
        return max(self.plan.cycles)

    @property
    def gather_every(self) -> int:
        """Steps between gathers: every cycle under ``adapt`` (the scheduler decides there), else every
        cycle that ends at least :data:`STATIC_GATHER_STEPS` steps after the last gather (a gather is a
        collective every worker waits for: the static loop only needs the measurements kept in order)."""
        return self.cycle if self.adapt else self.cycle * max(1, STATIC_GATHER_STEPS // self.cycle)

    def after_step(self, step: int, record: StepRecord | None) -> None:
        """Called by every worker after every scheduled step, with that step's record."""
        if record is not None:
            self.pending.append(record)
        self.last_step = step
        if (step - self.first_step + 1) % self.gather_every == 0:
            self._cycle_end(step)

    def finish(self) -> None:
        """The end of training: the records of an incomplete last cycle are gathered too (no decision;
        its curvature refresh, incomplete, gives no figure: a run resumed from a checkpoint completes it)."""
        self._collect(self.last_step)
        self._barrier()  # gloo aborted now and then when a worker left right after an object gather

    # -- the cycle's end ----------------------------------------------------------------------------

    def _collect(self, through: int | None) -> list[StepRecord]:
        """Gather every worker's records and drift samples; refreshes whose job cycle ended by step
        ``through`` become figures."""
        import time

        mine, self.pending = self.pending, []
        t0 = time.perf_counter()
        drift = self._drift()  # first: its read comes after the records' CUDA events, which are then done
        parts = self._gather(([resolved(r) for r in mine], drift))
        self.gather_seconds.append(time.perf_counter() - t0)
        records = sorted((r for part, _ in parts for r in part), key=lambda r: (r.step, r.node, r.replica))
        samples = [s for _, part in parts for s in part]
        self._fresh = [r for r in refreshes(samples, group=self._cycle_of)
                       if through is not None and self._cycle_of(r.step) + self.cycle - 1 <= through]
        self.refreshes.update((r.step, r) for r in self._fresh)
        if not records:
            return records
        plan = self.plan
        if plan.timelines is None:  # a schedule file without its profile: planned = as first measured
            plan = Plan(plan.data, plan.reason, window_timelines(records, self.nodes), plan.margin,
                        plan.expected_seconds, plan.overlap)
            self.plan = plan
            self.history[-1] = Switch(self.history[-1].step, plan, self.history[-1].decide_seconds)
            if self.scheduler is not None:
                self.scheduler.learned(plan)
        self.recent.append(records)
        for r in records:
            self.overruns[r.step] = max(self.overruns.get(r.step, 0.0), self._overrun(r))
        if self.prefix is not None:
            files = RunPaths.at(self.prefix)
            append_csv(files.measurements, [row for r in records for row in self._rows(r)])
            with open(files.cycles, "a", encoding="utf-8") as f:
                for n in range(self.nodes):
                    mine = [r for r in records if r.node == n and r.replica == 0]
                    if mine:
                        ours = {s.layer for s in samples if s.node == n}
                        drift = [{"step": r.step, "drift": r.drift, "aging": r.aging,
                                  "lags": None if r.lags is None else list(r.lags),
                                  "layers": {k: v for k, v in r.layers.items() if k in ours},
                                  "layer_aging": {k: v for k, v in r.layer_aging.items() if k in ours}}
                                 for r in self._fresh]
                        f.write(json.dumps({**cycle_summary(mine, self._planned(n)[1]), "drift": drift}) + "\n")
        return records

    def _cycle_of(self, step: int) -> int:
        """The first step of the job cycle ``step`` is in: a refresh's layers are spread over its cycle."""
        return self.first_step + (step - self.first_step) // self.cycle * self.cycle

    def _planned(self, node: int) -> tuple[list[list[Any]], list[float]]:
        key = f"{self.plan.digest}/{node}"
        if key not in self._placed:
            models = self.plan.models
            assert models is not None
            self._placed[key] = (lay_out(self.plan.data[node], models[node]), planned_gap_seconds(models[node]))
        return self._placed[key]

    def _overrun(self, r: StepRecord) -> float:
        return step_overrun(r, self._planned(r.node)[1])

    def _rows(self, r: StepRecord) -> list[tuple]:
        placed, _ = self._planned(r.node)
        plan = placed[r.iteration % len(placed)]
        scale = unit_seconds(self.plan.models[r.node])  # type: ignore[index]
        first_call = next((p for p in plan if p.category in ("forward", "backward")), None)
        got = next((lt for lt in r.labels if lt.label == (first_call.label if first_call else None)), None)
        shift = (got.start + got.wait - first_call.start * scale) if first_call is not None and got is not None else 0.0
        from pipefisher.schedule.packed import Placement

        aligned = [Placement(p.label, p.start * scale + shift, p.end * scale + shift, p.iteration) for p in plan]
        return instruction_rows(r, aligned)

    def _cycle_end(self, step: int) -> None:
        import time

        records = self._collect(step)
        if not self.adapt:
            return
        t0 = time.perf_counter()
        decision = None
        if self.scheduler is not None:
            self.scheduler.observe(records)
            self.scheduler.observe_drift(self._fresh)
            nxt = self.scheduler.next_schedule()
            if nxt.digest != self.plan.digest:
                decision = nxt.state()
        decision = self._broadcast(decision)
        self.decide_seconds.append(time.perf_counter() - t0)
        if decision is None:
            return
        plan = Plan.from_state(decision)
        self._check(plan)
        self._agree(f"adapted schedule {plan.digest} from step {step + 1}")
        self._switch(plan, step + 1)
        self.plan, self.first_step = plan, step + 1
        self.history.append(Switch(step + 1, plan, time.perf_counter() - t0))
        if self._echo is not None:
            self._echo(f"step {step + 1}: switching to a new schedule, K-FAC cycle k={max(plan.cycles)} "
                       f"(per node: {', '.join(map(str, plan.cycles))}): {plan.reason}")
        self.write_schedules()

    def cost_line(self) -> str:
        """What the loop cost this worker: its gathers and decisions (medians), between steps."""
        import statistics

        line = f"{len(self.gather_seconds)} gathers of the measurements, {statistics.median(self.gather_seconds) * 1e3:.1f} ms each" \
            if self.gather_seconds else "no gather of the measurements"
        if self.decide_seconds:
            line += (f"; {len(self.decide_seconds)} decisions, {statistics.median(self.decide_seconds) * 1e3:.1f} ms each"
                     f" (median), {len(self.history) - 1} switch(es)")
        return line

    # -- files --------------------------------------------------------------------------------------

    def write_schedules(self) -> None:
        """Every schedule the run used so far, and the history (rank 0, with an output prefix)."""
        if self.prefix is None:
            return
        from pipefisher.safe_io import dump_json_atomic
        from pipefisher.schedule.file import save_schedule

        files = RunPaths.at(self.prefix)
        folder = files.schedules
        os.makedirs(folder, exist_ok=True)
        rows = []
        for sw in self.history:
            path = os.path.join(folder, f"step-{sw.step:08d}.pickle")
            if not os.path.exists(path):
                save_schedule(path, sw.plan.data, overlap=sw.plan.overlap, margin=sw.plan.margin)
            rows.append({"step": sw.step, "digest": sw.plan.digest, "file": os.path.basename(path),
                         "cycle": max(sw.plan.cycles), "node_cycles": sw.plan.cycles, "overlap": sw.plan.overlap,
                         "reason": sw.plan.reason,
                         "expected_step_seconds": sw.plan.expected_seconds,
                         "decide_seconds": round(sw.decide_seconds, 6)})
        dump_json_atomic(files.history, {"switches": rows})

    def write_measured(self) -> list[str]:
        """The timelines measured over the last cycles, one pickle per node (rank 0, with a prefix)."""
        if self.prefix is None or not self.recent:
            return []
        from pipefisher.runtime.train.profiler import timeline_filename
        from pipefisher.safe_io import dump_pickle_atomic

        files = RunPaths.at(self.prefix)
        folder, name = files.measured, files.name
        os.makedirs(folder, exist_ok=True)
        dicts = window_timelines([r for c in self.recent for r in c], self.nodes, self.plan.models)
        paths = []
        for n, d in enumerate(dicts):
            paths.append(os.path.join(folder, timeline_filename(name, n)))
            dump_pickle_atomic(paths[-1], d)
        return paths

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.state(), "first_step": self.first_step,
                "pending": [_record_state(resolved(r)) for r in self.pending],
                "recent": [[_record_state(r) for r in c] for c in self.recent],
                "history": [{"step": s.step, "plan": s.plan.state(), "decide_seconds": s.decide_seconds}
                            for s in self.history],
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan = Plan.from_state(state["plan"])
        if self.adapt and len(set(self.plan.cycles)) > 1:
            from pipefisher.errors import InputError

            raise InputError(None, "the checkpoint's schedule has cycles of different lengths per node "
                                   f"({', '.join(map(str, self.plan.cycles))}): it was written without --adapt, "
                                   "and --adapt can switch only where every node ends its cycle; resume it without "
                                   "--adapt")
        self.first_step = int(state["first_step"])
        self.pending = [_record_from_state(x) for x in state.get("pending", [])]
        self.recent = deque(([_record_from_state(x) for x in c] for c in state.get("recent", [])),
                            maxlen=MEASURED_WINDOW)
        self.history = [Switch(int(h["step"]), Plan.from_state(h["plan"]), float(h.get("decide_seconds", 0.0)))
                        for h in state.get("history", [])] or [Switch(self.first_step, self.plan)]
        if self.scheduler is not None:
            self.scheduler.current = self.plan
            if state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
        self._switch(self.plan, self.first_step)
