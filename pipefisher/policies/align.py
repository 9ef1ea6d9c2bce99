"""Aligning the schedules of a sync group, so that its members share syncs, inverses and ends in order.

Each node is packed on its own; in a Chimera job the two replicas of a stage (a sync group, see
:mod:`pipefisher.rules.groups`) must then issue their all-reduces, refresh their inverses and end
their steps in the same order. This module takes the packed members of a group and rewrites them:

1. pad them to the same cycle length with iterations that hold only the pipeline;
2. take every sync and inverse out, keeping the covariance pieces where they are;
3. put them back one at a time, in one common order for the group (the order the members' own
   packings had them, by the latest time over members), each member appending the label at the earliest
   gap between pipeline items (or the iteration's tail) that is not before its dependencies (a sync after
   all its factor's pieces on that node, an inverse after its sync) nor before the member's previous
   shared label, and that still has room by the problem's room rule
   (:func:`pipefisher.schedule.problem.fits`); work that fits no bubble goes to a tail, as overflow. All members use the same iteration and the same side of
   ``-- end --``: the latest any member needs, bumped (adding pipeline-only iterations when needed)
   until every member has room there, and, for an inverse before the end, until it cannot deadlock;
4. drop trailing iterations that hold no K-FAC work on any member, and recompute placements and figures.

A refresh in pieces (several runs of one inverse label) keeps its pieces' order through all of this:
the room rule takes the j-th run after the factor's completion as piece j, at piece j's length, so a
later piece put back before an earlier one would be measured at the other's length where it was put
(the room-rule breaks ``run`` once refused Chimera's refresh pieces for). Every piece goes after its
pair's sync of the factor in the same cycle, so an aligned cycle never overlaps the next (pieces a
member's own packing ran on into the next cycle come back after the sync; docs/chimera.md says why).

An inverse waits for every member to reach its syncs of the layer (:mod:`pipefisher.rules.waits`),
and under Chimera the members also feed each other's pipelines: an inverse on one member before a call
whose input comes, through the pipelines, after a peer's sync would deadlock. So the aligner keeps a
clock that every point-to-point wait respects (:func:`waits.call_clock`; a profile's own times do not,
each node reads its own clock): a label between two calls of a member happens, on that clock, no
earlier than the end of the call before it, and an inverse no earlier than the latest sync of its
layer on any member (same iteration, before the end). An inverse goes before a call only where that
point is no later than the call's start; after a member's last call, or after ``-- end --``, it always
may. Every wait then goes forward on the clock, or along the group's common order, so none can close a
cycle. As a safety net :func:`align_groups` checks the result (:func:`waits.deadlock_violations`) and,
should it still deadlock, aligns again with every inverse after ``-- end --`` where the tails have room
for them (else the placement stays, and ``validate`` reports the deadlock).

Groups of one are returned as they are.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from pipefisher.rules.groups import Group, identity, is_shared
from pipefisher.rules.waits import Clock, call_clock, deadlock_violations, layer_of
from pipefisher.schedule.format import END, MARKERS, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.packed import NodeFigures, NodeSchedule, Placement
from pipefisher.schedule.problem import DEFAULT_MARGIN, NodeModel, fits, node_model
from pipefisher.schedule.timeline import Job, Time, TimelineKey

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
    margin: float  # the room rule's margin

    @property
    def tail(self) -> int:
        """Region of fittable work after the last pipeline item; the next two: overflow, after the end."""
        return len(self.pipe)

    def fittable(self, d: Time) -> bool:
        return fits(d, self.largest, self.margin)


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
    calls: Sequence[tuple[Clock, Clock]]  # per pipeline item: when it starts and ends on the call clock
    placed: dict[str, Position] = field(default_factory=dict)  # per own sync label: where it went
    pieces: dict[str, int] = field(default_factory=dict)  # per inverse identity: its pieces placed so far
    last: Position = (0, 0)  # where the previous shared label went
    clock: list[list[Clock]] = field(default_factory=list)  # per iteration and region before the end:
    # the call clock of its last label (its start: the end of the call before it)
    synced: dict[tuple[int, str], Clock] = field(default_factory=dict)  # per (iteration, layer): the call
    # clock of its latest sync before the end

    def add_iterations(self, k: int) -> None:
        while len(self.regions) < k:
            self.regions.append([[] for _ in range(self.shape.tail + 3)])
            self.used.append([0] * (self.shape.tail + 3))
            self.overflowing.append(False)
            after_call = [(0.0, 0)] + [end for _, end in self.calls]  # per region: the end of the call before it
            self.clock.append(after_call + after_call[-1:])  # the overflow region follows the last call too

    def in_time(self, r: int, wait: Clock | None) -> bool:
        """Whether an inverse that waits until ``wait`` on the call clock may go to region ``r``: no
        pipeline call follows it, or the next one starts no earlier (see the module's notes)."""
        return wait is None or r >= self.shape.tail or wait <= self.calls[r][0]

    def accepts(self, i: int, r: int, d: Time) -> bool:
        """Whether ``d`` of work appended to region ``r`` of iteration ``i`` keeps the room rules."""
        shape, used = self.shape, self.used[i]
        fittable = shape.fittable(d)
        if r < shape.tail:
            return fittable and fits(d, shape.room[r] - used[r], shape.margin)
        if r == shape.tail + 1:  # overflow, before the end: only work that fits no bubble
            return not fittable
        if not fittable:  # after the end: overflow may always go last
            return r == shape.tail + 2
        if r == shape.tail + 2 and self.overflowing[i]:
            return False
        return fits(d, shape.room[shape.tail] - used[shape.tail] - used[shape.tail + 2], shape.margin)

    def put(self, i: int, r: int, label: str, d: Time, wait: Clock | None = None) -> None:
        self.regions[i][r].append((label, d))
        if self.shape.fittable(d):
            self.used[i][r] += d
        elif r >= self.shape.tail:
            self.overflowing[i] = True
        self.last = (i, r)
        if label.startswith("sync_kron_"):
            self.placed.setdefault(label, (i, r))
        if r > self.shape.tail + 1:
            return  # after the end, which every member passes after all its calls and syncs before it
        if wait is not None:
            self.clock[i][r] = max(self.clock[i][r], wait)
        if label.startswith("sync_kron_"):
            at = (i, layer_of(label))
            self.synced[at] = max(self.synced.get(at, self.clock[i][r]), self.clock[i][r])

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
    return _Shape(tuple(pipe), tuple(starts), tuple(room), model.base, model.largest, model.margin)


def _pipe_labels(schedule: NodeSchedule) -> list[str]:
    return [label for label in schedule.iterations[0] if _is_pipeline(label)]


def job_calls(job: Job, schedules: Sequence[NodeSchedule]) -> list[list[tuple[Clock, Clock]]]:
    """The call clock (:func:`waits.call_clock`) of every node's pipeline, in its schedules' order."""
    shapes = [_shape(node_model(node, job.span), _pipe_labels(s)) for node, s in zip(job.nodes, schedules)]
    return call_clock([[label for label, _, _ in sh.pipe] for sh in shapes],
                      [[e - s for _, s, e in sh.pipe] for sh in shapes])


def _member(node: int, model: NodeModel, schedule: NodeSchedule, calls: Sequence[tuple[Clock, Clock]]) -> _Member:
    """A member with its shared labels taken out, covariance pieces (and anything else) left in place."""
    shape = _shape(model, _pipe_labels(schedule))
    durations: dict[str, list[Time]] = {}
    for w in model.work:
        durations.setdefault(w.label, []).extend(w.pieces)
    member = _Member(node, model, shape, [], [], [], {}, {}, {}, calls)
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
    return TimelineKey.parse(label).is_pipeline


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
    factor, and right after it at equal times; a refresh's pieces in their order (each no earlier
    than the piece before it: a member's own times need not say so, work after ``-- end --`` counts
    from the tail's start)."""
    syncs: dict[str, float] = {}
    for (ident, _), t in when.items():
        if ident.startswith("sync_kron_"):
            factor = ident[len("sync_kron_"):]
            syncs[factor] = max(syncs.get(factor, t), t)
    at: dict[Item, float] = {}
    for item in sorted(item for item in when if _is_inverse(item)):
        ident, occ = item
        at[item] = max(when[item], syncs.get(ident[len("inv_kron_"):], when[item]),
                       at.get((ident, occ - 1), when[item]))

    def key(item: Item) -> tuple[float, int, str, int]:
        ident, occ = item
        if ident.startswith("inv_kron_"):
            return (at[item], 1, ident, occ)
        return (when[item], 0, ident, occ)

    return sorted(when, key=key)


def _side(member: _Member, r: int) -> int:
    """0 before the iteration's ``-- end --``, 1 after it."""
    return 1 if r == member.shape.tail + 2 else 0


def _region_in(member: _Member, i: int, side: int, after: Position, d: Time, wait: Clock | None) -> int | None:
    """The first region of iteration ``i``'s ``side`` of the end, not before ``after``, with room for ``d``
    (and, for an inverse that waits until ``wait``, where it cannot deadlock)."""
    tail = member.shape.tail
    regions = range(tail + 2) if side == 0 else range(tail + 2, tail + 3)
    for r in regions:
        if (i, r) >= after and member.accepts(i, r, d) and member.in_time(r, wait):
            return r
    return None


def _waits_until(members: Sequence[_Member], ident: str, i: int, side: int) -> Clock | None:
    """Until when, on the call clock, an inverse ``ident`` in iteration ``i`` before the end waits: the
    latest sync of its layer on any member there (None: it waits for nothing a call could hold up)."""
    if side or not ident.startswith("inv_kron_"):
        return None
    layer = layer_of(ident)
    return max((m.synced[i, layer] for m in members if (i, layer) in m.synced), default=None)


@dataclass(frozen=True)
class _Spot:
    """Where a shared label goes on every member that holds it: one iteration and side of the end."""

    iteration: int
    side: int
    regions: dict[int, int]  # node -> region
    wait: Clock | None  # an inverse before the end: the call clock it waits until

    def not_after(self, other: _Spot) -> bool:
        """Whether this spot comes no later than ``other`` on every member (taking it first leaves
        ``other`` where it is, room aside)."""
        if (self.iteration, self.side) != (other.iteration, other.side):
            return (self.iteration, self.side) < (other.iteration, other.side)
        return all(r <= other.regions.get(n, r) for n, r in self.regions.items())


def _is_inverse(item: Item) -> bool:
    return item[0].startswith("inv_kron_")


def _factor(item: Item) -> str:
    """The factor a sync or an inverse is about (its identity without the kind's prefix)."""
    return item[0][len("sync_kron_"):] if item[0].startswith("sync_kron_") else item[0][len("inv_kron_"):]


def _spot(members: Sequence[_Member], item: Item, safe: bool, timed: bool = True) -> _Spot:
    """The earliest common spot for ``item`` (``safe``: an inverse after the end; ``timed``: an inverse
    before the end only where it cannot deadlock)."""
    holders = [(m, m.shared[item]) for m in members if item in m.shared]
    after = {m.node: m.after_dependencies(label) for m, (label, _, _) in holders}
    i, side = max((after[m.node][0], _side(m, after[m.node][1])) for m, _ in holders)
    late = safe and _is_inverse(item)
    side = 1 if late else side
    fresh = len(members[0].regions)  # from here on, iterations hold only the pipeline: room for anything
    while True:
        if i > fresh:  # only an inverse kept after the end: its iterations' tails have no room for it
            raise RuntimeError(f"no common place for {item[0]} in sync group {[m.node for m in members]}")
        for m in members:
            m.add_iterations(i + 1)
        wait = _waits_until(members, item[0], i, side) if timed else None
        regions = {m.node: _region_in(m, i, side, after[m.node], d, wait) for m, (_, d, _) in holders}
        if all(r is not None for r in regions.values()):
            return _Spot(i, side, regions, wait)  # type: ignore[arg-type]
        i, side = (i, 1) if side == 0 else (i + 1, 1 if late else 0)


def _put(members: Sequence[_Member], item: Item, spot: _Spot) -> None:
    for m in members:
        assert not _is_inverse(item) or m.pieces.get(item[0], 0) == item[1] or item not in m.shared, \
            f"{item[0]}: piece {item[1]} placed out of its refresh's order"  # the room rule counts on it
        if item in m.shared and _is_inverse(item):
            m.pieces[item[0]] = item[1] + 1
        if item in m.shared:
            label, d, _ = m.shared[item]
            m.put(spot.iteration, spot.regions[m.node], label, d, spot.wait)


def _place_all(members: Sequence[_Member], order: Sequence[Item], safe: bool = False) -> None:
    """Put every shared label back, each at the same spot on every member; ``safe``: every inverse
    after the end.

    An inverse that cannot go where it would without waiting for its layer's syncs (it would deadlock
    there) is put off, so that it does not hold back the labels after it: it goes in before the first
    later label whose spot it does not delay, or before a sync of its factor, or last, and never
    before an earlier piece of its own refresh (the j-th run of an inverse label after its factor's
    completion runs piece j, at piece j's length: swapped pieces would not fit where they were put).
    Only a later piece waits for an inverse, so the order stays correct, and it is still one order
    for the whole group.
    """
    pending: list[Item] = []  # inverses put off
    for item in order:
        spot = _spot(members, item, safe)
        if _is_inverse(item) and not safe:
            unhurried = _spot(members, item, safe, timed=False)
            if (spot.iteration, spot.side, spot.regions) != (unhurried.iteration, unhurried.side, unhurried.regions):
                pending.append(item)
                continue
        waiting: set[str] = set()  # identities with an earlier piece still put off: their later pieces wait too
        for held in list(pending):
            now = _spot(members, held, safe)
            if held[0] not in waiting and (now.not_after(spot) or _factor(held) == _factor(item)):
                _put(members, held, now)
                pending.remove(held)
                spot = _spot(members, item, safe)
            else:
                waiting.add(held[0])
        _put(members, item, spot)
    for held in pending:
        _put(members, held, _spot(members, held, safe))


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
        # every inverse piece now follows its pair's sync in the cycle: the aligned cycle never overlaps
        extra={**{key: v for key, v in old.extra.items() if key != "overlap"}, "sync_group": list(group),
               "iterations_before_alignment": old.iterations})
    return NodeSchedule(tuple(iterations), tuple(placements), figures)


