"""Schedule files: reading and writing them, and the metadata written beside them.

A schedule file is ``schedules[node][iteration] = [label, ...]`` (see the format spec), a plain list as
the published tool writes it; what makes one valid is :mod:`pipefisher.rules`. A packed schedule also
gets ``<file>.meta.json``: the policy, margins, cycles, the timelines it was packed from and the job it
fits, which ``validate``, the trainer and the runtime's checks read back.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from pipefisher.errors import InputError
from pipefisher.safe_io import dump_json_atomic, dump_pickle_atomic, load_json, load_pickle
from pipefisher.schedule.format import ScheduleData, check_schedule_data
from pipefisher.schedule.packed import JobSchedule
from pipefisher.schedule.timeline import Job, cov_record


def schedule_digest(data: ScheduleData) -> str:
    """A short hash of a schedule's labels (checkpoints and workers compare it)."""
    import hashlib  # here: saving a schedule needs none (some 3 ms of the packing command's start)

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
                  packed_for: Mapping[str, Any] | None = None, overlap: bool = False,
                  margin: float | None = None) -> None:
    """Write the schedule file atomically (the old file stays whole if anything fails).

    A packed :class:`JobSchedule` also gets its metadata beside it (:func:`meta_path`): the policy, the
    margin it was packed under, ``"overlap": true`` where its cycles overlap, and the K-FAC inflation ``kfac_margin`` it was packed against
    (:func:`pipefisher.schedule.timeline.inflate_kfac`; so ``validate`` checks it under the same rule, on the
    same job), per node the cycle and its lower bound, the ``timelines`` it was packed from where
    given (absolute paths: the trainer plans its measurements against them), and ``packed_for``, the
    job it fits (:func:`job_layout`, plus the run config's shape where known; the runtime refuses
    another). Plain schedule data gets metadata only where its cycles overlap (``overlap``, a re-pack of
    ``--adapt``): that, and the ``margin`` it was packed under, so that it is checked by the rules it was
    packed to. The schedule file itself stays the published format, a plain list.
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
            **({"overlap": True} if schedule.overlap else {}),
            "nodes": [{"iterations": n.figures.iterations, "lower_bound": n.figures.lower_bound,
                       "optimal": n.figures.optimal if n.figures.lower_bound is not None else None}
                      for n in schedule.nodes],
            **({"timelines": [os.path.abspath(os.fspath(t)) for t in timelines]} if timelines else {}),
            **({"packed_for": dict(packed_for)} if packed_for else {}),
        })
    elif overlap:
        dump_json_atomic(meta_path(path), {"format": "pipefisher-schedule-meta/1", "overlap": True,
                                           **({"margin": margin} if margin is not None else {})})
    elif os.path.exists(meta_path(path)):
        os.remove(meta_path(path))  # metadata of an older schedule would describe the wrong one


def job_layout(job: Job) -> dict[str, Any]:
    """What a job's timelines say about the job a schedule packed from them fits, keyed like the run
    config: ``pipeline.stages`` (nodes), ``data.num_micro_batches`` (node 0's forwards of chunk 0, both
    pipes), and ``modules``, per node its K-FAC modules as the labels name them (left out where a
    timeline has bare keys), and ``layout``, what the timelines say of the pipeline order
    (:func:`timeline_shape`: model chunks per device, a second pipe, split backwards). The runtime compares
    it with its own (:mod:`pipefisher.runtime.pipeline.checks`), ``validate`` with its timelines'."""
    first = job.nodes[0]
    m = first.micro_batches() + first.micro_batches(up_pipe=True)
    out: dict[str, Any] = {"pipeline.stages": len(job.nodes), "data.num_micro_batches": m,
                           "layout": list(timeline_shape(job))}
    if first.cov_micro_batches is not None:  # a profile that recorded it (COV_MICRO_BATCHES_KEY)
        out["kfac.cov_micro_batches"] = cov_record(first.cov_micro_batches, m)
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


def schedule_overlap(path: str | os.PathLike[str]) -> bool:
    """Whether a schedule's cycles overlap (metadata ``"overlap": true``, written by the packer that made
    it: :mod:`pipefisher.schedule.problem`); False where nothing is recorded."""
    meta = read_schedule_meta(path)
    overlap = False if meta is None else meta.get("overlap", False)
    if not isinstance(overlap, bool):
        raise InputError(meta_path(path), f"holds no valid overlap ({overlap!r}; true or false)")
    return overlap


