"""Aligning the schedules of a sync group, so that its members share syncs, inverses and ends in order.

Each node is packed on its own; in a Chimera job the two replicas of a stage (a sync group, see
:mod:`pipefisher.policies.groups`) must then issue their all-reduces, refresh their inverses and end
their steps in the same order. This module takes the packed members of a group and rewrites them:

1. pad them to the same cycle length with iterations that hold only the pipeline;
2. take every sync and inverse out, keeping the covariance pieces where they are;
3. put them back one at a time, in one common order for the group (the order the members' own
   packings had them, by the latest time over members), each member appending the label at the earliest
   gap between pipeline items (or the iteration's tail) that is not before its dependencies (a sync after
   all its factor's pieces on that node, an inverse after its sync) nor before the member's previous
   shared label, and that still has room by the packers' rule (:func:`bounds.fits`); work that fits no
   bubble goes to a tail, as overflow. All members use the same iteration and the same side of
   ``-- end --``: the latest any member needs, bumped (adding pipeline-only iterations when needed)
   until every member has room there;
4. drop trailing iterations that hold no K-FAC work on any member, and recompute placements and figures.

Groups of one are returned as they are.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

from pipefisher.policies.base import END, MARKERS, SAVE_OFF, SAVE_ON, START, NodeFigures, NodeSchedule, Placement
from pipefisher.policies.bounds import fits
from pipefisher.policies.groups import Group, identity, is_shared
from pipefisher.policies.model import NodeModel, node_model
from pipefisher.timeline import Job, Time, TimelineKey

Item = tuple[str, int]  # (identity, occurrence): one shared label of the cycle, as all members know it
Position = tuple[int, int]  # (iteration, region)


@dataclass
class _Shape:
    """The iteration a member repeats: its pipeline labels in order, the gaps around them."""

    pipe: tuple[tuple[str, Time, Time], ...]  # (label, start, end) in the schedule's order
    starts: tuple[Time, ...]  # where each gap's idle time begins: before pipe[j], and the tail (last)
    room: tuple[Time, ...]  # its idle time (measured as ``validate`` measures it)
    base: Time  # where an iteration without overflow ends
    largest: Time  # the largest bubble: work that does not fit it with the margin is overflow

    @property
    def tail(self) -> int:
        """Region of fittable work after the last pipeline item; the next two: overflow, after the end."""
        return len(self.pipe)

    def fittable(self, d: Time) -> bool:
        return fits(d, self.largest)


@dataclass
class _Member:
    """One member's cycle while its group is aligned: its K-FAC labels per iteration and region."""

    node: int
    model: NodeModel
    shape: _Shape
    regions: list[list[list[tuple[str, Time]]]]  # [iteration][region] = [(label, duration), ...]
    used: list[list[Time]]  # fittable work per iteration and region
    overflowing: list[bool]  # per iteration: its tail holds overflow (no fittable work may follow it)
    ready: dict[str, Position]  # per covariance label: where its last piece is
    ready_time: dict[str, float]  # and when it ends in the member's own packing
    shared: dict[Item, tuple[str, Time, float]]  # own label, duration, time it had in the member's packing
    placed: dict[str, Position] = field(default_factory=dict)  # per own sync label: where it went
    last: Position = (0, 0)  # where the previous shared label went

    def add_iterations(self, k: int) -> None:
        while len(self.regions) < k:
            self.regions.append([[] for _ in range(self.shape.tail + 3)])
            self.used.append([0] * (self.shape.tail + 3))
            self.overflowing.append(False)

    def accepts(self, i: int, r: int, d: Time) -> bool:
        """Whether ``d`` of work appended to region ``r`` of iteration ``i`` keeps the room rules."""
        shape, used = self.shape, self.used[i]
        fittable = shape.fittable(d)
        if r < shape.tail:
            return fittable and fits(d, shape.room[r] - used[r])
        if r == shape.tail + 1:  # overflow, before the end: only work that fits no bubble
            return not fittable
        if not fittable:  # after the end: overflow may always go last
            return r == shape.tail + 2
        if r == shape.tail + 2 and self.overflowing[i]:
            return False
        return fits(d, shape.room[shape.tail] - used[shape.tail] - used[shape.tail + 2])

    def put(self, i: int, r: int, label: str, d: Time) -> None:
        self.regions[i][r].append((label, d))
        if self.shape.fittable(d):
            self.used[i][r] += d
        elif r >= self.shape.tail:
            self.overflowing[i] = True
        self.last = (i, r)
        if label.startswith("sync_kron_"):
            self.placed.setdefault(label, (i, r))

    def after_dependencies(self, label: str) -> Position:
        """The earliest region ``label`` may be appended to: after its factor's pieces (a sync), or after
        its sync (an inverse; its pieces where the node has no sync for the factor)."""
        kind = TimelineKey.parse(label).kind
        rest = label[len(kind):]
        factor = kind[-1]
        dep = self.placed.get(f"sync_kron_{factor}{rest}") if kind.startswith("inv_kron_") else None
        if dep is None:
            dep = self.ready.get(f"cov_kron_{factor}{rest}", (0, 0))
        return max(dep, self.last)


