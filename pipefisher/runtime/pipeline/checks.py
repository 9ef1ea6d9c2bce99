"""Does this schedule fit this run: the runtime's own checks, before any step runs.

The rules that make any schedule valid are :mod:`pipefisher.rules` (format, groups, waits); these checks
add what only the runtime knows: the model's stages and K-FAC modules, its pipeline order, its replicas
and the job the schedule's metadata says it was packed for.

:func:`check_schedule` refuses, before any step runs, a schedule that would go wrong: another node
count, unknown labels or modules, ``:up_pipe`` work in a one-pipe job, a forward and backward order
other than the engine's (the point-to-point traffic would deadlock), K-FAC work that cannot run (a
covariance piece with no saved micro-batch, an inverse of an empty factor, saved micro-batches or
factors left over at the end of the cycle, no all-reduce with several replicas of a stage), or, under
Chimera, two devices sharing a group that would all-reduce (or refresh) their factors in different
orders (they would deadlock, mix factors up, or let the two copies of a stage drift apart).
Every worker checks every node, so all of them refuse together instead of some waiting on the others.
"""
from __future__ import annotations

import os
from collections import defaultdict, deque
from typing import Any, Mapping, Sequence

from pipefisher.errors import InputError
from pipefisher.rules.format import END, SAVE_OFF, SAVE_ON, START, ScheduleData, check_schedule_data
from pipefisher.rules.groups import chimera_groups
from pipefisher.rules.waits import group_violations
from pipefisher.runtime.job.config import RunConfig, current_builder
from pipefisher.runtime.pipeline.labels import BACKWARD, FORWARD, PIPELINE_CALLS, UNKNOWN, WEIGHT, labelled, parse_label
from pipefisher.runtime.pipeline.layout import is_chimera, node_kfac_names, sync_copies
from pipefisher.schedule_file import load_schedule, modules_difference, schedule_packed_for
from pipefisher.timeline import UP_SUFFIX


def check_schedule_for_stage(iterations: Sequence[Sequence[str]], *, node: int,
                             names: Sequence[str] | Mapping[int, Sequence[str]], ops: Sequence[str],
                             replicas: int = 1, path: str | None = None, interleaved: bool = False) -> None:
    """Refuse (:class:`InputError`) one node's cycle unless this runtime can run it as the spec says.

    ``names`` are the device's K-FAC modules (per pipe under Chimera), ``ops`` the engine's
    forward/backward labels of one step (:func:`pipefisher.runtime.pipeline.engine.pipeline_ops`), ``replicas``
    how many copies of each stage average their factors (sync_kron is needed when more than one),
    ``interleaved`` whether the copies are chunks (``:chunk<j>``) rather than pipes (``:up_pipe``).
    Pure: no torch, no process group.
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
                          "one model chunk per device (pipeline.schedule: interleaved and zb-v have several)"))
            if pipe not in by_pipe or (pipe > 0 and interleaved and not chunked):
                refuse(f"iteration {i}", f"'{label}': work of a second (up) pipeline, but this run's "
                                         "pipeline has one pipe (pipeline.schedule: chimera has two)")
            if kind == UNKNOWN:
                refuse(f"iteration {i}", f"'{label}': unknown label")
            if factor is not None and module is None:
                refuse(f"iteration {i}", f"'{label}': no module name; this runtime needs "
                                         "'<kind>:<module>' labels")
            if factor is not None and (pipe, module) not in known:
                refuse(f"iteration {i}", f"'{label}': this stage has no K-FAC module named '{module}'"
                                         + (" on its up pipe" if pipe else "")
                                         + " (the schedule is for another model, stage split or kfac.ignore)")
    k = len(iterations)
    # Symbolic K-FAC state through one cycle. At the start of every cycle (after step 0's naive
    # K-FAC, or the previous cycle) saving is on, nothing is saved, every factor is empty.
    saving = True
    Key = tuple  # (factor, module, pipe)
    saved: dict[Key, int] = defaultdict(int)  # saved micro-batches
    built: dict[Key, int] = defaultdict(int)  # pieces in the factor
    synced: dict[Key, bool] = defaultdict(bool)
    inverted: set[Key] = set()
    for i, labels in enumerate(iterations):
        where = f"iteration {i}"
        if not labels or labels[0] != START:
            refuse(where, f"does not begin with '{START}'")
        if labels.count(END) != 1:
            refuse(where, f"has {labels.count(END)} '{END}' labels, not 1")
        pipe_calls = [lb for lb in labels if parse_label(lb)[0] in PIPELINE_CALLS]
        if pipe_calls != list(ops):
            if sorted(pipe_calls) != sorted(ops):
                def count(seq: Sequence[str]) -> str:
                    return ", ".join(f"{seq.count(x)} {x}" for x in sorted(set(ops) | set(pipe_calls)))
                refuse(where, f"has {count(pipe_calls)}, but this run's pipeline step has {count(ops)} "
                              "(data.num_micro_batches, pipeline.schedule)")
            refuse(where, "runs its forwards and backwards in another order than this run's pipeline "
                          "(pipeline.schedule, stages); it would deadlock the point-to-point transfers")
        stash: dict[int, deque] = {p: deque() for p in by_pipe}  # saving flag per forward awaiting backward
        ended = False
        for j, label in enumerate(labels):
            kind, factor, module, pipe = parse_label(label)
            if ended and kind in (START, END, *PIPELINE_CALLS):
                refuse(where, f"'{label}' after '{END}'")
            if kind == END:
                ended = True
            elif kind == SAVE_ON or kind == SAVE_OFF:
                saving = kind == SAVE_ON
            elif kind == FORWARD:
                stash[pipe].append(saving)
                if saving:
                    for m in by_pipe[pipe]:
                        saved["A", m, pipe] += 1
            elif kind == BACKWARD:  # the B pass when split: factor B's output gradients come from it
                if stash[pipe].popleft():
                    for m in by_pipe[pipe]:
                        saved["B", m, pipe] += 1
            elif kind == WEIGHT:  # a W pass: weight gradients only, nothing K-FAC saves
                pass
            elif kind == START:
                if j != 0:
                    refuse(where, f"has a second '{START}'")
            else:
                assert factor is not None and module is not None
                key = (factor, module, pipe)
                if kind == "cov_kron":
                    if saved[key] <= 0:
                        refuse(where, f"'{label}': no saved micro-batch is left for this piece")
                    saved[key] -= 1
                    built[key] += 1
                    synced[key] = False
                elif kind == "sync_kron":
                    if built[key] == 0:
                        refuse(where, f"'{label}': the factor has no covariance to all-reduce")
                    synced[key] = True
                else:
                    if built[key] == 0:
                        refuse(where, f"'{label}': the factor has no covariance to invert")
                    if replicas > 1 and not synced[key]:
                        refuse(where, f"'{label}': the factor is inverted without a sync_kron all-reduce "
                                      f"first, but this run has {replicas} replicas of the stage")
                    built[key], synced[key] = 0, False
                    inverted.add(key)
    if not saving:
        refuse(f"iteration {k - 1}", f"the cycle must end with saving on ('{SAVE_ON}')")
    for pipe, ms in by_pipe.items():
        for m in ms:
            shown = labelled(m, pipe, interleaved)
            for f in "AB":
                key = (f, m, pipe)
                if saved[key]:
                    refuse("cycle", f"{saved[key]} saved micro-batch(es) of factor {f} of '{shown}' are never "
                                    f"used by a cov_kron_{f} piece")
                if built[key]:
                    refuse("cycle", f"factor {f} of '{shown}' is built but not inverted within the cycle")
                if key not in inverted:
                    refuse("cycle", f"factor {f} of '{shown}' is never refreshed (no inv_kron_{f}:{shown})")


def check_schedule(data: Any, cfg: RunConfig, replicas: int = 1, path: str | os.PathLike[str] | None = None) -> ScheduleData:
    """Refuse a schedule that does not belong to this job; every node is checked, whatever the caller's."""
    from pipefisher.runtime.pipeline.engine import pipeline_ops

    p = None if path is None else os.fspath(path)
    data = check_schedule_data(data, p)
    stages = cfg.pipeline.stages
    if len(data) != stages:
        raise InputError(p, f"has {len(data)} node schedule(s) but this run has {stages} pipeline stage(s)")
    for node, names in enumerate(node_kfac_names(cfg)):
        ops = pipeline_ops(cfg.pipeline.schedule, node, stages, cfg.data.num_micro_batches, cfg.pipeline.chunks)
        check_schedule_for_stage(data[node], node=node, names=names, ops=ops,
                                 replicas=sync_copies(cfg, replicas), path=p, interleaved=cfg.pipeline.chunked)
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
              "data.micro_batch_size", "data.num_micro_batches", "pipeline.stages", "pipeline.schedule",
              "pipeline.chunks")