def schedule_kfac_margin(path: str | os.PathLike[str]) -> float:
    """The K-FAC inflation a schedule was packed against (:func:`pipefisher.schedule.timeline.inflate_kfac`), as
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


def modules_difference(node: int, theirs: Sequence[str], ours: Sequence[str], here: str = "here") -> str:
    """How one node's K-FAC modules differ between a schedule's record (``theirs``) and a job
    (``ours``, named ``here``): which are in the schedule only, which are missing from it, one example each."""
    extra, missing = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    parts = ([f"{len(extra)} of its {len(theirs)} not {here} (e.g. '{extra[0]}')"] if extra else []) + \
            ([f"{len(missing)} {here} not in it (e.g. '{missing[0]}')"] if missing else [])
    return f"node {node}'s K-FAC modules: " + "; ".join(parts or ["another order"])


def pipeline_shape(order: str, stages: int, micro_batches: int, chunks: int = 1) -> tuple[int, bool, bool]:
    """What a pipeline order leaves in a node's timeline: (model chunks per device, a second pipe,
    backwards split into B and W passes), from the order's own generator."""
    from pipefisher.pipeline_orders import UP, WEIGHT, generate

    ops = [op for device in generate(order, stages, micro_batches, chunks if chunks > 1 else None).devices
           for op in device]
    return (max(op.chunk for op in ops) + 1, any(op.pipe == UP for op in ops), any(op.kind == WEIGHT for op in ops))


def timeline_shape(job: Job) -> tuple[int, bool, bool]:
    """What a job's timelines hold of its pipeline order: :func:`pipeline_shape`'s figures, from node 0."""
    node = job.nodes[0]
    return (len(node.chunks), node.has_up_pipe,
            any(node.weights(up, c) for up in (False, True) for c in node.chunks))


def _shape_words(shape: Sequence[Any]) -> str:
    chunks, up, split = shape
    return (f"{chunks} model chunk{'s' if chunks > 1 else ''} per device" + (", two pipes" if up else "")
            + (", backwards split into B and W" if split else ", whole backwards"))


def timelines_mismatch(path: str | os.PathLike[str], job: Job) -> str | None:
    """What differs between the job a schedule's metadata says it was packed for and the job of these
    timelines, in a few words (the pipeline order first), or None: what ``validate`` says instead of
    every label that could not fit."""
    recorded = schedule_packed_for(path)
    if recorded is None:
        return None
    here = job_layout(job)
    order = recorded.get("pipeline.order", recorded.get("pipeline.schedule"))  # metadata written before its rename
    stages, m = (recorded.get(k) for k in ("pipeline.stages", "data.num_micro_batches"))
    diffs = []
    layout = recorded.get("layout")
    if isinstance(layout, list) and len(layout) == 3 and tuple(layout) != timeline_shape(job):
        diffs.append(f"another pipeline order ({_shape_words(tuple(layout))}; the timelines: "
                     f"{_shape_words(timeline_shape(job))})")
    elif isinstance(order, str) and isinstance(stages, int) and isinstance(m, int):
        chunks = recorded.get("pipeline.chunks")
        try:
            want = pipeline_shape(order, stages, m, chunks if isinstance(chunks, int) else 1)
        except InputError:
            want = None  # not an order this version knows: the rules will say what does not fit
        if want is not None and want != timeline_shape(job):
            diffs.append(f"pipeline {order} ({_shape_words(want)}; the timelines: {_shape_words(timeline_shape(job))})")
    for key in ("pipeline.stages", "data.num_micro_batches"):
        if key in recorded and key in here and recorded[key] != here[key]:
            diffs.append(f"{key} {recorded[key]!r} (the timelines: {here[key]!r})")
    cov = "kfac.cov_micro_batches"  # timelines that record none cover all micro-batches
    if cov in recorded and recorded[cov] != here.get(cov, "all"):
        diffs.append(f"{cov} {recorded[cov]!r} (the timelines: {here.get(cov, 'all')!r})")
    theirs, ours = recorded.get("modules"), here.get("modules")
    if not diffs and isinstance(theirs, list) and isinstance(ours, list) and theirs != ours:
        n = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), 0)
        diffs.append(modules_difference(n, theirs[n] if n < len(theirs) else [], ours[n] if n < len(ours) else [],
                                        "in the timelines"))
    return ", ".join(diffs) or None
