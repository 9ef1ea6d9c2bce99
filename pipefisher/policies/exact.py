"""The ``exact`` policy: ``tight``'s cycle, shortened (or proven optimal) by a CP-SAT search.

Optional: it needs OR-Tools (``pip install 'pipefisher[exact]'``), imported only when the policy is
made, so importing this module never needs it.

Per node it starts from ``tight``'s schedule and lower bound (:func:`pipefisher.policies.tight.pack_node`).
Where they meet, the node is done. Elsewhere it asks CP-SAT (one worker, deterministic search, a time
limit) whether the node's work fits a cycle of k iterations, for k = tight - 1, tight - 2, ... down to
the bound. Descending, because feasibility is monotone in k (an empty iteration can always be
appended) and the gap is almost always one or two: each step down is a feasibility question whose
answer is usually found fast, an improvement is secured early within the time limit, and only the
last k, the one that fails, needs an infeasibility proof (ascending would need one per k below the
optimum before finding any shorter cycle).

The model has one slot per (iteration, bubble) plus an overflow slot per iteration (after its last
pipeline item). A covariance queue is a cumulative count of its pieces per slot (pieces go in order;
the time they take in a slot is the difference of its prefix sums, an element constraint); in the
cycle's first iteration the count up to a bubble is capped by the pieces whose forward/backward runs
before it. Syncs and inverses are one boolean per allowed slot. A sync needs its factor's pieces all
done by the end of its slot (laid after them there); an inverse needs the factor's first sync in its
slot or before (or all its pieces, where the node has no sync for the factor). Work that fits no
bubble goes to overflow slots only, every other item to bubbles only.

Room: the solution model uses the SUFFICIENT condition ``sum + margin * max < bubble``, in integers
rounded against itself (durations up, bubbles down, the largest piece of a queue for its margin), so
any solution is valid in any dependency-respecting order. Infeasibility proofs use a relaxation,
rounded the other way: ``sum + margin * (smallest item of the node) < bubble``, which every schedule
``validate`` accepts satisfies (its last item needs its margin). A relaxed solution is also tried as
a schedule: where it happens to pass ``validate`` it counts too. Every schedule this policy returns is
re-checked with :func:`pipefisher.rules.validate_node`.
"""
from __future__ import annotations

import importlib
import math
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from pipefisher.errors import InputError, install_hint
from pipefisher.policies.align import align_groups
from pipefisher.policies.bounds import model_bounds
from pipefisher.policies.cycle import Packed, node_schedule
from pipefisher.rules.groups import job_groups
from pipefisher.schedule.packed import JobSchedule, NodeSchedule, Policy, gc_paused
from pipefisher.schedule.problem import COV, DEFAULT_MARGIN, INV, SYNC, NodeModel, fits, node_model
from pipefisher.schedule.timeline import Job, NodeTimeline, Time

MISSING_ORTOOLS = "the 'exact' policy needs OR-Tools: " + install_hint("exact")
FLOAT_SCALE = 1e9  # float timelines are in seconds (or so): count them in nanoseconds
MARGIN_SCALE = 10 ** 6  # the margin as a fraction over this denominator (smaller for huge numbers)
BUILD_SECONDS_PER_CELL = 3e-5  # building the model, per (slot, work item): measured, with room to spare
_INT_LIMIT = 1 << 60  # keep every linear term of the model well inside int64


def cp_model_module() -> Any:
    """OR-Tools' CP-SAT module, or the one-line input error that says how to install it."""
    try:
        return importlib.import_module("ortools.sat.python.cp_model")
    except ImportError:
        raise InputError(None, MISSING_ORTOOLS) from None


class _Unsupported(Exception):
    """A node this model does not cover (the search is skipped; ``tight``'s schedule stays)."""


# ----------------------------------------------------------------------------------------------------
# Integers for the solver


