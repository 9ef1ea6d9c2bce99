"""Schedule files: reading, writing, and checking that a schedule is dependency-correct.

A schedule file is ``schedules[node][iteration] = [label, ...]`` (see the format spec). The trainer
walks it label by label, so a label in the wrong place means curvature built from the wrong data;
:func:`validate` finds every such place.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Callable, Sequence

from pipefisher.errors import InputError
from pipefisher.policies.base import END, MARKERS, SAVE_OFF, SAVE_ON, START, JobSchedule
from pipefisher.policies.bounds import MARGIN
from pipefisher.policies.groups import job_groups
from pipefisher.policies.model import node_model, sane_bounds
from pipefisher.policies.waits import group_violations
from pipefisher.safe_io import dump_pickle_atomic, load_pickle
from pipefisher.timeline import BACKWARD, COV_KINDS, FORWARD, Job, NodeTimeline, Time, TimelineKey
from pipefisher.violations import Violation

ScheduleData = list[list[list[str]]]


def check_schedule_data(data: Any, path: str | None = None) -> ScheduleData:
    """Check the schedule file's structure: a list per node of a list per iteration of label strings."""
    if not isinstance(data, list):
        raise InputError(path, f"holds a {type(data).__name__}, not a list of per-node schedules")
    for n, node in enumerate(data):
        if not isinstance(node, list):
            raise InputError(path, f"node {n} holds a {type(node).__name__}, not a list of iterations")
        for i, it in enumerate(node):
            if not isinstance(it, list) or not all(isinstance(label, str) for label in it):
                raise InputError(path, f"node {n} iteration {i} is not a list of label strings")
    return data


def load_schedule(path: str | os.PathLike[str]) -> ScheduleData:
    """Load a schedule file through the restricted pickle loader and check its structure."""
    return check_schedule_data(load_pickle(path), os.fspath(path))


def save_schedule(path: str | os.PathLike[str], schedule: JobSchedule | ScheduleData) -> None:
    """Write the schedule file atomically (the old file stays whole if anything fails)."""
    data = schedule.to_file_data() if isinstance(schedule, JobSchedule) else schedule
    dump_pickle_atomic(path, check_schedule_data(data))


# ----------------------------------------------------------------------------------------------------
# Dependency rules


def _layer_key(key: TimelineKey) -> tuple[str | None, bool]:
    return (key.module, key.up_pipe)


