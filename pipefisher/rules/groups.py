"""Sync groups: the nodes that hold replicas of one stage, and the order rule their schedules share.

In a Chimera pipeline of D nodes, node d holds stage d of the down pipe and stage D-1-d of the up pipe
(whose keys end in ``:up_pipe``), so stage s lives on nodes s and D-1-s. A ``sync_kron_X:<m>`` label is
an all-reduce over every replica of its stage, and so is ``-- end --`` (gradients): all members of a
group must issue them in the same order, or the run deadlocks or mixes factors. The replicas must also
stay bit-identical, so every member refreshes (inverts) each factor at the same point relative to the
syncs and ``-- end --``. Both facts are one rule over the *shared sequence* of each iteration (see
:func:`shared_sequence`). The runtime imports this module to refuse a schedule before training, so it
stays free of torch.
"""
from __future__ import annotations

from itertools import zip_longest
from typing import Iterable, Sequence

from pipefisher.rules.violations import Violation
from pipefisher.schedule.format import END
from pipefisher.schedule.timeline import UP_SUFFIX, Job

Group = tuple[int, ...]
SHARED_PREFIXES = ("sync_kron_", "inv_kron_")


def chimera_groups(num_nodes: int) -> list[Group]:
    """The sync groups of a Chimera pipeline: (d, D-1-d) for each d < D/2, the middle node alone."""
    if num_nodes < 0:
        raise ValueError(f"a pipeline cannot have {num_nodes} nodes")
    groups: list[Group] = [(d, num_nodes - 1 - d) for d in range(num_nodes // 2)]
    if num_nodes % 2:
        groups.append((num_nodes // 2,))
    return sorted(groups)


def singleton_groups(num_nodes: int) -> list[Group]:
    """Every node its own group: no schedule constrains another."""
    return [(n,) for n in range(num_nodes)]


def is_chimera_job(job: Job) -> bool:
    """Whether ``job`` has Chimera's shape: up-pipe K-FAC work, and for every node d the modules of its
    ``:up_pipe`` K-FAC keys are exactly the modules of node D-1-d's plain ones.

    Bare keys (no module) show nothing about which stage they belong to, so a job with any is not
    grouped; nor is a job whose up-pipe modules do not mirror (random jobs give each node its own).
    """
    up: list[set[str]] = []
    plain: list[set[str]] = []
    for node in job.nodes:
        keys = node.kfac_keys()
        if any(k.module is None for k in keys):
            return False
        up.append({k.module for k in keys if k.up_pipe and k.module is not None})
        plain.append({k.module for k in keys if not k.up_pipe and k.module is not None})
    if not any(up):
        return False
    last = len(job.nodes) - 1
    return all(up[d] == plain[last - d] for d in range(len(job.nodes)))


def job_groups(job: Job) -> list[Group]:
    """The sync groups the job's layout implies: Chimera's pairs where the job is Chimera-shaped
    (:func:`is_chimera_job`), else every node alone."""
    n = len(job.nodes)
    return chimera_groups(n) if is_chimera_job(job) else singleton_groups(n)


def is_shared(label: str) -> bool:
    """Whether every member of the group must run ``label`` at the same point: syncs, inverses, end."""
    return label.startswith(SHARED_PREFIXES) or label == END


def identity(label: str) -> str:
    """The label as every replica of its stage knows it: one trailing ``:up_pipe`` stripped."""
    return label[: -len(UP_SUFFIX)] if label.endswith(UP_SUFFIX) else label


def shared_sequence(labels: Iterable[str]) -> list[str]:
    """The labels of one iteration that the group shares, as identities, in order."""
    return [identity(label) for label in labels if is_shared(label)]


def group_order_violations(schedule: Sequence[Sequence[Sequence[str]]],
                           groups: Iterable[Sequence[int]]) -> list[Violation]:
    """Every place where members of a group disagree: ``group-cycle`` when their cycles differ in
    length, else ``group-order`` at the first differing shared entry of each iteration. Each member is
    compared with the group's first member; groups of one always pass."""
    out: list[Violation] = []
    for group in groups:
        members = list(group)
        for n in members:
            if not 0 <= n < len(schedule):
                raise ValueError(f"sync group {tuple(members)} names node {n}, the schedule has {len(schedule)}")
        if len(members) < 2:
            continue
        ref = members[0]
        for n in members[1:]:
            if len(schedule[n]) != len(schedule[ref]):
                out.append(Violation(n, None, "-", "group-cycle",
                                     f"node{n} has {len(schedule[n])} iterations where node{ref} has "
                                     f"{len(schedule[ref])} (sync group {_name(members)})"))
                continue
            for i, (mine, theirs) in enumerate(zip(schedule[n], schedule[ref])):
                v = _first_difference(n, ref, i, mine, theirs)
                if v is not None:
                    out.append(v)
    return out


def _name(members: Sequence[int]) -> str:
    return ", ".join(f"node{n}" for n in members)


def _first_difference(n: int, ref: int, iteration: int, mine: Sequence[str],
                      theirs: Sequence[str]) -> Violation | None:
    """The first shared entry where node ``n``'s iteration differs from node ``ref``'s, if any."""
    a = [label for label in mine if is_shared(label)]
    b = [label for label in theirs if is_shared(label)]
    for j, (x, y) in enumerate(zip_longest(a, b)):
        if x is not None and y is not None and identity(x) == identity(y):
            continue
        runs = lambda node, label: f"node{node} runs {label}" if label else f"node{node} runs nothing"  # noqa: E731
        return Violation(n, iteration, x or "-", "group-order",
                         f"{runs(n, x)} where {runs(ref, y)} (shared entry {j} of the iteration)")
    return None


__all__ = ["Group", "chimera_groups", "group_order_violations", "identity", "is_chimera_job", "is_shared",
           "job_groups", "shared_sequence", "singleton_groups"]