@dataclass(frozen=True)
class _Numbers:
    """The node's durations and bubble lengths as integers, rounded for one use (solution or proof)."""

    pieces: tuple[tuple[int, ...], ...]  # per work item, per piece
    gaps: tuple[int, ...]  # per bubble
    q: int  # the margin's denominator
    mq: int  # the margin's numerator: margin ~ mq / q (rounded up for solutions, down for proofs)


def _numbers(model: NodeModel, proof: bool) -> _Numbers:
    """Integers for the solver: exact for integer timelines; for float ones in nanoseconds, rounded
    against the solution (durations up, bubbles down) or, for ``proof``, in its favour."""
    lengths = [b.length for b in model.bubbles]
    integral = all(isinstance(x, int) for x in lengths) and \
        all(isinstance(d, int) for w in model.work for d in w.pieces)
    if integral:
        pieces = tuple(tuple(max(0, d) for d in w.pieces) for w in model.work)
        gaps = tuple(lengths)
    else:
        def dur(d: Time) -> int:
            x = float(d) * FLOAT_SCALE
            return max(0, math.floor(x) - 1) if proof else max(0, math.ceil(x) + 1)

        def gap(g: Time) -> int:
            x = float(g) * FLOAT_SCALE
            return math.ceil(x) + 1 if proof else max(0, math.floor(x) - 1)

        pieces = tuple(tuple(dur(d) for d in w.pieces) for w in model.work)
        gaps = tuple(gap(g) for g in lengths)
    big = max([sum(p) for p in pieces] + list(gaps) + [1])
    big = max(big, sum(p[0] for p, w in zip(pieces, model.work) if w.kind != COV))
    q = MARGIN_SCALE
    while q > 1 and q * big * 8 > _INT_LIMIT:
        q //= 10
    if big * 8 > _INT_LIMIT:
        raise _Unsupported("durations too large for the solver")
    exact_margin = Fraction(model.margin) * q
    mq = math.floor(exact_margin) if proof else math.ceil(exact_margin)
    return _Numbers(pieces, gaps, q, mq)


# ----------------------------------------------------------------------------------------------------
# The model of one cycle length


@dataclass
class _Model:
    cp: Any  # the CpModel
    k: int
    queues: dict[int, list[Any]]  # work index -> cumulative piece count per slot (vars or ints)
    plain: dict[int, dict[int, Any]]  # work index -> slot -> boolean
    last: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)  # slot -> (work index, "it is last")
    trivially_infeasible: bool = False


