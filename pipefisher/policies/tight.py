"""The ``tight`` policy: dependency-correct K-FAC packing, close to the lower bound, fast at scale.

Each node is packed on its own model (:mod:`pipefisher.schedule.problem`): its bubbles, the same in every
iteration, and its work items (covariance queues of m pieces per interval, syncs, inverses).
Dependencies, from the format spec: in the first iteration, covariance piece q may only follow
forward (A) / backward (B) ``q mod m`` of its pipe; a sync follows all pieces of its factor; an
inverse follows the factor's first sync (all its pieces where the node has no sync for it).

The packer walks the bubbles in time order, iteration after iteration, and fills each one with the
largest ready item that still fits (``d * 1.05 < room``, the published rule), ties broken towards
covariance work that unlocks the most sync and inverse time. A queue places as many consecutive pieces
as fit and are ready. Items longer (with the margin) than the node's largest bubble fit nowhere: they
go, dependency-correct, to the end of an iteration (after its last pipeline item), which they lengthen;
that is the only overflow. A queue's pieces split from one interval count as one size when choosing
(:func:`size_class`), so the split's one-unit remainder never makes a factor finish late. Candidate
lookup is one bisect plus one big-integer bit scan over the node's distinct (queue, piece size class)
and plain items, so a node costs O(pieces + items x log items).

When the walk needs more iterations than the node's lower bound (see :mod:`bounds`), it is repeated
preferring covariance pieces, and then a construction for a fixed cycle length k (from the bound up)
tries to do better: inverses and syncs are placed first, as late as possible, largest first, then
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
from pipefisher.rules.groups import job_groups
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


def pack_greedy(model: NodeModel, cov_first: bool = False, max_iterations: int = 1 << 20,
                shorter_than: int | None = None) -> Packed | None:
    """Walk the bubbles in time order, filling each with the largest ready item that fits.

    ``cov_first``: prefer covariance pieces (the start of every chain) over syncs and inverses, and
    take the largest of those that fit; this wins where inverses wait too long for their factors.
    With ``shorter_than``, None as soon as the cycle is sure to have that many iterations or more
    (:func:`sure_to_reach`).
    """
    work = model.work
    bubbles = model.bubbles
    nb = len(bubbles)
    largest = model.largest
    scale = model.scale
    ents = _Entities(model)
    need = ents.need
    ent_work = ents.work
    rank_by_size = ents.rank_by_size
    plain_rank = ents.plain_rank
    pos = [b.pos for b in bubbles]
    # Iteration 0: the first bubble at which a piece that follows pipeline item r is ready (nb: none).
    relb = [bisect_right(pos, r) for r in range(len(model.pipeline))]
    cov_bits = 0
    for r, wi in enumerate(ent_work):
        if work[wi].kind == COV:
            cov_bits |= 1 << r

    head = [0] * len(work)
    cov_left = list(model.factors.pieces)
    syncs_of, invs_of = model.factors.syncs, model.factors.invs
    sync_seen = [False] * model.groups
    next_piece = {a: b for invs in invs_of for a, b in zip(invs, invs[1:])}  # a refresh's pieces, in order
    done_at: list[tuple[int, int] | None] = [None] * model.groups  # where each factor completed
    inv_next = [0] * model.groups  # per factor, its next refresh piece (index into its inverses)
    overlapped = False
    remaining = sum(len(w.pieces) for w in work)
    if shorter_than is not None:
        bubble_time = sum(b.length for b in bubbles)
        fit_left = fittable_work(model)  # what is left of it: only bubbles take it
    # Overlapping: only refresh pieces may go back into the room of the iterations already walked, so
    # the rest (covariance and syncs, ``fit_left - inv_left``) still needs iterations of its own.
    inv_left = sum(w.pieces[0] for w in work if w.kind == INV and w.pieces[0] * scale < largest)

    mask = 0
    pending: list[list[int]] = [[] for _ in range(nb + 1)]
    forced: list[int] = []
    iteration = 0
    cur_bubble = 0

    def ready_plain(wi: int) -> None:
        nonlocal mask
        if work[wi].pieces[0] * scale < largest:
            mask |= 1 << plain_rank[wi]
        else:
            forced.append(wi)

    def group_cov_done(g: int) -> None:
        if model.synced[g]:
            for wi in syncs_of[g]:
                ready_plain(wi)
        elif invs_of[g]:
            completed(g)

    def completed(g: int) -> None:
        """The factor's refresh may begin: its first piece is ready (each next one once it is placed)."""
        done_at[g] = (iteration, cur_bubble)
        ready_plain(invs_of[g][0])

    def classify(wi: int) -> None:
        """Put queue ``wi``'s new head where it belongs: ready, waiting for its forward/backward, or forced."""
        nonlocal mask
        h = head[wi]
        pieces = work[wi].pieces
        if h >= len(pieces):
            return
        if not pieces[h] * scale < largest:
            forced.append(wi)
            return
        if iteration == 0:
            rb = relb[work[wi].release[h]]
            if rb > cur_bubble:
                pending[rb].append(wi)
                return
        mask |= 1 << rank_by_size[wi][pieces[h]]

    def placed(wi: int) -> None:
        """Bookkeeping after an item (plain) or a queue's last piece was placed."""
        nonlocal inv_left
        w = work[wi]
        g = w.group
        if w.kind == SYNC and not sync_seen[g]:
            sync_seen[g] = True
            if invs_of[g]:
                completed(g)
        elif w.kind == INV:
            inv_next[g] += 1
            if w.pieces[0] * scale < largest:
                inv_left -= w.pieces[0]
            if wi in next_piece:
                ready_plain(next_piece[wi])

    start_walk(model, group_cov_done, classify)

    in_bubbles: list[list[tuple[int, str, Time, Time]]] = []
    overflow: list[list[tuple[str, Time]]] = []
    while remaining > 0:
        if iteration >= max_iterations:
            raise RuntimeError("packing made no progress")  # pragma: no cover - the walk always progresses
        here: list[tuple[int, str, Time, Time]] = []
        spill: list[tuple[str, Time]] = []
        for b in range(nb):
            cur_bubble = b
            if iteration == 0 and pending[b]:
                for wi in pending[b]:
                    classify(wi)
                pending[b] = []
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
                wi = ent_work[r]
                w = work[wi]
                mask &= ~(1 << r)
                if w.kind != COV:
                    d = w.pieces[0]
                    here.append((b, w.label, t, t + d))
                    t += d
                    remaining -= 1
                    placed(wi)
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
                cov_left[g] -= done
                if h >= n:
                    if cov_left[g] == 0:
                        group_cov_done(g)
                    continue
                d = pieces[h]  # where the new head goes (classify, inlined: this is the hot path)
                if not d * scale < largest:
                    forced.append(wi)
                elif iteration == 0 and relb[release[h]] > b:
                    pending[relb[release[h]]].append(wi)
                else:
                    mask |= 1 << rank_by_size[wi][d]
        # The end of the iteration: everything else of iteration 0 is ready now; then the forced work.
        cur_bubble = nb
        if iteration == 0:
            for wi in pending[nb]:
                classify(wi)
            pending[nb] = []
        while forced:
            wi = forced.pop(0)
            w = work[wi]
            if w.kind != COV:
                spill.append((w.label, w.pieces[0]))
                remaining -= 1
                placed(wi)
                continue
            h = head[wi]
            pieces = w.pieces
            while h < len(pieces) and not pieces[h] * scale < largest:
                spill.append((w.label, pieces[h]))
                h += 1
            done = h - head[wi]
            head[wi] = h
            remaining -= done
            cov_left[w.group] -= done
            if h >= len(pieces):
                if cov_left[w.group] == 0:
                    group_cov_done(w.group)
            else:
                saved, iteration = iteration, max(iteration, 1)  # after the end: every release is met
                classify(wi)
                iteration = saved
        in_bubbles.append(here)
        overflow.append(spill)
        iteration += 1
        if model.overlap and remaining and not forced:
            left = [(g, invs_of[g][inv_next[g]:]) for g in range(model.groups)
                    if done_at[g] is not None and inv_next[g] < len(invs_of[g])]
            if sum(len(rest) for _, rest in left) == remaining:
                if _overlap_into_earlier(model, in_bubbles, left, done_at):
                    overlapped = True
                    break
        if shorter_than is not None and remaining:
            fit_left -= placed_time(here)
            if sure_to_reach(iteration, fit_left - inv_left if model.overlap else fit_left, bubble_time, shorter_than):
                return None
    if not in_bubbles:
        in_bubbles, overflow = [[]], [[]]
    return Packed(len(in_bubbles), in_bubbles, overflow, overlapped)


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
    if setup is None:
        setup = _fixed_setup(model)
    work = model.work
    bubbles = model.bubbles
    nb = len(bubbles)
    per = nb + 1  # slots per iteration: its bubbles, then its overflow slot
    nslots = k * per
    gap = setup.gap
    largest = model.largest
    scale, margin = model.scale, model.margin
    used: list[Time] = [0] * nslots
    maxd: list[Time] = [0] * nslots
    # (work index, piece) per slot; None for none yet (most slots of a trial that gives up stay so)
    content: list[list[tuple[int, int]] | None] = [None] * nslots

    syncs_of, invs_of = model.factors.syncs, model.factors.invs

    # -- 1. syncs and inverses, as late as possible --------------------------------------------------
    plain, order, rank, need = setup.plain, setup.order, setup.rank, setup.need
    fit_mask = 0  # ready fittable items, by rank
    forced_ready: list[int] = []
    slot_of: dict[int, int] = {}
    invs_left = [len(invs_of[g]) if model.synced[g] else 0 for g in range(model.groups)]

    def ready(wi: int) -> None:
        nonlocal fit_mask
        if work[wi].pieces[0] * scale < largest:
            fit_mask |= 1 << rank[wi]
        else:
            forced_ready.append(wi)

    # backwards: a refresh's last piece first, each earlier one once the one after it is placed
    before_piece = {b: a for invs in invs_of for a, b in zip(invs, invs[1:])}
    for wi in plain:
        w = work[wi]
        if (w.kind == INV and wi == invs_of[w.group][-1]) or (w.kind == SYNC and invs_left[w.group] == 0):
            ready(wi)
    allowed = setup.allowed

    def largest_fitting(candidates: int, slot: int, g_len: Time) -> int:
        """The rank of the largest candidate that still fits the slot (with the margin), or -1."""
        p = bisect_left(need, g_len - used[slot])
        while True:
            cand = candidates & ((1 << p) - 1)
            if not cand:
                return -1
            r = cand.bit_length() - 1
            d = work[order[r]].pieces[0]
            top = d if d > maxd[slot] else maxd[slot]
            if used[slot] + d + margin * top < g_len:
                return r
            p = r

    placed_plain = 0
    first_busy = nslots  # the first slot with a sync or inverse

    def put(wi: int, slot: int) -> list[int]:
        """Lay sync or inverse ``wi`` into ``slot``; returns the syncs this makes ready (its last inverse)."""
        nonlocal placed_plain, first_busy
        if slot < first_busy:
            first_busy = slot
        d = work[wi].pieces[0]
        used[slot] += d
        if d > maxd[slot]:
            maxd[slot] = d
        here = content[slot]
        if here is None:
            here = content[slot] = []
        here.append((wi, 0))
        slot_of[wi] = slot
        placed_plain += 1
        w = work[wi]
        if wi in before_piece:
            ready(before_piece[wi])
        if w.kind == INV and model.synced[w.group]:
            invs_left[w.group] -= 1
            if invs_left[w.group] == 0:
                return list(syncs_of[w.group])
        return []

    for slot in range(nslots - 1, -1, -1):
        if not fit_mask and not forced_ready:
            break  # nothing is ready, so nothing more can be: the slots before stay as they are
        b = slot % per
        if b == nb:  # overflow slot: every ready forced item, and whatever they make ready
            while forced_ready:
                for s in put(forced_ready.pop(), slot):
                    ready(s)
            continue
        g_len = gap[b]
        released: list[int] = []
        allow = allowed[b] if slot < nb else -1
        while fit_mask:
            r = largest_fitting(fit_mask & allow, slot, g_len)
            if r < 0:
                break
            fit_mask &= ~(1 << r)
            released.extend(put(order[r], slot))
        for s in released:  # a sync may share its inverse's bubble (it is laid out first)
            ready(s)
        if released and b < nb:
            # let them into this same bubble: run the bubble again
            while fit_mask:
                r = largest_fitting(fit_mask & allow, slot, g_len)
                if r < 0 or work[order[r]].kind != SYNC:
                    break
                fit_mask &= ~(1 << r)
                put(order[r], slot)
    if placed_plain < len(plain):
        return None, prefix

    # -- 2. covariance pieces, as early as possible, earliest deadline first -------------------------
    INF = nslots + 1
    deadline = [INF] * model.groups
    for g in range(model.groups):
        after = syncs_of[g] if model.synced[g] else invs_of[g]
        if after:
            deadline[g] = min(slot_of[wi] for wi in after)
    pos = setup.pos
    # per slot: the largest sync/inverse of each factor in it, and the largest of those that must come
    # after the slot's pieces (their factor has pieces there): the item that ends the bubble
    nothing: dict[int, Time] = {}  # shared by the slots without syncs or inverses (never written)
    big_of: list[dict[int, Time]] = [nothing] * nslots
    busy = sorted(set(slot_of.values()))  # the slots step 1 put syncs or inverses into (the others are empty)
    for slot in busy:
        big = big_of[slot] = {}
        for wi, _ in content[slot] or ():
            g, d = work[wi].group, work[wi].pieces[0]
            if d > big.get(g, 0):
                big[g] = d
    tail = [0] * nslots
    queues = [wi for wi, w in enumerate(work) if w.kind == COV]
    # per work index, what the walk reads of it (attribute lookups are most of its cost otherwise)
    group_of, pieces_of, release_of = setup.group_of, setup.pieces_of, setup.release_of
    queues.sort(key=lambda wi: (deadline[group_of[wi]], wi))
    smallest, left = setup.smallest, setup.fit  # left: what of the pieces fits some bubble
    smallest_need = smallest * scale
    # Give up as soon as the pieces left that fit a bubble are more than the room left in the bubbles
    # to come (a bubble that takes pieces ends with at least the margin of the smallest one free): the
    # construction would fail anyway, only later. The tolerance keeps float rounding on the safe side.
    free = [g - margin * smallest for g in gap]
    frees = ([f if f > 0 else 0 for f in free] + [0]) * k  # per slot (an overflow slot has none)
    for slot in busy:
        b = slot % per
        if used[slot] and b < nb:
            f = gap[b] - used[slot] - margin * smallest
            frees[slot] = f if f > 0 else 0
    room_from = list(accumulate(reversed(frees), initial=0.0))  # that room in slots s, s + 1, ...
    room_from.reverse()
    tolerance = 1e-9 * (k * sum(gap) + left)
    start = 0
    if prefix is not None and prefix.slot <= first_busy and prefix.order == queues:
        if any(was > room_from[s] + tolerance for s, was in enumerate(prefix.left_at)):
            return None, prefix
        start, left = prefix.slot, prefix.left
        head, active, left_at = dict(prefix.head), list(prefix.active), list(prefix.left_at)
        content[:start] = prefix.content
    else:
        head = {wi: 0 for wi in queues}
        active = list(queues)  # queues with pieces left, by deadline
        left_at = []
    shared: _Prefix | None = None  # the walk up to the first slot with a sync or inverse

    def walked(upto: int) -> _Prefix:
        return _Prefix(queues, upto, dict(head), list(active), left, list(left_at), content[:upto])

    for slot in range(start, nslots):
        if slot == first_busy:
            shared = walked(slot)
        if not active:
            break
        i, b = divmod(slot, per)
        still = []
        if left > room_from[slot] + tolerance:
            return None, shared or walked(slot)
        left_at.append(left)
        if b == nb:
            for wi in active:
                w = work[wi]
                h = head[wi]
                pieces = w.pieces
                while h < len(pieces) and not pieces[h] * scale < largest:
                    here = content[slot]
                    if here is None:
                        here = content[slot] = []
                    here.append((wi, h))
                    h += 1
                head[wi] = h
                if h < len(pieces):
                    if deadline[w.group] <= slot:
                        return None, shared
                    still.append(wi)
            active = still
            continue
        g_len = gap[b]
        u = used[slot]  # the slot's used room and tail, kept here while its queues are visited
        if not u + smallest_need < g_len:  # full (or too small) already: all wait
            if deadline[group_of[active[0]]] <= slot:
                return None, shared
            continue
        lim = pos[b]
        after_slot = tail[slot]
        big = big_of[slot]
        for q, wi in enumerate(active):
            if not u + smallest_need < g_len:  # full: the rest only wait (by deadline)
                if deadline[group_of[wi]] <= slot:
                    return None, shared
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
                    return None, shared
                still.append(wi)
        active = still
    if active:
        return None, shared

    # -- layout ---------------------------------------------------------------------------------------
    in_bubbles: list[list[tuple[int, str, Time, Time]]] = [[] for _ in range(k)]
    overflow: list[list[tuple[str, Time]]] = [[] for _ in range(k)]
    for slot in range(nslots):
        items = content[slot]
        if not items:
            continue
        i, b = divmod(slot, per)
        with_pieces = {work[wi].group for wi, _ in items if work[wi].kind == COV}
        # syncs/inverses of factors without pieces here, then the pieces, then the other syncs/inverses
        # (stable: pieces keep their order, a sync stays before its inverse)
        # (a refresh's pieces in order: step 1 put them there last first)
        def place_rank(x: tuple[int, int]) -> tuple[int, int, int]:
            w = work[x[0]]
            if w.kind == COV:
                return (1, 0, 0)
            return (2 if w.group in with_pieces else 0, w.kind, x[0])

        items = sorted(items, key=place_rank)  # not in place: a prefix's slots are shared
        if b == nb:
            overflow[i].extend((work[wi].label, work[wi].pieces[h]) for wi, h in items)
            continue
        t = bubbles[b].start
        out = in_bubbles[i]
        for wi, h in items:
            d = work[wi].pieces[h]
            out.append((b, work[wi].label, t, t + d))
            t += d
    return Packed(k, in_bubbles, overflow), shared


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
    meets the bound on most nodes), the walk preferring covariance pieces, plain best-fit (ties in key
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


def _first_walk(model: NodeModel) -> tuple[NodeBounds, Packed]:
    """The node's bounds and the portfolio's first candidate, the greedy walk (the first-iteration
    bound is only worked out where the walk misses the others)."""
    bounds = model_bounds(model, first_iteration=False)
    first = pack_greedy(model)
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
        ("greedy, covariance first", lambda: pack_greedy(model, cov_first=True, shorter_than=cap())),
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
            nodes = align_groups(job, pack_nodes(job, margin, each=each, overlap=self.overlap), job_groups(job), margin)
            overlaps = any(n.figures.extra.get("overlap") for n in nodes)
            return JobSchedule(self.name, job.span, nodes, margin, overlap=overlaps)


PARALLEL_PIECES = 50_000
"""Jobs with at least this many work pieces run the portfolio past its first walk in worker processes,
on the nodes where that walk misses the bound (some 50 ms to start them, against seconds of packing)."""


def pack_nodes(job: Job, margin: float = DEFAULT_MARGIN, workers: int | None = None,
               each: Callable[[int, NodeSchedule], None] | None = None, overlap: bool = False) -> tuple[NodeSchedule, ...]:
    """Every node's :func:`pack_node`, in node order.

    In a big job, the nodes whose first walk misses the bound run the rest of the portfolio in forked
    worker processes, one per CPU this process may use (``workers`` overrides that; 1: none), while
    this one walks the next nodes; the workers start only once a node needs them. Each node's result
    is a pure function of the node, so it is the same either way, and small to send back: no more
    than a shorter candidate where one is found. ``each(i, schedule)``, where given, is called with
    each node's schedule as soon as it is made, in node order (while workers still pack later nodes:
    a caller that evaluates the nodes does so then, not after).
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
            bounds, first = _first_walk(model)
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
