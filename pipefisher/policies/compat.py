"""The ``compat`` policy: the published PipeFisher packer, decision for decision, only faster.

``docs/compat-policy.md`` is the behaviour, flaws included (see the "Known flaws" there).
The published tool finds the next item that fits a bubble by rescanning the whole work list, checks
dependencies by rescanning it again, and deep-copies all remaining work for every trial. Here:

* the work list keeps its positions; removed items are marked dead, and a segment tree over positions
  holds, per position, the room an item needs (``duration * 1.05``) or infinity while it cannot be
  placed. "The first item at or after position i that fits" is one descent of the tree;
* the global dependency rules (any pending ``cov_kron_A`` blocks every ``sync_kron_A``, ...) are four
  counters; an item becomes placeable when the counters it waits on reach zero;
* a trial packs a clone of that state (flat lists copied at C speed) instead of a deep copy, and is
  not run at all where the work left is more than the schedule's gaps can hold (it could not finish).

``compat_reference`` is the literal transcription this is tested against.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from operator import neg
from typing import Any, Iterable, Sequence

from pipefisher.errors import InputError
from pipefisher.schedule.packed import (JobSchedule, NodeFigures, NodeSchedule, Placement, Policy, gc_paused,
                                        split_iterations)
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START, PIPELINE_CATEGORIES, label_category
from pipefisher.schedule.problem import DEFAULT_MARGIN, check_margin
from pipefisher.schedule.timeline import BACKWARD, COV_KINDS, FORWARD, KFAC_KINDS, Job, NodeTimeline, Time, cov_pieces

INF = float("inf")

Slot = tuple  # (label, start, end): one entry of a schedule being built

# The four counters of pending work the global dependency rules look at, by label substring.
_COUNTED = ("cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B")
# A plain item waits while any counter it names is non-zero (substring of its label -> counters).
_WAITS_ON = (
    ("sync_kron_A", (0,)),
    ("sync_kron_B", (1,)),
    ("inv_kron_A", (0, 2)),
    ("inv_kron_B", (1, 3)),
)


@dataclass(frozen=True)
class _Work:
    """The fixed facts of one work item (position = index in the sorted work list)."""

    label: str
    start: Time
    end: Time
    is_queue: bool
    step: Time  # queues: the piece length; plain items: their duration
    need: float  # step * 1.05: the room the item (or one queue piece) needs
    pieces: int
    gate_a: bool  # queue of a cov_kron_A label: piece j waits for the j-th forward
    gate_b: bool
    counted: tuple[int, ...]  # counters this item is counted in
    waits_on: tuple[int, ...]  # counters that must be zero before it is placed


class _State:
    """The mutable part of the work list; cheap to clone for a trial."""

    __slots__ = ("items", "size", "tree", "alive", "skip_to", "next_id", "counters", "waiters", "queues", "ungated")

    def __init__(self, items: Sequence[_Work]) -> None:
        self.items = items
        n = len(items)
        size = 1
        while size < max(n, 1):
            size *= 2
        self.size = size
        self.tree = [INF] * (2 * size)
        self.alive = [True] * n
        self.skip_to = list(range(n + 1))  # union-find: first alive position >= p
        self.next_id = [0] * n
        self.counters = [0, 0, 0, 0]
        self.waiters: list[list[int]] = [[], [], [], []]
        self.queues = [p for p, w in enumerate(items) if w.is_queue]
        self.ungated = False  # every queue refreshed with all forwards and backwards counted
        for p, w in enumerate(items):
            for c in w.counted:
                self.counters[c] += 1
            for c in w.waits_on:
                self.waiters[c].append(p)

    def clone(self) -> "_State":
        other = _State.__new__(_State)
        other.items, other.size, other.queues, other.waiters = self.items, self.size, self.queues, self.waiters
        other.tree = self.tree[:]
        other.alive = self.alive[:]
        other.skip_to = self.skip_to[:]
        other.next_id = self.next_id[:]
        other.counters = self.counters[:]
        other.ungated = self.ungated
        return other

    # -- tree ---------------------------------------------------------------------------------------
    def _set(self, p: int, value: float) -> None:
        tree = self.tree
        i = p + self.size
        if tree[i] == value:
            return
        tree[i] = value
        i >>= 1
        while i:
            v = min(tree[2 * i], tree[2 * i + 1])
            if tree[i] == v:
                break
            tree[i] = v
            i >>= 1

    def refresh(self, p: int, nf: int, nb: int) -> None:
        """Recompute whether position ``p`` can be placed now, and store that in the tree."""
        w = self.items[p]
        ok = self.alive[p]
        if ok and w.is_queue:
            need_count = self.next_id[p] + 1
            ok = not (w.gate_a and nf < need_count) and not (w.gate_b and nb < need_count)
        elif ok:
            ok = all(self.counters[c] == 0 for c in w.waits_on)
        self._set(p, w.need if ok else INF)

    def first_fit(self, lo: int, t: Time, limit: Time) -> int:
        """The first position >= ``lo`` whose item fits ``t + need < limit`` and may be placed, or -1."""
        size, tree = self.size, self.tree
        if lo >= size or not t + tree[1] < limit:
            return -1
        i = lo + size
        while True:
            if t + tree[i] < limit:
                while i < size:
                    i = 2 * i if t + tree[2 * i] < limit else 2 * i + 1
                return i - size
            while i & 1:
                i >>= 1
            if i == 0:
                return -1
            i += 1

    # -- removal ------------------------------------------------------------------------------------
    def _first_alive(self, p: int) -> int:
        skip = self.skip_to
        root = p
        while skip[root] != root:
            root = skip[root]
        while skip[p] != root:
            skip[p], p = root, skip[p]
        return root

    def remove(self, p: int, nf: int, nb: int) -> int:
        """Remove ``p``; return the position where the pass goes on (it skips the next item)."""
        self.alive[p] = False
        self.skip_to[p] = p + 1
        self._set(p, INF)
        for c in self.items[p].counted:
            self.counters[c] -= 1
            if self.counters[c] == 0:
                for q in self.waiters[c]:
                    if self.alive[q]:
                        self.refresh(q, nf, nb)
        skipped = self._first_alive(p + 1)
        return skipped + 1

    def least_need(self) -> float:
        return min((w.need for p, w in enumerate(self.items) if self.alive[p]), default=INF)

    def remaining(self) -> list[int]:
        return [p for p, a in enumerate(self.alive) if a]

    def empty(self) -> bool:
        return self._first_alive(0) >= len(self.items)


class _Gaps:
    """Gaps of a growing base worth visiting, kept across the trials of one node.

    Trials walk the schedule built so far, which only grows at its end, while the smallest remaining
    need only grows: so the gaps found before are re-checked and only the new tail is scanned.
    """

    __slots__ = ("scanned", "least", "candidates")

    def __init__(self) -> None:
        self.scanned, self.least, self.candidates = 1, -INF, []

    def update(self, base: Sequence[Slot], least: float) -> list[int]:
        if least < self.least:  # cannot happen within one node; start over rather than be wrong
            self.__init__()  # type: ignore[misc]
        # the gaps found before still pass where the least need is the same (their ends do not move)
        ok = list(self.candidates) if least == self.least else \
            [j for j in self.candidates if base[j - 1][2] + least < base[j][1]]
        ok += [j for j in range(self.scanned, len(base)) if base[j - 1][2] + least < base[j][1]]
        self.scanned, self.least, self.candidates = len(base), least, ok
        return ok


def _fill(state: _State, base: Sequence[Slot], nf: int, nb: int, pieces: int, gaps: _Gaps | None = None
          ) -> list[Slot]:
    """Pack work into the gaps between consecutive entries of ``base``; see the spec's ``fill``."""
    queues = state.queues
    if nf >= pieces and nb >= pieces:
        # Once refreshed with every gate open, a queue's room only changes where it is placed or
        # removed, which refreshes it: the refresh below would change nothing again.
        if not state.ungated:
            for p in queues:
                state.refresh(p, nf, nb)
            state.ungated = True
        return _fill_ungated(state, base, nf, nb, gaps or _Gaps())
    for p in queues:  # queue gates depend on the counts this fill starts with
        state.refresh(p, nf, nb)
    # A forward (backward) opens only the gates of the queues whose next piece waits for exactly that
    # count; every other queue's room is up to date already.
    next_id = state.next_id
    gated_a = [p for p in queues if state.items[p].gate_a]
    gated_b = [p for p in queues if state.items[p].gate_b]
    out: list[Slot] = [base[0]]
    prev = base[0]
    for nxt in base[1:]:
        label = prev[0]
        if label == FORWARD:
            nf += 1
            if nf <= pieces:
                for p in gated_a:
                    if next_id[p] + 1 == nf:
                        state.refresh(p, nf, nb)
        elif label == BACKWARD:
            nb += 1
            if nb <= pieces:
                for p in gated_b:
                    if next_id[p] + 1 == nb:
                        state.refresh(p, nf, nb)
        _fill_gap(state, out, prev[2], nxt[1], nf, nb)
        out.append(nxt)
        prev = nxt
    return out


