"""The ``tight`` policy: dependency-correct K-FAC packing, close to the lower bound, fast at scale.

Each node is packed on its own model (:mod:`pipefisher.schedule.problem`): its bubbles, the same in every
iteration, and its work items (covariance queues of m pieces per interval, syncs, inverses).
Dependencies, from the format spec: in the first iteration, covariance piece q may only follow
forward (A) / backward (B) ``q mod m`` of its pipe; a sync follows all pieces of its factor; an
inverse follows the factor's first sync (all its pieces where the node has no sync for it).

The packer walks the bubbles in time order, iteration after iteration, and fills each one with the
largest ready item that still fits (``d * 1.05 < room``, the published rule), ties broken towards
the pieces of factors already started (so that one completes and its inverse can start, rather than
several started and none finished), then towards covariance work that unlocks the most sync and
inverse time. A queue places as many consecutive pieces as fit and are ready. Items longer (with the margin) than the node's largest bubble fit nowhere: they
go, dependency-correct, to the end of an iteration (after its last pipeline item), which they lengthen;
that is the only overflow. A queue's pieces split from one interval count as one size when choosing
(:func:`size_class`), so the split's one-unit remainder never makes a factor finish late. Candidate
lookup is one bisect plus one big-integer bit scan over the node's distinct (queue, piece size class)
and plain items, so a node costs O(pieces + items x log items).

When the walk needs more iterations than the node's lower bound (see :mod:`bounds`), it is repeated
preferring covariance pieces (equally large ones in key order alone), and then a construction for a
fixed cycle length k (from the bound up) tries to do better: inverses and syncs are placed first, as late as possible, largest first, then
covariance pieces as early as possible, earliest sync deadline first. The shortest cycle is kept; every
candidate is dependency-correct by construction.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate, repeat
from operator import itemgetter
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Tuple

from pipefisher.policies.align import align_groups
from pipefisher.policies.bestfit import pack_best_fit
from pipefisher.schedule.packed import JobSchedule, NodeFigures, NodeSchedule, Policy, gc_paused, split_iterations
from pipefisher.policies.bounds import (NodeBounds, fittable_work, model_bounds, placed_time, sure_to_reach,
                                         with_first_iteration)
from pipefisher.policies.cycle import Packed, node_schedule, start_walk
from pipefisher.rules.groups import Group, job_groups
from pipefisher.rules.waits import deadlock_violations
from pipefisher.schedule.format import PIPELINE_CATEGORIES, label_category
from pipefisher.schedule.problem import COV, DEFAULT_MARGIN, INV, SYNC, NodeModel, fits, node_model
from pipefisher.schedule.timeline import KFAC_KINDS, Job, NodeTimeline, Time



# ----------------------------------------------------------------------------------------------------
# Packing


def size_class(pieces: Sequence[Time], fits_somewhere: Callable[[Time], bool] = lambda d: True) -> dict[Time, Time]:
    """Per piece size of a covariance queue, the size it counts as when the greedy walk chooses.

    An interval split into m integer pieces puts its remainder on the first ones (``split_evenly``), so
    a queue's pieces differ by one time unit. Choosing strictly by size would take every queue's
    longer pieces first and leave each factor's last, one-unit-shorter pieces for later: every factor
    finishes late, and so do its sync and inverse (a cycle longer than the plain greedy's on realistic
    jobs). A piece one unit shorter than another of its queue is that remainder: it counts as the
    longer size (it is still placed at its own length, with its own room), unless only the shorter one
    ``fits_somewhere`` (fits the node's largest bubble): counted as the longer, it would fit none and
    never be chosen, though it is no forced overflow.
    """
    sizes = set(pieces)
    return {d: d + 1 if isinstance(d, int) and d + 1 in sizes and fits_somewhere(d + 1) == fits_somewhere(d) else d
            for d in sizes}


class _Entities:
    """The things the packer picks from, sorted by the room they need: plain items and, per covariance
    queue, one entity per distinct piece size class (:func:`size_class`; only the one of the queue's
    current head is ever ready). Equal needs are ordered so that covariance work unlocking the most sync and inverse time comes last,
    that is, is picked first."""

    def __init__(self, model: NodeModel) -> None:
        work = model.work
        scale = model.scale
        downstream: dict[int, Time] = {}
        for w in work:
            if w.kind != COV:
                downstream[w.group] = downstream.get(w.group, 0) + w.pieces[0]
        entries: list[tuple[float, tuple, int, Time]] = []  # need, tie-break, work index, size
        largest = model.largest

        def fits_somewhere(d: Time) -> bool:  # not forced overflow (the walk's own test)
            return d * scale < largest

        for wi, w in enumerate(work):
            if w.kind == COV:
                for d in set(size_class(w.pieces, fits_somewhere).values()):
                    entries.append((d * scale, (2, downstream.get(w.group, 0), -wi), wi, d))
            else:
                entries.append((w.pieces[0] * scale, (1 if w.kind == SYNC else 0, 0, -wi), wi, w.pieces[0]))
        entries.sort(key=lambda e: (e[0], e[1]))
        self.need = [e[0] for e in entries]
        self.work = [e[2] for e in entries]
        self.rank_by_size: list[dict[Time, int]] = [{} for _ in work]
        for r, e in enumerate(entries):
            self.rank_by_size[e[2]][e[3]] = r
        for wi, w in enumerate(work):  # a queue's pieces map to their class's entity
            if w.kind == COV:
                ranks = self.rank_by_size[wi]
                ranks.update({d: ranks[c] for d, c in size_class(w.pieces, fits_somewhere).items()})
        self.plain_rank = [self.rank_by_size[wi][w.pieces[0]] if w.kind != COV else -1 for wi, w in enumerate(work)]
        # Per rank, the lowest rank of equal need (its ties); per factor, its covariance entities (bits).
        need = self.need
        self.tie_lo = [bisect_left(need, d) for d in need]
        self.factor_bits = [0] * model.groups
        for wi, w in enumerate(work):
            if w.kind == COV:
                for r in set(self.rank_by_size[wi].values()):
                    self.factor_bits[w.group] |= 1 << r


class _GreedyWalk:
    """The state of :func:`pack_greedy`'s walk, so that each of its steps is a method: what is ready
    (``mask``, by entity rank), what waits for its release (``pending``, per bubble of iteration 0) or for
    the end of an iteration (``forced``), and each factor's progress through its pieces and refresh."""

    def __init__(self, model: NodeModel, cov_first: bool, finish_started: bool = True) -> None:
        work = self.work = model.work
        self.model = model
        self.cov_first = cov_first
        self.bubbles = model.bubbles
        self.nb = nb = len(model.bubbles)
        self.largest = model.largest
        self.scale = model.scale
        ents = _Entities(model)
        self.need, self.ent_work = ents.need, ents.work
        self.rank_by_size, self.plain_rank = ents.rank_by_size, ents.plain_rank
        # ``finish_started``: among equally large ready pieces, those of a factor already started first
        # (without it, no factor counts as started: the walk takes them by their rank alone)
        self.tie_lo = ents.tie_lo
        self.factor_bits = ents.factor_bits if finish_started else [0] * model.groups
        self.started = 0  # the covariance entities (bits) of factors with pieces placed
        self.pos = pos = [b.pos for b in model.bubbles]
        # Iteration 0: the first bubble at which a piece that follows pipeline item r is ready (nb: none).
        self.relb = [bisect_right(pos, r) for r in range(len(model.pipeline))]
        self.cov_bits = 0
        for r, wi in enumerate(self.ent_work):
            if work[wi].kind == COV:
                self.cov_bits |= 1 << r
        self.head = [0] * len(work)
        self.cov_left = list(model.factors.pieces)
        self.syncs_of, self.invs_of = model.factors.syncs, model.factors.invs
        self.sync_seen = [False] * model.groups
        self.next_piece = {a: b for invs in self.invs_of for a, b in zip(invs, invs[1:])}  # a refresh's pieces, in order
        self.done_at: list[tuple[int, int] | None] = [None] * model.groups  # where each factor completed
        self.inv_next = [0] * model.groups  # per factor, its next refresh piece (index into its inverses)
        self.overlapped = False
        self.remaining = sum(len(w.pieces) for w in work)
        # Overlapping: only refresh pieces may go back into the room of the iterations already walked, so
        # the rest (covariance and syncs, ``fit_left - inv_left``) still needs iterations of its own.
        self.inv_left = sum(w.pieces[0] for w in work if w.kind == INV and w.pieces[0] * self.scale < self.largest)
        self.mask = 0
        self.pending: list[list[int]] = [[] for _ in range(nb + 1)]
        self.forced: list[int] = []
        self.iteration = 0
        self.cur_bubble = 0
        self.in_bubbles: list[list[tuple[int, str, Time, Time]]] = []
        self.overflow: list[list[tuple[str, Time]]] = []
        start_walk(model, self.group_cov_done, self.classify)

    def ready_plain(self, wi: int) -> None:
        if self.work[wi].pieces[0] * self.scale < self.largest:
            self.mask |= 1 << self.plain_rank[wi]
        else:
            self.forced.append(wi)

    def group_cov_done(self, g: int) -> None:
        if self.model.synced[g]:
            for wi in self.syncs_of[g]:
                self.ready_plain(wi)
        elif self.invs_of[g]:
            self.completed(g)

    def completed(self, g: int) -> None:
        """The factor's refresh may begin: its first piece is ready (each next one once it is placed)."""
        self.done_at[g] = (self.iteration, self.cur_bubble)
        self.ready_plain(self.invs_of[g][0])

    def classify(self, wi: int) -> None:
        """Put queue ``wi``'s new head where it belongs: ready, waiting for its forward/backward, or forced."""
        h = self.head[wi]
        w = self.work[wi]
        pieces = w.pieces
        if h >= len(pieces):
            return
        if not pieces[h] * self.scale < self.largest:
            self.forced.append(wi)
            return
        if self.iteration == 0:
            rb = self.relb[w.release[h]]
            if rb > self.cur_bubble:
                self.pending[rb].append(wi)
                return
        self.mask |= 1 << self.rank_by_size[wi][pieces[h]]

    def placed(self, wi: int) -> None:
        """Bookkeeping after an item (plain) or a queue's last piece was placed."""
        w = self.work[wi]
        g = w.group
        if w.kind == SYNC and not self.sync_seen[g]:
            self.sync_seen[g] = True
            if self.invs_of[g]:
                self.completed(g)
        elif w.kind == INV:
            self.inv_next[g] += 1
            if w.pieces[0] * self.scale < self.largest:
                self.inv_left -= w.pieces[0]
            if wi in self.next_piece:
                self.ready_plain(self.next_piece[wi])

    def iterate(self) -> list[tuple[int, str, Time, Time]]:
        """One iteration: its bubbles in time order, then the forced work at its end; what went into the bubbles."""
        here: list[tuple[int, str, Time, Time]] = []
        self.fill_bubbles(here)
        # The end of the iteration: everything else of iteration 0 is ready now; then the forced work.
        self.cur_bubble = self.nb
        if self.iteration == 0:
            for wi in self.pending[self.nb]:
                self.classify(wi)
            self.pending[self.nb] = []
        self.in_bubbles.append(here)
        self.overflow.append(self.spill_forced())
        self.iteration += 1
        return here

    def fill_bubbles(self, here: list[tuple[int, str, Time, Time]]) -> None:
        """Fill each bubble of this iteration with the largest ready item that fits, again and again
        (the hot path: the walk's state is read into locals; ``mask``, and the bubble, are written back
        around the calls that read or change them)."""
        work, bubbles, need, ent_work = self.work, self.bubbles, self.need, self.ent_work
        cov_bits, cov_first, pos, relb = self.cov_bits, self.cov_first, self.pos, self.relb
        rank_by_size, head, cov_left = self.rank_by_size, self.head, self.cov_left
        pending, forced, scale, largest = self.pending, self.forced, self.scale, self.largest
        iteration = self.iteration
        remaining = self.remaining
        tie_lo, factor_bits, cov_total = self.tie_lo, self.factor_bits, self.model.factors.pieces
        started = self.started
        mask = self.mask
        for b in range(self.nb):
            if iteration == 0 and pending[b]:
                self.cur_bubble = b
                self.mask = mask
                for wi in pending[b]:
                    self.classify(wi)
                pending[b] = []
                mask = self.mask
            bub = bubbles[b]
            t = bub.start
            end = bub.end
            while mask:
                p0 = bisect_left(need, end - t)
                r = -1
                for sel in ((mask & cov_bits, mask) if cov_first else (mask,)):
                    p = p0
                    while True:
                        cand = sel & ((1 << p) - 1)
                        if not cand:
                            r = -1
                            break
                        r = cand.bit_length() - 1
                        if t + need[r] < end:
                            break
                        p = r
                    if r >= 0:
                        break
                if r < 0:
                    break
                if mask & started:  # among equally large pieces, a started factor's first: finish it
                    tied = mask & started & ((2 << r) - (1 << tie_lo[r]))
                    if tied:
                        r = tied.bit_length() - 1
                wi = ent_work[r]
                w = work[wi]
                mask &= ~(1 << r)
                if w.kind != COV:
                    d = w.pieces[0]
                    here.append((b, w.label, t, t + d))
                    t += d
                    remaining -= 1
                    self.cur_bubble = b
                    self.mask = mask
                    self.placed(wi)
                    mask = self.mask
                    continue
                pieces, release = w.pieces, w.release
                h = head[wi]
                n = len(pieces)
                lim = pos[b]
                label = w.label
                ranks = rank_by_size[wi]
                while h < n and ranks[pieces[h]] == r and t + pieces[h] * scale < end and (iteration or release[h] < lim):
                    d = pieces[h]
                    here.append((b, label, t, t + d))
                    t += d
                    h += 1
                done = h - head[wi]
                head[wi] = h
                remaining -= done
                g = w.group
                if cov_left[g] == cov_total[g]:
                    started |= factor_bits[g]
                cov_left[g] -= done
                if h >= n:
                    if cov_left[g] == 0:
                        self.cur_bubble = b
                        self.mask = mask
                        self.group_cov_done(g)
                        mask = self.mask
                    continue
                d = pieces[h]  # where the new head goes (classify, inlined: this is the hot path)
                if not d * scale < largest:
                    forced.append(wi)
                elif iteration == 0 and relb[release[h]] > b:
                    pending[relb[release[h]]].append(wi)
                else:
                    mask |= 1 << rank_by_size[wi][d]
        self.mask = mask
        self.started = started
        self.remaining = remaining

    def spill_forced(self) -> list[tuple[str, Time]]:
        """The forced work, at the end of the iteration (its overflow), and whatever that makes ready."""
        spill: list[tuple[str, Time]] = []
        work, forced, head, scale, largest = self.work, self.forced, self.head, self.scale, self.largest
        while forced:
            wi = forced.pop(0)
            w = work[wi]
            if w.kind != COV:
                spill.append((w.label, w.pieces[0]))
                self.remaining -= 1
                self.placed(wi)
                continue
            h = head[wi]
            pieces = w.pieces
            while h < len(pieces) and not pieces[h] * scale < largest:
                spill.append((w.label, pieces[h]))
                h += 1
            done = h - head[wi]
            head[wi] = h
            self.remaining -= done
            self.cov_left[w.group] -= done
            if h >= len(pieces):
                if self.cov_left[w.group] == 0:
                    self.group_cov_done(w.group)
            else:
                saved, self.iteration = self.iteration, max(self.iteration, 1)  # after the end: every release is met
                self.classify(wi)
                self.iteration = saved
        return spill

    def overlaps_the_rest(self) -> bool:
        """Overlapping, where only refresh pieces are left: whether they all went into the room of the
        iterations already walked (then the walk is over)."""
        if not (self.model.overlap and self.remaining and not self.forced):
            return False
        invs_of, inv_next = self.invs_of, self.inv_next
        left = [(g, invs_of[g][inv_next[g]:]) for g in range(self.model.groups)
                if self.done_at[g] is not None and inv_next[g] < len(invs_of[g])]
        if sum(len(rest) for _, rest in left) == self.remaining:
            if _overlap_into_earlier(self.model, self.in_bubbles, left, self.done_at):
                self.overlapped = True
        return self.overlapped

    def packed(self) -> Packed:
        if not self.in_bubbles:
            return Packed(1, [[]], [[]], self.overlapped)
        return Packed(len(self.in_bubbles), self.in_bubbles, self.overflow, self.overlapped)


def pack_greedy(model: NodeModel, cov_first: bool = False, max_iterations: int = 1 << 20,
                shorter_than: int | None = None, finish_started: bool = True) -> Packed | None:
    """Walk the bubbles in time order, filling each with the largest ready item that fits.

    ``cov_first``: prefer covariance pieces (the start of every chain) over syncs and inverses, and
    take the largest of those that fit; this wins where inverses wait too long for their factors.
    ``finish_started``: among equally large pieces, take a started factor's first, so that it completes
    and its inverse can start in the bubble where it ends, rather than several factors all started and
    none finished (without: by the static tie-break alone, which wins on some Chimera jobs).
    With ``shorter_than``, None as soon as the cycle is sure to have that many iterations or more
    (:func:`sure_to_reach`).
    """
    walk = _GreedyWalk(model, cov_first, finish_started)
    if shorter_than is not None:
        bubble_time = sum(b.length for b in model.bubbles)
        fit_left = fittable_work(model)  # what is left of it: only bubbles take it
    while walk.remaining > 0:
        if walk.iteration >= max_iterations:
            raise RuntimeError("packing made no progress")  # pragma: no cover - the walk always progresses
        here = walk.iterate()
        if walk.overlaps_the_rest():
            break
        if shorter_than is not None and walk.remaining:
            fit_left -= placed_time(here)
            rest = fit_left - walk.inv_left if model.overlap else fit_left
            if sure_to_reach(walk.iteration, rest, bubble_time, shorter_than):
                return None
    return walk.packed()


def _overlap_into_earlier(model: NodeModel, in_bubbles: list[list[tuple[int, str, Time, Time]]],
                          left: Sequence[tuple[int, Sequence[int]]], done_at: Sequence[tuple[int, int] | None]) -> bool:
    """Place the refresh pieces ``left`` (per factor, its pieces not yet placed, in order) into the room
    the walked iterations left, each before its factor's completion (``done_at``: iteration and bubble;
    the bubble count for its overflow): in an overlapping cycle they are the previous refresh's last
    pieces (:mod:`pipefisher.schedule.problem`). Bubbles in time order, each filled after its own work with the
    largest next piece that fits (the room rule, as ``validate`` measures it). All of them or nothing:
    True where they all went in (``in_bubbles`` then holds them), else ``in_bubbles`` is unchanged."""
    work, bubbles, margin = model.work, model.bubbles, model.margin
    pending = {g: list(rest) for g, rest in left if rest}  # a factor leaves it with its last piece
    added: dict[int, list[tuple[int, str, Time, Time]]] = {}
    # A bubble without room for the smallest piece left takes none (most of them, in a dense packing),
    # and none goes at or after the latest completion.
    smallest = min(work[wi].pieces[0] for rest in pending.values() for wi in rest)
    last = max(done_at[g] for g in pending)  # type: ignore[type-var]
    for it, here in enumerate(in_bubbles[:last[0] + 1]):  # type: ignore[index]
        if not pending:
            break
        fill = {b: e for b, _, _, e in here}  # per bubble, where its work ends (laid out in time order)
        for b, bub in enumerate(bubbles):
            t, end = fill.get(b, bub.start), bub.end
            if not pending:
                break
            if not fits(smallest, end - t, margin):
                continue
            while True:
                best = -1
                for g, rest in pending.items():
                    if (it, b) < done_at[g]:  # type: ignore[operator]
                        d = work[rest[0]].pieces[0]
                        if fits(d, end - t, margin) and (best < 0 or d > work[pending[best][0]].pieces[0]):
                            best = g
                if best < 0:
                    break
                wi = pending[best].pop(0)
                if not pending[best]:
                    del pending[best]
                d = work[wi].pieces[0]
                added.setdefault(it, []).append((b, work[wi].label, t, t + d))
                t += d
    if pending:
        return False
    for it, extra in added.items():  # each bubble's new work after its own: stable by bubble
        in_bubbles[it] = sorted(in_bubbles[it] + extra, key=itemgetter(0))
    return True


def pack_fixed(model: NodeModel, k: int) -> Packed | None:
    """Try to pack the node into exactly ``k`` iterations; ``None`` when this construction cannot.

    1. Syncs and inverses, latest first: walk the slots backwards (each iteration's bubbles, then its
       overflow slot at the end) and put the largest item whose successors are all placed later and
       that still fits; items that fit no bubble go to overflow slots only.
    2. Covariance pieces, earliest first: walk the slots forwards and give the room left to the ready
       queue whose factor's sync (or inverse) comes first, as many pieces as fit.
    In a bubble the work is laid out back to back: first the syncs and inverses of factors with no
    pieces in it, then the covariance pieces, then the syncs and inverses of the factors whose pieces
    are there. Every item needs 5 % of its length free after its own end, so what decides whether a
    bubble of length G holding work S is full is mostly its last item: ``S + 0.05 L`` must stay below G
    (L: the last piece, or the largest sync/inverse laid out after the pieces), and the syncs and
    inverses laid out first must fit with their own margin (``S' + 0.05 D < G`` for their sum S' and
    largest D, checked when they are placed). A small piece last wastes far less than a large inverse.
    """
    return _pack_fixed(model, k)[0]


@dataclass
class _Prefix:
    """Step 2's forward walk of :func:`pack_fixed` up to (not including) ``slot``, for the next k.

    Before the first slot holding a sync or inverse, the walk depends on nothing k changes: the slots
    are the same (absolute from the start), empty, and no deadline is due yet, so a k' whose syncs and
    inverses all come at ``slot`` or later, and whose queue order is the same, walks there exactly so.
    It only gives up differently (its room test), which ``left_at`` lets it check without walking.
    """

    order: list[int]  # the queues by deadline: the walk's order of preference
    slot: int
    head: dict[int, int]
    active: list[int]
    left: Time
    left_at: list[Time]  # ``left`` at the start of each slot before ``slot``
    content: list[list[tuple[int, int]]]  # the pieces put in each slot before ``slot``


@dataclass(frozen=True)
class _FixedSetup:
    """What :func:`pack_fixed` derives from the node alone, the same for every k it is tried at: worked
    out once per node (:func:`_fixed_below` tries several k), read only."""

    gap: list[Time]  # the bubbles' lengths
    pos: list[int]  # the bubbles' places in the pipeline
    plain: list[int]  # the syncs and inverses (work indices)
    order: list[int]  # those by duration (then later index first): their ranks
    rank: dict[int, int]
    need: list[float]  # per rank, the room the item needs
    allowed: list[int]  # per bubble of iteration 0, the ranks (bits) that may go there
    group_of: list[int]  # per work index, its factor, pieces and releases
    pieces_of: list[tuple[Time, ...]]
    release_of: list[tuple[int, ...]]
    smallest: Time  # the smallest covariance piece, and the pieces' work that fits some bubble
    fit: Time


def _fixed_setup(model: NodeModel) -> _FixedSetup:
    work = model.work
    bubbles = model.bubbles
    plain = [wi for wi, w in enumerate(work) if w.kind != COV]
    order = sorted(plain, key=lambda wi: (work[wi].pieces[0], -wi))
    rank = {wi: r for r, wi in enumerate(order)}
    # In iteration 0 a sync or inverse can only follow its factor's last piece: not before the bubble
    # where that piece is first ready (in it, it is laid out after the pieces).
    pos = [bb.pos for bb in bubbles]
    earliest = [-1] * model.groups
    for w in work:
        if w.kind == COV:
            earliest[w.group] = bisect_right(pos, w.release[-1])
    nb = len(bubbles)
    allowed = [0] * nb
    for wi in plain:
        e = earliest[work[wi].group]
        for bb in range(e, nb):
            allowed[bb] |= 1 << rank[wi]
    smallest, fit = _pieces_to_fit(model)
    return _FixedSetup([b.length for b in bubbles], pos, plain, order, rank,
                       [work[wi].pieces[0] * model.scale for wi in order], allowed, [w.group for w in work],
                       [w.pieces for w in work], [w.release for w in work], smallest, fit)


def _pack_fixed(model: NodeModel, k: int, prefix: _Prefix | None = None,
                setup: _FixedSetup | None = None) -> tuple[Packed | None, _Prefix | None]:
    """:func:`pack_fixed`, resuming step 2 from ``prefix`` where that holds for ``k``; also the prefix
    for the next k (``prefix`` itself where this k gives up before walking). ``setup``: the node's
    :func:`_fixed_setup`, where the caller tries several k."""
    trial = _FixedTrial(model, k, setup or _fixed_setup(model))
    if not trial.place_plain():
        return None, prefix
    done, shared = trial.place_pieces(prefix)
    return (trial.layout() if done else None), shared


class _FixedTrial:
    """One try of :func:`pack_fixed` at ``k``: its slots (per iteration, its bubbles, then its overflow
    slot) and what its steps put there, so that each step is a method."""

    def __init__(self, model: NodeModel, k: int, setup: _FixedSetup) -> None:
        self.model, self.k, self.setup = model, k, setup
        self.work = model.work
        self.nb = len(model.bubbles)
        self.per = self.nb + 1  # slots per iteration: its bubbles, then its overflow slot
        self.nslots = nslots = k * self.per
        self.scale, self.margin, self.largest = model.scale, model.margin, model.largest
        self.used: list[Time] = [0] * nslots
        self.maxd: list[Time] = [0] * nslots
        # (work index, piece) per slot; None for none yet (most slots of a trial that gives up stay so)
        self.content: list[list[tuple[int, int]] | None] = [None] * nslots
        self.syncs_of, self.invs_of = model.factors.syncs, model.factors.invs
        self.slot_of: dict[int, int] = {}
        self.first_busy = nslots  # the first slot with a sync or inverse
        self.placed_plain = 0

    # -- 1. syncs and inverses, as late as possible --------------------------------------------------

    def place_plain(self) -> bool:
        """Step 1: walk the slots backwards, each taking the largest ready sync or inverse that fits;
        whether all of them went in."""
        model, setup, nb, per = self.model, self.setup, self.nb, self.per
        self.fit_mask = 0  # ready fittable items, by rank
        self.forced_ready: list[int] = []
        self.invs_left = [len(self.invs_of[g]) if model.synced[g] else 0 for g in range(model.groups)]
        # backwards: a refresh's last piece first, each earlier one once the one after it is placed
        self.before_piece = {b: a for invs in self.invs_of for a, b in zip(invs, invs[1:])}
        for wi in setup.plain:
            w = self.work[wi]
            if (w.kind == INV and wi == self.invs_of[w.group][-1]) or (w.kind == SYNC and self.invs_left[w.group] == 0):
                self.ready(wi)
        for slot in range(self.nslots - 1, -1, -1):
            if not self.fit_mask and not self.forced_ready:
                break  # nothing is ready, so nothing more can be: the slots before stay as they are
            b = slot % per
            if b == nb:  # overflow slot: every ready forced item, and whatever they make ready
                while self.forced_ready:
                    for s in self.put(self.forced_ready.pop(), slot):
                        self.ready(s)
                continue
            self.fill_plain(slot, setup.gap[b], setup.allowed[b] if slot < nb else -1)
        return self.placed_plain == len(setup.plain)

    def fill_plain(self, slot: int, g_len: Time, allow: int) -> None:
        """Step 1 in bubble slot ``slot`` (of length ``g_len``; ``allow``: the ranks that may go there)."""
        released: list[int] = []
        while self.fit_mask:
            r = self.largest_fitting(self.fit_mask & allow, slot, g_len)
            if r < 0:
                break
            self.fit_mask &= ~(1 << r)
            released.extend(self.put(self.setup.order[r], slot))
        for s in released:  # a sync may share its inverse's bubble (it is laid out first)
            self.ready(s)
        if released:
            # let them into this same bubble: run the bubble again
            while self.fit_mask:
                r = self.largest_fitting(self.fit_mask & allow, slot, g_len)
                if r < 0 or self.work[self.setup.order[r]].kind != SYNC:
                    break
                self.fit_mask &= ~(1 << r)
                self.put(self.setup.order[r], slot)

    def ready(self, wi: int) -> None:
        if self.work[wi].pieces[0] * self.scale < self.largest:
            self.fit_mask |= 1 << self.setup.rank[wi]
        else:
            self.forced_ready.append(wi)

    def largest_fitting(self, candidates: int, slot: int, g_len: Time) -> int:
        """The rank of the largest candidate that still fits the slot (with the margin), or -1."""
        work, order, used, top_here, margin = self.work, self.setup.order, self.used[slot], self.maxd[slot], self.margin
        p = bisect_left(self.setup.need, g_len - used)
        while True:
            cand = candidates & ((1 << p) - 1)
            if not cand:
                return -1
            r = cand.bit_length() - 1
            d = work[order[r]].pieces[0]
            top = d if d > top_here else top_here
            if used + d + margin * top < g_len:
                return r
            p = r

    def put(self, wi: int, slot: int) -> list[int]:
        """Lay sync or inverse ``wi`` into ``slot``; returns the syncs this makes ready (its last inverse)."""
        if slot < self.first_busy:
            self.first_busy = slot
        w = self.work[wi]
        d = w.pieces[0]
        self.used[slot] += d
        if d > self.maxd[slot]:
            self.maxd[slot] = d
        here = self.content[slot]
        if here is None:
            here = self.content[slot] = []
        here.append((wi, 0))
        self.slot_of[wi] = slot
        self.placed_plain += 1
        if wi in self.before_piece:
            self.ready(self.before_piece[wi])
        if w.kind == INV and self.model.synced[w.group]:
            self.invs_left[w.group] -= 1
            if self.invs_left[w.group] == 0:
                return list(self.syncs_of[w.group])
        return []

    # -- 2. covariance pieces, as early as possible, earliest deadline first -------------------------

    def deadlines(self) -> list[int]:
        """Per factor, the first slot of the sync (or inverse) that must follow its pieces."""
        deadline = [self.nslots + 1] * self.model.groups
        for g in range(self.model.groups):
            after = self.syncs_of[g] if self.model.synced[g] else self.invs_of[g]
            if after:
                deadline[g] = min(self.slot_of[wi] for wi in after)
        return deadline

    def ends(self, busy: Sequence[int]) -> list[dict[int, Time]]:
        """Per slot: the largest sync/inverse of each factor in it (the ``busy`` slots have some). The
        largest of those that must come after the slot's pieces (their factor has pieces there) is the
        item that ends the bubble."""
        nothing: dict[int, Time] = {}  # shared by the slots without syncs or inverses (never written)
        big_of: list[dict[int, Time]] = [nothing] * self.nslots
        for slot in busy:
            big = big_of[slot] = {}
            for wi, _ in self.content[slot] or ():
                g, d = self.work[wi].group, self.work[wi].pieces[0]
                if d > big.get(g, 0):
                    big[g] = d
        return big_of

    def room(self, busy: Sequence[int]) -> tuple[list[float], float]:
        """The room for pieces in the slots s, s + 1, ... per s, and the float tolerance on it.

        Step 2 gives up as soon as the pieces left that fit a bubble are more than that room (a bubble
        that takes pieces ends with at least the margin of the smallest one free): the construction
        would fail anyway, only later. The tolerance keeps float rounding on the safe side."""
        gap, margin, smallest, nb, per = self.setup.gap, self.margin, self.setup.smallest, self.nb, self.per
        free = [g - margin * smallest for g in gap]
        frees = ([f if f > 0 else 0 for f in free] + [0]) * self.k  # per slot (an overflow slot has none)
        for slot in busy:
            b = slot % per
            if self.used[slot] and b < nb:
                f = gap[b] - self.used[slot] - margin * smallest
                frees[slot] = f if f > 0 else 0
        room_from = list(accumulate(reversed(frees), initial=0.0))
        room_from.reverse()
        return room_from, 1e-9 * (self.k * sum(gap) + self.setup.fit)

    def place_pieces(self, prefix: _Prefix | None) -> tuple[bool, _Prefix | None]:
        """Step 2: walk the slots forwards, giving each one's room to the ready queues by deadline;
        whether every piece went in, and the walk up to the first slot with a sync or inverse (or
        ``prefix``, where this k gives up before walking)."""
        deadline = self.deadlines()
        busy = sorted(set(self.slot_of.values()))  # the slots step 1 filled (the others are empty)
        big_of = self.ends(busy)
        group_of = self.setup.group_of
        queues = sorted((wi for wi, w in enumerate(self.work) if w.kind == COV),
                        key=lambda wi: (deadline[group_of[wi]], wi))
        room_from, tolerance = self.room(busy)
        left = self.setup.fit  # what of the pieces fits some bubble
        start = 0
        if prefix is not None and prefix.slot <= self.first_busy and prefix.order == queues:
            if any(was > room_from[s] + tolerance for s, was in enumerate(prefix.left_at)):
                return False, prefix
            start, left = prefix.slot, prefix.left
            walk = _Prefix(queues, start, dict(prefix.head), list(prefix.active), left, list(prefix.left_at), [])
            self.content[:start] = prefix.content
        else:
            walk = _Prefix(queues, 0, {wi: 0 for wi in queues}, list(queues), left, [], [])
        return self.walk_pieces(walk, deadline, big_of, room_from, tolerance)

    def snapshot(self, walk: _Prefix, upto: int) -> _Prefix:
        """The walk's state before slot ``upto``, for the next k."""
        return _Prefix(walk.order, upto, dict(walk.head), list(walk.active), walk.left, list(walk.left_at),
                       self.content[:upto])

    def walk_pieces(self, walk: _Prefix, deadline: Sequence[int], big_of: Sequence[dict[int, Time]],
                    room_from: Sequence[float], tolerance: float) -> tuple[bool, _Prefix | None]:
        """Step 2's forward walk from ``walk.slot`` (the hot path: its state is kept in locals, ``walk``
        holds the head of each queue, the queues with pieces left and the room test's record)."""
        setup, used, content, per, nb = self.setup, self.used, self.content, self.per, self.nb
        group_of, pieces_of, release_of, gap, pos = (setup.group_of, setup.pieces_of, setup.release_of, setup.gap,
                                                      setup.pos)
        margin, smallest_need = self.margin, setup.smallest * self.scale
        head, left_at = walk.head, walk.left_at
        tail = [0] * self.nslots
        shared: _Prefix | None = None  # the walk up to the first slot with a sync or inverse
        for slot in range(walk.slot, self.nslots):
            if slot == self.first_busy:
                shared = self.snapshot(walk, slot)
            if not walk.active:
                break
            i, b = divmod(slot, per)
            if walk.left > room_from[slot] + tolerance:
                return False, shared or self.snapshot(walk, slot)
            left_at.append(walk.left)
            if b == nb:
                if not self.overflow_pieces(walk, slot, deadline):
                    return False, shared
                continue
            active = walk.active
            still: list[int] = []
            g_len = gap[b]
            u = used[slot]  # the slot's used room and tail, kept here while its queues are visited
            if not u + smallest_need < g_len:  # full (or too small) already: all wait
                if deadline[group_of[active[0]]] <= slot:
                    return False, shared
                continue
            lim = pos[b]
            after_slot = tail[slot]
            big = big_of[slot]
            left = walk.left
            for q, wi in enumerate(active):
                if not u + smallest_need < g_len:  # full: the rest only wait (by deadline)
                    if deadline[group_of[wi]] <= slot:
                        return False, shared
                    still.extend(active[q:])
                    break
                g = group_of[wi]
                pieces = pieces_of[wi]
                h = first = head[wi]
                n = len(pieces)
                after = after_slot
                own = big.get(g, 0)  # this factor's sync/inverse here goes after its pieces
                if own > after:
                    after = own
                v = u
                if i:  # the hot loop, one piece at a time: past iteration 0 every piece is released
                    while h < n:
                        d = pieces[h]
                        if not v + d + margin * (d if d > after else after) < g_len:
                            break
                        v += d
                        h += 1
                else:
                    release = release_of[wi]
                    while h < n and release[h] < lim:
                        d = pieces[h]
                        if not v + d + margin * (d if d > after else after) < g_len:
                            break
                        v += d
                        h += 1
                if h > first:  # pieces first .. h - 1 go here
                    u = used[slot] = v
                    after_slot = tail[slot] = after
                    left -= sum(pieces[first:h])
                    head[wi] = h
                    here = content[slot]
                    if here is None:
                        here = content[slot] = []
                    here.extend(zip(repeat(wi), range(first, h)))
                if h < n:
                    if deadline[g] <= slot:
                        return False, shared
                    still.append(wi)
            walk.left = left
            walk.active = still
        return not walk.active, shared

    def overflow_pieces(self, walk: _Prefix, slot: int, deadline: Sequence[int]) -> bool:
        """Step 2 in overflow slot ``slot``: each queue's next pieces that fit no bubble; False where a
        queue with pieces left is due."""
        still = []
        for wi in walk.active:
            w = self.work[wi]
            h = walk.head[wi]
            pieces = w.pieces
            while h < len(pieces) and not pieces[h] * self.scale < self.largest:
                here = self.content[slot]
                if here is None:
                    here = self.content[slot] = []
                here.append((wi, h))
                h += 1
            walk.head[wi] = h
            if h < len(pieces):
                if deadline[w.group] <= slot:
                    return False
                still.append(wi)
        walk.active = still
        return True

    # -- layout ---------------------------------------------------------------------------------------

    def layout(self) -> Packed:
        """The slots' content laid out in time: per bubble, the syncs/inverses of factors without pieces
        there, then the pieces, then the other syncs/inverses (stable: pieces keep their order, a sync
        stays before its inverse, a refresh's pieces in order: step 1 put them there last first)."""
        work, nb, k = self.work, self.nb, self.k
        in_bubbles: list[list[tuple[int, str, Time, Time]]] = [[] for _ in range(k)]
        overflow: list[list[tuple[str, Time]]] = [[] for _ in range(k)]
        for slot in range(self.nslots):
            items = self.content[slot]
            if not items:
                continue
            i, b = divmod(slot, self.per)
            with_pieces = {work[wi].group for wi, _ in items if work[wi].kind == COV}

            def place_rank(x: tuple[int, int]) -> tuple[int, int, int]:
                w = work[x[0]]
                if w.kind == COV:
                    return (1, 0, 0)
                return (2 if w.group in with_pieces else 0, w.kind, x[0])

            items = sorted(items, key=place_rank)  # not in place: a prefix's slots are shared
            if b == nb:
                overflow[i].extend((work[wi].label, work[wi].pieces[h]) for wi, h in items)
                continue
            t = self.model.bubbles[b].start
            out = in_bubbles[i]
            for wi, h in items:
                d = work[wi].pieces[h]
                out.append((b, work[wi].label, t, t + d))
                t += d
        return Packed(k, in_bubbles, overflow)


def _pieces_to_fit(model: NodeModel) -> tuple[Time, Time]:
    """The smallest covariance piece, and the pieces' work that fits some bubble (with the margin)."""
    scale, largest = model.scale, model.largest
    smallest: Time | None = None
    left: Time = 0
    for w in model.work:
        if w.kind == COV:
            pieces = w.pieces
            low = min(pieces)
            smallest = low if smallest is None or low < smallest else smallest
            left += sum(pieces) if max(pieces) * scale < largest else sum(d for d in pieces if d * scale < largest)
    return (smallest or 0), left


def fixed_fails_at_once(model: NodeModel, k: int) -> bool:
    """Whether :func:`pack_fixed` is sure to give up at its first slot for ``k``, without building anything.

    There it gives up when the pieces that fit some bubble are more than the room its first step
    leaves: per bubble slot, its length less the syncs and inverses put there and the margin of the
    smallest piece, where that is positive. That step puts every sync and inverse that fits a bubble
    into a bubble slot (or fails itself), each slot keeping the margin of its largest one free: so the
    room is at most ``k`` times the bubbles' (each less that margin) less all those syncs and
    inverses, plus, for those shorter than the smallest piece, the difference of the two margins.
    Twice the construction's float tolerance keeps this on the safe side of its own sum.
    """
    scale, largest, margin = model.scale, model.largest, model.margin
    smallest, left = _pieces_to_fit(model)
    plain = [w.pieces[0] for w in model.work if w.kind != COV and w.pieces[0] * scale < largest]
    excess = margin * sum(smallest - d for d in plain if d < smallest)
    gaps = [b.length for b in model.bubbles]
    per_iteration = sum(g - margin * smallest for g in gaps if g - margin * smallest > 0)
    tolerance = 1e-9 * (k * sum(gaps) + left)
    return left > k * per_iteration - sum(plain) + excess + 2 * tolerance


def _fixed_below(model: NodeModel, low: int, high: int, prune: bool = True) -> Packed | None:
    """The fixed-length construction's shortest cycle in [low, high), or None (with ``prune``, a k
    where it is sure to fail at once is not built)."""
    prefix: _Prefix | None = None
    setup: _FixedSetup | None = None
    for k in range(low, high):
        if prune and fixed_fails_at_once(model, k):
            continue
        setup = setup or _fixed_setup(model)
        trial, prefix = _pack_fixed(model, k, prefix, setup)
        if trial is not None:
            return trial
    return None


@dataclass(frozen=True)
class _Choice:
    """What a node's portfolio chose."""

    packed: Packed
    bounds: NodeBounds
    how: str
    compat: NodeSchedule | None  # the published construction's cycle, where honest, valid and shorter


def pack_node(node: NodeTimeline, span: Time, margin: float = DEFAULT_MARGIN, prune: bool = True,
              overlap: bool = False) -> NodeSchedule:
    """One node's cycle, as short as this policy can make it: a small portfolio of constructions.

    Each candidate is dependency-correct by construction; the shortest is kept, and the search stops
    as soon as one meets the node's lower bound (then it is optimal). In order: the greedy walk (which
    meets the bound on most nodes), the walk preferring covariance pieces (equally large ones in key
    order alone, not started factors' first), plain best-fit (ties in key
    order, then in reverse key order), the
    fixed-length construction for every k from the bound up, and the published packer's cycle where
    it is valid and honest. With ``prune`` (``False`` only to test that it changes nothing), each
    candidate after the first is told the best cycle so far and gives up once it cannot be shorter.
    ``overlap``: the problem of overlapping cycles (:mod:`pipefisher.schedule.problem`): the greedy walks may put
    refresh pieces before their factor's completion, and the bounds are that problem's.
    """
    model = node_model(node, span, margin, overlap)
    bounds, first = _first_walk(model)
    return _node_schedule(model, _chosen(first, bounds, _challenge(node, span, model, bounds, first.iterations, prune)))


def _first_walk(model: NodeModel, finish_started: bool = True) -> tuple[NodeBounds, Packed]:
    """The node's bounds and the portfolio's first candidate, the greedy walk (the first-iteration
    bound is only worked out where the walk misses the others)."""
    bounds = model_bounds(model, first_iteration=False)
    first = pack_greedy(model, finish_started=finish_started)
    assert first is not None  # it has no cap
    if first.iterations > bounds.tight:
        bounds = with_first_iteration(model, bounds)
    return bounds, first


# What the portfolio after the first walk found: a shorter candidate or None, its name, and the
# published construction's cycle where that is honest, valid and shorter still, or None.
_Challenge = Tuple[Optional[Packed], str, Optional[NodeSchedule]]


def _challenge(node: NodeTimeline, span: Time, model: NodeModel, bounds: NodeBounds, iterations: int,
               prune: bool = True) -> _Challenge:
    """The rest of :func:`pack_node`'s portfolio against a first walk of ``iterations``: a worker
    process needs no more than that number to run it."""
    best: Packed | None = None
    how = "greedy"

    def cap() -> int | None:
        return iterations if prune else None

    candidates = (
        ("greedy, covariance first", lambda: pack_greedy(model, cov_first=True, finish_started=False,
                                                         shorter_than=cap())),
        ("best-fit", lambda: pack_best_fit(model, shorter_than=cap())),
        ("best-fit, later keys first", lambda: pack_best_fit(model, later_first=True, shorter_than=cap())),
        ("fixed k", lambda: _fixed_below(model, bounds.tight, iterations, prune)),
    )
    for name, construct in candidates:
        if iterations <= bounds.tight:
            break
        other = construct()
        if other is not None and other.iterations < iterations:
            best, how, iterations = other, name, other.iterations
    # not provably optimal: the published construction may be shorter
    theirs = honest_compat(node, span, model, shorter_than=iterations) if iterations > bounds.tight else None
    return best, how, theirs


def _chosen(first: Packed, bounds: NodeBounds, challenge: _Challenge) -> _Choice:
    best, how, theirs = challenge
    return _Choice(first if best is None else best, bounds, how, theirs)


def _node_schedule(model: NodeModel, choice: _Choice) -> NodeSchedule:
    """The schedule of what :func:`_choose` chose."""
    schedule = node_schedule(model, choice.packed, choice.bounds)
    schedule = replace(schedule, figures=replace(schedule.figures, extra={**schedule.figures.extra,
                                                                         "construction": choice.how}))
    return schedule if choice.compat is None else _as_ours(choice.compat, schedule)


def honest_compat(node: NodeTimeline, span: Time, model: NodeModel | None = None,
                  shorter_than: int | None = None) -> NodeSchedule | None:
    """The published packer's cycle for ``node`` where it is dependency-correct and honest, else None.

    With ``shorter_than``, also None unless its cycle has fewer iterations (skipping the checks).

    Honest: integer times and no ``None`` (else its floor-divided pieces or zeroed times claim room it
    never used); every K-FAC item inside the iteration's pipeline window and none appended after the
    cycle's last forward/backward (else it lengthened the iteration); passing ``validate``'s room
    rules too (no time counted twice, as it does around a step marker that ends before the pipeline);
    and busy time within the cycle measured by this policy's iteration length.
    """
    from pipefisher.policies.compat import pack_node_slots, pack_node_slots_below, placements_from_slots

    if not all(isinstance(x, int) for ivs in node.entries.values() for iv in ivs for x in (iv.start, iv.end)):
        return None
    model = model or node_model(node, span)
    margin = model.margin
    if shorter_than is None:
        slots = pack_node_slots(node, span, margin)
    else:
        maybe = pack_node_slots_below(node, span, shorter_than, margin)
        if maybe is None:
            return None
        slots = maybe
    labels = split_iterations(slots)
    k = len(labels)
    if shorter_than is not None and k >= shorter_than:
        return None
    if _appended_after_the_pipeline(labels[-1]):
        return None
    placements = placements_from_slots(slots)
    work = [p for p in placements if p.category in KFAC_KINDS]
    first = min((ps for _, ps, _ in model.pipeline), default=0)
    if any(p.start < min(first, 0) or p.end > model.base for p in work):
        return None
    from pipefisher.rules import validate_node  # here: most calls give up before (a worker saves its import)

    if validate_node(0, node, labels, span, margin):
        return None
    kfac = sum(p.duration for p in work)
    cycle, busy = model.length * k, model.pipeline_busy * k
    if cycle <= 0 or busy + kfac > cycle:
        return None
    figures = NodeFigures(iterations=k, usage=(busy + kfac) / cycle * 100, cycle_time=cycle, pipeline_busy=busy,
                          kfac_placed=kfac, bubble_left=cycle - busy - kfac, extra={"construction": "compat"})
    return NodeSchedule(tuple(tuple(it) for it in labels), placements, figures)


def _appended_after_the_pipeline(last_iteration: Sequence[str]) -> bool:
    """Whether K-FAC work follows the cycle's last forward/backward: the published packer appends
    what fits no gap there, as overflow that lengthens the iteration."""
    pipe = [i for i, label in enumerate(last_iteration) if label_category(label) in PIPELINE_CATEGORIES]
    after = last_iteration[pipe[-1] + 1:] if pipe else last_iteration
    return any(label_category(label) in KFAC_KINDS for label in after)


def shorter_valid_compat(node: NodeTimeline, span: Time, model: NodeModel, ours: NodeSchedule) -> NodeSchedule:
    """``ours``, or the published construction's cycle where that is honest, valid and shorter."""
    theirs = honest_compat(node, span, model, shorter_than=ours.figures.iterations)
    return ours if theirs is None else _as_ours(theirs, ours)


def _as_ours(theirs: NodeSchedule, ours: NodeSchedule) -> NodeSchedule:
    """The published construction's cycle, reported with our bound and figures' extras."""
    figures = replace(theirs.figures, lower_bound=ours.figures.lower_bound,
                      extra={**ours.figures.extra, **theirs.figures.extra})
    return replace(theirs, figures=figures)


OVERLAP_BY_DEFAULT = True
"""``tight`` and ``target`` let cycles overlap unless told not to: never a longer cycle, and packing the
heavy regression job so costs no more processor time than without (docs/policies.md)."""


class TightPolicy(Policy):
    """Dependency-correct packing close to the lower bound; overflow only for work that fits no bubble."""

    name = "tight"
    summary = "dependency-correct packing near the lower bound (overflow only for work no bubble can hold)"

    options = ("overlap",)

    def __init__(self, overlap: bool = OVERLAP_BY_DEFAULT) -> None:
        """``overlap``: cycles may overlap (a refresh's pieces run on into the next cycle's first
        iterations, :mod:`pipefisher.schedule.problem`); the schedule's metadata then says so."""
        self.overlap = bool(overlap)

    def pack(self, job: Job, margin: float = DEFAULT_MARGIN,
             each: Callable[[int, NodeSchedule], None] | None = None) -> JobSchedule:
        """``each``: see :func:`pack_nodes` (the nodes it is given are before aligning sync groups)."""
        with gc_paused():
            groups = job_groups(job)
            nodes = align_groups(job, pack_nodes(job, margin, each=each, overlap=self.overlap), groups, margin)
            if any(len(group) > 1 for group in groups):
                # Aligning a sync group can lengthen its cycle by how its members were packed: the
                # members' packings by the walk in key order too, per group the shorter aligned cycle.
                theirs = pack_nodes(job, margin, overlap=self.overlap, finish_started=False)
                nodes = _shorter_groups(nodes, align_groups(job, theirs, groups, margin), groups)
            overlaps = any(n.figures.extra.get("overlap") for n in nodes)
            return JobSchedule(self.name, job.span, nodes, margin, overlap=overlaps)


def _shorter_groups(ours: Sequence[NodeSchedule], theirs: Sequence[NodeSchedule],
                    groups: Sequence[Group]) -> tuple[NodeSchedule, ...]:
    """``ours``, each sync group's members taken from ``theirs`` where its aligned cycle is shorter there
    (``ours`` whole where that mix could deadlock, :func:`waits.deadlock_violations`)."""
    mixed = list(ours)
    for group in groups:
        if len(group) > 1 and (max(theirs[n].figures.iterations for n in group)
                               < max(ours[n].figures.iterations for n in group)):
            for n in group:
                mixed[n] = theirs[n]
    if mixed != list(ours) and deadlock_violations([node.iterations for node in mixed], groups):
        return tuple(ours)
    return tuple(mixed)


PARALLEL_PIECES = 50_000
"""Jobs with at least this many work pieces run the portfolio past its first walk in worker processes,
on the nodes where that walk misses the bound (some 50 ms to start them, against seconds of packing)."""


def pack_nodes(job: Job, margin: float = DEFAULT_MARGIN, workers: int | None = None,
               each: Callable[[int, NodeSchedule], None] | None = None, overlap: bool = False,
               finish_started: bool = True) -> tuple[NodeSchedule, ...]:
    """Every node's :func:`pack_node`, in node order.

    In a big job, the nodes whose first walk misses the bound run the rest of the portfolio in forked
    worker processes, one per CPU this process may use (``workers`` overrides that; 1: none), while
    this one walks the next nodes; the workers start only once a node needs them. Each node's result
    is a pure function of the node, so it is the same either way, and small to send back: no more
    than a shorter candidate where one is found. ``each(i, schedule)``, where given, is called with
    each node's schedule as soon as it is made, in node order (while workers still pack later nodes:
    a caller that evaluates the nodes does so then, not after). ``finish_started``: the first walk's,
    :func:`pack_greedy`.
    """
    import os

    models = [node_model(node, job.span, margin, overlap) for node in job.nodes]
    if workers is None:
        big = sum(len(w.pieces) for model in models for w in model.work) >= PARALLEL_PIECES
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = cpus if big else 1
    pool = None
    firsts: list[tuple[NodeBounds, Packed]] = []
    challenges: list[Any] = []
    try:
        for node, model in zip(job.nodes, models):
            bounds, first = _first_walk(model, finish_started)
            firsts.append((bounds, first))
            args = (node, job.span, model, bounds, first.iterations)
            if first.iterations <= bounds.tight or workers < 2:
                challenges.append(_challenge(*args))
                continue
            if pool is None:
                import multiprocessing

                if "fork" not in multiprocessing.get_all_start_methods():
                    workers = 1
                    challenges.append(_challenge(*args))
                    continue
                # forked: the workers inherit the nodes and their models, so a task is only their index
                pool = multiprocessing.get_context("fork").Pool(workers, _adopt, (job.nodes, job.span, models))
            challenges.append(pool.apply_async(_challenge_for, ((len(firsts) - 1, bounds, first.iterations),)))
        out = []
        for i, (model, (bounds, first), c) in enumerate(zip(models, firsts, challenges)):
            out.append(_node_schedule(model, _chosen(first, bounds, c if isinstance(c, tuple) else c.get())))
            if each is not None:
                each(i, out[-1])
        return tuple(out)
    finally:
        if pool is not None:  # every task is done here, unless this failed
            pool.terminate()
            pool.join()


_adopted: tuple[Sequence[NodeTimeline], Time, Sequence[NodeModel]] | None = None
"""In a worker process of :func:`pack_nodes`: the job's nodes, its span and the nodes' models."""


def _adopt(nodes: Sequence[NodeTimeline], span: Time, models: Sequence[NodeModel]) -> None:
    """A worker's start: keep what it inherited from the forking process."""
    global _adopted
    _adopted = (nodes, span, models)


def _challenge_for(args: tuple[int, NodeBounds, int]) -> _Challenge:
    index, bounds, iterations = args
    assert _adopted is not None  # set by the pool's initializer
    nodes, span, models = _adopted
    return _challenge(nodes[index], span, models[index], bounds, iterations)