def _shape(model: NodeModel, pipe_labels: Sequence[str]) -> _Shape:
    """Gaps before each pipeline item of the schedule's order, and the tail, measured as ``validate``
    does: idle time starts after the latest end of the items so far."""
    times: dict[str, list[tuple[Time, Time]]] = {}
    for key, s, e in model.pipeline:
        times.setdefault(key, []).append((s, e))
    seen: Counter[str] = Counter()
    frontier: Time = min(min((s for _, s, _ in model.pipeline), default=0), 0)
    pipe, starts, room = [], [], []
    for label in pipe_labels:
        s, e = times[label][seen[label]]
        seen[label] += 1
        pipe.append((label, s, e))
        starts.append(frontier)
        room.append(s - frontier)
        frontier = max(frontier, e)
    starts.append(frontier)
    room.append(model.base - frontier)
    largest = max((b.length for b in model.bubbles), default=0)
    return _Shape(tuple(pipe), tuple(starts), tuple(room), model.base, largest)


def _member(node: int, model: NodeModel, schedule: NodeSchedule) -> _Member:
    """A member with its shared labels taken out, covariance pieces (and anything else) left in place."""
    pipe_labels = [label for label in schedule.iterations[0] if _is_pipeline(label)]
    shape = _shape(model, pipe_labels)
    durations: dict[str, list[Time]] = {}
    for w in model.work:
        durations.setdefault(w.label, []).extend(w.pieces)
    member = _Member(node, model, shape, [], [], [], {}, {}, {})
    member.add_iterations(len(schedule.iterations))
    seen: Counter[str] = Counter()
    tail = shape.tail
    for i, labels in enumerate(schedule.iterations):
        j, ended = 0, False
        fill: Counter[int] = Counter()  # work so far per region, shared labels included (their old times)
        for label in labels:
            if _is_pipeline(label):
                j += 1
                continue
            if label in MARKERS:
                ended = ended or label == END
                continue
            own = durations.get(label, ())
            d = own[seen[label] % len(own)] if own else 0
            seen[label] += 1
            if j < tail:
                r = j
            elif ended:
                r = tail + 2
            else:
                r = tail if shape.fittable(d) and not member.overflowing[i] else tail + 1
            at = shape.starts[min(r, tail)] + fill[r]
            fill[r] += d
            if is_shared(label):
                item = (identity(label), seen[label] - 1)
                member.shared[item] = (label, d, i * model.length + at)
                continue
            member.regions[i][r].append((label, d))
            if shape.fittable(d) or r < tail:
                member.used[i][r] += d
            else:
                member.overflowing[i] = True
            member.ready[label] = (i, r)
            member.ready_time[label] = i * model.length + at + d
    return member


def _is_pipeline(label: str) -> bool:
    return label.startswith(("call_forward", "call_backward"))


def _as_packed(members: Sequence[_Member]) -> dict[Item, float]:
    """Per shared label: the latest time any member's own packing gave it."""
    when: dict[Item, float] = {}
    for m in members:
        for item, (_, _, t) in m.shared.items():
            when[item] = max(when.get(item, t), t)
    return when


def _as_ready(members: Sequence[_Member]) -> dict[Item, float]:
    """Per shared label: the latest time any member finishes the factor's covariance pieces (inverses
    then follow their syncs at once)."""
    when: dict[Item, float] = {}
    for m in members:
        for item, (label, _, _) in m.shared.items():
            kind = TimelineKey.parse(label).kind
            t = m.ready_time.get(f"cov_kron_{kind[-1]}{label[len(kind):]}", 0.0)
            when[item] = max(when.get(item, t), t)
    return when


def _common_order(members: Sequence[_Member], when: dict[Item, float]) -> list[Item]:
    """The group's shared labels in one order: by ``when``; an inverse never before a sync of its
    factor, and right after it at equal times."""
    syncs: dict[str, float] = {}
    for (ident, _), t in when.items():
        if ident.startswith("sync_kron_"):
            factor = ident[len("sync_kron_"):]
            syncs[factor] = max(syncs.get(factor, t), t)

    def key(item: Item) -> tuple[float, int, str, int]:
        ident, occ = item
        if ident.startswith("inv_kron_"):
            return (max(when[item], syncs.get(ident[len("inv_kron_"):], when[item])), 1, ident, occ)
        return (when[item], 0, ident, occ)

    return sorted(when, key=key)


def _side(member: _Member, r: int) -> int:
    """0 before the iteration's ``-- end --``, 1 after it."""
    return 1 if r == member.shape.tail + 2 else 0


def _region_in(member: _Member, i: int, side: int, after: Position, d: Time) -> int | None:
    """The first region of iteration ``i``'s ``side`` of the end, not before ``after``, with room for ``d``."""
    tail = member.shape.tail
    regions = range(tail + 2) if side == 0 else range(tail + 2, tail + 3)
    for r in regions:
        if (i, r) >= after and member.accepts(i, r, d):
            return r
    return None


