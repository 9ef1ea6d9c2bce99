"""Measured steps: what every label of a schedule really took on a node, and what that says.

In ``scheduled`` mode the runtime records, per training step and node, each label it ran: start and
end on the node's own clock (seconds from the step's ``-- start --``) and the time it sat idle waiting
at a receive (``wait``, forwards and backwards only). Clocks of different nodes are never compared.
From those records this module derives, without torch:

* the **bubbles as they really are**: before every forward or backward, the time from the end of the
  node's previous call until its input was there (:class:`Gap`). It is known exactly where the call
  still had to wait, or where no K-FAC work ran before it; where K-FAC work ran and the call did not
  wait, the input came at some point during that work, so only an upper bound is known;
* the **overrun**: how long the K-FAC work before a call kept it waiting past its bubble's planned end;
* a **measured timeline** in the profiled format (:func:`measured_timeline`), from robust statistics
  over a window of steps: the job the adaptive scheduler re-packs and ``pipefisher schedule`` reads;
* the **planned placement** of a schedule's labels on a timeline (:func:`lay_out`), which also gives
  the iteration time a schedule is expected to take there (:func:`expected_step_seconds`);
* the per-instruction CSV (:data:`CSV_COLUMNS`): node, step, label, planned and measured start/end.

Frame of a measured timeline: every node's times start at its first pipeline call (no head bubble), or,
given the plan the steps ran, at the plan's head bubble (a head bubble cannot be measured: a step starts
when the previous one ended; keeping the plan's lets its head work count as fitting, as planned); the
rest of the idle time a node spends across the step boundary (after its last call, then waiting for the next
step's first input) becomes its tail bubble, up to the pipeline time of node 0 (its last call's end).
This equals the real cross-boundary idle when the nodes' end-of-step work (gradient all-reduce and
update) takes about as long on every node, which a pipeline's stages of one model do.
"""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from itertools import accumulate, chain, cycle, islice, repeat
from typing import Iterable, Sequence

from pipefisher.schedule.format import END, MARKERS, PIPELINE_CATEGORIES, START, label_category
from pipefisher.schedule.packed import KfacLayout, Placement
from pipefisher.schedule.problem import (
    COV_PREFIX, DEFAULT_MARGIN, INV_PREFIX, SYNC_PREFIX, NodeModel, cov_source, pieces_before_completion,
    runs_before_completion,
)
from pipefisher.schedule.timeline import COV_KINDS, COV_MICRO_BATCHES_KEY, STEP_KEY, Time, TimelineKey, cov_pieces

WAIT_EPS = 20e-6
"""Seconds of receive time below which a call counts as not having waited (the copy of an input that
was already there costs some microseconds)."""

CSV_COLUMNS = ("node", "replica", "step", "iteration", "label", "planned_start", "planned_end",
               "measured_start", "measured_end", "wait")
"""The per-instruction export: times in seconds from the step's start on the node's own clock."""


@dataclass(frozen=True)
class LabelTime:
    """One label as it ran: start and end (seconds from the step's start), idle time at receives."""

    label: str
    start: float
    end: float
    wait: float = 0.0


@dataclass(frozen=True)
class StepRecord:
    """Everything one node ran in one training step, in order (``iteration``: of the active cycle)."""

    node: int
    replica: int
    step: int
    iteration: int
    labels: tuple[LabelTime, ...]

    @property
    def seconds(self) -> float:
        """The step on this node: from its start to the end of its last label."""
        return self.labels[-1].end if self.labels else 0.0


def unit_seconds(model: NodeModel) -> float:
    """Seconds per time unit of a node model: profiles hold integer nanoseconds, hand-made ones may hold
    float seconds (the format allows both); records are always in seconds."""
    return seconds_per_unit(model.base)


def seconds_per_unit(t: Time) -> float:
    """Seconds per time unit of a job whose times are like ``t`` (its span, say): :func:`unit_seconds`."""
    return 1e-9 if isinstance(t, int) else 1.0


def planned_gap_seconds(model: NodeModel) -> list[float]:
    """:func:`planned_gaps` in seconds, to compare with records."""
    unit = unit_seconds(model)
    return [g * unit for g in planned_gaps(model)]


def is_pipeline(label: str) -> bool:
    return label_category(label) in PIPELINE_CATEGORIES


def is_kfac(label: str) -> bool:
    return label not in MARKERS and label_category(label) not in PIPELINE_CATEGORIES


