"""Schedule files: reading, writing, and checking that a schedule is dependency-correct.

A schedule file is ``schedules[node][iteration] = [label, ...]`` (see the format spec). The trainer
walks it label by label, so a label in the wrong place means curvature built from the wrong data;
:func:`validate` finds every such place.
"""
from __future__ import annotations

import hashlib
import os
from bisect import bisect_right
from collections import defaultdict
from itertools import accumulate
from typing import Any, Callable, Mapping, Sequence

from pipefisher.errors import InputError
from pipefisher.policies.base import END, MARKERS, SAVE_OFF, SAVE_ON, START, JobSchedule
from pipefisher.policies.groups import job_groups
from pipefisher.problem import DEFAULT_MARGIN, cov_source, fits, node_model, source_call
from pipefisher.policies.waits import group_violations
from pipefisher.safe_io import dump_json_atomic, dump_pickle_atomic, load_json, load_pickle
from pipefisher.timeline import COV_KINDS, Job, NodeTimeline, Time, TimelineKey, format_time
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


def schedule_digest(data: ScheduleData) -> str:
    """A short hash of a schedule's labels (checkpoints and workers compare it)."""
    h = hashlib.sha256()
    for n, node in enumerate(data):
        for i, labels in enumerate(node):
            h.update(f"{n}/{i}\0".encode())
            h.update("\0".join(labels).encode())
    return h.hexdigest()[:16]


def load_schedule(path: str | os.PathLike[str]) -> ScheduleData:
    """Load a schedule file through the restricted pickle loader and check its structure."""
    return check_schedule_data(load_pickle(path), os.fspath(path))


def meta_path(path: str | os.PathLike[str]) -> str:
    """Where a schedule file's metadata lies: beside it, ``<file>.meta.json``."""
    return os.fspath(path) + ".meta.json"


def save_schedule(path: str | os.PathLike[str], schedule: JobSchedule | ScheduleData,
                  timelines: Sequence[str | os.PathLike[str]] | None = None, *, kfac_margin: float = 1.0,
                  packed_for: Mapping[str, Any] | None = None) -> None:
    """Write the schedule file atomically (the old file stays whole if anything fails).

    A packed :class:`JobSchedule` also gets its metadata beside it (:func:`meta_path`): the policy, the
    margin it was packed under and the K-FAC inflation ``kfac_margin`` it was packed against
    (:func:`pipefisher.timeline.inflate_kfac`; so ``validate`` checks it under the same rule, on the
    same job), per node the cycle and its lower bound, the ``timelines`` it was packed from where
    given (absolute paths: the trainer plans its measurements against them), and ``packed_for``, the
    job it fits (:func:`job_layout`, plus the run config's shape where known; the runtime refuses
    another). The schedule file itself stays the published format, a plain list.
    """
    data = schedule.to_file_data() if isinstance(schedule, JobSchedule) else schedule
    dump_pickle_atomic(path, check_schedule_data(data))
    if isinstance(schedule, JobSchedule):
        dump_json_atomic(meta_path(path), {
            "format": "pipefisher-schedule-meta/1",
            "policy": schedule.policy,
            "margin": schedule.margin,
            "kfac_margin": kfac_margin,
            "pipeline_time": schedule.span,
            "nodes": [{"iterations": n.figures.iterations, "lower_bound": n.figures.lower_bound,
                       "optimal": n.figures.optimal if n.figures.lower_bound is not None else None}
                      for n in schedule.nodes],
            **({"timelines": [os.path.abspath(os.fspath(t)) for t in timelines]} if timelines else {}),
            **({"packed_for": dict(packed_for)} if packed_for else {}),
        })
    elif os.path.exists(meta_path(path)):
        os.remove(meta_path(path))  # metadata of an older schedule would describe the wrong one


def job_layout(job: Job) -> dict[str, Any]:
    """What a job's timelines say about the job a schedule packed from them fits, keyed like the run
    config: ``pipeline.stages`` (nodes), ``data.num_micro_batches`` (node 0's forwards of chunk 0, both
    pipes), and ``modules``, per node its K-FAC modules as the labels name them (left out where a
    timeline has bare keys). The runtime compares it with its own (:mod:`pipefisher.runtime.executor`)."""
    first = job.nodes[0]
    out: dict[str, Any] = {"pipeline.stages": len(job.nodes),
                           "data.num_micro_batches": first.micro_batches() + first.micro_batches(up_pipe=True)}
    modules = [sorted({str(k).partition(":")[2] for k in node.kfac_keys()}) for node in job.nodes]
    if all(names and "" not in names for names in modules):
        out["modules"] = modules
    return out