def _fill_ungated(state: _State, base: Sequence[Slot], nf: int, nb: int, gaps: _Gaps) -> list[Slot]:
    """``_fill`` once every forward and backward has been counted, so no queue gate can change.

    Then only the gaps matter, and a gap too small for the smallest remaining item (placeable or not)
    stays useless for the whole fill, since the smallest need only grows as work is placed. Those gaps
    are skipped in bulk; the base entries around them are copied as slices.
    """
    alive = state.alive
    least = min((w.need for p, w in enumerate(state.items) if alive[p]), default=INF)
    out: list[Slot] = []
    done = 0
    for j in gaps.update(base, least):
        out.extend(base[done:j])
        done = j
        _fill_gap(state, out, base[j - 1][2], base[j][1], nf, nb)
    out.extend(base[done:])
    return out


def _fill_gap(state: _State, out: list[Slot], t: Time, limit: Time, nf: int, nb: int) -> None:
    """Place work into one bubble ``[t, limit)``: passes over the work list until one places nothing."""
    items = state.items
    tree = state.tree
    while t + tree[1] < limit:  # passes, until one places nothing; tree[1]: least room needed
        placed = False
        cur = state.first_fit(0, t, limit)
        while cur >= 0:
            w = items[cur]
            if w.is_queue:
                next_id = state.next_id
                removed = False
                while t + w.need < limit:
                    i = next_id[cur]
                    if (w.gate_a and nf < i + 1) or (w.gate_b and nb < i + 1):
                        break
                    s, e = w.start + i * w.step, w.start + (i + 1) * w.step
                    d = e - s
                    out.append((w.label, t, t + d))
                    t += d
                    placed = True
                    next_id[cur] = i + 1
                    if i + 1 >= w.pieces:
                        removed = True
                        break
                if removed:
                    resume = state.remove(cur, nf, nb)
                else:
                    state.refresh(cur, nf, nb)
                    resume = cur + 1
            else:
                d = w.end - w.start
                out.append((w.label, t, t + d))
                t += d
                placed = True
                resume = state.remove(cur, nf, nb)
            cur = state.first_fit(resume, t, limit)
        if not placed:
            break