@dataclass(frozen=True)
class Gap:
    """The stretch before pipeline call ``index`` of a step (or after the last call: ``index`` = calls).

    ``opened``: the end of the previous call (0 for the first); ``kfac``: K-FAC seconds run in it;
    ``closed``: when the call got its input (its start plus its wait; for the tail, the start of
    ``-- end --``).
    """

    index: int
    opened: float
    kfac: float
    closed: float
    wait: float

    @property
    def exact(self) -> bool:
        """Whether ``closed - opened`` is the bubble itself: the call waited, or nothing ran before it."""
        return self.wait > WAIT_EPS or self.kfac == 0

    @property
    def seen(self) -> float:
        """``closed - opened``: the bubble where :attr:`exact`, else an upper bound on it."""
        return max(0.0, self.closed - self.opened)


def gaps(record: StepRecord) -> list[Gap]:
    """The gaps before each pipeline call of the step, then the tail gap (up to ``-- end --``)."""
    out: list[Gap] = []
    opened, kfac = 0.0, 0.0
    for lt in record.labels:
        if is_pipeline(lt.label):
            out.append(Gap(len(out), opened, kfac, lt.start + lt.wait, lt.wait))
            opened, kfac = lt.end, 0.0
        elif lt.label == END:
            out.append(Gap(len(out), opened, kfac, lt.start, 0.0))
            return out
        elif is_kfac(lt.label):
            kfac += lt.end - lt.start
    out.append(Gap(len(out), opened, kfac, opened + kfac, 0.0))
    return out


def pipeline_labels(record: StepRecord) -> list[LabelTime]:
    return [lt for lt in record.labels if is_pipeline(lt.label)]


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (linear interpolation) of a non-empty sample."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ----------------------------------------------------------------------------------------------------
# Planned placements


def _shifted_labels(model: NodeModel) -> set[str]:
    """The K-FAC labels whose order decides which piece an inverse run runs: per factor whose refresh
    runs in several pieces on ``model``, its covariance, sync and inverse labels (none: nothing to shift)."""
    factors = {label[len(INV_PREFIX):] for label, ds in model.durations.items()
               if label.startswith(INV_PREFIX) and len(ds) > 1}
    return {prefix + f for f in factors for prefix in (COV_PREFIX, SYNC_PREFIX, INV_PREFIX)} & model.durations.keys()


def _inverse_shift(runs: Iterable[tuple[str, int]], model: NodeModel, wanted: set[str] | None = None) -> dict[str, int]:
    """Per inverse label of a cycle (given as runs of labels, each with its count), how many of its runs come
    before its factor's completion: the j-th run of it in the cycle takes piece ``j - shift`` (modulo p), as
    the executor runs it (:func:`pipefisher.schedule.problem.pieces_before_completion`). Only the labels
    ``model`` has times for count (``wanted``: :func:`_shifted_labels`, where the caller has it)."""
    wanted = _shifted_labels(model) if wanted is None else wanted
    if not wanted:
        return {}
    return runs_before_completion([run for run in runs if run[0] in wanted], model)


def lay_out(iterations: Sequence[Sequence[str]], model: NodeModel) -> list[list[Placement]]:
    """Each iteration's labels placed in time on ``model`` (times relative to the iteration).

    A pipeline call starts where the timeline has it, or when the K-FAC work placed before it ends if
    that is later (a delay the rest of the iteration inherits); K-FAC work runs back to back from the
    end of the previous call; the j-th run of a K-FAC label in the cycle takes its j-th duration, an
    inverse label's counted from its factor's completion as the executor runs its pieces (in an overlapping
    cycle the runs before it are the previous refresh's last pieces: :func:`_inverse_shift`). For a
    schedule that validates on ``model`` this is its plan; for one that
    does not, it is how long its iterations are expected to take there. The iteration ends at its last
    label's end, or at the node's pipeline time if that is later (``-- end --`` is placed there).
    """
    where: dict[str, list[tuple[float, float]]] = {}
    for key, s, e in model.pipeline:
        where.setdefault(key, []).append((float(s), float(e)))
    lengths = model.durations
    shift = _inverse_shift(((label, 1) for labels in iterations for label in labels), model)
    done: dict[str, int] = {}
    out: list[list[Placement]] = []
    for i, labels in enumerate(iterations):
        seen: dict[str, int] = {}
        cursor = min(0.0, float(model.pipeline[0][1])) if model.pipeline else 0.0
        placed: list[Placement] = []
        for label in labels:
            if label in where:
                n = seen.get(label, 0)
                seen[label] = n + 1
                s, e = where[label][n % len(where[label])]
                start = max(s, cursor)
                cursor = start + (e - s)
                placed.append(Placement(label, start, cursor, i))
            elif label in lengths:
                n = done.get(label, 0)
                done[label] = n + 1
                d = float(lengths[label][(n - shift.get(label, 0)) % len(lengths[label])])
                placed.append(Placement(label, cursor, cursor + d, i))
                cursor += d
            elif label == END:
                cursor = max(cursor, float(model.base))
                placed.append(Placement(label, cursor, cursor, i))
            else:  # markers, and K-FAC work this model has no time for
                placed.append(Placement(label, cursor, cursor, i))
        out.append(placed)
    return out