class _Builder:
    """The feasibility model of a ``k``-iteration cycle (see the module's docstring), built in named
    steps (:func:`_build`): each work item's variables in work order (:meth:`plain_item`,
    :meth:`queue`), then the dependencies between them (:meth:`dependencies`), then each bubble's room
    (:meth:`room`). The order is the model's: CP-SAT's deterministic search follows it."""

    def __init__(self, cp_model: Any, model: NodeModel, k: int, nums: _Numbers, proof: bool) -> None:
        self.m = m = cp_model.CpModel()
        self.model, self.nums, self.proof = model, nums, proof
        self.work = model.work
        self.nb = len(model.bubbles)
        self.per = self.nb + 1
        self.nslots = k * self.per
        self.out = _Model(m, k, {}, {})
        self.terms: list[list[Any]] = [[] for _ in range(self.nslots)]  # the slot's work (scaled durations)
        # per slot, what may be there: (work index, literal "it is there", largest and smallest size)
        self.present: list[list[tuple[int, Any, int, int]]] = [[] for _ in range(self.nslots)]
        self.queues_of: list[list[int]] = [[] for _ in range(model.groups)]
        self.syncs_of: list[list[int]] = [[] for _ in range(model.groups)]
        self.next_piece = {a: b for invs in model.factors.invs for a, b in zip(invs, invs[1:])}
        self.pos = [b.pos for b in model.bubbles]

    def fits_alone(self, d: int, b: int) -> bool:
        return self.nums.q * d + self.nums.mq * d <= self.nums.q * self.nums.gaps[b] - 1

    def room_slot(self, s: int) -> int:
        """Whose room fittable work in slot ``s`` uses: its bubble's, or none (an overflow slot)."""
        return s if s % self.per < self.nb else -1

    def may_hold(self, d: int, s: int) -> bool:
        """Whether fittable work of (smallest) size ``d`` may go to slot ``s``: bubbles only."""
        b = s % self.per
        return b < self.nb and self.fits_alone(d, b)

    def forced(self, wi: int) -> list[bool]:
        """Per piece of item ``wi``: whether it fits no bubble (overflow slots only)."""
        return [not fits(d, self.model.largest, self.model.margin) for d in self.work[wi].pieces]

    def plain_item(self, wi: int) -> bool:
        """A sync or inverse: one boolean per slot it may go to, exactly one true; False where it may go nowhere."""
        m, w = self.m, self.work[wi]
        if w.kind == SYNC:
            self.syncs_of[w.group].append(wi)
        d = self.nums.pieces[wi][0]
        forced = self.forced(wi)[0]
        lits: dict[int, Any] = {}
        for s in range(self.nslots):
            if (s % self.per == self.nb) if forced else self.may_hold(d, s):
                lit = m.new_bool_var(f"y{wi}_{s}")
                lits[s] = lit
                r = -1 if forced else self.room_slot(s)
                if r >= 0:
                    self.terms[r].append(d * lit)
                    self.present[r].append((wi, lit, d, d))
        if not lits:
            return False
        m.add_exactly_one(list(lits.values()))
        self.out.plain[wi] = lits
        return True

    def queue(self, wi: int) -> bool:
        """A covariance queue: its cumulative piece count per slot (in the cycle's first iteration capped
        by the pieces whose forward/backward runs before the bubble; all done by the cycle's end); False
        where no count can meet its slot's limits."""
        m, w, nb, per, nslots = self.m, self.work[wi], self.nb, self.per, self.nslots
        sizes = self.nums.pieces[wi]
        forced = self.forced(wi)
        if any(forced) and not all(forced):
            raise _Unsupported("a covariance queue with pieces both inside and beyond the bubbles")
        self.queues_of[w.group].append(wi)
        n = len(sizes)
        in_overflow = forced[0]
        prefix = [0]
        for d in sizes:
            prefix.append(prefix[-1] + d)
        uniform = all(d == sizes[0] for d in sizes)
        top = max(sizes)
        smallest = min(sizes)
        # iteration 0: pieces (in order) whose forward/backward runs before bubble b
        limit = [next((j for j, r in enumerate(w.release) if r >= self.pos[b]), n) for b in range(nb)]
        counts: list[Any] = []
        prev_c: Any = 0
        prev_s: Any = 0
        for s in range(nslots):
            i, b = divmod(s, per)
            can = b == nb if in_overflow else self.may_hold(smallest, s)
            r = -1 if in_overflow else self.room_slot(s)
            ub = limit[b] if (i == 0 and b < nb) else n
            lo = n if s == nslots - 1 else 0  # all pieces done by the end of the cycle
            if not can:  # nothing of this queue here: its count stays, within this slot's limits
                if isinstance(prev_c, int):
                    if not lo <= prev_c <= ub:
                        return False
                else:
                    if lo > 0:
                        m.add(prev_c >= lo)
                    if ub < n:
                        m.add(prev_c <= ub)
                counts.append(prev_c)
                continue
            if ub < lo:
                return False
            c = m.new_int_var(lo, ub, f"c{wi}_{s}")
            m.add(c >= prev_c)
            if uniform:
                s_expr: Any = sizes[0] * c
            else:
                s_expr = m.new_int_var(0, prefix[-1], f"s{wi}_{s}")
                m.add_element(c, prefix, s_expr)
            if r >= 0:
                self.terms[r].append(s_expr - prev_s)
                z = m.new_bool_var(f"z{wi}_{s}")  # some of its pieces are here
                m.add(c - prev_c <= n * z)
                m.add(c - prev_c >= 1).only_enforce_if(z)
                self.present[r].append((wi, z, top, smallest))
            counts.append(c)
            prev_c, prev_s = c, s_expr
        self.out.queues[wi] = counts
        return True

    def after_pieces(self, wi: int) -> None:
        """Item ``wi`` (a sync, or an inverse of a factor without sync) after all its factor's pieces."""
        m, out = self.m, self.out
        for qi in self.queues_of[self.work[wi].group]:
            n = len(self.work[qi].pieces)
            counts = out.queues[qi]
            for s, lit in out.plain[wi].items():
                c = counts[s]
                if isinstance(c, int):
                    if c < n:
                        m.add(lit == 0)
                else:
                    m.add(c >= n).only_enforce_if(lit)

    def position(self, wi: int) -> Any:
        return sum(s * lit for s, lit in self.out.plain[wi].items())

    def dependencies(self) -> None:
        """A sync (and an inverse of a factor without sync) after all its factor's pieces; an inverse in
        its factor's first sync's slot or after; a refresh's pieces in order."""
        m, model = self.m, self.model
        first_sync: dict[int, Any] = {}
        for wi, w in enumerate(self.work):
            if w.kind == COV:
                continue
            if w.kind == SYNC or not model.synced[w.group]:
                self.after_pieces(wi)
                continue
            g = w.group
            if g not in first_sync:
                f = m.new_int_var(0, self.nslots - 1, f"first_sync{g}")
                m.add_min_equality(f, [self.position(si) for si in self.syncs_of[g]])
                first_sync[g] = f
            m.add(self.position(wi) >= first_sync[g])
        for wi, nxt in self.next_piece.items():  # a refresh's pieces in order (the layout orders a slot's by index)
            m.add(self.position(nxt) >= self.position(wi))

    def room(self, s: int) -> None:
        """The room rule of slot ``s``'s bubble.

        The work of a bubble runs back to back; what decides whether it fits is mostly its last
        item, which needs its margin before the bubble's end: ``total + margin * last < bubble``. Each
        bubble picks its last item among those there that nothing else there must follow (the model's
        dependencies within one slot: a queue's sync, or inverse where unsynced, after its pieces; an
        inverse after its sync). Proofs need only that (with the last item's smallest size). Solutions
        need the others to fit before it too: ``total - last + margin * largest < bubble`` suffices (each
        earlier item ends by ``total - last``), with the last item's largest size in the first condition
        and its smallest in this one; the layout then puts the chosen item last."""
        m, q, mq = self.m, self.nums.q, self.nums.mq
        b = s % self.per
        here = self.present[s]
        if b == self.nb or not here:
            return  # (``present`` holds work of bubbles only: see ``room_slot``)
        total = sum(self.terms[s])
        room = q * self.nums.gaps[b] - 1
        lasts = self.last_items(s)
        busy = m.new_bool_var(f"busy{s}")  # one last item where there is any work
        m.add(sum(last for _, last, _, _ in lasts) == busy)
        for _, lit, _, _ in here:
            m.add_implication(lit, busy)
        self.out.last[s] = [(wi, last) for wi, last, _, _ in lasts]
        if self.proof:
            m.add(q * total + mq * sum(lo * last for _, last, _, lo in lasts) <= room)
            return
        m.add(q * total + mq * sum(hi * last for _, last, hi, _ in lasts) <= room)
        if len(here) == 1:
            return  # the one item there is the last
        big = m.new_int_var(0, max(hi for _, _, hi, _ in here), f"max{s}")
        for _, lit, hi, _ in here:
            m.add(big >= hi).only_enforce_if(lit)
        m.add(q * total - q * sum(lo * last for _, last, _, lo in lasts) + mq * big <= room)

    def last_items(self, s: int) -> list[tuple[int, Any, int, int]]:
        """Per item that may be in slot ``s``: (work index, literal "it is the bubble's last", largest and
        smallest size); an item cannot be last where something there must follow it."""
        m, work, here = self.m, self.work, self.present[s]
        lits_of: dict[tuple[int, int], list[Any]] = {}  # (group, kind) -> literals here
        for wi, lit, _, _ in here:
            lits_of.setdefault((work[wi].group, work[wi].kind), []).append(lit)
        lasts = []
        for wi, lit, hi, lo in here:
            w = work[wi]
            if w.kind == COV:
                blockers = lits_of.get((w.group, SYNC), []) if self.model.synced[w.group] else \
                    lits_of.get((w.group, SYNC), []) + lits_of.get((w.group, INV), [])
            elif w.kind == SYNC and (not self.proof or len(self.syncs_of[w.group]) == 1):
                # an inverse here follows this sync (for proofs: only certain where it is the only one)
                blockers = lits_of.get((w.group, INV), [])
            elif w.kind == INV and wi in self.next_piece:  # the refresh's next piece, if here, follows it
                blockers = [other for v, other, _, _ in here if v == self.next_piece[wi]]
            else:
                blockers = []
            last = m.new_bool_var(f"last{wi}_{s}")
            m.add_implication(last, lit)
            for other in blockers:
                if other is not lit:
                    m.add_bool_or([last.Not(), other.Not()])
            lasts.append((wi, last, hi, lo))
        return lasts