"""The config values a schedule's fit depends on: its labels (stages, micro-batches, pipeline order,
chunks) and the K-FAC and pipeline times it was packed from (the model's and the micro-batches' shape)."""

MISMATCH_FLAG = "--allow-schedule-mismatch"


def packed_for(cfg: RunConfig) -> dict[str, Any]:
    """What a schedule packed for ``cfg`` fits, as its metadata records it (``packed_for``,
    :func:`pipefisher.schedule_file.save_schedule`): the :data:`SHAPE_KEYS` values (``pipeline.chunks`` 1
    unless interleaved) and, per node, its K-FAC modules as the labels name them (the keys of
    :func:`pipefisher.schedule_file.job_layout`, which is what a profile alone can say)."""
    import json

    values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SHAPE_KEYS}
    values["pipeline.chunks"] = cfg.pipeline.chunks if cfg.pipeline.chunked else 1
    values["modules"] = [sorted(labelled(n, pipe, cfg.pipeline.chunked) for pipe, names in by_pipe.items()
                                for n in names) for by_pipe in node_kfac_names(cfg)]
    return json.loads(json.dumps(values, default=list))  # as JSON reads it back: lists, plain dicts


def schedule_mismatch(recorded: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """What differs between the job a schedule was packed for (``recorded``) and ``cfg``, in a few
    words, or None; keys the record lacks (a schedule packed from timelines alone) are not compared."""
    here = packed_for(cfg)
    diffs = []
    for key, want in recorded.items():
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
    return check_schedule(data, cfg, replicas, path)


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
        labels = [START, *pipeline_ops(cfg.pipeline.schedule, node, stages, m, cfg.pipeline.chunks)]
        mods = [labelled(n, pipe, cfg.pipeline.chunked) for pipe, names in by_pipe.items() for n in names]
        per_copy = m if cfg.pipeline.chunked else m // len(by_pipe)  # each chunk sees every micro-batch
        for name in mods:
            for f in "AB":
                labels += [f"cov_kron_{f}:{name}"] * per_copy
        if sync_copies(cfg, replicas) > 1:
            labels += [f"sync_kron_{f}:{name}" for name in mods for f in "AB"]
        labels += [f"inv_kron_{f}:{name}" for name in mods for f in "AB"]
        out.append([labels + [END, SAVE_OFF, SAVE_ON]])
    return out
