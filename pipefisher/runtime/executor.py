"""Running schedule files: check that a schedule belongs to this job, then walk it label by label.

A schedule file is ``schedules[node][iteration] = [label, ...]`` (see the format spec). Training step 0
is a plain pipeline step plus naive K-FAC; step ``s >= 1`` runs iteration ``(s - 1) % k`` of the node's
cycle, one call per label:

=====================================  ===========================================================
label                                  call
=====================================  ===========================================================
``-- start --``                        ``engine.begin_step(step)``
``call_forward`` / ``call_backward``   ``engine.forward()`` / ``engine.backward()`` (with p2p)
``cov/sync/inv_kron_A|B:<module>``     ``kfac.cov / sync / inv(factor, module)``
any of these with ``:up_pipe``         the same on the up pipe's engine / stage copy (Chimera)
any of these with ``:chunk<j>``        the same on chunk j's engine / stage copy (interleaved)
``-- end --``                          ``engine.finish_step()``, then the trainer's end of step
``turn_off/on_save_inputs_outgrads``   ``kfac.set_saving(False / True)``
=====================================  ===========================================================

:func:`check_schedule` refuses, before any step runs, a schedule that would go wrong: another node
count, unknown labels or modules, ``:up_pipe`` work in a one-pipe job, a forward and backward order
other than the engine's (the point-to-point traffic would deadlock), K-FAC work that cannot run (a
covariance piece with no saved micro-batch, an inverse of an empty factor, saved micro-batches or
factors left over at the end of the cycle, no all-reduce with several replicas of a stage), or, under
Chimera, two devices sharing a group that would all-reduce (or refresh) their factors in different
orders (they would deadlock, mix factors up, or let the two copies of a stage drift apart).
Every worker checks every node, so all of them refuse together instead of some waiting on the others.

Before the K-FAC work of a bubble (the first of a run of K-FAC labels followed, within the step, by a
pipeline call), the executor has the engine post that call's receives (``engine.prepost``): with gloo
a neighbour's send completes only once its receive is posted, so posting it only when the call comes
would hold the neighbour for the whole bubble (:func:`prepost_points`).
"""
from __future__ import annotations

import functools
import os
import re
from collections import defaultdict, deque
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Mapping, Sequence

from pipefisher.errors import InputError
from pipefisher.runtime.config import RunConfig
from pipefisher.schedule import schedule_digest  # noqa: F401 (re-exported)
from pipefisher.timeline import UP_SUFFIX

START = "-- start --"
END = "-- end --"
SAVE_OFF = "turn_off_save_inputs_outgrads"
SAVE_ON = "turn_on_save_inputs_outgrads"
FORWARD, BACKWARD = "call_forward", "call_backward"
KFAC_KINDS = ("cov_kron", "sync_kron", "inv_kron")

ScheduleData = list[list[list[str]]]


CHUNK_SUFFIX = ":chunk"
_CHUNK_RE = re.compile(r":chunk([1-9][0-9]*)$")


def chunk_suffix(chunk: int) -> str:
    """The key suffix of an interleaved device's chunk: none for chunk 0, ``:chunk<j>`` otherwise."""
    return f"{CHUNK_SUFFIX}{chunk}" if chunk else ""


def copy_suffix(copy: int, interleaved: bool) -> str:
    """The label suffix of a device's stage copy: its chunk's (interleaved) or its pipe's (Chimera)."""
    return chunk_suffix(copy) if interleaved else (UP_SUFFIX if copy else "")