def _build(cp_model: Any, model: NodeModel, k: int, nums: _Numbers, proof: bool) -> _Model:
    """The feasibility model of a ``k``-iteration cycle (see the module's docstring): every item's
    variables, the dependencies, every bubble's room (:class:`_Builder`)."""
    built = _Builder(cp_model, model, k, nums, proof)
    for wi, w in enumerate(model.work):
        if not (built.queue(wi) if w.kind == COV else built.plain_item(wi)):
            built.out.trivially_infeasible = True  # some item has nowhere to go
            return built.out
    built.dependencies()
    for s in range(built.nslots):
        built.room(s)
    return built.out


def _packed(model: NodeModel, built: _Model, solver: Any) -> Packed:
    """The solution as a packed cycle, laid out as ``tight`` lays out its fixed-length cycles."""
    work = model.work
    bubbles = model.bubbles
    nb = len(bubbles)
    per = nb + 1
    k = built.k
    content: list[list[tuple[int, int]]] = [[] for _ in range(k * per)]
    for wi, counts in built.queues.items():
        prev = 0
        for s, c in enumerate(counts):
            v = c if isinstance(c, int) else int(solver.value(c))
            content[s].extend((wi, h) for h in range(prev, v))
            prev = v
    for wi, lits in built.plain.items():
        for s, lit in lits.items():
            if solver.value(lit):
                content[s].append((wi, 0))
    in_bubbles: list[list[tuple[int, str, Time, Time]]] = [[] for _ in range(k)]
    overflow: list[list[tuple[str, Time]]] = [[] for _ in range(k)]
    for s, items in enumerate(content):
        if not items:
            continue
        i, b = divmod(s, per)
        with_pieces = {work[wi].group for wi, _ in items if work[wi].kind == COV}
        chosen = next((wi for wi, lit in built.last.get(s, ()) if solver.value(lit)), -1)

        # syncs/inverses of factors without pieces here, then the pieces, then the other
        # syncs/inverses (stable: pieces keep their order; a sync comes before an inverse); the item
        # the model chose to end the bubble (a queue: its pieces here) goes last
        def place_rank(x: tuple[int, int]) -> tuple[int, int, int, int]:
            w = work[x[0]]
            if w.kind == COV:
                return (x[0] == chosen, 1, 0, 0)
            return (x[0] == chosen, 2 if w.group in with_pieces else 0, w.kind, x[0])

        items.sort(key=place_rank)
        if b == nb:
            overflow[i].extend((work[wi].label, work[wi].pieces[h]) for wi, h in items)
            continue
        t = bubbles[b].start
        for wi, h in items:
            d = work[wi].pieces[h]
            in_bubbles[i].append((b, work[wi].label, t, t + d))
            t += d
    return Packed(k, in_bubbles, overflow)