def read_schedule_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The metadata beside a schedule file (:func:`save_schedule`), or None where there is none."""
    where = meta_path(path)
    if not os.path.exists(where):
        return None
    meta = load_json(where)
    if not isinstance(meta, dict):
        raise InputError(where, f"holds a {type(meta).__name__}, not the schedule's metadata (a JSON object)")
    return meta


def schedule_timelines(path: str | os.PathLike[str]) -> list[str] | None:
    """The timeline files recorded beside a schedule file (what it was packed from), or None."""
    meta = read_schedule_meta(path)
    paths = None if meta is None else meta.get("timelines")
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return None
    return paths


def schedule_margin(path: str | os.PathLike[str]) -> float | None:
    """The margin recorded beside a schedule file, or None where there is no (readable) record."""
    meta = read_schedule_meta(path)
    if meta is None:
        return None
    margin = meta.get("margin")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin < 10:
        raise InputError(meta_path(path), f"holds no valid margin ({margin!r})")
    return float(margin)


def schedule_kfac_margin(path: str | os.PathLike[str]) -> float:
    """The K-FAC inflation a schedule was packed against (:func:`pipefisher.timeline.inflate_kfac`), as
    recorded beside it; 1 (the profiled times) where nothing is recorded."""
    meta = read_schedule_meta(path)
    scale = 1.0 if meta is None else meta.get("kfac_margin", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 1 <= scale < float("inf"):
        raise InputError(meta_path(path), f"holds no valid kfac_margin ({scale!r}; at least 1)")
    return float(scale)


def schedule_packed_for(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job a schedule was packed for, as recorded beside it (:func:`save_schedule`), or None."""
    meta = read_schedule_meta(path)
    packed_for = None if meta is None else meta.get("packed_for")
    if packed_for is not None and not isinstance(packed_for, dict):
        raise InputError(meta_path(path), f"holds no valid packed_for ({packed_for!r}; a JSON object)")
    return packed_for


# ----------------------------------------------------------------------------------------------------
# Dependency rules


def _layer_key(key: TimelineKey) -> tuple[str | None, bool, int]:
    return key.layer