def validate_node(node_index: int, node: NodeTimeline, iterations: Sequence[Sequence[str]],
                  span: Time | None = None) -> list[Violation]:
    """Every violation of the spec's rules in one node's cycle; with the job's pipeline time ``span``,
    also of the bubbles' room (see :func:`_room_violations`)."""
    out: list[Violation] = []

    def bad(iteration: int | None, label: str, rule: str, detail: str) -> None:
        out.append(Violation(node_index, iteration, label, rule, detail))

    if not iterations:
        bad(None, "-", "empty-cycle", "the node has no iterations")
        return out

    pipe_counts = {False: node.micro_batches(False), True: node.micro_batches(True)}
    known = set(MARKERS)
    expected: dict[str, int] = {}
    has_sync: set[tuple[str, tuple[str | None, bool]]] = set()
    for key, intervals in node.entries.items():
        parsed = TimelineKey.parse(key)
        if parsed.kind in (FORWARD, BACKWARD):
            known.add(key)
        elif parsed.is_kfac:
            known.add(key)
            per = pipe_counts[parsed.up_pipe] if parsed.kind in COV_KINDS else 1
            expected[key] = expected.get(key, 0) + len(intervals) * per
            if parsed.kind.startswith("sync"):
                has_sync.add((parsed.factor or "", _layer_key(parsed)))

    # -- markers and per-iteration pipeline work ------------------------------------------------
    last = len(iterations) - 1
    for i, labels in enumerate(iterations):
        if not labels or labels[0] != START:
            bad(i, labels[0] if labels else "-", "iteration-start", f"the iteration does not begin with '{START}'")
        ends = [j for j, label in enumerate(labels) if label == END]
        if len(ends) != 1:
            bad(i, END, "iteration-end", f"the iteration has {len(ends)} '{END}' labels, not 1")
        for pipe_key in (FORWARD, BACKWARD, FORWARD + ":up_pipe", BACKWARD + ":up_pipe"):
            want = len(node.intervals(pipe_key))
            got = sum(1 for label in labels if label == pipe_key)
            if got != want:
                bad(i, pipe_key, "pipeline-count", f"{got} in the iteration, the pipeline step has {want}")
        for label in labels:
            if label not in known:
                bad(i, label, "unknown-label", "not a marker and not a key of this node's timeline")
        if i == 0:
            after_end = labels[ends[0] + 1:] if len(ends) == 1 else []
            if SAVE_OFF not in after_end:
                bad(0, SAVE_OFF, "save-off", f"the first iteration must stop saving after its '{END}'")
        if i == last and (not labels or labels[-1] != SAVE_ON):
            bad(i, SAVE_ON, "save-on", "the last iteration must end by turning saving back on")

    # -- dependencies, walking the cycle in execution order ---------------------------------------
    seen_pipe = {(FORWARD, False): 0, (BACKWARD, False): 0, (FORWARD, True): 0, (BACKWARD, True): 0}
    cov_done: dict[str, int] = defaultdict(int)  # label -> pieces so far
    count: dict[str, int] = defaultdict(int)
    factor_state: dict[tuple[str, tuple[str | None, bool]], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for i, labels in enumerate(iterations):
        for label in labels:
            if label in MARKERS or label not in known:
                continue
            key = TimelineKey.parse(label)
            if key.kind in (FORWARD, BACKWARD):
                if i == 0:
                    seen_pipe[(key.kind, key.up_pipe)] += 1
                continue
            count[label] += 1
            layer = (key.factor or "", _layer_key(key))
            state = factor_state[layer]
            m = pipe_counts[key.up_pipe]
            if key.kind in COV_KINDS:
                j = cov_done[label]
                cov_done[label] += 1
                state["cov"] += 1
                needed_op = FORWARD if key.factor == "A" else BACKWARD
                mb = j % m if m else j
                if seen_pipe[(needed_op, key.up_pipe)] < mb + 1:
                    what = "forward" if needed_op == FORWARD else "backward"
                    rule = f"cov-before-{what}"
                    bad(i, label, rule, f"piece {j} needs {what} {mb} of the first iteration"
                        f"{' (up pipe)' if key.up_pipe else ''}, which has not run yet")
            elif key.kind.startswith("sync"):
                cov_key = f"cov_kron_{key.factor}" + label[len(key.kind):]
                want = expected.get(cov_key, 0)
                if state["cov"] < want:
                    bad(i, label, "sync-before-cov", f"only {state['cov']} of {want} covariance pieces done")
                state["sync"] += 1
            else:  # inverse
                cov_key = f"cov_kron_{key.factor}" + label[len(key.kind):]
                want = expected.get(cov_key, 0)
                if layer in has_sync:
                    if state["sync"] < 1:
                        bad(i, label, "inv-before-sync", "the factor has not been all-reduced yet")
                elif state["cov"] < want:
                    bad(i, label, "inv-before-cov", f"only {state['cov']} of {want} covariance pieces done")

    for label, want in expected.items():
        got = count.get(label, 0)
        if got != want:
            what = "pieces" if TimelineKey.parse(label).kind in COV_KINDS else "times"
            bad(None, label, "work-count", f"appears {got} {what} in the cycle, the timeline asks for {want}")
    if span is not None:
        _room_violations(node, iterations, span, bad)
    return out


def _room_violations(node: NodeTimeline, iterations: Sequence[Sequence[str]], span: Time,
                     bad: Callable[[int | None, str, str, str], None]) -> None:
    """K-FAC work between two pipeline items must fit the idle time between them, as measured.

    A schedule that claims more room than a bubble has (pieces floored to zero length, a missing time
    read as 0, a gap counted while another item still runs) makes every such iteration longer than
    reported: ``bubble-overfilled``. Work after an iteration's last pipeline item may run past the
    pipeline time only if it fits no bubble of the node (with the 5 % margin); otherwise it lengthens
    the iteration for nothing: ``unforced-overflow``. Covariance pieces are measured at their floor
    (length // m), so rounding never counts against a schedule.
    """
    model = node_model(node, span)
    where: dict[str, list[tuple[Time, Time]]] = defaultdict(list)  # per pipeline key, in time order
    for key, s, e in model.pipeline:
        where[key].append((s, e))
    largest = max((b.length for b in model.bubbles), default=0)
    lengths: dict[str, list[Time]] = {}
    pieces_per: dict[str, int] = {}
    for key, intervals in node.entries.items():
        parsed = TimelineKey.parse(key)
        if parsed.is_kfac:
            lengths[key] = [e - s for s, e in (sane_bounds(iv, 0) for iv in intervals)]
            pieces_per[key] = max(node.micro_batches(parsed.up_pipe), 1) if parsed.kind in COV_KINDS else 1
    done: dict[str, int] = defaultdict(int)
    begin = min(min((s for _, s, _ in model.pipeline), default=0), 0)
    tolerance = 1e-9 * max(abs(model.base), abs(begin), 1) if isinstance(model.base, float) else 0
    for i, labels in enumerate(iterations):
        seen: dict[str, int] = defaultdict(int)
        frontier: Time = begin
        pending: list[tuple[str, Time]] = []
        for label in labels:
            if label in where:
                k = seen[label]
                seen[label] += 1
                if k >= len(where[label]):
                    continue  # the pipeline-count rule reports it
                s, e = where[label][k]
                work = sum(d for _, d in pending)
                if work > 0 and work > s - frontier + tolerance:
                    bad(i, label, "bubble-overfilled", f"{work} of K-FAC work is placed before it, but only "
                        f"{max(s - frontier, 0)} of idle time precedes it")
                frontier = max(frontier, e)
                pending = []
            elif label in lengths and lengths[label]:
                n, m = done[label], pieces_per[label]
                done[label] += 1
                d = lengths[label][(n // m) % len(lengths[label])]
                pending.append((label, d // m if isinstance(d, int) else d / m))
        room = model.base - frontier
        for label, d in pending:  # after the last pipeline item: up to the pipeline time, then overflow
            room -= d
            if room < -tolerance and d * MARGIN < largest:
                bad(i, label, "unforced-overflow", f"runs past the pipeline time though it fits the node's "
                    f"largest bubble ({largest})")


def validate(schedule: ScheduleData, job: Job, path: str | None = None, room: bool = True,
             groups: Sequence[Sequence[int]] | None = None) -> list[Violation]:
    """Every violation of the dependency rules and counts in ``schedule`` for ``job``, with ``room`` of
    the bubbles' room (work that does not fit where it is placed), and of the sync groups' shared order
    (:func:`pipefisher.policies.groups.group_order_violations`); where a group has several members, also
    every step whose waits form a cycle (``deadlock``, :func:`pipefisher.policies.waits.deadlock_violations`).
    ``groups``: the nodes that hold replicas of one stage; None infers them from the job's layout
    (Chimera's pairs, or every node alone)."""
    if len(schedule) != len(job.nodes):
        raise InputError(path, f"has {len(schedule)} node schedules but the job has {len(job.nodes)} timelines")
    out: list[Violation] = []
    for n, (node, iterations) in enumerate(zip(job.nodes, schedule)):
        out.extend(validate_node(n, node, iterations, job.span if room else None))
    groups = job_groups(job) if groups is None else [tuple(g) for g in groups]
    out.extend(group_violations(schedule, groups))
    return out