def _zero(t: Time | None) -> Time:
    return 0 if t is None else t


def _pipeline(node: NodeTimeline, span: Time) -> list[Slot]:
    # The published tool's pipeline: every key CONTAINING call_forward / call_backward (the spec). That
    # already takes in zero-bubble W passes (``call_backward:weight...``, timeline.weight_key), so compat
    # keeps K-FAC out of them too; and since only keys that ARE call_forward / call_backward count as
    # micro-batches (_fill), W never does. No W-specific rule is needed, and byte-exactness is kept.
    slots: list[Slot] = [(START, 0, 0)]
    for word in (FORWARD, BACKWARD):
        for key, intervals in node.entries.items():
            if word in key:
                slots.extend((key, _zero(iv.start), _zero(iv.end)) for iv in intervals)
    slots.append((END, span, span))
    slots.sort(key=lambda s: s[1])
    return slots


def _work_items(node: NodeTimeline, pieces: int, scale: float) -> list[_Work]:
    raw: list[tuple[int, Time, _Work]] = []
    for priority, kind in enumerate(KFAC_KINDS):
        for key, intervals in node.entries.items():
            if kind not in key:
                continue
            counted = tuple(c for c, word in enumerate(_COUNTED) if word in key)
            waits_on = tuple(sorted({c for word, cs in _WAITS_ON if word in key for c in cs}))
            for iv in intervals:
                s, e = _zero(iv.start), _zero(iv.end)
                if kind in COV_KINDS:
                    step = (e - s) // pieces
                    w = _Work(key, s, e, True, step, step * scale, pieces,
                              "cov_kron_A" in key, "cov_kron_B" in key, counted, ())
                else:
                    w = _Work(key, s, e, False, e - s, (e - s) * scale, 1, False, False, counted, waits_on)
                raw.append((priority, s, w))
    raw.sort(key=lambda r: r[1])  # by start, then (stable) by priority, as the published tool does
    raw.sort(key=lambda r: r[0])
    return [w for _, _, w in raw]


def _gap_lengths(base: Sequence[Slot], gaps: Iterable[int]) -> list[Time]:
    """Lengths of the gaps before ``base[j]``, for j in ``gaps``."""
    return [base[j][1] - base[j - 1][2] for j in gaps]


def _work_by_need(state: _State) -> list[tuple[float, Time]]:
    """The work left (queues: their pieces left), summed per room need, largest need first."""
    need_work: dict[float, Time] = {}
    for p, w in enumerate(state.items):
        if state.alive[p]:
            d = (w.pieces - state.next_id[p]) * w.step if w.is_queue else w.end - w.start
            need_work[w.need] = need_work.get(w.need, 0) + d
    return sorted(need_work.items(), reverse=True)