def iteration_time(iterations: Sequence[Sequence[str]], model: NodeModel) -> list[float]:
    """How long each iteration of a node's cycle is expected to take on ``model`` (see :func:`lay_out`):
    the node's pipeline time plus every delay its K-FAC work adds to a call or to the iteration's end.

    A delay a later bubble absorbs on this node is still counted: the late call's output reaches the
    next stage late too, and the pipeline couples them, so an overrun is never free.
    """
    return planned_iterations(iterations, model)[0]


def planned_iterations(iterations: Sequence[Sequence[str]], model: NodeModel,
                       layout: KfacLayout | None = None) -> tuple[list[float], list[float]]:
    """Per iteration of a node's cycle on ``model``: its expected time (:func:`iteration_time`), and when
    its last label before ``-- end --`` ends (0 where none comes before it), where end-of-step work starts.

    The figures :func:`lay_out`'s placements give, without building them: a cycle of a big job is
    millions of labels, and the ``target`` policy evaluates several. Every label moves a cursor
    (a call to ``max(its start, cursor)`` plus its length, K-FAC work by its length, ``-- end --`` to
    the pipeline time at least), so the cursor after label j is ``B_j + max(cursor0, max_i<=j a_i - B_i-1)``
    with ``B`` the running sum of the lengths and ``a_i`` the label's earliest start: a running sum and
    a running maximum per iteration, in numpy. On integer timelines (profiled nanoseconds) every figure
    is exact, so equal to the placements' to the unit. ``layout``: the labels' :data:`KfacLayout`, where
    the policy has it (:func:`_planned_layout` then reads only the K-FAC work).
    """
    if layout is not None:
        return _planned_layout(layout, model)
    import numpy as np

    keys: dict[str, int] = {}
    starts: list[list[float]] = []
    ends: list[list[float]] = []
    for key, s, e in model.pipeline:
        i = keys.setdefault(key, len(keys))
        if i == len(starts):
            starts.append([])
            ends.append([])
        starts[i].append(float(s))
        ends[i].append(float(e))
    pipes = len(keys)
    code_of: dict[str, int] = dict(keys)
    code_of[END] = pipes
    table: list[float] = []
    offset: list[int] = []
    count: list[int] = []
    named: list[str] = []  # the K-FAC labels, by code - pipes - 1
    for label, ds in model.durations.items():
        if label not in code_of:
            code_of[label] = pipes + 1 + len(offset)
            named.append(label)
            offset.append(len(table))
            count.append(len(ds))
            table.extend(map(float, ds))
    sizes = np.fromiter(map(len, iterations), dtype=np.int64, count=len(iterations))
    k, n = len(sizes), int(sizes.sum())
    base = float(model.base)
    cursor0 = min(0.0, float(model.pipeline[0][1])) if model.pipeline else 0.0
    if n == 0:
        return [base] * k, [0.0] * k
    codes = np.fromiter(map(code_of.get, chain.from_iterable(iterations), repeat(-1)), dtype=np.int64, count=n)
    first = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(sizes, out=first[1:])
    row = np.repeat(np.arange(k), sizes)  # each label's iteration, and its place in it
    col = np.arange(n) - first[row]
    earliest = np.full(n, -np.inf)  # a_i: where the label can start at the earliest
    length = np.zeros(n)  # b_i: how far it moves the cursor past that
    for i in range(pipes):  # the j-th call of a key in an iteration is the key's j-th in the timeline
        at = np.flatnonzero(codes == i)
        nth = (np.arange(len(at)) - np.searchsorted(at, first[:-1])[row[at]]) % len(starts[i])
        s = np.asarray(starts[i])[nth]
        earliest[at], length[at] = s, np.asarray(ends[i])[nth] - s
    ends_at = np.flatnonzero(codes == pipes)
    earliest[ends_at] = base
    work = np.flatnonzero(codes > pipes)
    if len(work):  # the j-th run of a K-FAC label in the cycle takes its j-th duration (cyclically), an
        ids = codes[work] - pipes - 1  # inverse's counted from its factor's completion (_inverse_shift)
        order = np.argsort(ids, kind="stable")
        ranked = ids[order]
        nth = np.empty_like(ids)
        nth[order] = np.arange(len(ids)) - np.searchsorted(ranked, ranked)
        wanted = _shifted_labels(model)
        if wanted:
            among = np.flatnonzero(np.isin(ids, [i for i, label in enumerate(named) if label in wanted]))
            shift = _inverse_shift([(named[i], 1) for i in ids[among].tolist()], model, wanted)
            nth -= np.asarray([shift.get(label, 0) for label in named], dtype=np.int64)[ids]
        length[work] = np.asarray(table)[np.asarray(offset)[ids] + nth % np.asarray(count)[ids]]
    # one row per iteration, padded: the running sum and maximum restart with every iteration
    width = int(sizes.max())
    b = np.zeros((k, width))
    a = np.full((k, width), -np.inf)
    b[row, col], a[row, col] = length, earliest
    total = np.cumsum(b, axis=1)
    cursor = total + np.maximum(np.maximum.accumulate(a - (total - b), axis=1), cursor0)
    previous = np.concatenate((np.full((k, 1), cursor0), cursor[:, :-1]), axis=1)
    calls = np.flatnonzero((codes >= 0) & (codes < pipes))
    late = np.maximum(previous[row[calls], col[calls]] - earliest[calls], 0.0)  # each call's delay
    before = np.concatenate(([0.0], late[:-1]))
    opening = np.searchsorted(calls, first[:-1])  # each iteration's first call (where it has one)
    before[opening[opening < np.searchsorted(calls, first[1:])]] = 0.0
    grown = np.bincount(row[calls], weights=np.maximum(late - before, 0.0), minlength=k)
    last = np.zeros(k)
    last[row[calls]] = late  # the last call's delay (later ones overwrite earlier)
    end = np.maximum(cursor[np.arange(k), np.maximum(sizes - 1, 0)], 0.0)
    end[sizes == 0] = 0.0
    times = base + (grown + np.maximum(end - base - last, 0.0))
    # end-of-step work starts after the last label before the iteration's first -- end --
    cut = sizes.copy()
    its, firsts = np.unique(row[ends_at], return_index=True)
    cut[its] = col[ends_at[firsts]]
    ready = np.where(cut > 0, cursor[np.arange(k), np.maximum(cut - 1, 0)], 0.0)
    return times.tolist(), ready.tolist()


