"""A test oracle: valid schedules built straight from the problem's rules, independently of the packers.

:func:`random_cycle` walks one node's bubbles iteration by iteration and puts random READY items in
them WHILE THEY FIT, with nothing but the definitions of :mod:`pipefisher.schedule.problem`: the room rule
``t + (1 + margin) d < e`` (work runs back to back from the bubble's start), forced overflow (work that
fits no bubble runs after the iteration's last pipeline item) and the dependency rules (piece j of a
factor after forward/backward ``j mod m`` of iteration 0, a sync after all pieces of its factor, an
inverse after the factor's first sync or, with no sync, after all its pieces). It shares no code with
any policy, so a schedule it builds is a witness of what ``validate`` accepts, and every such witness
bounds the optimum from above: a lower bound above one of them is wrong.

Randomness decides which ready item goes next (uniform, or the largest, or the smallest that fits),
and when to leave a bubble with room to spare. With ``ties`` set to ``"first"`` or ``"last"`` and
``style="largest"`` it is a deterministic plain best-fit greedy (:func:`plain_greedy_cycle`), the
baseline ``tight`` must never lose to. After the last pipeline item, fittable work comes first
(up to the pipeline time) and forced overflow after it, as the problem states.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.problem import COV, SYNC, NodeModel, fits, node_model
from pipefisher.schedule.timeline import Job, NodeTimeline, Time


@dataclass
class _Queue:
    """One label's items in the order ``validate`` measures them (its n-th occurrence is item n)."""

    label: str
    kind: int
    group: int
    durations: list[Time] = field(default_factory=list)
    release: list[int] = field(default_factory=list)  # covariance: the pipeline index each piece follows
    head: int = 0

    def done(self) -> bool:
        return self.head >= len(self.durations)


def _queues(model: NodeModel) -> list[_Queue]:
    by_label: dict[str, _Queue] = {}
    for w in model.work:
        q = by_label.setdefault(w.label, _Queue(w.label, w.kind, w.group))
        q.durations.extend(w.pieces)
        q.release.extend(w.release if w.kind == COV else [-1] * len(w.pieces))
    return list(by_label.values())


