"""Schedule files: reading, writing, and checking that a schedule is dependency-correct.

A schedule file is ``schedules[node][iteration] = [label, ...]`` (see the format spec). The trainer
walks it label by label, so a label in the wrong place means curvature built from the wrong data;
:func:`validate` finds every such place.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from pipefisher.errors import InputError
from pipefisher.policies.base import END, MARKERS, SAVE_OFF, SAVE_ON, START, JobSchedule
from pipefisher.safe_io import dump_pickle_atomic, load_pickle
from pipefisher.timeline import BACKWARD, COV_KINDS, FORWARD, Job, NodeTimeline, TimelineKey

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


@dataclass(frozen=True)
class Violation:
    """One broken rule: where (node, iteration, label) and which rule."""

    node: int
    iteration: int | None  # None: the rule is about the whole cycle
    label: str
    rule: str
    detail: str

    def __str__(self) -> str:
        where = "cycle" if self.iteration is None else f"iteration {self.iteration}"
        return f"node{self.node} {where}: {self.label}: {self.rule}: {self.detail}"


def _layer_key(key: TimelineKey) -> tuple[str | None, bool]:
    return (key.module, key.up_pipe)


def validate_node(node_index: int, node: NodeTimeline, iterations: Sequence[Sequence[str]]) -> list[Violation]:
    """Every violation of the spec's rules in one node's cycle."""
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
    return out


def validate(schedule: ScheduleData, job: Job, path: str | None = None) -> list[Violation]:
    """Every violation of the dependency rules and counts in ``schedule`` for ``job``."""
    if len(schedule) != len(job.nodes):
        raise InputError(path, f"has {len(schedule)} node schedules but the job has {len(job.nodes)} timelines")
    out: list[Violation] = []
    for n, (node, iterations) in enumerate(zip(job.nodes, schedule)):
        out.extend(validate_node(n, node, iterations))
    return out