def _cannot_finish(work_by_need: Sequence[tuple[float, Time]], live: list[Time], fresh: list[Time],
                   iterations_left: int, margin: float, tolerance: float = 0.0) -> bool:
    """Whether the work left (:func:`_work_by_need`) cannot go into the ``live`` gaps plus
    ``iterations_left`` copies of the ``fresh`` ones (both longest first): for some need h, the items
    needing at least h are more (by over ``tolerance``) than the gaps longer than h can hold. An item
    needs ``d * (1 + margin) < gap``, so such a gap ends with at least ``margin d = h margin / (1 +
    margin)`` of it free (h / 21 at 5 %). Gaps no longer than the least need never count."""
    free = margin / (1.0 + margin)
    work: Time = 0
    room: Time = 0
    i = j = 0
    for need, amount in work_by_need:
        work += amount
        while i < len(live) and live[i] > need:
            room += live[i]
            i += 1
        while j < len(fresh) and fresh[j] > need:
            room += fresh[j] * iterations_left
            j += 1
        if work > room - (i + j * iterations_left) * need * free + tolerance:
            return True
    return False


class _Lengths:
    """Gap lengths, longest first, with what :func:`_cannot_finish_integral` needs to count and sum
    those longer than a need in one bisect: the lengths negated (ascending) and their running sums."""

    __slots__ = ("negated", "sums")

    def __init__(self, lengths: Sequence[Time]) -> None:
        self.negated = list(map(neg, lengths))
        self.sums = list(accumulate(lengths, initial=0))


_NO_GAPS = _Lengths(())


def _cannot_finish_integral(work_by_need: Sequence[tuple[float, Time]], live: _Lengths, fresh: _Lengths,
                            iterations_left: int, margin: float, tolerance: float = 0.0) -> bool:
    """:func:`_cannot_finish` where every gap length is an integer (profiled nanoseconds): then the
    room it sums is the same in any order, so per need the gaps longer than it are one bisect and
    one running sum rather than a walk over them (the same answer, the same comparisons)."""
    free = margin / (1.0 + margin)
    work: Time = 0
    for need, amount in work_by_need:
        work += amount
        i = bisect_left(live.negated, -need)  # the live gaps longer than ``need``
        j = bisect_left(fresh.negated, -need)
        room = live.sums[i] + fresh.sums[j] * iterations_left
        if work > room - (i + j * iterations_left) * need * free + tolerance:
            return True
    return False


def pack_node_slots(node: NodeTimeline, span: Time, margin: float = DEFAULT_MARGIN) -> list[Slot]:
    """The published tool's flat schedule for one node: (label, start, end) in order."""
    slots = _pack_node(node, span, None, margin)
    assert slots is not None
    return slots


def pack_node_slots_below(node: NodeTimeline, span: Time, iterations: int,
                          margin: float = DEFAULT_MARGIN) -> list[Slot] | None:
    """``pack_node_slots``, or None as soon as the cycle is sure to have ``iterations`` or more.

    Sure: the work left is more than the gaps it could still go to (the live gaps of the schedule so
    far, and those of every iteration it could still add). Only work placed in gaps counts, so a cycle
    that would end by appending work as it stands may be given up on too; no such cycle is honest.
    Work with a negative duration (an end before its start) makes room in this packer's arithmetic,
    so then it never gives up early.
    """
    return _pack_node(node, span, iterations, margin)


