"""The packing problem, stated once: what a node offers, what its K-FAC work needs, and the rules.

Every check and every packer imports its definitions from here: ``pipefisher validate``, the lower
bounds (:mod:`pipefisher.policies.bounds`), the policies, the aligner. So "lower bound" means: no
schedule that ``validate`` accepts, with the same margin, has fewer iterations.

* **The node.** The pipeline repeats every iteration, so a node's bubbles are the same in every
  iteration: the idle gaps between its pipeline items (``NodeTimeline.pipe_keys()``, one definition:
  forwards and backwards of either pipe and every model chunk, and zero-bubble weight-gradient passes
  W, which are pipeline work but not micro-batches), plus the head and
  tail gaps up to the job's pipeline time (an iteration spans [min(0, first item), max(pipeline time,
  last item end)]).
* **The work.** A covariance key is a queue of m pieces per interval (m = micro-batches of the pipe its
  module serves, or the first ``kfac.cov_micro_batches`` of them, :meth:`NodeTimeline.cov_pieces`; the
  interval's length split evenly, remainder on the first pieces), a sync key one item
  per interval (each as long as the key's longest interval), an inverse key one item per interval: the
  refresh's pieces, in order, each as long as its own interval (the j-th run of the label after the
  factor's completion runs piece j; every packer places a factor's pieces in that order).
* **The room rule.** An item of duration d that starts at t in a bubble ending at e fits when
  ``t + (1 + margin) d < e``: work runs back to back from the bubble's start, and each item keeps a
  margin of its own length free after it (the published tool's rule, with margin 0.05). The margin is
  part of the problem: packers, bounds and ``validate`` take the same value (:data:`DEFAULT_MARGIN`
  unless the user sets another).
* **Forced overflow.** An item that fits no bubble of the node (``(1 + margin) d`` not below the largest
  bubble) runs after the iteration's last pipeline item and its fittable work, past the pipeline time,
  and lengthens that iteration; no other work may run past the pipeline time or after such an item.
* **Dependencies.** In the cycle's first iteration, covariance piece j of a factor follows forward (A)
  or backward (B) ``j mod m`` of its pipe, or under interleaving of its own model chunk (``:chunk<j>``
  keys; m = that chunk's forwards) (:func:`cov_source`, :func:`source_call`); a sync follows all
  pieces of its factor; an inverse follows the factor's first sync, or all its pieces where the node has
  no sync for it (``NodeModel.synced``): the factor's *completion*. In an overlapping cycle
  (``NodeModel.overlap``, schedule metadata ``"overlap": true``) an inverse piece may also lie before
  its factor's completion: cyclically, the p inverse labels after a completion are its refresh's p
  pieces, so those before the completion are pieces of the previous cycle's refresh
  (:func:`pieces_before_completion`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import compress
from typing import Collection, Iterable, Iterator, Sequence

from pipefisher.schedule.format import END
from pipefisher.schedule.timeline import (
    BACKWARD, FORWARD, Interval, NodeTimeline, Time, TimelineKey, pipe_key, split_evenly,
)

DEFAULT_MARGIN = 0.05
"""Room an item needs beyond its own duration, as a fraction of it (the published tool's 5 %)."""

COV, SYNC, INV = 0, 1, 2
COV_PREFIX, SYNC_PREFIX, INV_PREFIX = "cov_kron_", "sync_kron_", "inv_kron_"
_KIND = {"cov_kron_A": COV, "cov_kron_B": COV, "sync_kron_A": SYNC, "sync_kron_B": SYNC,
         "inv_kron_A": INV, "inv_kron_B": INV}


def check_margin(margin: float) -> float:
    """The margin as a float; a negative or non-finite one is a caller's error."""
    m = float(margin)
    if not (0.0 <= m < 10.0):
        raise ValueError(f"margin must be in [0, 10), not {margin!r}")
    return m


def fits(duration: Time, room: Time, margin: float = DEFAULT_MARGIN) -> bool:
    """The room rule: an item of ``duration`` fits where ``room`` is left before the bubble's end."""
    return duration * (1.0 + margin) < room


def cov_source(factor: str | None, up_pipe: bool, chunk: int = 0) -> str:
    """The pipeline key whose calls a factor's covariance pieces follow: forwards for A, backwards for B,
    of the factor's own pipe and model chunk (a chunk's layers see only that chunk's micro-batches)."""
    return pipe_key(FORWARD if factor == "A" else BACKWARD, up_pipe, chunk)


def source_call(piece: int, micro_batches: int) -> int:
    """Which call (0-based, in the cycle's first iteration) covariance piece ``piece`` follows."""
    return piece % micro_batches if micro_batches else piece


@dataclass(frozen=True)
class Bubble:
    """An idle gap of every iteration; ``pos`` = pipeline items that come before it."""

    start: Time
    end: Time
    pos: int

    @property
    def length(self) -> Time:
        return self.end - self.start


@dataclass(frozen=True)
class Work:
    """One K-FAC key's work: a covariance queue of pieces, or one sync / inverse occurrence."""

    label: str
    kind: int  # COV, SYNC or INV
    group: int  # the factor (A or B) of one layer copy: (factor, module, pipe)
    pieces: tuple[Time, ...]  # piece durations (one for sync and inverse items)
    release: tuple[int, ...]  # covariance: per piece, the pipeline item (index) it must follow in iteration 0


@dataclass(frozen=True)
class Factors:
    """Per factor (group): its covariance piece count, and the work indices of its syncs and inverses:
    what every packer needs to know when a factor's pieces are done and what that makes ready."""

    pieces: tuple[int, ...]
    syncs: tuple[tuple[int, ...], ...]
    invs: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class NodeModel:
    """What packing one node needs: its pipeline (sorted), its bubbles, its work and their groups."""

    pipeline: tuple[tuple[str, Time, Time], ...]
    bubbles: tuple[Bubble, ...]
    base: Time  # where an iteration without overflow ends: max(pipeline time, last pipeline end)
    length: Time  # its length: ``base`` minus any pipeline time before 0 (nodes that start early)
    pipeline_busy: Time  # time covered by forwards and backwards in one iteration
    work: tuple[Work, ...]
    groups: int
    synced: tuple[bool, ...]  # per group: the node has a sync item for it (inverses wait for it)
    margin: float = DEFAULT_MARGIN  # the room rule's margin (see the module's docstring)
    overlap: bool = False  # inverse pieces may lie before their factor's completion (the module's docstring)
    cov_micro_batches: int | None = None  # the node's NodeTimeline.cov_micro_batches (None: all)

    @property
    def scale(self) -> float:
        """Room per unit of duration an item needs: ``1 + margin`` (hot loops multiply by it)."""
        return 1.0 + self.margin

    @property
    def largest(self) -> Time:
        """The largest bubble: work that does not fit it (with the margin) is forced overflow."""
        return max((b.length for b in self.bubbles), default=0)

    @cached_property
    def durations(self) -> dict[str, tuple[Time, ...]]:
        """Per K-FAC label, its items' durations in cycle order: the j-th time a label runs in a cycle it
        takes the j-th (modulo their count) of these (a covariance key: its j-th piece), an inverse label
        counted from its factor's completion (the j-th run after it: piece j; :func:`pieces_before_completion`)."""
        out: dict[str, list[Time]] = {}
        for w in self.work:
            out.setdefault(w.label, []).extend(w.pieces)
        return {label: tuple(d) for label, d in out.items()}

    @cached_property
    def factors(self) -> Factors:
        """Each factor's piece count, syncs and inverses (work indices, in work order)."""
        pieces = [0] * self.groups
        syncs: list[list[int]] = [[] for _ in range(self.groups)]
        invs: list[list[int]] = [[] for _ in range(self.groups)]
        for wi, w in enumerate(self.work):
            if w.kind == COV:
                pieces[w.group] += len(w.pieces)
            else:
                (syncs if w.kind == SYNC else invs)[w.group].append(wi)
        return Factors(tuple(pieces), tuple(map(tuple, syncs)), tuple(map(tuple, invs)))


def completions(runs: Iterable[tuple[str, int]], node: NodeTimeline | NodeModel | None = None) -> dict[str, int]:
    """Where each factor of a cycle completes (the one definition: the packers, ``validate``, the plans, the
    measurements and the runtime's executor all take it from here): per factor (its labels' text after the
    kind, ``A:<m>`` with any ``:up_pipe`` / ``:chunk<j>``), the index in ``runs`` (the cycle's labels in
    order, each with how many times it runs there) of its FIRST ``sync_kron`` run, or where the factor has no
    sync, its last ``cov_kron`` run. The first sync: every covariance piece comes before any sync (the
    rules), so the factor is final at it and its inverse may begin there; a later sync re-averages what
    the replicas already share. Whether a factor has a sync: ``node``'s timeline (or model) has the key,
    or with ``node`` None (a cycle as it ran), the cycle runs one. A factor whose node has a sync the cycle
    lacks does not complete."""
    # dicts built in C (dict(zip(...))), not a Python loop over every label: a big job's cycle holds
    # 10^5 of them; the later of a label's indices wins
    names = [label if count else None for label, count in runs]
    last = dict(zip(names, range(len(names))))
    first = dict(zip(reversed(names), range(len(names) - 1, -1, -1)))
    in_order = sorted((label for label in first if label is not None), key=first.__getitem__)
    first_sync = {label[len(SYNC_PREFIX):]: first[label] for label in in_order if label.startswith(SYNC_PREFIX)}
    last_cov = {label[len(COV_PREFIX):]: last[label] for label in in_order if label.startswith(COV_PREFIX)}
    out: dict[str, int] = {}
    for factor in (*first_sync, *last_cov):
        if factor in out:
            continue
        if node is None:
            synced = factor in first_sync
        elif isinstance(node, NodeModel):
            synced = SYNC_PREFIX + factor in node.durations
        else:
            synced = bool(node.entries.get(SYNC_PREFIX + factor))
        at = first_sync.get(factor) if synced else last_cov.get(factor)
        if at is not None:
            out[factor] = at
    return out


def runs_before_completion(runs: Sequence[tuple[str, int]],
                           node: NodeTimeline | NodeModel | None = None) -> dict[str, int]:
    """:func:`pieces_before_completion` of a cycle given as runs (each label with how many times it runs
    there, :func:`completions`): per inverse label, its runs before its factor's completion."""
    done = completions(runs, node)
    names = [label for label, _ in runs]
    invs = {label for label in set(names) if label.startswith(INV_PREFIX)}
    out: dict[str, int] = {}
    for i in positions(names, invs):
        label, count = runs[i]
        out[label] = out.get(label, 0) + (count if i < done.get(label[len(INV_PREFIX):], -1) else 0)
    return out


def positions(names: Sequence[str], wanted: Collection[str]) -> Iterator[int]:
    """The indices of ``names`` that hold one of ``wanted``, found in C (a refresh's few runs among the
    cycle's many labels)."""
    return compress(range(len(names)), map(wanted.__contains__, names))


def pieces_before_completion(node: NodeTimeline | NodeModel | None,
                             iterations: Sequence[Sequence[str]]) -> dict[str, int]:
    """Per inverse label of a cycle, how many of its runs come before its factor's completion
    (:func:`completions`: its first sync, or without one on the node its last covariance piece; none: the
    cycle's start). In an overlapping cycle those are the previous refresh's last pieces, so the j-th run
    in the cycle runs piece ``(j - this count) mod p``; in any other valid cycle the count is 0 (what
    ``validate`` allows). ``node`` None: a cycle as it ran (measured steps), whose factor has a sync where
    the cycle runs one."""
    return runs_before_completion([(label, 1) for labels in iterations for label in labels], node)


def curvature_age(node: NodeTimeline, iterations: Sequence[Sequence[str]],
                  layout: Sequence[Sequence[tuple[int, str, int]]] | None = None) -> tuple[int, float, int] | None:
    """The curvature's age over one node's cycle, in steps: (least, mean, most) over its steps and factors;
    None where the cycle refreshes nothing.

    At a step's ``-- end --`` the gradients are preconditioned with the latest installed refresh; its age
    is the steps since iteration 0 of the cycle whose micro-batches built it. A refresh whose last piece
    runs in iteration ``f`` counted from that iteration 0 (``f >= k`` where the cycle overlaps the next:
    its last pieces come before the next completion, :func:`pieces_before_completion`; one more where
    the piece comes after the ``-- end --``) is installed at step ``f``'s end at age ``f + 1`` and used
    until the next one: ages ``f + 1`` to ``f + k``. ``layout``: the labels'
    :data:`~pipefisher.schedule.packed.KfacLayout`, where the policy gave one: the same figures from the
    K-FAC work alone (all of it before ``-- end --``), not from every label of a big job's cycle.
    """
    k = len(iterations)
    if layout is not None:
        before = runs_before_completion([(label, count) for work in layout for _, label, count in work], node)
        runs = [[(label, count, 0) for _, label, count in work if label in before] for work in layout]
    else:
        before = pieces_before_completion(node, iterations)
        runs = []
        for labels in iterations:
            end = labels.index(END) if END in labels else len(labels)
            runs.append([(labels[j], 1, 1 if j > end else 0) for j in positions(labels, before)])
    seen: dict[str, int] = {}
    last_at: dict[str, int] = {}  # per inverse label: the installing run's iteration (after its end: +1)
    for i, work in enumerate(runs):
        for label, count, late in work:
            done = seen.get(label, 0)
            seen[label] = done + count
            if not before[label] or done < before[label] <= done + count:
                last_at[label] = i + late  # the run with the last piece before the completion, or the last
    ages: list[int] = []
    for label, at in last_at.items():
        f = at + (k if before[label] else 0)
        ages.extend(range(f + 1, f + k + 1))
    if not ages:
        return None
    return min(ages), sum(ages) / len(ages), max(ages)


def sane_bounds(iv: Interval, fallback: Time) -> tuple[Time, Time]:
    """A missing bound is no measured time; an end before the start is no time either."""
    s, e = iv.start, iv.end
    if s is None and e is None:
        return fallback, fallback
    if s is None:
        s = e
    elif e is None:
        e = s
    assert s is not None and e is not None
    return s, (e if e >= s else s)


def node_model(node: NodeTimeline, span: Time, margin: float = DEFAULT_MARGIN, overlap: bool = False) -> NodeModel:
    """Sort the pipeline, find the bubbles in [0, span], and turn the K-FAC keys into work items;
    ``overlap``: the packing problem of overlapping cycles (the module's docstring)."""
    margin = check_margin(margin)
    raw = []
    order = 0
    pipe_keys = node.pipe_keys()
    for key in pipe_keys:
        prev: Time = 0
        for iv in node.intervals(key):
            s, e = sane_bounds(iv, prev)
            raw.append((s, order, key, e))
            order += 1
            prev = e
    raw.sort(key=lambda r: (r[0], r[1]))
    pipeline = tuple((key, s, e) for s, _, key, e in raw)

    # The node's iteration window: from its first pipeline item (or 0) to its last (or the pipeline
    # time); every idle gap in it is a bubble, the same in every iteration.
    first_start = min((s for _, s, _ in pipeline), default=0)
    last_end = max((e for _, _, e in pipeline), default=0)
    base = span if span >= last_end else last_end
    length = base - first_start if first_start < 0 else base
    bubbles = []
    cur: Time = first_start if first_start < 0 else 0
    busy: Time = 0
    for i, (_, s, e) in enumerate(pipeline):
        if s > cur:
            bubbles.append(Bubble(cur, s, i))
        if e > cur:
            busy += e - (s if s > cur else cur)  # union of pipeline intervals, for usage
            cur = e
    if base > cur:
        bubbles.append(Bubble(cur, base, len(pipeline)))

    positions: dict[str, list[int]] = {key: [] for key in pipe_keys}
    for i, (key, _, _) in enumerate(pipeline):
        positions[key].append(i)

    group_of: dict[tuple[str, str | None, bool, int], int] = {}
    items: list[Work] = []
    synced: set[int] = set()
    for key, intervals in node.entries.items():
        parsed = TimelineKey.parse(key)
        kind = _KIND.get(parsed.kind)
        if kind is None:
            continue
        gkey = (parsed.factor or "", parsed.module, parsed.up_pipe, parsed.chunk)
        g = group_of.setdefault(gkey, len(group_of))
        durations = [e - s for s, e in (sane_bounds(iv, 0) for iv in intervals)]
        if kind == COV:
            m = node.cov_pieces(parsed.up_pipe, parsed.chunk)
            if m == 0 or not durations:
                continue  # the timeline asks for no pieces of a pipe (or chunk) that does not run here
            pos = positions[cov_source(parsed.factor, parsed.up_pipe, parsed.chunk)]
            pieces: list[Time] = []
            for d in durations:
                pieces.extend(split_evenly(d, m))
            last = len(pos) - 1  # a timeline with fewer backwards than forwards: follow the last one
            # piece q follows call source_call(q, m): calls 0..m-1 of every interval, the same for each
            # (capped at the last call), so one period of m releases is built and repeated
            period = (tuple(pos[:m]) + (pos[last],) * (m - len(pos))) if pos else (-1,) * m
            release = period * len(durations)
            items.append(Work(key, COV, g, tuple(pieces), release))
        else:
            if kind == SYNC:
                if durations:
                    synced.add(g)
                # A sync that ran several times in the profiled step: every run is measured at the
                # longest (a label names no run, so a check cannot tell which one comes when).
                longest = max(durations, default=0)
                items.extend(Work(key, kind, g, (longest,), ()) for _ in durations)
            else:  # an inverse's intervals are its refresh's pieces, each run in order at its own length
                items.extend(Work(key, kind, g, (d,), ()) for d in durations)
    return NodeModel(pipeline, tuple(bubbles), base, length, busy, tuple(items), len(group_of),
                     tuple(g in synced for g in range(len(group_of))), margin, overlap, node.cov_micro_batches)
