"""Is a schedule valid for a job: the one entry point over every rule.

Format (:mod:`~pipefisher.schedule.format`), dependencies (:mod:`~pipefisher.rules.dependencies`), room
(:mod:`~pipefisher.rules.room`), the sync groups' shared order (:mod:`~pipefisher.rules.groups`) and
waits that deadlock (:mod:`~pipefisher.rules.waits`). ``pipefisher validate``, the packers' self-checks,
the driver and the reports all call :func:`validate` (or :func:`validate_node` for one node).
"""
from __future__ import annotations

from typing import Sequence

from pipefisher.errors import InputError
from pipefisher.rules.dependencies import dependency_violations
from pipefisher.rules.groups import job_groups
from pipefisher.rules.room import room_violations
from pipefisher.rules.violations import Violation
from pipefisher.rules.waits import group_violations
from pipefisher.schedule.format import ScheduleData
from pipefisher.schedule.problem import DEFAULT_MARGIN
from pipefisher.schedule.timeline import Job, NodeTimeline, Time


def validate_node(node_index: int, node: NodeTimeline, iterations: Sequence[Sequence[str]],
                  span: Time | None = None, margin: float = DEFAULT_MARGIN, overlap: bool = False) -> list[Violation]:
    """Every violation of the dependency rules in one node's cycle; with the job's pipeline time
    ``span``, also of the room rule with ``margin`` (:func:`pipefisher.rules.room.room_violations`);
    ``overlap``: by the rules of an overlapping cycle (:mod:`pipefisher.schedule.problem`)."""
    out = dependency_violations(node_index, node, iterations, overlap=overlap)
    if iterations and span is not None:
        out.extend(room_violations(node_index, node, iterations, span, margin, overlap))
    return out


def validate(schedule: ScheduleData, job: Job, path: str | None = None, room: bool = True,
             groups: Sequence[Sequence[int]] | None = None, margin: float = DEFAULT_MARGIN,
             overlap: bool = False) -> list[Violation]:
    """Every violation of the dependency rules and counts in ``schedule`` for ``job``, with ``room`` of
    the bubbles' room (work that does not fit where it is placed), and of the sync groups' shared order
    (:func:`pipefisher.rules.groups.group_order_violations`); where a group has several members, also
    every step whose waits form a cycle (``deadlock``, :func:`pipefisher.rules.waits.deadlock_violations`).
    ``groups``: the nodes that hold replicas of one stage; None infers them from the job's layout
    (Chimera's pairs, or every node alone). ``overlap``: the schedule's cycles overlap (its metadata's
    ``"overlap": true``): checked by that rule (:mod:`pipefisher.schedule.problem`), every other rule as always."""
    if len(schedule) != len(job.nodes):
        raise InputError(path, f"has {len(schedule)} node schedules but the job has {len(job.nodes)} timelines")
    out: list[Violation] = []
    for n, (node, iterations) in enumerate(zip(job.nodes, schedule)):
        out.extend(validate_node(n, node, iterations, job.span if room else None, margin, overlap))
    groups = job_groups(job) if groups is None else [tuple(g) for g in groups]
    out.extend(group_violations(schedule, groups))
    return out