def _planned_layout(layout: KfacLayout, model: NodeModel) -> tuple[list[float], list[float]]:
    """:func:`planned_iterations` of labels laid out as ``layout`` says, from their K-FAC work alone.

    The calls run in timeline order, so each one's delay is ``D_j = max(0, D_j-1 + K_j - g_j)``, with
    ``K_j`` the K-FAC work before it and ``g_j`` its bubble (its start less the previous call's end).
    Between calls with no work before them and no negative bubble (calls that overlap) the delay only
    shrinks, by the bubbles' sum at most down to 0, so only the calls with work before them (and those
    overlaps) are visited: per iteration, its K-FAC work, not its pipeline.
    """
    calls = model.pipeline
    n = len(calls)
    base = float(model.base)
    cursor0 = min(0.0, float(calls[0][1])) if calls else 0.0
    gaps = [0.0] * n  # g_j, and their running sum: the decay over a stretch of calls
    total = [0.0] * (n + 1)
    previous_end = cursor0
    for j, (_, s, e) in enumerate(calls):
        gaps[j] = float(s) - previous_end
        total[j + 1] = total[j] + gaps[j]
        previous_end = float(e)
    last_end = previous_end  # the last call's planned end (cursor0 without calls)
    overlaps = [j for j in range(n) if gaps[j] < 0] + [n + 1]  # calls a delay can grow at without work
    lengths = model.durations
    shift = _inverse_shift(((label, count) for work in layout for _, label, count in work), model)
    seen: dict[str, list] = {}  # per label: [the running sum of its durations over one round, its next piece]
    times, ready = [], []
    for work in layout:
        # one pass over the iteration's runs of K-FAC work; at each call with work before it (or a call
        # that overlaps the one before), the delay: D_j = max(0, D_j-1 + K_j - g_j), grown where it rises
        delay = grown = tail = 0.0  # the delay of the call before call j; work after the last call
        j, o = 0, 0  # the next call; the next overlap
        here, k = -1, 0.0  # the call the work gathered so far comes before, and that work
        for pos, label, count in (*work, (n + 1, "", 0)):  # a last run past every call: the flush
            if pos != here:
                while here >= 0:  # call `here` gets its work k (and overlaps before it, none)
                    at = overlaps[o] if overlaps[o] < here else here
                    if at < j:  # an overlap passed already
                        o += 1
                        continue
                    if at >= n:
                        if j < n:
                            delay = max(0.0, delay - (total[n] - total[j]))
                            j = n
                        tail += k
                        break
                    if delay and at > j:  # calls j .. at-1: no work before them, no overlap: it shrinks
                        delay = max(0.0, delay - (total[at] - total[j]))
                    late = delay + (k if at == here else 0.0) - gaps[at]
                    if late > 0.0:
                        if late > delay:
                            grown += late - delay
                        delay = late
                    else:
                        delay = 0.0
                    j = at + 1
                    if at == here:
                        break
                    o += 1
                if pos > n:
                    break
                here, k = pos, 0.0
            state = seen.get(label)
            if state is None:
                ds = lengths.get(label)
                if ds is None:  # K-FAC work this model has no time for: a marker
                    continue
                state = seen[label] = [[0.0, *accumulate(map(float, ds))], -shift.get(label, 0)]
            running, first = state
            state[1] = first + count
            size = len(running) - 1
            i = first % size
            if i + count <= size:  # the label's durations i .. i + count - 1, without wrapping round
                k += running[i + count] - running[i]
            else:
                k += _cyclic_sum(running, first, count)
        while overlaps[o] < n:  # overlaps after the last call with work
            at = overlaps[o]
            o += 1
            if at < j:
                continue
            if delay and at > j:
                delay = max(0.0, delay - (total[at] - total[j]))
            late = delay - gaps[at]
            if late > delay:
                grown += late - delay
            delay, j = max(0.0, late), at + 1
        if j < n:
            delay = max(0.0, delay - (total[n] - total[j]))
        before_end = last_end + delay + tail
        end = max(0.0, before_end, base)
        times.append(base + grown + max(0.0, end - base - delay))
        ready.append(before_end)
    return times, ready


