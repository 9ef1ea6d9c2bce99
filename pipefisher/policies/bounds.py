"""Lower bounds on a node's curvature refresh interval (pipeline iterations per K-FAC cycle).

Bounds on the problem of :mod:`pipefisher.schedule.problem`, under its room rule with the same margin: no
schedule that ``pipefisher validate`` accepts (with that margin) has fewer iterations. Such a schedule
puts all work that fits some bubble into the cycle's bubbles, k copies of the node's per-iteration
bubbles (only work that fits none may overflow). These facts bound k from below, whatever the order
or the dependencies (margin 5 % in the examples):

* volume: the fittable work W cannot exceed k times the bubble time C, so ``k >= ceil(W / C)``;
* size classes: an item of duration d fits a bubble of length G only if ``d * 1.05 < G``, so the items
  of at least h must fit into the bubbles longer than ``1.05 h`` alone;
* counting: a bubble of length G holds at most ``n`` items of at least h where ``(n + 0.05) h < G``
  (n - 1 of them end to end, and the last one with its 5 % margin), so the items of at least h need
  ``ceil(count / sum of n over bubbles)`` iterations;
* chains: each factor's last covariance piece, sync and inverse, alone on the node, end in some
  iteration at the earliest; the cycle needs at least one more;
* overlapping cycles (``NodeModel.overlap``): an inverse piece may lie anywhere in the cycle (before its
  factor's completion it is a piece of the previous refresh), so the bounds below that order work
  (chains, one iteration, first iteration) take inverse pieces as free from the cycle's start: bounds of
  the problem that packer solves, never above any valid overlapping schedule's cycle;
* one iteration: a one-iteration cycle must do every factor's pieces after their forwards/backwards
  and its sync and inverse after that, all before the iteration ends; when the work released at or
  after some pipeline position cannot fit the bubbles after it, the cycle needs at least two;
* first iteration: in the cycle's first iteration a piece can only follow its own forward or backward,
  so a bubble early in the pipeline holds at most what has been released before it. With C0 the most
  the first iteration's bubbles can hold that way, ``k >= 1 + ceil((W - C0) / C)``. This is what
  decides 1F1B's first stage, whose largest bubble comes right after its warm-up forwards.

Everything here is a pure function of item durations and bubble lengths; the policy hands them in.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from itertools import chain
from operator import itemgetter, sub
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from pipefisher.schedule.problem import COV, DEFAULT_MARGIN, INV, SYNC, NodeModel, fits
from pipefisher.schedule.timeline import Time

_SLACK = 1e-9  # floats: keep every bound valid when a ratio lands on a whole number by rounding
MAX_THRESHOLDS = 64  # distinct item sizes tried by the size-class and counting bounds (largest first)


def ceil_ratio(work: Time, capacity: Time) -> int:
    """``ceil(work / capacity)``, exact for integers and rounding-safe (never too high) for floats."""
    if work <= 0:
        return 0
    if capacity <= 0:
        raise ValueError("positive work needs positive capacity")
    if isinstance(work, int) and isinstance(capacity, int):
        return -(-work // capacity)
    return max(0, math.ceil(work / capacity - _SLACK))


def volume_bound(fittable_work: Time, bubble_time: Time) -> int:
    """``ceil(W / C)``, at least 1 (a cycle has at least one iteration)."""
    if fittable_work <= 0:
        return 1
    return max(1, ceil_ratio(fittable_work, bubble_time))


def fittable_work(model: NodeModel) -> Time:
    """The node's work that fits some bubble (with the margin; covariance per piece): only bubbles
    ever take it."""
    scale, largest = model.scale, model.largest
    if all(max(w.pieces, default=0) * scale < largest for w in model.work):  # the usual case: all of it,
        return sum(chain.from_iterable(w.pieces for w in model.work))  # summed in the same order, in C
    return sum(d for w in model.work for d in w.pieces if d * scale < largest)


def placed_time(placed: Sequence[tuple[int, str, Time, Time]]) -> Time:
    """The time a walk's iteration put into bubbles: its (bubble, label, start, end) placements' lengths,
    summed in order (what the walks subtract from :func:`fittable_work` as they go)."""
    return sum(map(sub, map(itemgetter(3), placed), map(itemgetter(2), placed)))


def sure_to_reach(done: int, fit_left: Time, bubble_time: Time, iterations: int) -> bool:
    """Whether a walk with ``done`` iterations packed and work still to place, ``fit_left`` of it
    fittable, ends with ``iterations`` or more: it needs one more, and an iteration's bubbles take no
    more than their length. A portfolio's candidate only matters if it is shorter than the best so
    far, so giving up then changes no result."""
    return done + max(1, ceil_ratio(fit_left, bubble_time)) >= iterations


def _count_capacity(gap: float, h: float, margin: float) -> int:
    """Most items of duration >= h that one bubble of length ``gap`` can hold (never underestimated)."""
    if h <= 0:
        return 1 << 30
    return max(0, math.floor(gap / h - margin + _SLACK))


def size_class_bound(sizes: Sequence[tuple[Time, int]], bubbles: Sequence[Time],
                     margin: float = DEFAULT_MARGIN) -> int:
    """The best of the per-size volume and counting bounds over the largest distinct item sizes.

    ``sizes``: (duration, how many items of it) for every fittable item (covariance counted per
    piece); ``bubbles``: the bubble lengths of one iteration. Items that fit no bubble are the caller's
    to leave out.
    """
    if not sizes or not bubbles:
        return 1
    gaps = sorted(bubbles)  # ascending
    suffix = [0.0] * (len(gaps) + 1)  # suffix[i] = sum of gaps[i:]
    for i in range(len(gaps) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + gaps[i]
    merged: dict[Time, int] = {}
    for d, c in sizes:
        merged[d] = merged.get(d, 0) + c
    best = 1
    count = 0
    volume: float = 0
    # Walk the distinct sizes from the largest down: count and volume of the items >= h so far.
    for tried, h in enumerate(sorted(merged, reverse=True)):
        if h <= 0 or tried >= MAX_THRESHOLDS:
            break
        count += merged[h]
        volume += h * merged[h]
        first = bisect_right(gaps, h * (1.0 + margin))  # bubbles longer than 1.05 h (strictly)
        room = suffix[first]
        if room <= 0:
            continue  # cannot happen for fittable items; be safe
        best = max(best, ceil_ratio(volume, room))
        slots = sum(_count_capacity(g, h, margin) for g in gaps[first:])
        if slots > 0:
            best = max(best, -(-count // slots))
    return best


@dataclass(frozen=True)
class NodeBounds:
    """The bounds of one node, and what they are computed from."""

    volume: int
    """``ceil(W / C)``: the bound the issue asks for."""
    tight: int
    """The best proven bound (volume, size classes, counting, one-iteration test)."""
    fittable_work: Time
    bubble_time: Time
    largest_bubble: Time
    forced_items: int
    """Items that fit no bubble at all (they become overflow)."""


def node_bounds(sizes: Sequence[tuple[Time, int]], bubbles: Sequence[Time],
                chains: Sequence["Chain"] | None = None,
                bubble_positions: Sequence[int] | None = None, margin: float = DEFAULT_MARGIN) -> NodeBounds:
    """All bounds for a node with these work item sizes ((duration, count) pairs, covariance per piece)
    and per-iteration bubble lengths. With ``chains`` and the bubbles' pipeline positions, the chain
    and one-iteration bounds are applied too."""
    largest = max(bubbles, default=0)
    fittable = [(d, c) for d, c in sizes if c > 0 and fits(d, largest, margin)]
    work = sum(d * c for d, c in fittable)
    capacity = sum(bubbles)
    vol = volume_bound(work, capacity) if fittable else 1
    tight = max(vol, size_class_bound(fittable, bubbles, margin))
    if chains is not None and bubble_positions is not None:
        placed = list(zip(bubble_positions, bubbles))
        for c in chains:
            tight = max(tight, chain_finish(c.last_piece, c.syncs, c.invs, placed, largest, margin) + 1)
        if tight == 1 and not one_iteration_possible(chains, placed, margin):
            tight = 2  # chains given without their pieces make this test weaker, never wrong
    forced = sum(c for _, c in sizes) - sum(c for _, c in fittable)
    return NodeBounds(vol, tight, work, capacity, largest, forced)


@dataclass(frozen=True)
class Chain:
    """One factor's work as the single-iteration test sees it: its covariance pieces with the pipeline
    position each must follow, and the sync and inverse time that must follow all of them."""

    pieces: tuple[tuple[int, Time], ...]  # (pipeline position it must follow, duration); fittable ones
    tail: tuple[Time, ...]  # fittable sync and inverse durations
    tail_after_overflow: bool = False  # a fittable sync/inverse waits for work that fits no bubble
    last_piece: tuple[int, Time] | None = None  # the piece released last: (position, duration)
    syncs: tuple[Time, ...] = ()  # all sync durations (overflow ones too)
    invs: tuple[Time, ...] = ()  # all inverse durations that wait for a sync (or for the pieces)


def one_iteration_possible(chains: Sequence[Chain], bubbles: Sequence[tuple[int, Time]],
                           margin: float = DEFAULT_MARGIN) -> bool:
    """Whether all work could fit in ONE iteration, judged by volume after each release point.

    In a one-iteration cycle, everything released at pipeline position x (covariance pieces after their
    forward or backward, and the sync and inverse of a factor after its last piece) must fit into the
    bubbles after x. ``bubbles``: (pipeline items before it, length). Work that follows overflow (which
    sits at the very end of the iteration) cannot run in the same iteration at all.
    """
    if any(c.tail_after_overflow and c.tail for c in chains):
        return False
    events: dict[int, float] = {}  # release position -> work released there
    biggest: dict[int, float] = {}
    for c in chains:
        last = max((p for p, _ in c.pieces), default=-1)
        for p, d in c.pieces:
            events[p] = events.get(p, 0) + d
            biggest[p] = max(biggest.get(p, 0), d)
        if c.tail:
            events[last] = events.get(last, 0) + sum(c.tail)
            biggest[last] = max(biggest.get(last, 0), max(c.tail))
    if not events:
        return True
    gaps = sorted(bubbles)
    positions = sorted(events, reverse=True)
    # Walk release points from the latest back: work released at or after x vs. bubbles after x.
    work: float = 0
    big: float = 0
    gi = len(gaps)
    room: float = 0
    widest: float = 0
    for x in positions:
        work += events[x]
        big = max(big, biggest[x])
        while gi > 0 and gaps[gi - 1][0] > x:
            gi -= 1
            room += gaps[gi][1]
            widest = max(widest, gaps[gi][1])
        if work > room * (1 + _SLACK) or not fits(big, widest, margin):
            return False
    return True


def first_iteration_bound(chains: Sequence[Chain], bubbles: Sequence[tuple[int, Time]], capacity: Time) -> int:
    """``1 + ceil((W - C0) / C)``: the cycle's first iteration holds at most C0, every other one C.

    ``chains`` with their pieces (fittable ones, each with its release position) and their fittable
    syncs and inverses (released with the factor's last piece); ``bubbles``: (position, length) of one
    iteration; ``capacity``: C, their total length. C0 comes from filling the bubbles in pipeline order,
    each with at most its length and never beyond the work released before it.
    """
    released: dict[int, float] = {}
    get = released.get
    for c in chains:
        for p, d in c.pieces:
            released[p] = get(p, 0) + d
        if c.tail:
            last = max(c.pieces)[0] if c.pieces else -1
            released[last] = get(last, 0) + sum(c.tail)
    return _first_iteration_bound(released, bubbles, capacity)


def _first_iteration_bound(released: dict[int, float], bubbles: Sequence[tuple[int, Time]], capacity: Time) -> int:
    """:func:`first_iteration_bound` from the work released at each pipeline position (in the order
    it was added up: float sums depend on it)."""
    total = sum(released.values())
    if total <= 0 or capacity <= 0:
        return 1
    points = sorted(released)
    filled: float = 0
    available: float = 0
    i = 0
    for pos, length in sorted(bubbles):
        while i < len(points) and points[i] < pos:
            available += released[points[i]]
            i += 1
        filled = min(filled + length, available)
    if total <= filled:
        return 1
    return 1 + ceil_ratio(total - filled, capacity)


def chain_finish(last_piece: tuple[int, Time] | None, syncs: Sequence[Time], invs: Sequence[Time],
                 bubbles: Sequence[tuple[int, Time]], largest: Time | None = None,
                 margin: float = DEFAULT_MARGIN) -> int:
    """The earliest iteration (0-based) in which one factor's chain can end, alone on the node.

    The chain: its last covariance piece (after pipeline position p in iteration 0), then a sync, then
    every inverse (each after a sync). Each item goes to the earliest bubble where it fits after the
    previous one (in the same bubble when there is room left), or, if it fits no bubble, to the end
    of the iteration (overflow), after which only the next iteration's bubbles are left. Other factors
    only take room away, so a cycle needs more iterations than this index.
    """
    nb = len(bubbles)
    if largest is None:
        largest = max((g for _, g in bubbles), default=0)

    def advance(cur: tuple[int, int, Time], d: Time, after: int = -1) -> tuple[int, int, Time]:
        i, b, used = cur
        need = d * (1.0 + margin)
        if not need < largest:
            return (i, nb, 0)
        if 0 <= b < nb and need < bubbles[b][1] - used:
            return (i, b, used + d)
        b += 1
        while True:
            if b >= nb:
                i, b = i + 1, 0
            pos, g = bubbles[b]
            if need < g and (i > 0 or pos > after):
                return (i, b, d)
            b += 1

    cur: tuple[int, int, Time] = (0, -1, 0)
    if last_piece is not None:
        cur = advance(cur, last_piece[1], last_piece[0])
    if syncs:
        cur = min(advance(cur, d) for d in syncs)
    if invs:
        cur = max(advance(cur, d) for d in invs)
    return cur[0]


# ----------------------------------------------------------------------------------------------------
# The bounds of a node model


def model_bounds(model: NodeModel, first_iteration: bool = True) -> NodeBounds:
    """The node's lower bounds, from its item sizes (covariance per piece), bubbles and chains.

    ``first_iteration=False`` leaves out the first-iteration bound, which walks every piece: a
    packing that meets the other bounds is optimal without it (see :func:`with_first_iteration`).
    """
    gaps = [b.length for b in model.bubbles]
    largest = max(gaps, default=0)
    sizes: list[tuple[Time, int]] = []
    for w in model.work:
        if w.kind == COV and len(w.pieces) > 1:
            sizes.extend(Counter(w.pieces).items())
        else:
            sizes.extend((d, 1) for d in w.pieces)
    positions = [b.pos for b in model.bubbles]
    bounds = node_bounds(sizes, gaps, _chains(model, largest, with_pieces=False), positions, model.margin)
    if bounds.tight == 1 and not one_iteration_possible(_chains(model, largest), list(zip(positions, gaps)),
                                                        model.margin):
        bounds = replace(bounds, tight=2)
    return with_first_iteration(model, bounds) if first_iteration else bounds


def with_first_iteration(model: NodeModel, bounds: NodeBounds) -> NodeBounds:
    """``bounds`` raised by the first-iteration bound where that is higher."""
    placed = [(b.pos, b.length) for b in model.bubbles]
    largest = max((g for _, g in placed), default=0)
    first = _first_iteration_bound(_released(model, largest), placed, bounds.bubble_time)
    return replace(bounds, tight=first) if first > bounds.tight else bounds


def _released(model: NodeModel, largest: Time) -> dict[int, float]:
    """The work released at each pipeline position as :func:`first_iteration_bound` adds it up from
    ``_chains(model, largest)``: factor by factor, its fittable pieces in order, then its fittable
    syncs and inverses after its last piece. Same additions in the same order (so the same floats),
    without building the chains: a big node has tens of thousands of pieces."""
    scale = model.scale
    of_group: list[list[int]] = [[] for _ in range(model.groups)]
    for wi, w in enumerate(model.work):
        of_group[w.group].append(wi)
    released: dict[int, float] = {}
    get = released.get
    for members in of_group:
        last = -1
        tail: list[Time] = []
        for wi in members:
            w = model.work[wi]
            if w.kind != COV:
                if model.overlap and w.kind == INV:  # free from the cycle's start
                    released[-1] = get(-1, 0) + sum(d for d in w.pieces if d * scale < largest)
                else:
                    tail.extend(d for d in w.pieces if d * scale < largest)
                continue
            if max(w.pieces) * scale < largest:  # the common case: all of it fits some bubble
                for p, d in zip(w.release, w.pieces):
                    released[p] = get(p, 0) + d
                last = max(last, max(w.release))
                continue
            for p, d in zip(w.release, w.pieces):
                if d * scale < largest:
                    released[p] = get(p, 0) + d
                    last = max(last, p)
        if tail:
            released[last] = get(last, 0) + sum(tail)
    return released


def _chains(model: NodeModel, largest: Time, with_pieces: bool = True) -> list[Chain]:
    """Each factor's chain of work as the bounds see it (covariance pieces only ``with_pieces``)."""
    g_n = model.groups
    scale = model.scale
    pieces: list[list[tuple[int, Time]]] = [[] for _ in range(g_n)]
    tails: list[list[Time]] = [[] for _ in range(g_n)]
    last: list[tuple[int, Time] | None] = [None] * g_n
    syncs: list[list[Time]] = [[] for _ in range(g_n)]
    invs: list[list[Time]] = [[] for _ in range(g_n)]
    forced_level = [99] * g_n  # chain level (cov 0, sync 1, inverse 2) of the first overflow item
    fit_level = [-1] * g_n  # and of the last fittable one
    for w in model.work:
        g = w.group
        if model.overlap and w.kind == INV:  # a piece free from the cycle's start: no link of the chain
            if with_pieces:
                pieces[g].extend((-1, d) for d in w.pieces if d * scale < largest)
            continue
        level = w.kind if model.synced[g] or w.kind == COV else SYNC
        if w.kind == COV:
            last[g] = (w.release[-1], w.pieces[-1])  # releases repeat per interval and rise within it
        elif level == SYNC and w.kind == SYNC:
            syncs[g].append(w.pieces[0])
        else:
            invs[g].append(w.pieces[0])
        if max(w.pieces) * scale < largest:  # the common case: all of it fits some bubble
            fits_all, fit_count = True, len(w.pieces)
        else:
            fits_all, fit_count = False, sum(1 for d in w.pieces if d * scale < largest)
        if w.kind == COV and with_pieces:
            pieces[g].extend(zip(w.release, w.pieces) if fits_all else
                             ((r, d) for r, d in zip(w.release, w.pieces) if d * scale < largest))
        elif w.kind != COV:
            tails[g].extend(d for d in w.pieces if d * scale < largest)
        if fit_count:
            fit_level[g] = max(fit_level[g], level)
        if fit_count < len(w.pieces):
            forced_level[g] = min(forced_level[g], level)
    return [Chain(tuple(pieces[g]), tuple(tails[g]), forced_level[g] < fit_level[g], last[g], tuple(syncs[g]),
                  tuple(invs[g])) for g in range(g_n)]