# ----------------------------------------------------------------------------------------------------
# One node


def _solve(cp_model: Any, model: NodeModel, k: int, proof: bool, seconds: float) -> tuple[str, Packed | None]:
    """``("infeasible" | "feasible" | "unknown", packed cycle or None)`` for cycle length ``k``."""
    deadline = time.perf_counter() + seconds
    if k * (len(model.bubbles) + 1) * len(model.work) * BUILD_SECONDS_PER_CELL > seconds / 2:
        return "unknown", None  # building the model alone would take most of the time
    nums = _numbers(model, proof)
    built = _build(cp_model, model, k, nums, proof)
    if built.trivially_infeasible:
        return "infeasible", None
    left = deadline - time.perf_counter()
    if left <= 0.01:
        return "unknown", None
    for level, share in ((0, 0.5), (1, 1.0)):
        # Two deterministic runs: pure clause learning first (linearization level 0: on these
        # packing models it found and refuted most cycles several times faster), then the default
        # with the LP relaxation (level 1) for the rest of the time, which wins on the others.
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        solver.parameters.linearization_level = level
        solver.parameters.max_time_in_seconds = max(left * share, 0.01)
        status = solver.solve(built.cp)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return "feasible", _packed(model, built, solver)
        if status == cp_model.INFEASIBLE:
            return "infeasible", None
        left = deadline - time.perf_counter()
        if left <= 0.01:
            break
    return "unknown", None