def _cyclic_sum(running: list[float], first: int, count: int) -> float:
    """The sum of ``count`` durations from the ``first``-th, cyclically, of a label whose running sum over
    one round is ``running`` (``running[j]``: the first j)."""
    n = len(running) - 1
    if count == 1:
        i = first % n
        return running[i + 1] - running[i]
    rounds, start = divmod(first, n)
    end = first + count
    full, stop = divmod(end, n)
    return (full - rounds) * running[n] + running[stop] - running[start]


def expected_step_time(schedule: Sequence[Sequence[Sequence[str]]], models: Sequence[NodeModel],
                          max_steps: int = 2520) -> float:
    """Mean expected step time (in the models' time unit) of a job's schedule: per step, its slowest node's iteration (the pipeline
    couples them), over the job's cycle (the least common multiple of the nodes' cycles, capped)."""
    return job_cycle_mean([iteration_time(it, m) for it, m in zip(schedule, models)], max_steps)


def job_cycle_mean(per_node: Sequence[Sequence[float]], max_steps: int = 2520) -> float:
    """Per-iteration times of every node's cycle, as the job's mean step: per step, the slowest node's
    (the pipeline couples them), over the least common multiple of the cycles (capped at ``max_steps``)."""
    steps = 1
    for times in per_node:
        steps = steps * len(times) // math.gcd(steps, len(times))
    steps = min(steps, max_steps)
    return sum(map(max, zip(*(islice(cycle(times), steps) for times in per_node)))) / steps


def planned_gaps(model: NodeModel) -> list[float]:
    """The bubble before each pipeline call of ``model`` (and the tail after the last), in call order."""
    out: list[float] = []
    prev = min(0.0, float(model.pipeline[0][1])) if model.pipeline else 0.0
    for _, s, e in model.pipeline:
        out.append(max(0.0, float(s) - prev))
        prev = max(prev, float(e))
    out.append(max(0.0, float(model.base) - prev))
    return out


# ----------------------------------------------------------------------------------------------------
# Overrun


def gap_overruns(record: StepRecord, planned: Sequence[float]) -> list[float]:
    """Per gap of the step (:func:`gaps`), how long its K-FAC work kept the next call waiting past the
    bubble's planned length ``planned[i]``: 0 where the call still waited for its input (the work fit),
    else what the work plus the call's start took beyond the plan. The tail's overrun delays the step's end."""
    out = []
    for g in gaps(record):
        if g.kfac == 0 or g.wait > WAIT_EPS or g.index >= len(planned):
            out.append(0.0)
        else:
            out.append(max(0.0, g.seen - planned[g.index]))
    return out


def significant(overrun: float, planned: float, margin: float = DEFAULT_MARGIN) -> bool:
    """An overrun beyond the room rule's margin of its planned bubble (and the clock's resolution): work
    that really outgrew its room, where less is the jitter the margin is there to absorb."""
    return overrun > max(WAIT_EPS, margin * planned)


def step_overrun(record: StepRecord, planned: Sequence[float]) -> float:
    """Seconds the step's K-FAC work delayed this node's calls beyond their planned bubbles (summed)."""
    return sum(gap_overruns(record, planned))


