"""The ``best-fit`` policy: the plainest greedy packing, a baseline every other policy must match.

Bubble by bubble, in time order, iteration after iteration: put the largest ready item that still fits
(the room rule of :mod:`pipefisher.schedule.problem`) at the bubble's current time; repeat until nothing ready
fits, then go to the next bubble. Work that fits no bubble of the node waits for the end of an
iteration, after its last pipeline item (forced overflow). Ready means the dependency rules allow it
now: a covariance piece after its forward or backward of the first iteration (and after the pieces
before it in its queue), a sync after all pieces of its factor, an inverse after the factor's first
sync (or all its pieces, where the node has no sync for it), each piece of a refresh after the one before.

It knows nothing the other policies do not: ``tight`` runs it as one candidate of its portfolio, so
``tight`` never loses to it.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

from pipefisher.policies.align import align_groups
from pipefisher.policies.bounds import fittable_work, model_bounds, placed_time, sure_to_reach
from pipefisher.policies.cycle import Packed, node_schedule, start_walk
from pipefisher.rules.groups import job_groups
from pipefisher.schedule.packed import JobSchedule, Policy, gc_paused
from pipefisher.schedule.problem import COV, DEFAULT_MARGIN, INV, SYNC, NodeModel, node_model
from pipefisher.schedule.timeline import Job, Time


def pack_best_fit(model: NodeModel, max_iterations: int = 1 << 20, later_first: bool = False,
                  shorter_than: int | None = None) -> Packed | None:
    """The best-fit cycle of one node (see the module's docstring); dependency-correct by construction.

    Of equally large ready items the one whose key comes first in the timeline goes first, or with
    ``later_first`` the one whose key comes last (``tight`` runs both: which factors finish first can
    decide whether the big inverses find their bubbles in time). With ``shorter_than``, None as soon
    as the cycle is sure to have that many iterations or more (:func:`sure_to_reach`).
    """
    tie = 1 if later_first else -1
    work = model.work
    bubbles = model.bubbles
    scale = model.scale
    largest = model.largest
    positions = [b.pos for b in bubbles]

    head = [0] * len(work)  # per covariance queue: its next piece
    pieces_left = list(model.factors.pieces)
    syncs_of, invs_of = model.factors.syncs, model.factors.invs
    synced_yet = [False] * model.groups
    next_piece = {a: b for invs in invs_of for a, b in zip(invs, invs[1:])}  # a refresh's pieces, in order
    if shorter_than is not None:
        bubble_time = sum(b.length for b in bubbles)
        fit_left = fittable_work(model)  # what is left of it: only bubbles take it

    ready: list[tuple[Time, int, int]] = []  # (room needed, tie * work index, work index), ascending
    forced: list[int] = []  # ready work that fits no bubble: overflow at the iteration's end
    waiting: dict[int, list[int]] = {}  # iteration 0: bubble index -> queues whose head is released there
    iteration = 0
    bubble = 0

    def make_ready(wi: int) -> None:
        w = work[wi]
        d = w.pieces[head[wi]] if w.kind == COV else w.pieces[0]
        if not d * scale < largest:
            forced.append(wi)
        elif w.kind == COV and iteration == 0 and bisect_right(positions, w.release[head[wi]]) > bubble:
            waiting.setdefault(bisect_right(positions, w.release[head[wi]]), []).append(wi)
        else:
            insort(ready, (d * scale, tie * wi, wi))

    def factor_pieces_done(g: int) -> None:
        for wi in (syncs_of[g] if model.synced[g] else invs_of[g][:1]):
            make_ready(wi)

    def done(wi: int) -> Time:
        """Book item ``wi`` (a queue's head piece) as placed; make ready what it unlocks."""
        w = work[wi]
        if w.kind == COV:
            d = w.pieces[head[wi]]
            head[wi] += 1
            pieces_left[w.group] -= 1
            if head[wi] < len(w.pieces):
                make_ready(wi)
            elif pieces_left[w.group] == 0:
                factor_pieces_done(w.group)
            return d
        if w.kind == SYNC and not synced_yet[w.group]:
            synced_yet[w.group] = True
            for v in invs_of[w.group][:1]:
                make_ready(v)
        elif w.kind == INV and wi in next_piece:
            make_ready(next_piece[wi])
        return w.pieces[0]

    start_walk(model, factor_pieces_done, make_ready)

    in_bubbles: list[list[tuple[int, str, Time, Time]]] = []
    overflow: list[list[tuple[str, Time]]] = []
    while ready or forced or waiting:
        if iteration >= max_iterations:
            raise RuntimeError("best-fit packing made no progress")  # pragma: no cover
        here: list[tuple[int, str, Time, Time]] = []
        add = here.append
        for bubble, b in enumerate(bubbles):
            for wi in waiting.pop(bubble, []) if iteration == 0 else []:
                make_ready(wi)
            t, end = b.start, b.end
            while ready:
                i = bisect_left(ready, (end - t,)) - 1  # the largest need below the room left
                if i < 0:
                    break
                need, _, wi = ready.pop(i)
                w = work[wi]
                if w.kind != COV:
                    d = done(wi)
                    add((bubble, w.label, t, t + d))
                    t += d
                    continue
                # The queue's next piece, if it has the same size, is ready and still fits, would be
                # the next pick again (nothing ready needs more, and of equal needs it comes first):
                # place the whole run at once, then book its last piece with ``done`` as usual.
                pieces, release, label = w.pieces, w.release, w.label
                first = h = head[wi]
                d = pieces[h]
                n = len(pieces)
                while True:
                    add((bubble, label, t, t + d))
                    t += d
                    h += 1
                    if not (h < n and pieces[h] == d and need < end - t
                            and (iteration or bisect_right(positions, release[h]) <= bubble)):
                        break
                # book the run as ``done`` books one piece, inlined (once per run: the hot path)
                head[wi] = h
                g = w.group
                pieces_left[g] -= h - first
                if h < n:  # the queue's next piece: ready, waiting for its release, or forced (make_ready)
                    d = pieces[h]
                    if not d * scale < largest:
                        forced.append(wi)
                    elif iteration == 0 and bisect_right(positions, release[h]) > bubble:
                        waiting.setdefault(bisect_right(positions, release[h]), []).append(wi)
                    else:
                        insort(ready, (d * scale, tie * wi, wi))
                elif pieces_left[g] == 0:
                    factor_pieces_done(g)
        if iteration == 0:  # past the last bubble: every release of the first iteration is met
            bubble = len(bubbles)
            for wi in [v for key in sorted(waiting) for v in waiting[key]]:
                insort(ready, (work[wi].pieces[head[wi]] * scale, tie * wi, wi))
            waiting.clear()
        spill: list[tuple[str, Time]] = []
        while forced:
            wi = forced.pop(0)
            label = work[wi].label
            spill.append((label, done(wi)))
        in_bubbles.append(here)
        overflow.append(spill)
        iteration += 1
        if shorter_than is not None and (ready or forced or waiting):
            fit_left -= placed_time(here)
            if sure_to_reach(iteration, fit_left, bubble_time, shorter_than):
                return None
    if not in_bubbles:
        in_bubbles, overflow = [[]], [[]]
    return Packed(len(in_bubbles), in_bubbles, overflow)


class BestFitPolicy(Policy):
    """Largest ready item that fits, bubble by bubble: a plain baseline (``tight`` includes it)."""

    name = "best-fit"
    summary = "plain best-fit greedy: the largest ready item that fits, bubble by bubble (a baseline)"

    def pack(self, job: Job, margin: float = DEFAULT_MARGIN) -> JobSchedule:
        with gc_paused():
            nodes = []
            for node in job.nodes:
                model = node_model(node, job.span, margin)
                nodes.append(node_schedule(model, pack_best_fit(model), model_bounds(model)))
            return JobSchedule(self.name, job.span, align_groups(job, tuple(nodes), job_groups(job), margin), margin)