def search_node(cp_model: Any, node: NodeTimeline, span: Time, margin: float, start: NodeSchedule,
                seconds: float) -> NodeSchedule:
    """``start`` (``tight``'s schedule), or a shorter valid cycle found within ``seconds``; its figures
    carry the best proven bound and the search's outcome."""
    from pipefisher.rules import validate_node

    t0 = time.perf_counter()
    deadline = t0 + seconds
    model = node_model(node, span, margin)
    bounds = model_bounds(model)
    lower = max(bounds.tight, start.figures.lower_bound or 1)
    tight_k = start.figures.iterations
    best: NodeSchedule | None = None
    best_k = tight_k
    status = "bound met"

    def checked(packed: Packed | None) -> NodeSchedule | None:
        if packed is None:
            return None
        schedule = node_schedule(model, packed, bounds)
        if validate_node(0, node, schedule.iterations, span, margin):
            return None
        return schedule

    if lower < tight_k:
        status = "not proven"
        try:
            k = tight_k - 1
            while k >= lower:
                left = deadline - time.perf_counter()
                if left <= 0:
                    status = "time limit"
                    break
                outcome, packed = _solve(cp_model, model, k, False, left / 2)  # the rest: a proof
                found = checked(packed)
                if found is None and packed is not None:
                    # A solution of the sufficient model that fails validate: a bug in the model; it
                    # must never happen. Keep what we have (tight's schedule or a checked one).
                    status = "model error"
                    break
                if found is None:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        status = "time limit"
                        break
                    outcome, packed = _solve(cp_model, model, k, True, left)
                    if outcome == "infeasible":
                        lower = k + 1
                        break
                    found = checked(packed)  # the relaxed cycle may still pass the exact rule
                    if found is None:
                        status = "time limit" if outcome == "unknown" else "not proven"
                        break
                best, best_k = found, k
                k -= 1
            # where a gap is left, try to raise the bound from below (ascending, relaxed model)
            if best_k > lower and status == "not proven":
                for j in range(lower, best_k - 1):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        status = "time limit"
                        break
                    outcome, _ = _solve(cp_model, model, j, True, left)
                    if outcome != "infeasible":
                        if outcome == "unknown":
                            status = "time limit"
                        break
                    lower = j + 1
        except _Unsupported as why:
            status = f"unsupported: {why}"
        if best_k == lower:
            status = "improved, proven optimal" if best is not None else "proven optimal"
        elif best is not None:
            status = "improved" if status == "not proven" else f"improved ({status})"
    schedule = best if best is not None else start
    elapsed = time.perf_counter() - t0
    f = schedule.figures
    extra = {**f.extra, "optimal": f.iterations <= lower, "gap": f.iterations - lower,
             "exact_seconds": round(elapsed, 4), "exact_status": status, "tight_iterations": tight_k}
    return replace(schedule, figures=replace(f, lower_bound=lower, extra=extra))


