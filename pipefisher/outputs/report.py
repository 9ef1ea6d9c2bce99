"""Usage reports of a packed job: the published one-line-per-node text, a workload listing, and JSON."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from pipefisher.schedule.packed import JobSchedule, NodeSchedule
from pipefisher.schedule.timeline import Job, Time, format_time


def usage_line(index: int, node: NodeSchedule, margin: float | None = None) -> str:
    """The published tool's line, character for character; policies that prove a lower bound on the
    cycle append it, with the room rule's margin it holds for (``margin``: the schedule's), whether the
    cycle meets it (optimal at that margin) or by how much it misses it (gap), and their overflow, if
    any, per step and per cycle: ``... (usage: 91.20 %) [lower bound 3 at margin 0.05, optimal]``."""
    f = node.figures
    line = f"node{index}:{f.iterations} pipeline iterations (usage: {f.usage:.2f} %)"
    if f.lower_bound is None:
        return line
    at = "" if margin is None else f" at margin {margin:g}"
    extra = f"lower bound {f.lower_bound}{at}, " + ("optimal" if f.optimal else f"gap {f.gap}")
    if f.overflow:
        step = f.overflow / f.iterations if f.iterations else f.overflow
        step = round(step) if isinstance(f.overflow, int) else step
        extra += f"; overflow {format_time(step)} per step, {format_time(f.overflow)} per cycle"
    return f"{line} [{extra}]"


def usage_lines(schedule: JobSchedule, job: Job | None = None) -> list[str]:
    """Per node, its cycle and usage; given the ``job`` it was packed from, where its profile records
    end-of-step work, then :func:`step_end_lines`; for a ``target`` schedule, then the trade-off it was
    chosen by. Without such records the lines are the published tool's alone."""
    lines = [usage_line(i, node, schedule.margin) for i, node in enumerate(schedule.nodes)]
    if job is not None:
        ends = step_ends(schedule, job)
        if any(e.update or e.precondition for e in ends):
            lines += ["", *step_end_lines(ends)]
        if any(node.figures.lower_bound is not None for node in schedule.nodes):  # not the published report
            lines += ["", *age_lines(schedule, job)]
    if schedule.tradeoff is not None:
        lines += ["", *schedule.tradeoff.lines()]
    return lines


@dataclass(frozen=True)
class StepEnd:
    """One node's K-FAC work: what its schedule places in the bubbles, against what runs at every step's
    end, where no bubble is planned for it (times in the job's unit)."""

    iterations: int
    in_bubbles: Time
    """K-FAC work placed over the cycle within the pipeline time (the placed work less the overflow)."""
    overflow: Time
    """Time the cycle's iterations run past the pipeline time (work that fits no bubble)."""
    update: Time
    """The profiled update (:data:`~pipefisher.schedule.timeline.UPDATE_KEY`, the whole ``-- end --``), per step."""
    precondition: Time
    """Its K-FAC part (:data:`~pipefisher.schedule.timeline.PRECONDITION_KEY`), per step."""
    exposed: Time
    """What the update adds to the node's step, averaged over the cycle: the part the tail bubble left
    after the iteration's K-FAC work does not hide (the planned step's figure, on the profiled times)."""


def step_ends(schedule: JobSchedule, job: Job) -> list[StepEnd]:
    """Per node, its :class:`StepEnd`; the update is 0 where the profile does not record it."""
    from pipefisher.cost.objective import end_of_step, exposed_end_of_step
    from pipefisher.schedule.problem import node_model

    def unit(x: float) -> Time:
        return round(x) if isinstance(job.span, int) else x

    out = []
    for node, timeline in zip(schedule.nodes, job.nodes):
        f = node.figures
        rest, precondition = end_of_step(timeline)
        exposed = 0.0
        if rest or precondition:
            model = node_model(timeline, job.span, schedule.margin)
            _, per = exposed_end_of_step(node.iterations, node.layout, model, timeline)
            exposed = sum(per) / len(per) if per else 0.0
        out.append(StepEnd(f.iterations, max(f.kfac_placed - f.overflow, 0), f.overflow, unit(rest + precondition),
                           unit(precondition), unit(exposed)))
    return out


def age_lines(schedule: JobSchedule, job: Job) -> list[str]:
    """One line per node: the curvature's age over its cycle (:func:`pipefisher.schedule.problem.curvature_age`),
    which the refresh interval k alone does not say where a refresh runs on into the next cycle."""
    from pipefisher.schedule.problem import curvature_age

    lines = []
    for i, (node, timeline) in enumerate(zip(schedule.nodes, job.nodes)):
        age = curvature_age(timeline, node.iterations, node.layout)
        k = node.figures.iterations
        if age is None:
            lines.append(f"node{i}: no curvature refresh in its cycle of {k}")
            continue
        low, mean, high = age
        lines.append(f"node{i}: curvature age {low}..{high} steps (mean {mean:.2f}) over its cycle of {k}"
                     + (" (overlapping)" if schedule.overlap else ""))
    return lines


def step_end_lines(ends: list[StepEnd]) -> list[str]:
    """One line per node: K-FAC work in the bubbles per cycle, and the update at the step's end, with its
    preconditioning and the part of it no bubble hides, per step."""
    lines = []
    for i, e in enumerate(ends):
        past = f", past the pipeline time {format_time(e.overflow)}" if e.overflow else ""
        lines.append(f"node{i}: K-FAC in bubbles {format_time(e.in_bubbles)} per cycle of {e.iterations}{past}; "
                     f"at the step's end: update {format_time(e.update)} (preconditioning "
                     f"{format_time(e.precondition)} of it), exposed {format_time(e.exposed)} per step")
    return lines