def parse_label(label: str) -> tuple[str, str | None, str | None, int]:
    """``(kind, factor, module, copy)``: kind is a marker, ``call_forward``/``call_backward``,
    ``cov_kron``, ``sync_kron``, ``inv_kron`` or ``unknown``; copy is 1 for ``:up_pipe`` labels and
    j for ``:chunk<j>`` ones (:func:`label_is_chunked` tells the two apart), else 0."""
    pipe = 0
    if label.endswith(UP_SUFFIX):
        label, pipe = label[: -len(UP_SUFFIX)], 1
    elif (hit := _CHUNK_RE.search(label)) is not None:
        label, pipe = label[: hit.start()], int(hit.group(1))
    if label in (START, END, SAVE_OFF, SAVE_ON):
        return (label, None, None, 0) if pipe == 0 else ("unknown", None, None, pipe)
    if label in (FORWARD, BACKWARD):
        return label, None, None, pipe
    head, _, module = label.partition(":")
    for kind in KFAC_KINDS:
        if head in (kind + "_A", kind + "_B"):
            return kind, head[-1], module or None, pipe
    return "unknown", None, None, pipe


# ----------------------------------------------------------------------------------------------------
# Which modules each stage has (without building the full-size model)


@functools.lru_cache(maxsize=32)
def _stage_kfac_names(cfg: RunConfig, stages: int) -> tuple[tuple[str, ...], ...]:
    import torch

    from pipefisher.kfac.kfac import kfac_modules
    from pipefisher.runtime.model import make_stage

    # Module names do not depend on the weights: the stages are built through the run's builder on
    # torch's "meta" device (no memory, no init cost, whatever the model's size). A builder that cannot
    # build there is run on the CPU instead.
    out = []
    with torch.random.fork_rng(devices=[]):
        for s in range(stages):
            try:
                with torch.device("meta"):
                    stage = make_stage(cfg, s, stages)
            except InputError:
                raise
            except Exception:
                stage = make_stage(cfg, s, stages)
            out.append(tuple(kfac_modules(stage, cfg.kfac.ignore)))
    return tuple(out)


def stage_kfac_names(cfg: RunConfig) -> list[list[str]]:
    """The K-FAC module names of every pipeline stage of ``cfg``, in model order."""
    return [list(n) for n in _stage_kfac_names(cfg, cfg.pipeline.virtual_stages)]


def is_chimera(cfg: RunConfig) -> bool:
    return cfg.pipeline.schedule == "chimera"


def is_interleaved(cfg: RunConfig) -> bool:
    return cfg.pipeline.schedule == "interleaved"


def node_pipes(cfg: RunConfig, node: int) -> dict[int, int]:
    """Copy -> the (virtual) stage that copy holds on device ``node``, in canonical order (stage index):
    the order of everything a Chimera pair of devices does together. Copies are pipes under Chimera
    (the up pipe's: stage ``D - 1 - node``) and chunks when interleaved (chunk j: ``node + j*D``)."""
    p = cfg.pipeline
    if is_interleaved(cfg):
        return {j: node + j * p.stages for j in range(p.chunks)}
    pipes = {0: node}
    if is_chimera(cfg):
        pipes[1] = p.stages - 1 - node
    return dict(sorted(pipes.items(), key=lambda kv: kv[1]))


def node_kfac_names(cfg: RunConfig) -> list[dict[int, list[str]]]:
    """Per device, per pipe (canonical order), the K-FAC module names of the stage copy on it."""
    names = stage_kfac_names(cfg)
    return [{pipe: names[stage] for pipe, stage in node_pipes(cfg, node).items()}
            for node in range(cfg.pipeline.stages)]


def labelled(name: str, pipe: int, interleaved: bool = False) -> str:
    """A module's name as its labels carry it (``:up_pipe`` for the up copy, ``:chunk<j>`` for chunk j)."""
    return name + copy_suffix(pipe, interleaved)


# ----------------------------------------------------------------------------------------------------
# Checks


