"""Does this schedule fit this run: the runtime's own checks, before any step runs.

The rules that make any schedule valid are :mod:`pipefisher.rules` (format, groups, waits); these checks
add what only the runtime knows: the model's stages and K-FAC modules, its pipeline order, its replicas
and the job the schedule's metadata says it was packed for.

:func:`check_schedule` refuses, before any step runs, a schedule that would go wrong: another node
count, unknown labels or modules, ``:up_pipe`` work in a one-pipe job, a forward and backward order
other than the engine's (the point-to-point traffic would deadlock), a cycle that breaks the
dependency rules (:func:`pipefisher.rules.dependencies.dependency_violations`, called on this run's
step as a timeline, :func:`step_timeline`: markers, counts, covariance after its micro-batch, sync
after covariance, inverse after sync, every factor refreshed; with several replicas of a stage, every
factor all-reduced), saving markers beyond the cycle's two, or, under
Chimera, two devices sharing a group that would all-reduce (or refresh) their factors in different
orders (they would deadlock, mix factors up, or let the two copies of a stage drift apart).
Every worker checks every node, so all of them refuse together instead of some waiting on the others.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from pipefisher.errors import InputError
from pipefisher.rules.dependencies import dependency_violations
from pipefisher.rules.groups import chimera_groups
from pipefisher.rules.waits import group_violations
from pipefisher.runtime.job.config import RENAMED_KEYS, RunConfig, cov_limit, current_builder
from pipefisher.runtime.pipeline.labels import PIPELINE_CALLS, UNKNOWN, labelled, parse_label
from pipefisher.runtime.pipeline.layout import is_chimera, node_kfac_names, sync_copies
from pipefisher.schedule.file import load_schedule, modules_difference, schedule_overlap, schedule_packed_for
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START, ScheduleData, check_schedule_data
from pipefisher.schedule.timeline import UP_SUFFIX, Interval, NodeTimeline, cov_pieces, cov_record


def check_schedule_for_stage(iterations: Sequence[Sequence[str]], *, node: int,
                             names: Sequence[str] | Mapping[int, Sequence[str]], ops: Sequence[str],
                             replicas: int = 1, path: str | None = None, interleaved: bool = False,
                             overlap: bool = False, cov_micro_batches: int | None = None) -> None:
    """Refuse (:class:`InputError`) one node's cycle unless this runtime can run it as the spec says.

    ``names`` are the device's K-FAC modules (per pipe under Chimera), ``ops`` the engine's
    forward/backward labels of one step (:func:`pipefisher.runtime.pipeline.engine.pipeline_ops`), ``replicas``
    how many copies of each stage average their factors (sync_kron is needed when more than one),
    ``interleaved`` whether the copies are chunks (``:chunk<j>``) rather than pipes (``:up_pipe``),
    ``overlap`` whether the schedule's metadata says its refreshes overlap cycles (inverse labels may then
    stand before their factor's completion: pieces of the previous cycle's refresh). A refresh may run in
    several inverse labels (pieces); that their count is K-FAC's the executor checks, which knows it.
    ``cov_micro_batches``: the micro-batches of each pipe K-FAC saves for covariance (None: all): the
    covariance pieces per factor the cycle must hold. Pure: no torch, no process group.
    """
    def refuse(where: str, problem: str) -> None:
        raise InputError(path, f"node {node} {where}: {problem}")

    if not iterations:
        refuse("", "has no pipeline iterations")
    by_pipe = {0: list(names)} if not isinstance(names, Mapping) else {p: list(n) for p, n in names.items()}
    known = {(p, n) for p, ns in by_pipe.items() for n in ns}
    for i, labels in enumerate(iterations):  # first what each label is, then where it stands
        for label in labels:
            kind, factor, module, pipe = parse_label(label)
            chunked = pipe > 0 and not label.endswith(UP_SUFFIX)
            if chunked and (not interleaved or pipe not in by_pipe):
                refuse(f"iteration {i}", f"'{label}': work of model chunk {pipe}, but this run has "
                       + (f"{len(by_pipe)} chunk(s) per device" if interleaved else
                          "one model chunk per device (pipeline.order: interleaved, zb-v and dualpipev "
                          "have several)"))
            if pipe not in by_pipe or (pipe > 0 and interleaved and not chunked):
                refuse(f"iteration {i}", f"'{label}': work of a second (up) pipeline, but this run's "
                                         "pipeline has one pipe (pipeline.order: chimera has two)")
            if kind == UNKNOWN:
                refuse(f"iteration {i}", f"'{label}': unknown label")
            if factor is not None and module is None:
                refuse(f"iteration {i}", f"'{label}': no module name; this runtime needs "
                                         "'<kind>:<module>' labels")
            if factor is not None and (pipe, module) not in known:
                refuse(f"iteration {i}", f"'{label}': this stage has no K-FAC module named '{module}'"
                                         + (" on its up pipe" if pipe else "")
                                         + " (the schedule is for another model, stage split or kfac.ignore)")
    for i, labels in enumerate(iterations):  # what only this runtime needs of each iteration
        where = f"iteration {i}"
        pipe_calls = [lb for lb in labels if parse_label(lb).kind in PIPELINE_CALLS]
        if pipe_calls != list(ops):
            if sorted(pipe_calls) != sorted(ops):
                def count(seq: Sequence[str]) -> str:
                    return ", ".join(f"{seq.count(x)} {x}" for x in sorted(set(ops) | set(pipe_calls)))
                refuse(where, f"has {count(pipe_calls)}, but this run's pipeline step has {count(ops)} "
                              "(data.num_micro_batches, pipeline.order)")
            refuse(where, "runs its forwards and backwards in another order than this run's pipeline "
                          "(pipeline.order, stages); it would deadlock the point-to-point transfers")
        if START in labels[1:]:
            refuse(where, f"has a second '{START}'")
        if END in labels:  # '-- end --' steps the optimizer: the step's calls come before it
            late = [lb for lb in labels[labels.index(END) + 1:] if lb in (START, END) or lb in pipe_calls]
            if late:
                refuse(where, f"'{late[0]}' after '{END}'")
        for marker, at in ((SAVE_OFF, 0), (SAVE_ON, len(iterations) - 1)):
            if labels.count(marker) > int(i == at):  # the rules check the one's place
                refuse(where, f"'{marker}' {'again' if i == at else 'here'}: a cycle has it once, in iteration "
                              f"{at}; another would change which micro-batches the workers save for covariance")
    syncs = {lb for labels in iterations for lb in labels if parse_label(lb).kind == "sync_kron"}
    inverses = Counter(lb for labels in iterations for lb in labels if parse_label(lb).kind == "inv_kron")
    model = step_timeline(ops, by_pipe, interleaved, syncs, every_sync=replicas > 1, inverses=inverses,
                          cov_micro_batches=cov_micro_batches)
    bad = dependency_violations(node, model, iterations, needs="this run's step needs", overlap=overlap)
    if bad:  # the first, in the runtime's words; the rule's name says which
        v = bad[0]
        no_sync = v.rule == "inv-before-sync" or parse_label(v.label).kind == "sync_kron"
        hint = (f"; this run has {replicas} replicas of the stage, which all-reduce each factor with "
                f"sync_kron before its inverse" if replicas > 1 and no_sync else "")
        where = "cycle" if v.iteration is None else f"iteration {v.iteration}"
        refuse(where, f"'{v.label}': {v.detail} ({v.rule}){hint}")


def step_timeline(ops: Sequence[str], by_copy: Mapping[int, Sequence[str]], interleaved: bool,
                  syncs: Iterable[str] = (), every_sync: bool = False,
                  inverses: Mapping[str, int] | None = None, cov_micro_batches: int | None = None) -> NodeTimeline:
    """One node's step in this run as the dependency rules (:mod:`pipefisher.rules.dependencies`) read a
    profiled timeline: every pipeline call of ``ops`` as often as the engine makes it, and per factor of
    each stage copy's K-FAC modules one covariance key (a piece per micro-batch of the copy), one
    inverse (or as many as ``inverses`` counts for its label: a refresh in pieces), and one all-reduce where
    ``every_sync`` (several replicas) or ``syncs`` names it; a piece per micro-batch up to
    ``cov_micro_batches`` (None: all). The intervals hold no times: the rules only count them."""
    none = Interval(None, None)
    entries: dict[str, tuple[Interval, ...]] = {op: (none,) * ops.count(op) for op in dict.fromkeys(ops)}
    syncs = set(syncs)
    for copy, names in by_copy.items():
        for name in names:
            shown = labelled(name, copy, interleaved)
            for f in "AB":
                entries[f"cov_kron_{f}:{shown}"] = (none,)
                if every_sync or f"sync_kron_{f}:{shown}" in syncs:
                    entries[f"sync_kron_{f}:{shown}"] = (none,)
                inv = f"inv_kron_{f}:{shown}"
                entries[inv] = (none,) * max(1, (inverses or {}).get(inv, 1))
    return NodeTimeline("<this run>", entries, cov_micro_batches)


def check_schedule(data: Any, cfg: RunConfig, replicas: int = 1, path: str | os.PathLike[str] | None = None,
                   overlap: bool = False) -> ScheduleData:
    """Refuse a schedule that does not belong to this job; every node is checked, whatever the caller's.
    ``overlap``: its metadata says its refreshes overlap cycles (:func:`pipefisher.schedule.file.schedule_overlap`)."""
    from pipefisher.runtime.pipeline.engine import pipeline_ops

    p = None if path is None else os.fspath(path)
    data = check_schedule_data(data, p)
    stages = cfg.pipeline.stages
    if len(data) != stages:
        raise InputError(p, f"has {len(data)} node schedule(s) but this run has {stages} pipeline stage(s)")
    for node, names in enumerate(node_kfac_names(cfg)):
        ops = pipeline_ops(cfg.pipeline.order, node, stages, cfg.data.num_micro_batches, cfg.pipeline.chunks)
        check_schedule_for_stage(data[node], node=node, names=names, ops=ops,
                                 replicas=sync_copies(cfg, replicas), path=p, interleaved=cfg.pipeline.chunked,
                                 overlap=overlap, cov_micro_batches=cov_limit(cfg.kfac.cov_micro_batches))
    if is_chimera(cfg):
        bad = group_violations(data, chimera_groups(stages))
        if bad:
            why = ("; it would hang until pipeline.timeout_s" if bad[0].rule == "deadlock" else
                   " (devices that share a group must all-reduce and refresh their factors in the same order; "
                   "pack with 'tight', which aligns them)")
            raise InputError(p, f"{bad[0]}{why}")
    return data


SHAPE_KEYS = ("model.builder", "model.options", "model.vocab_size", "model.hidden_size", "model.num_layers",
              "model.num_heads", "model.intermediate_size", "model.max_position", "data.seq_len",
              "data.micro_batch_size", "data.num_micro_batches", "pipeline.stages", "pipeline.order",
              "pipeline.chunks")
"""The config values a schedule's fit depends on: its labels (stages, micro-batches, pipeline order,
chunks) and the K-FAC and pipeline times it was packed from (the model's and the micro-batches' shape)."""

MISMATCH_FLAG = "--allow-schedule-mismatch"


def packed_for(cfg: RunConfig) -> dict[str, Any]:
    """What a schedule packed for ``cfg`` fits, as its metadata records it (``packed_for``,
    :func:`pipefisher.schedule.file.save_schedule`): the :data:`SHAPE_KEYS` values (``pipeline.chunks`` 1
    unless interleaved), ``kfac.cov_micro_batches`` (:func:`pipefisher.schedule.timeline.cov_record`) and, per node,
    its K-FAC modules as the labels name them (the keys of
    :func:`pipefisher.schedule.file.job_layout`, which is what a profile alone can say)."""
    import json

    values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SHAPE_KEYS}
    values["pipeline.chunks"] = cfg.pipeline.chunks if cfg.pipeline.chunked else 1
    values["kfac.cov_micro_batches"] = cov_record(cov_limit(cfg.kfac.cov_micro_batches), cfg.data.num_micro_batches)
    values["modules"] = [sorted(labelled(n, pipe, cfg.pipeline.chunked) for pipe, names in by_pipe.items()
                                for n in names) for by_pipe in node_kfac_names(cfg)]
    return json.loads(json.dumps(values, default=list))  # as JSON reads it back: lists, plain dicts


def schedule_mismatch(recorded: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """What differs between the job a schedule was packed for (``recorded``) and ``cfg``, in a few
    words, or None; keys the record lacks (a schedule packed from timelines alone) are not compared."""
    here = packed_for(cfg)
    diffs = []
    for key, want in recorded.items():
        key = RENAMED_KEYS.get(key, key)  # metadata written before the key was renamed
        if key == "model.builder":
            want = current_builder(want)
        if key not in here or here[key] == want:
            continue
        if key == "modules":
            nodes = [n for n, (a, b) in enumerate(zip(want, here[key])) if a != b] if isinstance(want, list) else []
            n = nodes[0] if nodes else 0
            ours = here[key][n] if n < len(here[key]) else []
            theirs = want[n] if isinstance(want, list) and n < len(want) and isinstance(want[n], list) else []
            diffs.append(modules_difference(n, theirs, ours, "in this run"))
        else:
            diffs.append(f"{key} {want!r} (this run: {here[key]!r})")
    return ", ".join(diffs) or None


def check_packed_for(path: str | os.PathLike[str], cfg: RunConfig, allow_mismatch: bool = False) -> str | None:
    """Refuse a schedule whose metadata says it was packed for another job than ``cfg`` (another model
    shape, stage split, micro-batch count, pipeline order or K-FAC modules); a schedule without that
    record (a published file) passes. With ``allow_mismatch``, return the difference instead."""
    recorded = schedule_packed_for(path)
    diff = None if recorded is None else schedule_mismatch(recorded, cfg)
    if diff is not None and not allow_mismatch:
        raise InputError(os.fspath(path), f"was packed for another job: {diff}; pack one for this run "
                                          f"(pipefisher run, or train --profile then schedule), or pass "
                                          f"{MISMATCH_FLAG} to train it anyway")
    return diff


def load_checked_schedule(path: str | os.PathLike[str], cfg: RunConfig, replicas: int = 1,
                          allow_mismatch: bool = False) -> ScheduleData:
    """Load a schedule file through the restricted loader, refuse it if its metadata says it was packed
    for another job (:func:`check_packed_for`, unless ``allow_mismatch``), and :func:`check_schedule` it."""
    data = load_schedule(path)
    check_packed_for(path, cfg, allow_mismatch)
    return check_schedule(data, cfg, replicas, path, overlap=schedule_overlap(path))


def single_iteration_schedule(cfg: RunConfig, replicas: int = 1) -> ScheduleData:
    """A cycle of one iteration: the pipeline, then all K-FAC work in naive order, then ``-- end --``.

    It refreshes the curvature every step from that step's micro-batches, exactly as ``kfac`` mode
    with ``kfac.interval: 1`` does (a baseline, and the reference of the tests). Under Chimera the
    two copies' work comes in canonical (stage index) order, so a pair's syncs line up.
    """
    from pipefisher.runtime.pipeline.engine import pipeline_ops

    out = []
    stages, m = cfg.pipeline.stages, cfg.data.num_micro_batches
    for node, by_pipe in enumerate(node_kfac_names(cfg)):
        labels = [START, *pipeline_ops(cfg.pipeline.order, node, stages, m, cfg.pipeline.chunks)]
        mods = [labelled(n, pipe, cfg.pipeline.chunked) for pipe, names in by_pipe.items() for n in names]
        per_copy = cov_pieces(m if cfg.pipeline.chunked else m // len(by_pipe),  # each chunk sees every one
                              cov_limit(cfg.kfac.cov_micro_batches))
        for name in mods:
            for f in "AB":
                labels += [f"cov_kron_{f}:{name}"] * per_copy
        if sync_copies(cfg, replicas) > 1:
            labels += [f"sync_kron_{f}:{name}" for name in mods for f in "AB"]
        labels += [f"inv_kron_{f}:{name}" for name in mods for f in "AB"]
        out.append([labels + [END, SAVE_OFF, SAVE_ON]])
    return out