def _bound_met(schedule: NodeSchedule) -> NodeSchedule:
    """``tight``'s schedule where it meets its bound (no search), with the figures of a searched one."""
    f = schedule.figures
    lower = f.lower_bound or 1
    extra = {**f.extra, "optimal": f.iterations <= lower, "gap": f.iterations - lower, "exact_seconds": 0.0,
             "exact_status": "bound met", "tight_iterations": f.iterations}
    return replace(schedule, figures=replace(f, extra=extra))


def _needs_search(schedule: NodeSchedule) -> bool:
    f = schedule.figures
    return f.lower_bound is not None and f.iterations > f.lower_bound


class ExactPolicy(Policy):
    """``tight``'s cycles, shortened or proven optimal by CP-SAT within a time limit."""

    name = "exact"
    summary = "tight's packing, shortened or proven optimal by an OR-Tools CP-SAT search (needs pipefisher[exact])"
    options = ("time_limit",)

    def __init__(self, time_limit: float = 5.0) -> None:
        self.time_limit = float(time_limit)
        if not (self.time_limit >= 0 and math.isfinite(self.time_limit)):
            raise InputError(None, f"the 'exact' policy's time limit must be a number of seconds >= 0, "
                             f"not {time_limit!r}")
        self._cp = cp_model_module()

    def pack(self, job: Job, margin: float = DEFAULT_MARGIN) -> JobSchedule:
        from pipefisher.policies.tight import pack_node

        cp_model = self._cp
        t0 = time.perf_counter()
        with gc_paused():
            nodes = [pack_node(node, job.span, margin) for node in job.nodes]
        todo = [n for n, s in enumerate(nodes) if _needs_search(s)]
        for left_nodes, n in enumerate(todo):
            budget = (self.time_limit - (time.perf_counter() - t0)) / (len(todo) - left_nodes)
            nodes[n] = search_node(cp_model, job.nodes[n], job.span, margin, nodes[n], max(budget, 0.0))
        for n, s in enumerate(nodes):
            if n not in todo:
                nodes[n] = _bound_met(s)
        with gc_paused():
            aligned = list(align_groups(job, tuple(nodes), job_groups(job), margin))
        for n, s in enumerate(aligned):
            if s is not nodes[n]:  # aligned with its sync group: the cycle may have grown
                f = s.figures
                lower = f.lower_bound or 1
                extra = {**f.extra, "optimal": f.iterations <= lower, "gap": f.iterations - lower}
                aligned[n] = replace(s, figures=replace(f, extra=extra))
        return JobSchedule(self.name, job.span, tuple(aligned), margin)


def pack_node_exact(node: NodeTimeline, span: Time, margin: float = DEFAULT_MARGIN,
                    time_limit: float = 5.0) -> NodeSchedule:
    """One node's cycle as the ``exact`` policy packs it (no sync-group alignment)."""
    from pipefisher.policies.tight import pack_node

    cp_model = cp_model_module()
    start = pack_node(node, span, margin)
    if not _needs_search(start):
        return _bound_met(start)
    return search_node(cp_model, node, span, margin, start, time_limit)


__all__ = ["ExactPolicy", "MISSING_ORTOOLS", "cp_model_module", "pack_node_exact", "search_node"]
