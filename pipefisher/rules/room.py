"""The room rule on a schedule: K-FAC work fits, with its margin, where its labels place it.

The rule itself (an item of length ``d`` fits ``(1 + margin) d < room``) is stated once in
:mod:`pipefisher.schedule.problem`; this module checks a schedule's labels against it, measuring every item as
the packers do, so that the check and the packers agree to the last bit.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from itertools import accumulate
from typing import Sequence

from pipefisher.rules.violations import Violation
from pipefisher.schedule.problem import DEFAULT_MARGIN, fits, node_model, pieces_before_completion
from pipefisher.schedule.timeline import NodeTimeline, Time, format_time


def room_violations(node_index: int, node: NodeTimeline, iterations: Sequence[Sequence[str]], span: Time,
                    margin: float = DEFAULT_MARGIN, overlap: bool = False) -> list[Violation]:
    """Every violation of the room rule of :mod:`pipefisher.schedule.problem`, on the labels between two pipeline items.

    The K-FAC work labelled between two pipeline items runs back to back from the end of the first
    (the latest end of the pipeline items so far); each item must fit with its margin before the
    second starts: ``(1 + margin) d < start - t``, zero-length items too, each item measured as the
    packers measure it (the j-th covariance piece of a key is its j-th even share, a missing time no
    time, the j-th run of an inverse label its j-th piece, counted from its factor's completion in an
    ``overlap`` cycle) and ``t`` summed item by item, so that the check and the packers agree to the last bit. A
    schedule that claims more room than that makes every such iteration longer than reported (or
    leaves a bubble no safety margin): ``bubble-overfilled``. Work after an iteration's last pipeline
    item runs up to the pipeline time under the same rule; then only work that fits no bubble of the
    node may run (forced overflow, past the pipeline time); fittable work past the pipeline time or
    after forced work lengthens the iteration for nothing: ``unforced-overflow``.
    """
    out: list[Violation] = []

    def bad(iteration: int | None, label: str, rule: str, detail: str) -> None:
        out.append(Violation(node_index, iteration, label, rule, detail))

    model = node_model(node, span, margin)
    where: dict[str, list[tuple[Time, Time]]] = defaultdict(list)  # per pipeline key, in time order
    for key, s, e in model.pipeline:
        where[key].append((s, e))
    largest = model.largest
    lengths = model.durations  # per K-FAC key: its items' durations, in order
    done: dict[str, int] = defaultdict(int)
    # an overlapping cycle's inverse runs before the completion are the previous refresh's last pieces
    shift = pieces_before_completion(node, iterations) if overlap else {}
    begin = min(min((s for _, s, _ in model.pipeline), default=0), 0)

    # Pipeline items in time order, each with its occurrence of its key, and the running latest end: the
    # items a stretch of K-FAC work starting at t may run over are those after the first whose
    # running end passes t.
    occurrence: dict[str, int] = defaultdict(int)
    items: list[tuple[str, int, Time, Time]] = []
    for key, s, e in model.pipeline:
        items.append((key, occurrence[key], s, e))
        occurrence[key] += 1
    reach = list(accumulate((e for _, _, _, e in items), max))

    def over_unlisted(i: int, pending: list[tuple[str, Time]], start: Time, before: Time | None,
                      seen: dict[str, int]) -> None:
        """K-FAC work laid out from ``start`` that runs over a pipeline item the iteration has not listed
        before the next listed one (at ``before``; None: none follows), such as a zero-bubble W pass a
        schedule leaves out: that work and the pipeline would share the node's time."""
        end = start + sum(d for _, d in pending)
        for key, k, s, e in items[bisect_right(reach, start):]:
            if s >= end or (before is not None and s >= before):
                break
            if k >= seen[key] and e > start and s < end:
                bad(i, pending[0][0], "kfac-over-pipeline", f"K-FAC work runs {format_time(start)}..{format_time(end)}"
                    f", over '{key}' at {format_time(s)}..{format_time(e)}, which the iteration does not list "
                    f"before it")
                return

    def overfilled(pending: list[tuple[str, Time]], start: Time, end: Time) -> bool:
        t = start  # summed item by item from the gap's start, as the packers lay work out
        for _, d in pending:
            if not fits(d, end - t, margin):
                return True
            t += d
        return False

    for i, labels in enumerate(iterations):
        seen: dict[str, int] = defaultdict(int)
        frontier: Time = begin
        pending: list[tuple[str, Time]] = []
        for label in labels:
            if label in where:
                k = seen[label]
                seen[label] += 1
                if k >= len(where[label]):
                    continue  # the pipeline-count rule reports it
                s, e = where[label][k]
                if pending and overfilled(pending, frontier, s):
                    bad(i, label, "bubble-overfilled", f"{format_time(sum(d for _, d in pending))} of K-FAC work is "
                        f"placed before it, but {format_time(max(s - frontier, 0))} of idle time precedes it (each "
                        f"item needs its length x {1 + margin:g} free when it starts)")
                if pending:
                    over_unlisted(i, pending, frontier, s, seen)
                frontier = max(frontier, e)
                pending = []
            elif lengths.get(label):
                n = done[label] - shift.get(label, 0)
                done[label] += 1
                pending.append((label, lengths[label][n % len(lengths[label])]))
        # After the last pipeline item: fittable work up to the pipeline time; then forced work only,
        # which runs past it (the iteration's overflow).
        over_unlisted(i, pending, frontier, None, seen)
        t = frontier
        overflowing = False
        for label, d in pending:
            if not fits(d, largest, margin):
                overflowing = True
            elif overflowing or not fits(d, model.base - t, margin):
                bad(i, label, "unforced-overflow", "runs past the pipeline time, into its margin or after "
                    f"overflow work, though it fits the node's largest bubble ({format_time(largest)})")
            t += d
    return out
