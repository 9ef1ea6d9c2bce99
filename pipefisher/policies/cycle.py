"""A packed cycle, as every construction of a policy returns it, and how it becomes a node's schedule.

The constructions (greedy walks, fixed-length packing, best-fit, an exact solver) only decide which
work goes into which bubble of which iteration, in which order, and what overflows; turning that into
the schedule file's labels, the placements a chart draws and the report's figures is done here, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Callable

from pipefisher.policies.bounds import NodeBounds
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.packed import LazyPlacements, NodeFigures, NodeSchedule, Placement
from pipefisher.schedule.problem import COV, NodeModel
from pipefisher.schedule.timeline import Time


@dataclass
class Packed:
    """A packed cycle: per iteration, the work in each bubble (in order) and the overflow at its end."""

    iterations: int
    in_bubbles: list[list[tuple[int, str, Time, Time]]]  # per iteration: (bubble, label, start, end)
    overflow: list[list[tuple[str, Time]]]  # per iteration: (label, duration), after the last pipeline item
    # some refresh pieces lie before their factor's completion (:mod:`pipefisher.schedule.problem`)
    overlap: bool = False


def start_walk(model: NodeModel, factor_done: Callable[[int], None], queue_ready: Callable[[int], None]) -> None:
    """What a walk over the bubbles (greedy, best-fit) has ready before it places anything: each factor
    with no covariance pieces on this node is done at once (``factor_done(group)``: its syncs or its
    refresh may start), and each covariance queue's first piece is ready (``queue_ready(work index)``)."""
    for g, pieces in enumerate(model.factors.pieces):
        if pieces == 0:
            factor_done(g)
    for wi, w in enumerate(model.work):
        if w.kind == COV:
            queue_ready(wi)


def node_schedule(model: NodeModel, packed: Packed, bounds: NodeBounds) -> NodeSchedule:
    """Labels in time order per iteration, placements with times (built when first read), and the
    figures of the report."""
    keys = [key for key, _, _ in model.pipeline]
    at = [b.pos for b in model.bubbles]
    calls = len(keys)
    iterations: list[tuple[str, ...]] = []
    layout: list[tuple[tuple[int, str, int], ...]] = []
    kfac: Time = 0
    total_overflow: Time = 0
    k = packed.iterations
    for i in range(k):
        labels = [START]
        work: list[tuple[int, str]] = []  # each K-FAC label, with the calls before it
        nxt = 0  # next pipeline item to emit
        for b, label, s, e in packed.in_bubbles[i]:
            upto = at[b]
            if nxt < upto:
                labels += keys[nxt:upto]
                nxt = upto
            labels.append(label)
            work.append((upto, label))
            kfac += e - s
        labels += keys[nxt:]
        for label, d in packed.overflow[i]:
            labels.append(label)
            work.append((calls, label))
            kfac += d
            total_overflow += d
        labels.append(END)
        if i == 0:
            labels.append(SAVE_OFF)
        if i == k - 1:
            labels.append(SAVE_ON)
        iterations.append(tuple(labels))
        layout.append(tuple((calls_before, label, len(list(run))) for (calls_before, label), run in groupby(work)))
    cycle = model.length * k + total_overflow
    busy = model.pipeline_busy * k
    usage = (busy + kfac) / cycle * 100 if cycle else 0.0
    figures = NodeFigures(
        iterations=k,
        usage=usage,
        cycle_time=cycle,
        pipeline_busy=busy,
        kfac_placed=kfac,
        bubble_left=cycle - busy - kfac,
        overflow=total_overflow,
        lower_bound=bounds.tight,
        extra={
            "volume_bound": bounds.volume,
            "fittable_work": bounds.fittable_work,
            "bubble_time_per_iteration": bounds.bubble_time,
            "largest_bubble": bounds.largest_bubble,
            "forced_items": bounds.forced_items,
            **({"overlap": True} if packed.overlap else {}),
        },
    )
    return NodeSchedule(tuple(iterations), LazyPlacements(lambda: _placements(model, packed)), figures, tuple(layout))


def _placements(model: NodeModel, packed: Packed) -> tuple[Placement, ...]:
    """Every label of the cycle with its start, end and iteration, as :func:`node_schedule` orders them."""
    pipeline = model.pipeline
    bubbles = model.bubbles
    placements: list[Placement] = []
    k = packed.iterations
    make = tuple.__new__  # Placement is a NamedTuple: build it without the keyword machinery
    P = Placement
    for i in range(k):
        places = [make(P, (START, 0, 0, i))]
        nxt = 0  # next pipeline item to emit
        for b, label, s, e in packed.in_bubbles[i]:
            upto = bubbles[b].pos
            while nxt < upto:
                key, ps, pe = pipeline[nxt]
                places.append(make(P, (key, ps, pe, i)))
                nxt += 1
            places.append(make(P, (label, s, e, i)))
        for key, ps, pe in pipeline[nxt:]:
            places.append(make(P, (key, ps, pe, i)))
        t = model.base
        for label, d in packed.overflow[i]:
            places.append(make(P, (label, t, t + d, i)))
            t += d
        places.append(make(P, (END, t, t, i)))
        if i == 0:
            places.append(make(P, (SAVE_OFF, t, t, i)))
        if i == k - 1:
            places.append(make(P, (SAVE_ON, t, t, i)))
        placements.extend(places)
    return tuple(placements)
