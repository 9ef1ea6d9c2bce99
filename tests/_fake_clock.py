"""A deterministic, reality-like fake clock for the measurement loop (a test helper, no tests in it).

Every node has a *true* :class:`~pipefisher.schedule.problem.NodeModel`: the profile with some K-FAC keys made
slower or faster (:func:`slowed_job`, :func:`true_models`). The pipeline of all nodes repeats with
period ``P`` = the largest ``model.base``; in step ``t`` pipeline call ``j`` of a node gets its input at
``t * P + s_j`` (``s_j``: the call's start in the model; calls matched to the model's pipeline by key
and occurrence within the step, as :func:`pipefisher.cost.measure.lay_out` does). The node runs its labels
back to back: a call starts when it is called and gets its input at ``max(cursor, offered)`` (``wait``
is the difference), then lasts its model duration; a K-FAC label lasts its true duration: the j-th run
of a key in the node's *cycle* takes the key's j-th piece, an inverse's counted from its factor's
completion (the packing problem's rule, :func:`pipefisher.schedule.problem.pieces_before_completion`,
as ``lay_out`` and the executor count: :func:`first_pieces`), so pieces of unequal length run at their
own lengths in whichever step they run; markers take no time; ``-- end --`` takes ``end_seconds``.
Records are in seconds from the step's ``-- start --``.

**Where a step starts (resume safety).** On hardware a step starts right after the previous step's
``-- end --``, which would make every record depend on everything run before it: a process resumed from
a checkpoint would not know it. Here every step is a pure function of its own labels. Its start is as
late as its own head work allows and no earlier than the previous step could have ended::

    start = max(t*P + e_last - P + end,   # the previous step ended on plan, nothing after its last call
                t*P + s_first - head)     # just in time for this step's head work before its first call

(``e_last``: the model's last pipeline end, ``s_first``: the first call's start, ``head``: the true time
of the labels before the first call). So the idle a node spends across the step boundary is shared:
work after the last call runs there freely (it only lengthens its own step's record, never the next
step), work before the first call gets the idle right before that call, and a node with no idle there
(node 0 ends the pipeline time) has its head work delay its first call. What the fake does not model:
a step whose tail work plus the next step's head work exceed the idle between them delays nothing, and a
late call never delays another node (the inputs come on the period's time, whatever happened before).
The absolute offsets ``t * P`` cancel out, so a record depends on the labels run, their cycle and the
model only: two runs that run the same labels get identical records, resumed or not.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from pipefisher.cost.measure import LabelTime, StepRecord
from pipefisher.runtime.train.recorder import StepRecorder
from pipefisher.schedule.format import END, MARKERS
from pipefisher.schedule.problem import DEFAULT_MARGIN, NodeModel, node_model, pieces_before_completion
from pipefisher.schedule.timeline import Interval, Job, TimelineKey


def slowed_job(job: Job, factors: Mapping[tuple[int, str], float] | None = None,
               every_kfac: float = 1.0) -> Job:
    """``job`` with K-FAC key ``key`` of node ``node`` ``factors[(node, key)]`` times as long (every
    interval of it, rounded to the nanosecond), and every other K-FAC key ``every_kfac`` times."""
    factors = dict(factors or {})
    nodes = []
    for n, node in enumerate(job.nodes):
        entries = {}
        for key, intervals in node.entries.items():
            f = factors.get((n, key), every_kfac if TimelineKey.parse(key).is_kfac else 1.0)
            entries[key] = intervals if f == 1.0 else tuple(
                Interval(iv.start, iv.start + round((iv.end - iv.start) * f)) for iv in intervals)
        nodes.append(dataclasses.replace(node, entries=entries))
    unknown = [k for k in factors if k[0] >= len(nodes) or k[1] not in nodes[k[0]].entries]
    if unknown:
        raise KeyError(f"no such node keys: {unknown}")
    return dataclasses.replace(job, nodes=tuple(nodes))


def true_models(job: Job, margin: float = DEFAULT_MARGIN) -> list[NodeModel]:
    """Every node's true model (the margin plays no part in the fake's timings)."""
    return [node_model(node, job.span, margin) for node in job.nodes]


def period(models: Sequence[NodeModel]) -> int:
    """The pipeline's period P: the largest node's ``base``."""
    return max(int(m.base) for m in models)


def _is_call(label: str, where: Mapping[str, list]) -> bool:
    return label in where


def first_pieces(iterations: Sequence[Sequence[str]], iteration: int, model: NodeModel) -> dict[str, int]:
    """Per K-FAC label, the piece its first run in ``iterations[iteration]`` runs (the module docstring):
    its runs in the cycle's earlier iterations, less, for an inverse, its runs before its factor's
    completion (a negative index counts from the last piece, cyclically)."""
    out = {label: -n for label, n in pieces_before_completion(model, iterations).items()}
    for labels in iterations[:iteration]:
        for label in labels:
            out[label] = out.get(label, 0) + 1
    return out


def fake_step(labels: Sequence[str], model: NodeModel, period_ns: int, end_seconds: float = 0.0,
              first: Mapping[str, int] | None = None) -> tuple[LabelTime, ...]:
    """One step of ``labels`` on ``model`` (see the module docstring): its labels' times in seconds.
    ``first``: per K-FAC label, the piece its first run in the step runs (:func:`first_pieces`; none:
    piece 0, a one-iteration cycle without inverse runs before their completion)."""
    where: dict[str, list[tuple[int, int]]] = {}
    for key, s, e in model.pipeline:
        where.setdefault(key, []).append((s, e))
    pieces: dict[str, list[int]] = {}
    for w in model.work:
        pieces.setdefault(w.label, []).extend(w.pieces)
    end_ns = end_seconds * 1e9

    # durations of K-FAC labels (by occurrence within the step) and of markers
    seen: dict[str, int] = {}

    def length(label: str) -> float:
        if label == END:
            return end_ns
        if label in MARKERS or label not in pieces:
            return 0.0
        j = seen.get(label, (first or {}).get(label, 0))
        seen[label] = j + 1
        ps = pieces[label]
        return float(ps[j % len(ps)])

    durations = [None if _is_call(lb, where) else length(lb) for lb in labels]

    # the step's start on the period's clock (t*P taken as 0: it cancels out)
    first = next((i for i, lb in enumerate(labels) if _is_call(lb, where)), None)
    e_last = max((e for _, _, e in model.pipeline), default=0)
    start = float(e_last - period_ns) + end_ns
    if first is not None:
        head = sum(d for d in durations[:first] if d is not None)
        start = max(start, where[labels[first]][0][0] - head)

    out = []
    calls: dict[str, int] = {}
    cursor = 0.0
    for label, d in zip(labels, durations):
        if d is None:
            n = calls.get(label, 0)
            calls[label] = n + 1
            s, e = where[label][n % len(where[label])]
            got = max(cursor, s - start)
            out.append(LabelTime(label, cursor / 1e9, (got + (e - s)) / 1e9, (got - cursor) / 1e9))
            cursor = got + (e - s)
        else:
            out.append(LabelTime(label, cursor / 1e9, (cursor + d) / 1e9))
            cursor += d
    return tuple(out)


def fake_records(schedule_data: Sequence[Sequence[Sequence[str]]], models: Sequence[NodeModel], first_step: int,
                 steps: int, replica: int = 0, end_seconds: float = 0.0) -> list[StepRecord]:
    """Every node's records of steps ``first_step .. first_step + steps - 1`` of ``schedule_data`` (step
    ``first_step + t`` runs iteration ``t % k`` of each node), on the true ``models``."""
    p = period(models)
    out = []
    for t in range(steps):
        for n, (iterations, model) in enumerate(zip(schedule_data, models)):
            it = t % len(iterations)
            out.append(StepRecord(n, replica, first_step + t, it, fake_step(
                iterations[it], model, p, end_seconds, first_pieces(iterations, it, model))))
    return out


class FakeRecorder(StepRecorder):
    """The fake clock driven by the executor: each wrapped label runs its call and is logged; the step's
    record is :func:`fake_step` of the labels run, so it equals :func:`fake_records`' for the same labels.
    ``cycle()``: the node's cycle the executor runs now (its pieces' numbering, :func:`first_pieces`).

    It keeps no state across steps (see the module docstring), so a resumed run records as the
    uninterrupted one did.
    """

    def __init__(self, node: int, replica: int, model: NodeModel, period_ns: int,
                 cycle: Callable[[], Sequence[Sequence[str]]], end_seconds: float = 0.0) -> None:
        super().__init__(node, replica)
        self.model, self.period_ns, self.end_seconds = model, period_ns, end_seconds
        self.cycle = cycle
        self._step = self._iteration = 0
        self._ran: list[str] = []

    def begin_step(self, step: int, iteration: int) -> None:
        self._step, self._iteration = step, iteration
        self._ran = []

    def wrap(self, label: str, call: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            call()
            self._ran.append(label)
        return timed

    def end_step(self) -> StepRecord:
        first = first_pieces(self.cycle(), self._iteration, self.model)
        return StepRecord(self.node, self.replica, self._step, self._iteration,
                          fake_step(self._ran, self.model, self.period_ns, self.end_seconds, first))