def _fmt(t: Time) -> str:
    return f"{t:.9g}" if isinstance(t, float) else str(t)


def workload_lines(schedule: JobSchedule) -> Iterator[str]:
    """Per node, every placed label in order with start, end and duration, and the bubbles between.

    Times are relative to the start of each label's pipeline iteration, in the timeline's unit.
    """
    for i, node in enumerate(schedule.nodes):
        yield f"node{i}: {len(node.placements)} items in {len(node.iterations)} iteration list(s)"
        prev_end: Time | None = None
        prev_iter = -1
        for p in node.placements:
            if p.iteration != prev_iter:
                yield f"  iteration {p.iteration}"
                prev_iter, prev_end = p.iteration, None
            if prev_end is not None and p.start > prev_end:
                gap = p.start - prev_end
                yield f"    {'(bubble)':<48} start={_fmt(prev_end):>14} end={_fmt(p.start):>14} duration={_fmt(gap)}"
            yield f"    {p.label:<48} start={_fmt(p.start):>14} end={_fmt(p.end):>14} duration={_fmt(p.duration)}"
            if prev_end is None or p.end > prev_end:
                prev_end = p.end


def _plain(x: Any) -> Any:
    if isinstance(x, float) and x != x:  # NaN is not JSON
        return None
    return x


def node_bound(schedule: JobSchedule, job: Job, index: int) -> int:
    """Node ``index``'s lower bound: the policy's own, else computed under the schedule's margin."""
    own = schedule.nodes[index].figures.lower_bound
    if own is not None:
        return own
    from pipefisher.policies.bounds import model_bounds
    from pipefisher.schedule.problem import node_model

    return model_bounds(node_model(job.nodes[index], job.span, schedule.margin)).tight


def report_data(schedule: JobSchedule, job: Job) -> dict[str, Any]:
    """The report as data, for ``--json``: per node, the figures a user compares, the K-FAC work in the
    bubbles against the update at the step's end among them (:class:`StepEnd`; 0 where not recorded),
    and the curvature's age over the cycle (least, mean and most steps; None where nothing is refreshed).

    Every policy's nodes carry the lower bound, the gap to it and whether the cycle is proven optimal
    (for policies that compute no bound, it is computed here; a negative gap then means the schedule
    breaks the rules: no valid one is that short).
    """
    from pipefisher.schedule.problem import curvature_age

    nodes = []
    ends = step_ends(schedule, job)
    for i, (node, timeline, end) in enumerate(zip(schedule.nodes, job.nodes, ends)):
        f = node.figures
        bound = node_bound(schedule, job, i)
        age = curvature_age(timeline, node.iterations, node.layout)
        entry = {
            "node": i,
            "timeline": timeline.path,
            "iterations": f.iterations,
            "usage_percent": _plain(round(f.usage, 6)),
            "cycle_time": f.cycle_time,
            "pipeline_busy_time": f.pipeline_busy,
            "kfac_placed_time": f.kfac_placed,
            "bubble_time_left": f.bubble_left,
            "overflow_time": f.overflow,
            "kfac_in_bubbles_time": end.in_bubbles,
            "update_time": end.update,
            "precondition_time": end.precondition,
            "update_exposed_time": end.exposed,
            "lower_bound": bound,
            "gap": f.iterations - bound,
            "optimal": f.iterations == bound,
            "curvature_age": None if age is None else {"min": age[0], "mean": _plain(round(age[1], 6)), "max": age[2]},
        }
        entry.update({k: _plain(v) for k, v in f.extra.items()})
        nodes.append(entry)
    return {
        "policy": schedule.policy,
        "margin": schedule.margin,
        "overlap": schedule.overlap,
        **({"tradeoff": schedule.tradeoff.data()} if schedule.tradeoff is not None else {}),
        "pipeline_time": job.span,
        "time_unit": "seconds" if isinstance(job.span, float) else "nanoseconds",
        "nodes": nodes,
    }


def compare_lines(job: Job, schedules: "list[JobSchedule]") -> list[str]:
    """Policies side by side, one row per node: cycle, usage, overflow, lower bound, validates?

    The bound column shows the best bound any of the policies proves (compat proves none).
    """
    from pipefisher.rules import validate

    bad = [{v.node for v in validate(s.to_file_data(), job, margin=s.margin, overlap=s.overlap)} for s in schedules]
    head = ["node"]
    for s in schedules:
        head += [f"{s.policy}:cycle", "usage%", "overflow", "valid"]
    head.append("bound")
    rows = [head]
    totals = [0] * len(schedules)
    bound_total = 0
    for i in range(len(job.nodes)):
        row = [f"node{i}"]
        bounds = []
        for j, s in enumerate(schedules):
            f = s.nodes[i].figures
            totals[j] += f.iterations
            row += [str(f.iterations), f"{f.usage:.2f}", _fmt(f.overflow), "yes" if i not in bad[j] else "NO"]
            if f.lower_bound is not None:
                bounds.append(f.lower_bound)
        bound = max(bounds, default=None)
        bound_total += bound or 0
        row.append("-" if bound is None else str(bound))
        rows.append(row)
    total = ["total"]
    for j, s in enumerate(schedules):
        valid = len(job.nodes) - len(bad[j])
        total += [str(totals[j]), "", "", f"{valid}/{len(job.nodes)}"]
    total.append(str(bound_total) if bound_total else "-")
    rows.append(total)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]