def cycle_summary(records: Sequence[StepRecord], planned: Sequence[float] | None = None) -> dict:
    """One node's steps (a cycle, say) in a few numbers: the steps, their mean time, each K-FAC label's
    mean time, each bubble as it really was (per gap before a call, then the tail: the median of its
    exact sightings, None where K-FAC work overran it every time) and the largest overrun of each gap
    past ``planned`` (seconds; see :func:`gap_overruns`)."""
    if not records:
        raise ValueError("no step records to summarize")
    work: dict[str, list[float]] = {}
    seen: dict[int, list[float]] = {}
    over: dict[int, float] = {}
    for r in records:
        for lt in r.labels:
            if is_kfac(lt.label):
                work.setdefault(lt.label, []).append(lt.end - lt.start)
        for g in gaps(r):
            seen.setdefault(g.index, [])
            if g.exact:
                seen[g.index].append(g.seen)
        if planned is not None:
            for i, o in enumerate(gap_overruns(r, planned)):
                over[i] = max(over.get(i, 0.0), o)
    return {"node": records[0].node, "steps": [min(r.step for r in records), max(r.step for r in records)],
            "step_seconds": sum(r.seconds for r in records) / len(records),
            "kfac_seconds": {k: sum(v) / len(v) for k, v in sorted(work.items())},
            "bubble_seconds": [quantile(seen[i], 0.5) if seen[i] else None for i in sorted(seen)],
            "overrun_seconds": [over.get(i, 0.0) for i in sorted(seen)] if planned is not None else None}


# ----------------------------------------------------------------------------------------------------
# Measured timelines


def _whole_cycles(records: Sequence[StepRecord]) -> list[tuple[list[StepRecord], bool]]:
    """One replica's records (sorted by step) cut into whole cycles: stretches of consecutive steps whose
    iterations run 0, 1, 2, ... and that the next cycle's iteration 0 follows (the last stretch: when it is
    as long as a closed one, or is the only one; a window holds whole cycles). Each with whether it
    continues the cycle before it (adjacent, and the same labels: the same schedule running on)."""
    stretches: list[list[StepRecord]] = []
    for r in records:
        last = stretches[-1][-1] if stretches else None
        if last is not None and r.iteration and r.iteration == last.iteration + 1 and r.step == last.step + 1:
            stretches[-1].append(r)
        else:
            stretches.append([r])
    closed = [i + 1 < len(stretches) and stretches[i + 1][0].iteration == 0
              and stretches[i + 1][0].step == s[-1].step + 1 for i, s in enumerate(stretches)]
    lengths = {len(s) for s, c in zip(stretches, closed) if c}
    whole = [s[0].iteration == 0 and (c or (i == len(stretches) - 1 and (not lengths or len(s) in lengths)))
             for i, (s, c) in enumerate(zip(stretches, closed))]
    out: list[tuple[list[StepRecord], bool]] = []
    for i, s in enumerate(stretches):
        if whole[i]:
            labels = [[lt.label for lt in r.labels] for r in s]
            on = i > 0 and whole[i - 1] and closed[i - 1] and len(stretches[i - 1]) == len(s) \
                and [[lt.label for lt in r.labels] for r in stretches[i - 1]] == labels
            out.append((s, on))
    return out


def inverse_pieces(records: Sequence[StepRecord]) -> dict[str, list[list[float]]]:
    """Per inverse label whose refresh runs in p > 1 pieces: the seconds of every run of piece j, j < p.

    A label that runs p times per cycle is a refresh in p pieces (the runtime refuses any other count,
    :meth:`pipefisher.runtime.pipeline.executor.ScheduleExecutor.switch`), and the executor runs its pieces
    as the packing problem has them: the j-th run after the factor's completion runs piece j, those before
    it continue the previous cycle's refresh (:func:`pipefisher.schedule.problem.pieces_before_completion`).
    So each run is numbered from its own cycle's labels as they ran, in whole cycles only
    (:func:`_whole_cycles`); a run before the completion counts only where the same schedule ran the cycle
    before (in a schedule's first cycle it continues nothing: K-FAC skips it)."""
    out: dict[str, list[list[float]]] = {}
    by_replica: dict[int, list[StepRecord]] = {}
    for r in records:
        by_replica.setdefault(r.replica, []).append(r)
    for mine in by_replica.values():
        for cycle, on in _whole_cycles(sorted(mine, key=lambda r: r.step)):
            runs: dict[str, list[float]] = {}
            for r in cycle:
                for lt in r.labels:
                    if lt.label.startswith(INV_PREFIX):
                        runs.setdefault(lt.label, []).append(lt.end - lt.start)
            before = pieces_before_completion(None, [[lt.label for lt in r.labels] for r in cycle])
            for label, seconds in runs.items():
                p = len(seconds)
                if p < 2:
                    continue
                pieces = out.setdefault(label, [])
                pieces.extend([] for _ in range(p - len(pieces)))
                for j, d in enumerate(seconds):
                    if j >= before[label] or on:
                        pieces[(j - before[label]) % p].append(d)
    return out