def random_cycle(model: NodeModel, rng: random.Random, *, style: str = "random", leave: float = 0.0,
                 max_iterations: int = 10_000, sizes: str = "piece", ties: str = "random") -> list[list[str]]:
    """One valid cycle of ``model``'s node (the schedule file's entry for it), built at random.

    ``style``: how the next item is chosen among the ready ones that fit: ``"random"``, ``"largest"``
    (best fit: ends near the limit of the room rule), ``"smallest"``, or ``"mixed"`` (a random style per
    choice). ``leave``: the chance of leaving a bubble before it is full (a worse but valid cycle).
    ``sizes``: what "largest" and "smallest" compare: each item's own duration (``"piece"``), or for a
    covariance queue its longest piece (``"queue"``: a queue's pieces count as one size). ``ties``:
    among equally sized items, a random one, or the first or last in the timeline's key order.
    """
    margin = model.margin
    largest = model.largest
    queues = _queues(model)
    cov_left = [0] * model.groups
    syncs_done = [0] * model.groups
    for q in queues:
        if q.kind == COV:
            cov_left[q.group] += len(q.durations)
    n_pipe = len(model.pipeline)
    by_pos = {b.pos: b for b in model.bubbles}
    tail_start = max((e for _, _, e in model.pipeline), default=0)
    tail_start = max(tail_start, min(min((s for _, s, _ in model.pipeline), default=0), 0))

    def forced(d: Time) -> bool:
        return not fits(d, largest, margin)

    def ready(q: _Queue, iteration: int, pos: int) -> bool:
        if q.done():
            return False
        if q.kind == COV:
            return iteration > 0 or q.release[q.head] < pos
        if q.kind == SYNC:
            return cov_left[q.group] == 0
        if model.synced[q.group]:
            return syncs_done[q.group] > 0
        return cov_left[q.group] == 0

    def take(q: _Queue) -> tuple[str, Time]:
        d = q.durations[q.head]
        q.head += 1
        if q.kind == COV:
            cov_left[q.group] -= 1
        elif q.kind == SYNC:
            syncs_done[q.group] += 1
        return q.label, d

    longest = {id(q): max(q.durations, default=0) for q in queues}

    def size(q: _Queue) -> Time:
        return longest[id(q)] if sizes == "queue" and q.kind == COV else q.durations[q.head]

    def choose(cands: list[_Queue]) -> _Queue:
        how = rng.choice(("random", "largest", "smallest")) if style == "mixed" else style
        if how == "largest":
            top = max(size(q) for q in cands)
            cands = [q for q in cands if size(q) == top]
        elif how == "smallest":
            low = min(size(q) for q in cands)
            cands = [q for q in cands if size(q) == low]
        if ties == "first":
            return cands[0]
        if ties == "last":
            return cands[-1]
        return rng.choice(cands)

    def fill(start: Time, end: Time, iteration: int, pos: int, allow_forced: bool) -> list[str]:
        """Labels for the room [start, end) after ``pos`` pipeline items; forced items too if allowed."""
        t = start
        out: list[str] = []
        while not (leave and rng.random() < leave):
            cands = [q for q in queues if ready(q, iteration, pos) and (
                (not forced(q.durations[q.head]) and fits(q.durations[q.head], end - t, margin))
                or (allow_forced and forced(q.durations[q.head])))]
            if not cands:
                break
            label, d = take(choose(cands))
            out.append(label)
            t += d
        return out

    cycle: list[list[str]] = []
    while any(not q.done() for q in queues):
        i = len(cycle)
        if i >= max_iterations:
            raise AssertionError("the oracle made no progress")
        if i > 20:
            leave = 0.0  # always finishes: every fittable item fits the largest bubble when it is empty
        labels = [START]
        for p in range(n_pipe + 1):
            b = by_pos.get(p)
            if p == n_pipe:
                # After the last pipeline item: the tail bubble (if any) up to the pipeline time, then
                # forced overflow.
                end = b.end if b is not None else tail_start
                start = b.start if b is not None else tail_start
                labels += fill(start, end, i, p, allow_forced=False)
                labels += fill(end, end, i, p, allow_forced=True)  # forced only: no room is left
            elif b is not None:
                labels += fill(b.start, b.end, i, p, allow_forced=False)
            if p < n_pipe:
                labels.append(model.pipeline[p][0])
        labels.append(END)
        if i == 0:
            labels.append(SAVE_OFF)
        cycle.append(labels)
    if not cycle:
        cycle = [[START] + [key for key, _, _ in model.pipeline] + [END, SAVE_OFF]]
    cycle[-1].append(SAVE_ON)
    return cycle


PLAIN_GREEDIES = tuple((sizes, ties) for sizes in ("piece", "queue") for ties in ("first", "last"))
"""Plain best-fit variants: (what "largest" compares, which of equally large items goes first)."""


def plain_greedy_cycle(model: NodeModel, sizes: str = "piece", ties: str = "first") -> list[list[str]]:
    """A plain best-fit cycle: in each bubble, in time order, the largest ready item that fits, until none
    does (deterministic; see :func:`random_cycle` for ``sizes`` and ``ties``)."""
    return random_cycle(model, random.Random(0), style="largest", sizes=sizes, ties=ties)


def random_job_schedule(job: Job, margin: float, rng: random.Random, **kw) -> list[list[list[str]]]:
    """A schedule file's content: one random valid cycle per node of ``job``."""
    return [random_cycle(node_model(node, job.span, margin), rng, **kw) for node in job.nodes]


def node_cycle(node: NodeTimeline, span: Time, margin: float, seed: int = 0, **kw) -> list[list[str]]:
    return random_cycle(node_model(node, span, margin), random.Random(seed), **kw)


def iterations_of(schedule: Sequence[Sequence[Sequence[str]]]) -> list[int]:
    return [len(node) for node in schedule]
