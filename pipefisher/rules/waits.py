"""Who waits for whom when a schedule runs, and whether it can deadlock.

A schedule's labels block on other nodes in three ways at run time:

- ``call_forward`` / ``call_backward`` (either pipe, any model chunk) receive the activation or gradient
  of the same micro-batch from the neighbouring (virtual) stage of their pipe (sends never block); under
  interleaving chunk j of node n is virtual stage ``j * nodes + n`` (``:chunk<j>`` labels, the loop
  layout of :func:`pipefisher.pipeline_orders.stage_on`: the labels do not say whether the chunks sit
  in a V, and the waits are followed in grouped jobs only, Chimera's, which have one chunk);
- ``inv_kron_X:<m>`` waits for the all-reduces of layer ``m``'s factors that this node started and
  has not waited for yet (a ``sync_kron`` only starts its all-reduce), so for every member of the
  sync group to have started them;
- ``-- end --`` all-reduces the gradients over the sync group: every member must reach it.

Matching the shared order of a group (:mod:`pipefisher.rules.groups`) is necessary but not enough:
under Chimera the members of a group also feed each other's pipelines, so a node can wait at an
inverse for a peer that itself waits for this node's next forward. :func:`deadlock_violations` builds
the graph of these waits, one training step at a time, and reports every step that has a cycle. It
needs the labels alone (the k-th forward of a pipe carries the same micro-batch on every node), so
the trainer runs it before any step, without timelines, and ``pipefisher validate`` with them.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from pipefisher.pipeline_orders import device_of_stage, stage_on
from pipefisher.rules.groups import group_order_violations, identity
from pipefisher.rules.violations import Violation
from pipefisher.schedule.format import END
from pipefisher.schedule.timeline import TimelineKey

_CALLS = {"call_forward": "F", "call_backward": "B"}
MAX_STEPS = 4096
"""Steps checked at most: the cycles of all nodes repeat together after lcm(k) steps."""


Clock = tuple[float, int]
"""A point of :func:`call_clock`: (time, calls run before it on the way), compared in that order."""


def _call_key(label: str) -> tuple[str, int]:
    """A call's kind (F, B, or W for a zero-bubble weight-gradient pass) and lane: 1 for the up pipe,
    ``2 j`` for model chunk j of the down pipe (0 for the published keys; the up pipe has no chunks, so
    one int tells them all apart)."""
    key = TimelineKey.parse(label)
    return ("W" if key.is_weight else _CALLS[key.kind]), 1 if key.up_pipe else 2 * key.chunk


def _chunks(lanes: Iterable[int]) -> int:
    """Model chunks per node of a schedule: one more than the highest chunk its calls name."""
    return 1 + max((lane // 2 for lane in lanes if lane % 2 == 0), default=0)


def _producer(n: int, kind: str, lane: int, nodes: int, chunks: int = 1) -> tuple[int, str, int] | None:
    """Whose call of the same micro-batch a ``kind`` call of ``lane`` on node ``n`` receives from, as
    (node, kind, lane); None at the first stage (forwards) or the last (backwards) of its pipe, and for
    W passes, which use only their own node's data."""
    if kind == "W":
        return None
    if lane == 1:  # the up pipe: stage s on node nodes - 1 - s
        stage = nodes - 1 - n
        src = stage - 1 if kind == "F" else stage + 1
        return (nodes - 1 - src, kind, 1) if 0 <= src < nodes else None
    stage = stage_on(n, lane // 2, nodes)  # virtual stage: chunk j of node n
    src = stage - 1 if kind == "F" else stage + 1
    if not 0 <= src < nodes * chunks:
        return None
    return device_of_stage(src, nodes), kind, 2 * (src // nodes)


def call_clock(orders: Sequence[Sequence[str]],
               durations: Sequence[Sequence[float]]) -> list[list[tuple[Clock, Clock]]]:
    """When each node's calls (``orders[n]``: its ``call_forward``/``call_backward`` labels in its order,
    lasting ``durations[n]``) start and end if the nodes run only their pipelines, each call as soon as
    the node is free and its input has arrived.

    Unlike a profile, whose nodes each read their own clock, this clock respects every point-to-point
    wait: a call starts no earlier than the call it receives from ends, and every call ends strictly
    after it starts (the count of calls breaks ties of zero-length calls). Where the orders alone would
    deadlock, the receives that never arrive are ignored.
    """
    nodes = len(orders)
    chunks = _chunks(_call_key(call)[1] for order in orders for call in order)
    out: list[list[tuple[Clock, Clock]]] = [[] for _ in range(nodes)]
    ends: dict[tuple[int, str, int, int], Clock] = {}  # (node, F/B, pipe, k-th) -> when that call ends
    counts: list[dict[tuple[str, int], int]] = [defaultdict(int) for _ in range(nodes)]
    strict = True
    while any(len(out[n]) < len(orders[n]) for n in range(nodes)):
        progressed = False
        for n in range(nodes):
            while len(out[n]) < len(orders[n]):
                j = len(out[n])
                call = orders[n][j]
                key = _call_key(call)
                k = counts[n][key]
                start: Clock = out[n][-1][1] if j else (0.0, 0)
                src = _producer(n, *key, nodes, chunks)
                if src is not None:
                    arrived = ends.get((*src, k))
                    if arrived is None and strict:
                        break
                    if arrived is not None:
                        start = max(start, arrived)
                end = (start[0] + max(float(durations[n][j]), 0.0), start[1] + 1)
                out[n].append((start, end))
                ends[(n, *key, k)] = end
                counts[n][key] += 1
                progressed = True
        strict = progressed
    return out


def layer_of(label: str) -> str:
    """The layer a sync or inverse belongs to, as every replica of its stage names it."""
    return identity(label).partition(":")[2]


def deadlock_violations(schedule: Sequence[Sequence[Sequence[str]]],
                        groups: Iterable[Sequence[int]]) -> list[Violation]:
    """One ``deadlock`` violation per node stuck in the first step whose waits form a cycle."""
    groups = [tuple(g) for g in groups]
    nodes = len(schedule)
    if nodes == 0 or any(not node for node in schedule):
        return []
    group_of = {n: g for g in groups for n in g}
    cycles = [len(node) for node in schedule]
    steps = min(math.lcm(*cycles), MAX_STEPS)
    iterations: dict[tuple[int, int], _Iteration] = {}  # (node, iteration) -> its waits, read once
    seen: set[tuple[int, ...]] = set()
    for step in range(1, steps + 1):
        combo = tuple((step - 1) % k for k in cycles)
        if combo in seen:
            continue
        seen.add(combo)
        for n, i in enumerate(combo):
            if (n, i) not in iterations:
                iterations[n, i] = _Iteration.of(schedule[n][i])
        found = _step_deadlock([iterations[n, i] for n, i in enumerate(combo)], combo, group_of, step)
        if found:
            return found
    return []


@dataclass(frozen=True)
class _Iteration:
    """One iteration of a node as the wait graph sees it: its labels that wait or are waited on."""

    labels: tuple[str, ...]
    calls: tuple[tuple[int, str, int, int], ...]  # (position, F/B, lane, k-th of that kind and lane)
    syncs: dict[str, int]  # sync identity -> position of its first occurrence
    inverses: tuple[tuple[int, tuple[str, ...]], ...]  # (position, identities of the syncs it waits for)
    ends: tuple[int, ...]  # positions of ``-- end --`` (one in a valid schedule)

    @staticmethod
    def of(iteration: Sequence[str]) -> _Iteration:
        labels = tuple(lb for lb in iteration
                       if lb.partition(":")[0] in _CALLS or lb == END or lb.startswith(("sync_kron_", "inv_kron_")))
        calls, syncs, inverses, ends = [], {}, [], []
        count: dict[tuple[str, int], int] = defaultdict(int)
        in_flight: dict[str, list[str]] = defaultdict(list)  # per layer: syncs started, not waited for
        for p, lb in enumerate(labels):
            if lb.partition(":")[0] in _CALLS:
                key = _call_key(lb)
                calls.append((p, *key, count[key]))
                count[key] += 1
            elif lb.startswith("sync_kron_"):
                syncs.setdefault(identity(lb), p)
                in_flight[layer_of(lb)].append(identity(lb))
            elif lb.startswith("inv_kron_"):
                inverses.append((p, tuple(in_flight.pop(layer_of(lb), []))))
            elif lb == END:
                in_flight.clear()  # waited for by then: every member started them before its end
                ends.append(p)
        return _Iteration(labels, tuple(calls), syncs, tuple(inverses), tuple(ends))


def _step_deadlock(its: Sequence[_Iteration], combo: tuple[int, ...],
                   group_of: dict[int, tuple[int, ...]], step: int) -> list[Violation]:
    nodes = len(its)
    base = [0] * (nodes + 1)  # event of node n's p-th label: base[n] + p
    for n, it in enumerate(its):
        base[n + 1] = base[n] + len(it.labels)
    preds: list[list[int]] = [[] for _ in range(base[nodes])]
    calls: dict[tuple[int, str, int, int], int] = {}  # (node, F/B, pipe, k-th) -> event
    for n, it in enumerate(its):
        for p in range(1, len(it.labels)):
            preds[base[n] + p].append(base[n] + p - 1)
        for p, kind, pipe, k in it.calls:
            calls[n, kind, pipe, k] = base[n] + p
    chunks = _chunks(lane for _, _, lane, _ in calls)
    for (n, kind, pipe, k), ev in calls.items():  # point to point, from the neighbouring stage
        src = _producer(n, kind, pipe, nodes, chunks)
        if src is not None:
            dep = calls.get((*src, k))
            if dep is not None:
                preds[ev].append(dep)
    for n, it in enumerate(its):
        members = [b for b in group_of.get(n, (n,)) if b != n]
        for p, waited in it.inverses:
            for b in members:
                for ident in waited:
                    q = its[b].syncs.get(ident)
                    if q is not None:
                        preds[base[n] + p].append(base[b] + q)
        for end in it.ends:  # every member reaches its (first) end
            for b in members:
                at = its[b].ends[0] if its[b].ends else None
                if at:
                    preds[base[n] + end].append(base[b] + at - 1)
    # Kahn's algorithm: what is left has a cycle among its waits
    succ: list[list[int]] = [[] for _ in preds]
    indeg = [len(p) for p in preds]
    for ev, ps in enumerate(preds):
        for q in ps:
            succ[q].append(ev)
    ready = [ev for ev, d in enumerate(indeg) if d == 0]
    done = 0
    while ready:
        ev = ready.pop()
        done += 1
        for nxt in succ[ev]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                ready.append(nxt)
    if done == len(preds):
        return []

    def where(ev: int) -> tuple[int, int]:
        n = bisect_right(base, ev) - 1
        return n, ev - base[n]

    out = []
    for n, it in enumerate(its):
        stuck = next((p for p in range(len(it.labels)) if indeg[base[n] + p] > 0), None)
        if stuck is None:
            continue
        ev = base[n] + stuck
        blocker = next((where(q) for q in sorted(preds[ev]) if indeg[q] > 0 and where(q)[0] != n), None)
        needs = (f", waiting for node{blocker[0]}'s '{its[blocker[0]].labels[blocker[1]]}'"
                 if blocker is not None else "")
        out.append(Violation(n, combo[n], it.labels[stuck], "deadlock",
                             f"at training step {step} the nodes wait for each other in a cycle: node{n} "
                             f"stops here{needs}"))
    return out


def group_violations(schedule: Sequence[Sequence[Sequence[str]]],
                     groups: Iterable[Sequence[int]]) -> list[Violation]:
    """Everything that makes a grouped schedule unrunnable, as ``validate`` and the trainer check it:
    the shared order of every group, then (where a group has several members) the waits' cycles."""
    groups = [tuple(g) for g in groups]
    out = group_order_violations(schedule, groups)
    if any(len(g) > 1 for g in groups):
        out.extend(deadlock_violations(schedule, groups))
    return out


__all__ = ["MAX_STEPS", "Clock", "call_clock", "deadlock_violations", "group_violations", "layer_of"]