def measured_timeline(records: Sequence[StepRecord], planned: NodeModel | None = None,
                      q: float = 0.5) -> dict[str, list[tuple[int, int]]]:
    """One node's timeline in the profiled format (integer nanoseconds), from its steps' records.

    Every duration is the ``q``-quantile over the records (robust to a few noisy steps): each call's
    compute time (its length minus its wait), each bubble where it was seen exactly, each K-FAC label.
    A stretch after a late call (one that did not wait for its input, with K-FAC work before it or
    before an earlier call it followed without waiting) is left out: it starts late, so it is shorter
    than the bubble.
    A bubble never seen exactly (its K-FAC work always overran it) is at most the shortest stretch seen
    there, and at most ``planned``'s where given (``planned``: in nanoseconds, the profiled format's
    unit; its head bubble is kept, see the module's docstring). K-FAC keys are written after the pipeline, back to back
    (only their lengths matter); a covariance key as long as all its pieces together, as profiles have it
    (``planned``'s ``cov_micro_batches`` of them per pipe, :func:`pipefisher.schedule.timeline.cov_pieces`, which the
    timeline then records too); an inverse whose refresh runs in p > 1 pieces as p intervals in piece order,
    each piece's own quantile (:func:`inverse_pieces`), as profiles have it, so that a re-pack holds the p
    labels per cycle the runtime runs. A piece never identified (no whole cycle in the records) is taken
    from ``planned`` where it has p pieces of the key, else it is the quantile of all the label's runs.
    """
    if not records:
        raise ValueError("no step records to build a timeline from")
    calls = [lt.label for lt in pipeline_labels(records[0])]
    same = [r for r in records if [lt.label for lt in pipeline_labels(r)] == calls]
    compute: list[list[float]] = [[] for _ in calls]
    exact: list[list[float]] = [[] for _ in range(len(calls) + 1)]
    upper: list[list[float]] = [[] for _ in range(len(calls) + 1)]
    work: dict[str, list[float]] = {}
    for r in same:
        for i, lt in enumerate(pipeline_labels(r)):
            compute[i].append(max(0.0, lt.end - lt.start - lt.wait))
        late = False  # the previous call started after its input came (K-FAC work held it up)
        for g in gaps(r):
            if not late:  # after a late call the stretch starts late: it says nothing of the bubble
                (exact if g.exact else upper)[g.index].append(g.seen)
            late = g.wait <= WAIT_EPS and (g.kfac > 0 or late)
        for lt in r.labels:
            if is_kfac(lt.label):
                work.setdefault(lt.label, []).append(lt.end - lt.start)
    plan = planned_gap_seconds(planned) if planned is not None else None
    bubble = []
    for i in range(len(calls) + 1):
        if exact[i]:
            bubble.append(quantile(exact[i], q))
        else:
            bound = min(upper[i]) if upper[i] else 0.0
            bubble.append(min(bound, plan[i]) if plan is not None and i < len(plan) else bound)

    def ns(x: float) -> int:
        return int(round(x * 1e9))

    out: dict[str, list[tuple[int, int]]] = {}
    # The head bubble is never measured (the step starts when the previous one ended); keep the plan's,
    # so that the current schedule is judged in the frame it was packed in (its head work not a delay).
    t = plan[0] if plan else 0.0
    for i, label in enumerate(calls):
        if i:
            t += bubble[i]
        d = quantile(compute[i], q)
        out.setdefault(label, []).append((ns(t), ns(t + d)))
        t += d
    end_of_calls = t
    counts = {label: len(v) for label, v in out.items()}
    limit = planned.cov_micro_batches if planned is not None else None
    if planned is not None:  # keys the records lack (work never run in the window): as planned
        for key, lengths in planned.durations.items():
            work.setdefault(key, [float(x) * unit_seconds(planned) for x in lengths])
    pieces = inverse_pieces(records)
    for key in sorted(work):
        parsed = TimelineKey.parse(key)
        d = quantile(work[key], q)
        if parsed.kind in COV_KINDS:
            d *= cov_pieces(counts.get(cov_source(parsed.factor, parsed.up_pipe, parsed.chunk), 1), limit)
        plan = [float(x) * unit_seconds(planned) for x in planned.durations.get(key, ())] if planned else []
        runs = pieces.get(key) or ([[] for _ in plan] if key.startswith(INV_PREFIX) and len(plan) > 1 else [])
        if not runs:
            out[key] = [(ns(t), ns(t + d))]
            t += d
            continue
        out[key] = []
        for j, seen in enumerate(runs):  # an inverse in pieces: each piece its own interval, in order
            dj = quantile(seen, q) if seen else plan[j] if len(plan) == len(runs) else d
            out[key].append((ns(t), ns(t + dj)))
            t += dj
    out[STEP_KEY] = [(0, ns(max(t, end_of_calls + bubble[-1])))]
    if limit is not None:
        out[COV_MICRO_BATCHES_KEY] = [(limit, limit)]
    return out


