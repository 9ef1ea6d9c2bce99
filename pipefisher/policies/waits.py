"""Who waits for whom when a schedule runs, and whether it can deadlock.

A schedule's labels block on other nodes in three ways at run time:

- ``call_forward`` / ``call_backward`` (either pipe) receive the activation or gradient of the same
  micro-batch from the neighbouring stage of their pipe (sends never block);
- ``inv_kron_X:<m>`` waits for the all-reduces of layer ``m``'s factors that this node started and
  has not waited for yet (a ``sync_kron`` only starts its all-reduce), so for every member of the
  sync group to have started them;
- ``-- end --`` all-reduces the gradients over the sync group: every member must reach it.

Matching the shared order of a group (:mod:`pipefisher.policies.groups`) is necessary but not enough:
under Chimera the members of a group also feed each other's pipelines, so a node can wait at an
inverse for a peer that itself waits for this node's next forward. :func:`deadlock_violations` builds
the graph of these waits, one training step at a time, and reports every step that has a cycle. It
needs the labels alone (the k-th forward of a pipe carries the same micro-batch on every node), so
the trainer runs it before any step, without timelines, and ``pipefisher validate`` with them.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

from pipefisher.policies.base import END
from pipefisher.policies.groups import identity
from pipefisher.timeline import UP_PIPE
from pipefisher.violations import Violation

_UP = ":" + UP_PIPE
_CALLS = {"call_forward": "F", "call_backward": "B"}
MAX_STEPS = 4096
"""Steps checked at most: the cycles of all nodes repeat together after lcm(k) steps."""


def _layer(label: str) -> str:
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
    seen: set[tuple[int, ...]] = set()
    for step in range(1, steps + 1):
        combo = tuple((step - 1) % k for k in cycles)
        if combo in seen:
            continue
        seen.add(combo)
        found = _step_deadlock(schedule, combo, group_of, step)
        if found:
            return found
    return []


def _step_deadlock(schedule: Sequence[Sequence[Sequence[str]]], combo: tuple[int, ...],
                   group_of: dict[int, tuple[int, ...]], step: int) -> list[Violation]:
    nodes = len(schedule)
    labels: list[list[tuple[int, str]]] = []  # per node: (index in its iteration, label) that wait or are waited on
    for n, i in enumerate(combo):
        labels.append([(j, lb) for j, lb in enumerate(schedule[n][i])
                       if lb.partition(":")[0] in _CALLS or lb == END or lb.startswith(("sync_kron_", "inv_kron_"))])
    ids: dict[tuple[int, int], int] = {}  # (node, position in labels[n]) -> event
    for n in range(nodes):
        for p in range(len(labels[n])):
            ids[n, p] = len(ids)
    preds: list[set[int]] = [set() for _ in ids]
    calls: dict[tuple[int, str, int, int], int] = {}  # (node, F/B, pipe, k-th) -> event
    syncs: dict[tuple[int, str], int] = {}  # (node, sync identity) -> event (its first in the iteration)
    for n in range(nodes):
        count: dict[tuple[str, int], int] = defaultdict(int)
        for p, (_, lb) in enumerate(labels[n]):
            ev = ids[n, p]
            if p:
                preds[ev].add(ids[n, p - 1])
            head = lb.partition(":")[0]
            if head in _CALLS:
                key = (_CALLS[head], 1 if lb.endswith(_UP) else 0)
                calls[(n, *key, count[key])] = ev
                count[key] += 1
            elif lb.startswith("sync_kron_"):
                syncs.setdefault((n, identity(lb)), ev)

    def stage_of(n: int, pipe: int) -> int:
        return n if pipe == 0 else nodes - 1 - n

    def node_of(stage: int, pipe: int) -> int:
        return stage if pipe == 0 else nodes - 1 - stage

    for (n, kind, pipe, k), ev in calls.items():  # point to point, from the neighbouring stage
        s = stage_of(n, pipe)
        src = s - 1 if kind == "F" else s + 1
        if 0 <= src < nodes:
            dep = calls.get((node_of(src, pipe), kind, pipe, k))
            if dep is not None:
                preds[ev].add(dep)
    for n in range(nodes):
        members = [b for b in group_of.get(n, (n,)) if b != n]
        if not members:
            continue
        in_flight: dict[str, list[str]] = defaultdict(list)
        for p, (_, lb) in enumerate(labels[n]):
            ev = ids[n, p]
            if lb.startswith("sync_kron_"):
                in_flight[_layer(lb)].append(identity(lb))
            elif lb.startswith("inv_kron_"):
                for ident in in_flight.pop(_layer(lb), []):
                    for b in members:
                        if (b, ident) in syncs:
                            preds[ev].add(syncs[b, ident])
            elif lb == END:
                in_flight.clear()  # waited for by then: every member started them before its end
                for b in members:
                    at = next((q for q, (_, x) in enumerate(labels[b]) if x == END), None)
                    if at:
                        preds[ev].add(ids[b, at - 1])
    # Kahn's algorithm: what is left has a cycle among its waits
    succ: list[list[int]] = [[] for _ in ids]
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
    if done == len(ids):
        return []
    where = {ev: (n, p) for (n, p), ev in ids.items()}
    out = []
    for n in range(nodes):
        stuck = next((p for p in range(len(labels[n])) if indeg[ids[n, p]] > 0), None)
        if stuck is None:
            continue
        ev = ids[n, stuck]
        blocker = next((where[q] for q in sorted(preds[ev]) if indeg[q] > 0 and where[q][0] != n), None)
        needs = (f", waiting for node{blocker[0]}'s '{labels[blocker[0]][blocker[1]][1]}'"
                 if blocker is not None else "")
        out.append(Violation(n, combo[n], labels[n][stuck][1], "deadlock",
                             f"at training step {step} the nodes wait for each other in a cycle: node{n} "
                             f"stops here{needs}"))
    return out


__all__ = ["MAX_STEPS", "deadlock_violations"]