def validate_node(node_index: int, node: NodeTimeline, iterations: Sequence[Sequence[str]],
                  span: Time | None = None, margin: float = DEFAULT_MARGIN) -> list[Violation]:
    """Every violation of the problem's rules (:mod:`pipefisher.problem`) in one node's cycle; with the
    job's pipeline time ``span``, also of the room rule with ``margin`` (see :func:`_room_violations`)."""
    out: list[Violation] = []

    def bad(iteration: int | None, label: str, rule: str, detail: str) -> None:
        out.append(Violation(node_index, iteration, label, rule, detail))

    if not iterations:
        bad(None, "-", "empty-cycle", "the node has no iterations")
        return out

    chunks = node.chunks
    pipe_counts = {(up, c): node.micro_batches(up, c) for up in (False, True) for c in chunks}
    known = set(MARKERS)
    expected: dict[str, int] = {}
    has_sync: set[tuple[str, tuple[str | None, bool, int]]] = set()
    for key, intervals in node.entries.items():
        parsed = TimelineKey.parse(key)
        if parsed.is_pipeline:
            known.add(key)
        elif parsed.is_kfac:
            known.add(key)
            per = pipe_counts.get((parsed.up_pipe, parsed.chunk), 0) if parsed.kind in COV_KINDS else 1
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
        for pipe_key in node.pipe_keys():
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
    seen_pipe: dict[tuple[str, bool, int], int] = defaultdict(int)  # (kind, up pipe, chunk) -> calls in iteration 0
    cov_done: dict[str, int] = defaultdict(int)  # label -> pieces so far
    count: dict[str, int] = defaultdict(int)
    factor_state: dict[tuple[str, tuple[str | None, bool, int]], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for i, labels in enumerate(iterations):
        for label in labels:
            if label in MARKERS or label not in known:
                continue
            key = TimelineKey.parse(label)
            if key.is_pipeline:
                if i == 0 and not key.is_weight:  # a W pass is no forward or backward pieces follow
                    seen_pipe[(key.kind, key.up_pipe, key.chunk)] += 1
                continue
            count[label] += 1
            layer = (key.factor or "", _layer_key(key))
            state = factor_state[layer]
            m = pipe_counts.get((key.up_pipe, key.chunk), 0)
            if key.kind in COV_KINDS:
                j = cov_done[label]
                cov_done[label] += 1
                state["cov"] += 1
                needed_op = cov_source(key.factor, key.up_pipe, key.chunk)
                mb = source_call(j, m)
                if seen_pipe[(TimelineKey.parse(needed_op).kind, key.up_pipe, key.chunk)] < mb + 1:
                    what = "forward" if key.factor == "A" else "backward"
                    rule = f"cov-before-{what}"
                    whose = " (up pipe)" if key.up_pipe else f" of chunk {key.chunk} ('{needed_op}')" if key.chunk else ""
                    bad(i, label, rule, f"piece {j} needs {what} {mb} of the first iteration"
                        f"{whose}, which has not run yet")
            elif key.kind.startswith("sync"):
                cov_key = f"cov_kron_{key.factor}" + label[len(key.kind):]
                want = expected.get(cov_key, 0)
                if state["cov"] < want:
                    bad(i, label, "sync-before-cov", f"only {state['cov']} of {want} covariance pieces done")
                state["sync"] += 1
            else:  # inverse
                cov_key = f"cov_kron_{key.factor}" + label[len(key.kind):]
                want = expected.get(cov_key, 0)
                if layer in has_sync:  # the inverse waits for the factor's first sync
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
        _room_violations(node, iterations, span, bad, margin)
    return out


def _room_violations(node: NodeTimeline, iterations: Sequence[Sequence[str]], span: Time,
                     bad: Callable[[int | None, str, str, str], None], margin: float = DEFAULT_MARGIN) -> None:
    """The room rule of :mod:`pipefisher.problem`, on the labels between two pipeline items.

    The K-FAC work labelled between two pipeline items runs back to back from the end of the first
    (the latest end of the pipeline items so far); each item must fit with its margin before the
    second starts: ``(1 + margin) d < start - t``, zero-length items too, each item measured as the
    packers measure it (the j-th covariance piece of a key is its j-th even share, a missing time no
    time) and ``t`` summed item by item, so that the check and the packers agree to the last bit. A
    schedule that claims more room than that makes every such iteration longer than reported (or
    leaves a bubble no safety margin): ``bubble-overfilled``. Work after an iteration's last pipeline
    item runs up to the pipeline time under the same rule; then only work that fits no bubble of the
    node may run (forced overflow, past the pipeline time); fittable work past the pipeline time or
    after forced work lengthens the iteration for nothing: ``unforced-overflow``.
    """
    model = node_model(node, span, margin)
    where: dict[str, list[tuple[Time, Time]]] = defaultdict(list)  # per pipeline key, in time order
    for key, s, e in model.pipeline:
        where[key].append((s, e))
    largest = model.largest
    lengths = model.durations  # per K-FAC key: its items' durations, in order
    done: dict[str, int] = defaultdict(int)
    begin = min(min((s for _, s, _ in model.pipeline), default=0), 0)

    # Pipeline items in time order, each with its occurrence of its key, and the running latest end: the
    # items a stretch of K-FAC work starting at t may run over are those after the first whose
    # running end passes t.
    occurrence: dict[str, int] = defaultdict(int)
    items: list[tuple[str, int, Time, Time]] = []
    for key, s, e in model.pipeline:
        items.append((key, occurrence[key], s, e))
        occurrence[key] += 1
    reach = list(accumulate((e for _, _, _, e in items), max))

    def over_unlisted(i: int, pending: list[tuple[str, Time]], start: Time, before: Time | None,
                      seen: dict[str, int]) -> None:
        """K-FAC work laid out from ``start`` that runs over a pipeline item the iteration has not listed
        before the next listed one (at ``before``; None: none follows), such as a zero-bubble W pass a
        schedule leaves out: that work and the pipeline would share the node's time."""
        end = start + sum(d for _, d in pending)
        for key, k, s, e in items[bisect_right(reach, start):]:
            if s >= end or (before is not None and s >= before):
                break
            if k >= seen[key] and e > start and s < end:
                bad(i, pending[0][0], "kfac-over-pipeline", f"K-FAC work runs {format_time(start)}..{format_time(end)}"
                    f", over '{key}' at {format_time(s)}..{format_time(e)}, which the iteration does not list "
                    f"before it")
                return

    def overfilled(pending: list[tuple[str, Time]], start: Time, end: Time) -> bool:
        t = start  # summed item by item from the gap's start, as the packers lay work out
        for _, d in pending:
            if not fits(d, end - t, margin):
                return True
            t += d
        return False

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
                if pending and overfilled(pending, frontier, s):
                    bad(i, label, "bubble-overfilled", f"{format_time(sum(d for _, d in pending))} of K-FAC work is "
                        f"placed before it, but {format_time(max(s - frontier, 0))} of idle time precedes it (each "
                        f"item needs its length x {1 + margin:g} free when it starts)")
                if pending:
                    over_unlisted(i, pending, frontier, s, seen)
                frontier = max(frontier, e)
                pending = []
            elif lengths.get(label):
                n = done[label]
                done[label] += 1
                pending.append((label, lengths[label][n % len(lengths[label])]))
        # After the last pipeline item: fittable work up to the pipeline time; then forced work only,
        # which runs past it (the iteration's overflow).
        over_unlisted(i, pending, frontier, None, seen)
        t = frontier
        overflowing = False
        for label, d in pending:
            if not fits(d, largest, margin):
                overflowing = True
            elif overflowing or not fits(d, model.base - t, margin):
                bad(i, label, "unforced-overflow", "runs past the pipeline time, into its margin or after "
                    f"overflow work, though it fits the node's largest bubble ({format_time(largest)})")
            t += d


def validate(schedule: ScheduleData, job: Job, path: str | None = None, room: bool = True,
             groups: Sequence[Sequence[int]] | None = None, margin: float = DEFAULT_MARGIN) -> list[Violation]:
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
        out.extend(validate_node(n, node, iterations, job.span if room else None, margin))
    groups = job_groups(job) if groups is None else [tuple(g) for g in groups]
    out.extend(group_violations(schedule, groups))
    return out