def window_timelines(records: Iterable[StepRecord], nodes: int, planned: Sequence[NodeModel | None] | None = None,
                     q: float = 0.5) -> list[dict[str, list[tuple[int, int]]]]:
    """:func:`measured_timeline` of every node (records of all replicas of a stage pooled)."""
    by_node: dict[int, list[StepRecord]] = {n: [] for n in range(nodes)}
    for r in records:
        by_node.setdefault(r.node, []).append(r)
    return [measured_timeline(by_node[n], planned[n] if planned else None, q) for n in range(nodes)]


# ----------------------------------------------------------------------------------------------------
# Per-instruction CSV


def instruction_rows(record: StepRecord, planned: Sequence[Placement] | None = None) -> list[tuple]:
    """The CSV rows of one step (:data:`CSV_COLUMNS`); planned times from the iteration's placements."""
    rows = []
    plan = list(planned) if planned is not None else []
    for j, lt in enumerate(record.labels):
        p = plan[j] if j < len(plan) and plan[j].label == lt.label else None
        rows.append((record.node, record.replica, record.step, record.iteration, lt.label,
                     _num(p.start if p else None), _num(p.end if p else None), _num(lt.start), _num(lt.end),
                     _num(lt.wait)))
    return rows


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.9f}"


def append_csv(path: str | os.PathLike[str], rows: Iterable[Sequence]) -> None:
    """Append rows to the per-instruction CSV, with its header when the file is new."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if new:
            w.writerow(CSV_COLUMNS)
        w.writerows(rows)


@dataclass(frozen=True)
class InstructionRow:
    """One row of a per-instruction CSV (:data:`CSV_COLUMNS`); planned times may be missing."""

    node: int
    replica: int
    step: int
    iteration: int
    label: str
    planned_start: float | None
    planned_end: float | None
    start: float
    end: float
    wait: float


def read_rows(path: str | os.PathLike[str]) -> list[InstructionRow]:
    """Every row of a per-instruction CSV; anything else is an :class:`~pipefisher.errors.InputError`
    naming the file (not CSV text, a missing column, a bad row with its line, no rows at all)."""
    from pipefisher.errors import InputError

    def opt(text: str | None) -> float | None:
        return None if text is None or not text.strip() else float(text)

    p = os.fspath(path)
    out: list[InstructionRow] = []
    try:
        with open(p, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise InputError(p, "is empty, not a pipefisher measurements CSV")
            missing = [c for c in CSV_COLUMNS if c not in reader.fieldnames]
            if missing:
                raise InputError(p, f"is not a pipefisher measurements CSV (no column {missing[0]!r})")
            for n, row in enumerate(reader, start=2):
                try:
                    if not row["label"]:
                        raise ValueError("no label")
                    out.append(InstructionRow(int(row["node"]), int(row["replica"]), int(row["step"]),
                                              int(row["iteration"]), row["label"], opt(row["planned_start"]),
                                              opt(row["planned_end"]), float(row["measured_start"]),
                                              float(row["measured_end"]), float(row["wait"] or 0.0)))
                except (TypeError, ValueError):
                    raise InputError(p, f"line {n}: not a measurement row "
                                        f"({', '.join(map(str, row.values()))})") from None
    except OSError as err:
        raise InputError(p, f"cannot be read ({err.strerror or err})") from None
    except (UnicodeDecodeError, csv.Error):
        raise InputError(p, "is not a pipefisher measurements CSV (not CSV text)") from None
    if not out:
        raise InputError(p, "has no measurements (only a header)")
    return out


def read_csv(path: str | os.PathLike[str]) -> list[StepRecord]:
    """The steps of a per-instruction CSV back as records (:func:`read_rows`; planned times dropped)."""
    steps: dict[tuple[int, int, int], list[LabelTime]] = {}
    iteration: dict[tuple[int, int, int], int] = {}
    for row in read_rows(path):
        key = (row.node, row.replica, row.step)
        iteration[key] = row.iteration
        steps.setdefault(key, []).append(LabelTime(row.label, row.start, row.end, row.wait))
    return [StepRecord(n, rep, s, iteration[(n, rep, s)], tuple(v)) for (n, rep, s), v in sorted(steps.items())]


__all__ = ["WAIT_EPS", "CSV_COLUMNS", "LabelTime", "StepRecord", "Gap", "gaps", "lay_out", "iteration_time", "planned_iterations",
           "expected_step_time", "planned_gaps", "gap_overruns", "step_overrun", "significant", "unit_seconds", "planned_gap_seconds", "measured_timeline",
           "window_timelines", "cycle_summary", "instruction_rows", "append_csv", "InstructionRow", "read_rows", "read_csv", "quantile", "START", "END"]