def align_group(job: Job, schedules: Sequence[NodeSchedule], group: Group,
                calls: Sequence[Sequence[tuple[Clock, Clock]]] | None = None, safe: bool = False,
                margin: float = DEFAULT_MARGIN) -> list[NodeSchedule]:
    """The group's members (``schedules[n]`` for n in ``group``) rewritten to share one order of syncs,
    inverses and ends, with no inverse where it could deadlock (``calls``: the job's call clock,
    :func:`job_calls`; ``safe``: every inverse after ``-- end --``); a group of one comes back unchanged."""
    if len(group) < 2:
        return [schedules[n] for n in group]
    if calls is None:
        calls = job_calls(job, schedules)
    models = [node_model(job.nodes[n], job.span, margin) for n in group]
    best: list[_Member] | None = None
    for order_by in (_as_packed, _as_ready):  # two common orders; the shorter cycle wins
        members = [_member(n, model, schedules[n], calls[n]) for n, model in zip(group, models)]
        k = max(len(m.regions) for m in members)
        for m in members:
            m.add_iterations(k)
        _place_all(members, _common_order(members, order_by(members)), safe)
        _trim(members)
        if best is None or len(members[0].regions) < len(best[0].regions):
            best = members
    assert best is not None
    return [_node_schedule(m, schedules[m.node], group) for m in best]


def align_groups(job: Job, schedules: Sequence[NodeSchedule], groups: Sequence[Group],
                 margin: float = DEFAULT_MARGIN) -> tuple[NodeSchedule, ...]:
    """Every node's schedule, each sync group of several members aligned (:func:`align_group`); should
    the result still deadlock (:func:`waits.deadlock_violations`), aligned again with every inverse after
    ``-- end --``."""
    if all(len(group) < 2 for group in groups):
        return tuple(schedules)
    calls = job_calls(job, schedules)
    out = list(schedules)
    for safe in (False, True):
        try:
            tried = list(schedules)
            for group in groups:
                if len(group) > 1:
                    for n, aligned in zip(group, align_group(job, schedules, group, calls, safe, margin)):
                        tried[n] = aligned
        except RuntimeError:  # no room for some inverse after any end: keep the first placement
            break
        out = tried
        if not deadlock_violations([node.iterations for node in out], groups):
            break
    return tuple(out)