def _place_all(members: Sequence[_Member], order: Sequence[Item]) -> None:
    """Put every shared label back, each at the same iteration and side of the end on every member."""
    for item in order:
        holders = [(m, m.shared[item]) for m in members if item in m.shared]
        after = {m.node: m.after_dependencies(label) for m, (label, _, _) in holders}
        i, side = max((after[m.node][0], _side(m, after[m.node][1])) for m, _ in holders)
        fresh = len(members[0].regions)  # from here on, iterations hold only the pipeline: room for anything
        while True:
            if i > fresh:  # pragma: no cover - cannot happen, see above
                raise RuntimeError(f"no common place for {item[0]} in sync group {[m.node for m in members]}")
            for m in members:
                m.add_iterations(i + 1)
            chosen = [(m, _region_in(m, i, side, after[m.node], d), label, d) for m, (label, d, _) in holders]
            if all(r is not None for _, r, _, _ in chosen):
                for m, r, label, d in chosen:
                    assert r is not None
                    m.put(i, r, label, d)
                break
            i, side = (i, 1) if side == 0 else (i + 1, 0)


def _trim(members: Sequence[_Member]) -> None:
    """Drop trailing iterations that hold no K-FAC work on any member (at least one stays)."""
    while len(members[0].regions) > 1 and not any(any(m.regions[-1]) for m in members):
        for m in members:
            m.regions.pop()
            m.used.pop()
            m.overflowing.pop()


def _node_schedule(member: _Member, before: NodeSchedule, group: Group) -> NodeSchedule:
    """The member's labels, placements and figures, laid out as the packer lays out a cycle."""
    shape, model = member.shape, member.model
    tail = shape.tail
    k = len(member.regions)
    iterations: list[tuple[str, ...]] = []
    placements: list[Placement] = []
    kfac: Time = 0
    overflow: Time = 0
    for i, regions in enumerate(member.regions):
        labels: list[str] = []
        places: list[Placement] = []

        def emit(label: str, s: Time, e: Time) -> None:
            labels.append(label)
            places.append(Placement(label, s, e, i))

        def lay(items: list[tuple[str, Time]], t: Time, in_tail: bool = True) -> Time:
            nonlocal kfac
            for label, d in items:
                if in_tail and not shape.fittable(d) and t < shape.base:
                    t = shape.base  # overflow runs after the pipeline time, as the packer lays it out
                emit(label, t, t + d)
                t += d
                kfac += d
            return t

        emit(START, 0, 0)
        for j, (key, s, e) in enumerate(shape.pipe):
            lay(regions[j], shape.starts[j], in_tail=False)
            emit(key, s, e)
        t = lay(regions[tail] + regions[tail + 1], shape.starts[tail])
        emit(END, t, t)
        if i == 0:
            emit(SAVE_OFF, t, t)
        t = lay(regions[tail + 2], t)
        if i == k - 1:
            emit(SAVE_ON, t, t)
        overflow += max(t - shape.base, 0)
        iterations.append(tuple(labels))
        placements.extend(places)
    cycle = model.length * k + overflow
    busy = model.pipeline_busy * k
    old = before.figures
    figures = NodeFigures(
        iterations=k, usage=(busy + kfac) / cycle * 100 if cycle else 0.0, cycle_time=cycle, pipeline_busy=busy,
        kfac_placed=kfac, bubble_left=cycle - busy - kfac, overflow=overflow, lower_bound=old.lower_bound,
        extra={**old.extra, "sync_group": list(group), "iterations_before_alignment": old.iterations})
    return NodeSchedule(tuple(iterations), tuple(placements), figures)


def align_group(job: Job, schedules: Sequence[NodeSchedule], group: Group) -> list[NodeSchedule]:
    """The group's members (``schedules[n]`` for n in ``group``) rewritten to share one order of syncs,
    inverses and ends; a group of one comes back unchanged."""
    if len(group) < 2:
        return [schedules[n] for n in group]
    models = [node_model(job.nodes[n], job.span) for n in group]
    best: list[_Member] | None = None
    for order_by in (_as_packed, _as_ready):  # two common orders; the shorter cycle wins
        members = [_member(n, model, schedules[n]) for n, model in zip(group, models)]
        k = max(len(m.regions) for m in members)
        for m in members:
            m.add_iterations(k)
        _place_all(members, _common_order(members, order_by(members)))
        _trim(members)
        if best is None or len(members[0].regions) < len(best[0].regions):
            best = members
    assert best is not None
    return [_node_schedule(m, schedules[m.node], group) for m in best]


def align_groups(job: Job, schedules: Sequence[NodeSchedule], groups: Sequence[Group]) -> tuple[NodeSchedule, ...]:
    """Every node's schedule, each sync group of several members aligned (:func:`align_group`)."""
    out = list(schedules)
    for group in groups:
        if len(group) > 1:
            for n, aligned in zip(group, align_group(job, schedules, group)):
                out[n] = aligned
    return tuple(out)