def check_schedule_for_stage(iterations: Sequence[Sequence[str]], *, node: int,
                             names: Sequence[str] | Mapping[int, Sequence[str]], ops: Sequence[str],
                             replicas: int = 1, path: str | None = None, interleaved: bool = False) -> None:
    """Refuse (:class:`InputError`) one node's cycle unless this runtime can run it as the spec says.

    ``names`` are the device's K-FAC modules (per pipe under Chimera), ``ops`` the engine's
    forward/backward labels of one step (:func:`pipefisher.runtime.engine.pipeline_ops`), ``replicas``
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
                          "one model chunk per device (pipeline.schedule: interleaved has several)"))
            if pipe not in by_pipe or (pipe > 0 and interleaved and not chunked):
                refuse(f"iteration {i}", f"'{label}': work of a second (up) pipeline, but this run's "
                                         "pipeline has one pipe (pipeline.schedule: chimera has two)")
            if kind == "unknown":
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
        pipe_calls = [lb for lb in labels if parse_label(lb)[0] in (FORWARD, BACKWARD)]
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
            if ended and kind in (START, END, FORWARD, BACKWARD):
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
            elif kind == BACKWARD:
                if stash[pipe].popleft():
                    for m in by_pipe[pipe]:
                        saved["B", m, pipe] += 1
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


def sync_copies(cfg: RunConfig, replicas: int) -> int:
    """How many copies of each stage average their K-FAC factors: the data-parallel replicas, twice
    that under Chimera (both pipes hold a copy)."""
    return replicas * (2 if is_chimera(cfg) else 1)


def check_schedule(data: Any, cfg: RunConfig, replicas: int = 1, path: str | os.PathLike[str] | None = None) -> ScheduleData:
    """Refuse a schedule that does not belong to this job; every node is checked, whatever the caller's."""
    from pipefisher.runtime.engine import pipeline_ops
    from pipefisher.schedule import check_schedule_data

    p = None if path is None else os.fspath(path)
    data = check_schedule_data(data, p)
    stages = cfg.pipeline.stages
    if len(data) != stages:
        raise InputError(p, f"has {len(data)} node schedule(s) but this run has {stages} pipeline stage(s)")
    for node, names in enumerate(node_kfac_names(cfg)):
        ops = pipeline_ops(cfg.pipeline.schedule, node, stages, cfg.data.num_micro_batches, cfg.pipeline.chunks)
        check_schedule_for_stage(data[node], node=node, names=names, ops=ops,
                                 replicas=sync_copies(cfg, replicas), path=p, interleaved=is_interleaved(cfg))
    if is_chimera(cfg):
        from pipefisher.policies.groups import chimera_groups
        from pipefisher.policies.waits import group_violations

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
    :func:`pipefisher.schedule.save_schedule`): the :data:`SHAPE_KEYS` values (``pipeline.chunks`` 1
    unless interleaved) and, per node, its K-FAC modules as the labels name them (the keys of
    :func:`pipefisher.schedule.job_layout`, which is what a profile alone can say)."""
    import json

    values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SHAPE_KEYS}
    values["pipeline.chunks"] = cfg.pipeline.chunks if is_interleaved(cfg) else 1
    values["modules"] = [sorted(labelled(n, pipe, is_interleaved(cfg)) for pipe, names in by_pipe.items()
                                for n in names) for by_pipe in node_kfac_names(cfg)]
    return json.loads(json.dumps(values, default=list))  # as JSON reads it back: lists, plain dicts


def schedule_mismatch(recorded: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """What differs between the job a schedule was packed for (``recorded``) and ``cfg``, in a few
    words, or None; keys the record lacks (a schedule packed from timelines alone) are not compared."""
    here = packed_for(cfg)
    diffs = []
    for key, want in recorded.items():
        if key not in here or here[key] == want:
            continue
        if key == "modules":
            nodes = [n for n, (a, b) in enumerate(zip(want, here[key])) if a != b] if isinstance(want, list) else []
            n = nodes[0] if nodes else 0
            ours = here[key][n] if n < len(here[key]) else []
            theirs = want[n] if isinstance(want, list) and n < len(want) and isinstance(want[n], list) else []
            odd = sorted(set(theirs) ^ set(ours))
            diffs.append(f"node {n}'s K-FAC modules ({len(theirs)} packed for, {len(ours)} here"
                         + (f"; e.g. '{odd[0]}'" if odd else "") + ")")
        else:
            diffs.append(f"{key} {want!r} (this run: {here[key]!r})")
    return ", ".join(diffs) or None


def check_packed_for(path: str | os.PathLike[str], cfg: RunConfig, allow_mismatch: bool = False) -> str | None:
    """Refuse a schedule whose metadata says it was packed for another job than ``cfg`` (another model
    shape, stage split, micro-batch count, pipeline order or K-FAC modules); a schedule without that
    record (a published file) passes. With ``allow_mismatch``, return the difference instead."""
    from pipefisher.schedule import schedule_packed_for

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
    from pipefisher.schedule import load_schedule

    data = load_schedule(path)
    check_packed_for(path, cfg, allow_mismatch)
    return check_schedule(data, cfg, replicas, path)


def single_iteration_schedule(cfg: RunConfig, replicas: int = 1) -> ScheduleData:
    """A cycle of one iteration: the pipeline, then all K-FAC work in naive order, then ``-- end --``.

    It refreshes the curvature every step from that step's micro-batches, exactly as ``kfac`` mode
    with ``kfac.interval: 1`` does (a baseline, and the reference of the tests). Under Chimera the
    two copies' work comes in canonical (stage index) order, so a pair's syncs line up.
    """
    from pipefisher.runtime.engine import pipeline_ops

    out = []
    stages, m = cfg.pipeline.stages, cfg.data.num_micro_batches
    for node, by_pipe in enumerate(node_kfac_names(cfg)):
        labels = [START, *pipeline_ops(cfg.pipeline.schedule, node, stages, m, cfg.pipeline.chunks)]
        mods = [labelled(n, pipe, is_interleaved(cfg)) for pipe, names in by_pipe.items() for n in names]
        per_copy = m if is_interleaved(cfg) else m // len(by_pipe)  # each chunk sees every micro-batch
        for name in mods:
            for f in "AB":
                labels += [f"cov_kron_{f}:{name}"] * per_copy
        if sync_copies(cfg, replicas) > 1:
            labels += [f"sync_kron_{f}:{name}" for name in mods for f in "AB"]
        labels += [f"inv_kron_{f}:{name}" for name in mods for f in "AB"]
        out.append([labels + [END, SAVE_OFF, SAVE_ON]])
    return out


# ----------------------------------------------------------------------------------------------------
# Running


def prepost_points(labels: Sequence[str]) -> dict[int, str]:
    """Where the executor posts a pipeline call's receives ahead: label index -> the call's label.

    At the first K-FAC label of every bubble (a run of K-FAC labels, after a pipeline call or the
    step's start) whose step goes on with a pipeline call: that call's receives, so the neighbour's
    send completes while this node works. Each call is posted for at most once; work after
    ``-- end --`` (the next step's call lies beyond the step's end) posts nothing.
    """
    kinds = [parse_label(label)[0] for label in labels]
    out: dict[int, str] = {}
    claimed: set[int] = set()
    for i, kind in enumerate(kinds):
        if kind not in KFAC_KINDS or (i > 0 and kinds[i - 1] in KFAC_KINDS):
            continue
        for j in range(i + 1, len(kinds)):
            if kinds[j] in (FORWARD, BACKWARD):
                if j not in claimed:
                    out[i] = labels[j]
                    claimed.add(j)
                break
            if kinds[j] in (START, END):
                break
    return out


class ScheduleExecutor:
    """Runs one node's iterations label by label on an engine, its K-FAC states and an end-of-step call.

    ``kfacs`` maps a copy (0; 1 for ``:up_pipe`` labels; j for ``:chunk<j>`` labels) to the K-FAC
    state of that stage copy. Each iteration is compiled once into a list of bound calls, so a step costs one Python call
    per label. ``span(label)`` wraps every K-FAC label (the profiler uses it; a no-op otherwise).
    ``recorder`` (:mod:`pipefisher.runtime.recorder`) times every label of every step; its record of
    the last step is :attr:`last_record`. The cycle starts at step ``first_step``; :meth:`switch` puts
    another cycle in its place from a later step (a cycle boundary: see :class:`pipefisher.runtime.adapt.ScheduleLoop`).
    With ``prepost`` (and an engine that has ``prepost``), every bubble's K-FAC work is preceded by
    posting the next pipeline call's receives (:func:`prepost_points`); that is no label, not recorded.
    """

    def __init__(self, iterations: Sequence[Sequence[str]], engine: Any, kfacs: Mapping[int, Any],
                 end_of_step: Callable[[], None], span: Callable[[str], ContextManager[Any]] | None = None,
                 recorder: Any = None, first_step: int = 1, prepost: bool = True) -> None:
        self.engine, self.kfacs, self.end_of_step = engine, kfacs, end_of_step
        self.span = span
        self.prepost = prepost
        self.recorder = recorder
        if recorder is not None:
            recorder.attach(engine)
        self.last_record: Any = None
        self._step = 0
        self._loss: float | None = None
        self.switch(iterations, first_step)

    def switch(self, iterations: Sequence[Sequence[str]], first_step: int) -> None:
        """Run ``iterations`` from training step ``first_step`` on (its iteration 0)."""
        if first_step < 1:
            raise ValueError("a schedule's cycle starts at step 1 or later (step 0 is a plain step)")
        self.iterations = [list(it) for it in iterations]
        self._compiled = [self._compile_iteration(it) for it in self.iterations]
        self.first_step = first_step

    @property
    def cycle(self) -> int:
        return len(self.iterations)

    def iteration_of(self, step: int) -> int:
        """The iteration that training step ``step >= first_step`` runs."""
        return (step - self.first_step) % self.cycle

    def _set_saving(self, on: bool) -> None:
        for k in self.kfacs.values():
            k.set_saving(on)

    def _compile_iteration(self, labels: Sequence[str]) -> list[Callable[[], None]]:
        """One bound call per label, each bubble's receive posts (unrecorded) before its K-FAC work."""
        post = getattr(self.engine, "prepost", None) if self.prepost else None
        points = prepost_points(labels) if post is not None else {}
        calls: list[Callable[[], None]] = []
        for i, label in enumerate(labels):
            if i in points:
                calls.append(functools.partial(post, points[i]))
            calls.append(self._compile(label))
        return calls

    def _compile(self, label: str) -> Callable[[], None]:
        call = self._bind(label)
        return call if self.recorder is None else self.recorder.wrap(label, call)

    def _bind(self, label: str) -> Callable[[], None]:
        kind, factor, module, pipe = parse_label(label)
        if kind == START:
            return lambda: self.engine.begin_step(self._step)
        if kind in (FORWARD, BACKWARD):
            return self.engine.op(label)
        if kind == END:
            return self._end
        if kind == SAVE_ON:
            return functools.partial(self._set_saving, True)
        if kind == SAVE_OFF:
            return functools.partial(self._set_saving, False)
        if kind in KFAC_KINDS and module is not None:
            kfac = self.kfacs[pipe]
            work = {"cov_kron": kfac.cov, "sync_kron": kfac.sync, "inv_kron": kfac.inv}[kind]
            call = functools.partial(work, factor, module)
            if self.span is None:
                return call
            span = self.span

            def spanned() -> None:
                with span(label):
                    call()
            return spanned
        raise ValueError(f"label {label!r} cannot be run (check the schedule first)")

    def _end(self) -> None:
        self._loss = self.engine.finish_step()
        self.end_of_step()

    def run_step(self, step: int) -> float | None:
        """Run the iteration of training step ``step >= first_step``; the step's loss on the last stage."""
        if step < self.first_step:
            raise ValueError(f"step {step} comes before this cycle's first step {self.first_step} "
                             "(step 0 is a plain pipeline step with naive K-FAC, not a schedule iteration)")
        self._step, self._loss = step, None
        it = self.iteration_of(step)
        if self.recorder is not None:
            self.recorder.begin_step(step, it)
        try:
            for call in self._compiled[it]:
                call()
        except BaseException:
            drop = getattr(self.engine, "drop_preposted", None)
            if drop is not None:  # receives posted ahead of a call the failed step never ran
                drop()
            raise
        if self.recorder is not None:
            self.last_record = self.recorder.end_step()
        return self._loss


def null_span(label: str) -> ContextManager[Any]:
    return nullcontext()