def _pack_node(node: NodeTimeline, span: Time, give_up_at: int | None, margin: float) -> list[Slot] | None:
    pipeline = _pipeline(node, span)
    pieces = sum(1 for s in pipeline if s[0] == FORWARD)
    # a queue per covariance key of as many pieces as the micro-batches it covers (the published tool's
    # every forward, unless the profile recorded kfac.cov_micro_batches); piece j still waits for forward j
    items = _work_items(node, cov_pieces(pieces, node.cov_micro_batches), 1.0 + check_margin(margin))
    if pieces == 0 and any(w.is_queue for w in items):
        raise InputError(node.path, f"has no '{FORWARD}' intervals to split covariance work over "
                                    "(the compat policy counts only down-pipe forwards)")
    # Room arguments (:func:`_cannot_finish`) hold only where no work has a negative duration.
    sound = not any(w.step < 0 or w.end < w.start for w in items)
    if not sound:
        give_up_at = None
    state = _State(items)
    for p in range(len(items)):
        state.refresh(p, 0, 0)
    sched = _fill(state, pipeline, 0, 0, pieces)
    sched.append((SAVE_OFF, sched[-1][2], sched[-1][2]))
    gaps = _Gaps()
    fresh = sorted(_gap_lengths(pipeline, range(1, len(pipeline))), reverse=True)  # an added iteration's gaps
    # Integer times (profiled nanoseconds) make every gap length an integer: the room arguments then
    # sum them in any order (:func:`_cannot_finish_integral`).
    integral = isinstance(span, int) and all(isinstance(x, int) for _, s, e in pipeline for x in (s, e)) and \
        all(isinstance(x, int) for w in items for x in (w.start, w.end, w.step))
    fresh_lengths = _Lengths(fresh)
    iterations = 1
    while not state.empty():
        # The gaps the trial fills (it makes this same update), and whether the work left can fit them
        # at all: a trial that cannot finish is not run (the tolerance keeps float rounding from
        # skipping one that would). Most trials are skipped so.
        live = sorted(_gap_lengths(sched, gaps.update(sched, state.least_need())), reverse=True)
        work_left = _work_by_need(state) if sound else []
        tolerance = 1e-9 * (sum(live) + sum(a for _, a in work_left))
        if sound and integral:
            live_lengths = _Lengths(live)
            if not _cannot_finish_integral(work_left, live_lengths, _NO_GAPS, 0, margin, tolerance):
                trial = state.clone()
                attempt = _fill(trial, sched, pieces, pieces, pieces, gaps)
                if trial.empty():
                    sched = attempt
                    break
            if give_up_at is not None and _cannot_finish_integral(
                    work_left, live_lengths, fresh_lengths, max(0, give_up_at - 1 - iterations), margin):
                return None
        else:
            if not (sound and _cannot_finish(work_left, live, [], 0, margin, tolerance)):
                trial = state.clone()
                attempt = _fill(trial, sched, pieces, pieces, pieces, gaps)
                if trial.empty():
                    sched = attempt
                    break
            if give_up_at is not None and _cannot_finish(work_left, live, fresh, max(0, give_up_at - 1 - iterations),
                                                         margin):
                return None
        iterations += 1
        before = len(state.remaining())
        sched += _fill(state, pipeline, pieces, pieces, pieces)
        left = state.remaining()
        if len(left) == before:  # nothing fits an empty iteration: append the rest as it stands
            sched += [(items[p].label, items[p].start, items[p].end) for p in left]
            break
    sched.append((SAVE_ON, sched[-1][2], sched[-1][2]))
    return sched


def figures_from_slots(slots: Sequence[Slot], span: Time) -> tuple[int, float, dict[str, Any]]:
    """Iterations and usage exactly as the published tool computes them, plus a breakdown."""
    iterations = sum(1 for s in slots if s[0] == START)
    total: Any = 0
    busy: Any = 0
    kfac: Any = 0
    for label, start, end in slots:
        d = end - start
        total += d
        cat = label_category(label)
        if cat in PIPELINE_CATEGORIES:
            busy += d
        elif cat in KFAC_KINDS:
            kfac += d
    usage = total / (span * iterations) * 100 if iterations and span else float("nan")
    return iterations, usage, {"busy": busy, "kfac": kfac}


def placements_from_slots(slots: Sequence[Slot]) -> tuple[Placement, ...]:
    out = []
    index = 0
    seen_any = False
    for label, start, end in slots:
        if label == START and seen_any:
            index += 1
        seen_any = True
        out.append(Placement(label, start, end, index))
    return tuple(out)


class CompatPolicy(Policy):
    """The published PipeFisher packer, reproduced exactly (flaws included)."""

    name = "compat"
    summary = "the published PipeFisher packer, label for label (known flaws included)"

    def pack(self, job: Job, margin: float = DEFAULT_MARGIN) -> JobSchedule:
        with gc_paused():
            return self._pack(job, margin)

    def _pack(self, job: Job, margin: float) -> JobSchedule:
        nodes = []
        for node in job.nodes:
            slots = pack_node_slots(node, job.span, margin)
            iterations, usage, parts = figures_from_slots(slots, job.span)
            cycle = job.span * iterations
            figures = NodeFigures(
                iterations=iterations,
                usage=usage,
                cycle_time=cycle,
                pipeline_busy=parts["busy"],
                kfac_placed=parts["kfac"],
                bubble_left=cycle - parts["busy"] - parts["kfac"],
            )
            labels = split_iterations(slots)
            nodes.append(NodeSchedule(tuple(tuple(it) for it in labels), placements_from_slots(slots), figures))
        return JobSchedule(self.name, job.span, tuple(nodes), margin)
