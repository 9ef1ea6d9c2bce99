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
``-- end --``                          ``engine.finish_step()``, then the trainer's end of step
``turn_off/on_save_inputs_outgrads``   ``kfac.set_saving(False / True)``
=====================================  ===========================================================

:func:`check_schedule` refuses, before any step runs, a schedule that would go wrong: another node
count, unknown labels or modules, ``:up_pipe`` work (this runtime has no second pipe), a forward and
backward order other than the engine's (the point-to-point traffic would deadlock), or K-FAC work that
cannot run (a covariance piece with no saved micro-batch, an inverse of an empty factor, saved
micro-batches or factors left over at the end of the cycle, no all-reduce with several replicas).
Every worker checks every node, so all of them refuse together instead of some waiting on the others.
"""
from __future__ import annotations

import functools
import hashlib
import os
from collections import defaultdict, deque
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

from pipefisher.errors import InputError
from pipefisher.runtime.config import RunConfig

START = "-- start --"
END = "-- end --"
SAVE_OFF = "turn_off_save_inputs_outgrads"
SAVE_ON = "turn_on_save_inputs_outgrads"
FORWARD, BACKWARD = "call_forward", "call_backward"
KFAC_KINDS = ("cov_kron", "sync_kron", "inv_kron")
UP_PIPE = "up_pipe"

ScheduleData = list[list[list[str]]]


def parse_label(label: str) -> tuple[str, str | None, str | None]:
    """``(kind, factor, module)``: kind is a marker, ``call_forward``/``call_backward``, ``cov_kron``,
    ``sync_kron``, ``inv_kron``, ``up_pipe`` (any label of the second pipe) or ``unknown``."""
    if label in (START, END, SAVE_OFF, SAVE_ON, FORWARD, BACKWARD):
        return label, None, None
    head, _, module = label.partition(":")
    if label.endswith(":" + UP_PIPE):
        return UP_PIPE, None, None
    for kind in KFAC_KINDS:
        if head in (kind + "_A", kind + "_B"):
            return kind, head[-1], module or None
    return "unknown", None, None


# ----------------------------------------------------------------------------------------------------
# Which modules each stage has (without building the full-size model)


@functools.lru_cache(maxsize=32)
def _stage_kfac_names(model_cfg: Any, ignore: tuple[str, ...], stages: int) -> tuple[tuple[str, ...], ...]:
    import dataclasses

    import torch

    from pipefisher.kfac.kfac import kfac_modules
    from pipefisher.runtime.model import PipelineStage

    # Module names depend on the layer layout only, so a model with the same layers but minimal widths
    # names them all in milliseconds, whatever the real size.
    shape = dataclasses.replace(model_cfg, vocab_size=8, hidden_size=model_cfg.num_heads,
                                intermediate_size=1, max_position=1)
    out = []
    with torch.random.fork_rng(devices=[]):
        for s in range(stages):
            out.append(tuple(kfac_modules(PipelineStage(shape, s, stages), ignore)))
    return tuple(out)


def stage_kfac_names(cfg: RunConfig) -> list[list[str]]:
    """The K-FAC module names of every pipeline stage of ``cfg``, in model order."""
    return [list(n) for n in _stage_kfac_names(cfg.model, tuple(cfg.kfac.ignore), cfg.pipeline.stages)]


# ----------------------------------------------------------------------------------------------------
# Checks


def schedule_digest(data: ScheduleData) -> str:
    """A short hash of a schedule's labels (checkpoints and workers compare it)."""
    h = hashlib.sha256()
    for n, node in enumerate(data):
        for i, labels in enumerate(node):
            h.update(f"{n}/{i}\0".encode())
            h.update("\0".join(labels).encode())
    return h.hexdigest()[:16]


def check_schedule_for_stage(iterations: Sequence[Sequence[str]], *, node: int, names: Sequence[str],
                             ops: Sequence[str], replicas: int = 1, path: str | None = None) -> None:
    """Refuse (:class:`InputError`) one node's cycle unless this runtime can run it as the spec says.

    ``names`` are the stage's K-FAC modules, ``ops`` the engine's forward/backward order of one step
    (:func:`pipefisher.runtime.engine.pipeline_ops`). Pure: no torch, no process group.
    """
    def refuse(where: str, problem: str) -> None:
        raise InputError(path, f"node {node} {where}: {problem}")

    if not iterations:
        refuse("", "has no pipeline iterations")
    known = set(names)
    for i, labels in enumerate(iterations):  # first what each label is, then where it stands
        for label in labels:
            kind, factor, module = parse_label(label)
            if kind == UP_PIPE:
                refuse(f"iteration {i}", f"'{label}': work of a second (up) pipeline; this runtime runs "
                                         "one pipe (no Chimera)")
            if kind == "unknown":
                refuse(f"iteration {i}", f"'{label}': unknown label")
            if factor is not None and module is None:
                refuse(f"iteration {i}", f"'{label}': no module name; this runtime needs "
                                         "'<kind>:<module>' labels")
            if factor is not None and module not in known:
                refuse(f"iteration {i}", f"'{label}': this stage has no K-FAC module named '{module}' "
                                         "(the schedule is for another model, stage split or kfac.ignore)")
    k = len(iterations)
    # Symbolic K-FAC state through one cycle. At the start of every cycle (after step 0's naive
    # K-FAC, or the previous cycle) saving is on, nothing is saved, every factor is empty.
    saving = True
    saved: dict[tuple[str, str], int] = defaultdict(int)  # (factor, module) -> saved micro-batches
    built: dict[tuple[str, str], int] = defaultdict(int)  # (factor, module) -> pieces in the factor
    synced: dict[tuple[str, str], bool] = defaultdict(bool)
    inverted: set[tuple[str, str]] = set()
    for i, labels in enumerate(iterations):
        where = f"iteration {i}"
        if not labels or labels[0] != START:
            refuse(where, f"does not begin with '{START}'")
        if labels.count(END) != 1:
            refuse(where, f"has {labels.count(END)} '{END}' labels, not 1")
        pipe = [lb for lb in labels if lb in (FORWARD, BACKWARD)]
        if pipe != list(ops):
            got = f"{pipe.count(FORWARD)} forwards and {pipe.count(BACKWARD)} backwards"
            want = f"{list(ops).count(FORWARD)} of each"
            if pipe.count(FORWARD) != list(ops).count(FORWARD) or pipe.count(BACKWARD) != list(ops).count(BACKWARD):
                refuse(where, f"has {got}, but this run's pipeline step has {want} (data.num_micro_batches)")
            refuse(where, "runs its forwards and backwards in another order than this run's pipeline "
                          f"(pipeline.schedule, stages); it would deadlock the point-to-point transfers")
        stash: deque = deque()  # saving flag of each forwarded micro-batch awaiting its backward
        ended = False
        for j, label in enumerate(labels):
            kind, factor, module = parse_label(label)
            if ended and kind in (START, END, FORWARD, BACKWARD):
                refuse(where, f"'{label}' after '{END}'")
            if kind == END:
                ended = True
            elif kind == SAVE_ON or kind == SAVE_OFF:
                saving = kind == SAVE_ON
            elif kind == FORWARD:
                stash.append(saving)
                if saving:
                    for m in names:
                        saved["A", m] += 1
            elif kind == BACKWARD:
                if stash.popleft():
                    for m in names:
                        saved["B", m] += 1
            elif kind == START:
                if j != 0:
                    refuse(where, f"has a second '{START}'")
            else:
                assert factor is not None and module is not None
                key = (factor, module)
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
                                      f"first, but this run has {replicas} data-parallel replicas")
                    built[key], synced[key] = 0, False
                    inverted.add(key)
    if not saving:
        refuse(f"iteration {k - 1}", f"the cycle must end with saving on ('{SAVE_ON}')")
    for m in names:
        for f in "AB":
            if saved[f, m]:
                refuse("cycle", f"{saved[f, m]} saved micro-batch(es) of factor {f} of '{m}' are never "
                                f"used by a cov_kron_{f} piece")
            if built[f, m]:
                refuse("cycle", f"factor {f} of '{m}' is built but not inverted within the cycle")
            if (f, m) not in inverted:
                refuse("cycle", f"factor {f} of '{m}' is never refreshed (no inv_kron_{f}:{m})")


def check_schedule(data: Any, cfg: RunConfig, replicas: int = 1, path: str | os.PathLike[str] | None = None) -> ScheduleData:
    """Refuse a schedule that does not belong to this job; every node is checked, whatever the caller's."""
    from pipefisher.runtime.engine import pipeline_ops
    from pipefisher.schedule import check_schedule_data

    p = None if path is None else os.fspath(path)
    data = check_schedule_data(data, p)
    stages = cfg.pipeline.stages
    if len(data) != stages:
        raise InputError(p, f"has {len(data)} node schedule(s) but this run has {stages} pipeline stage(s)")
    names = stage_kfac_names(cfg)
    for node in range(stages):
        ops = pipeline_ops(cfg.pipeline.schedule, node, stages, cfg.data.num_micro_batches)
        check_schedule_for_stage(data[node], node=node, names=names[node], ops=ops, replicas=replicas, path=p)
    return data


def load_checked_schedule(path: str | os.PathLike[str], cfg: RunConfig, replicas: int = 1) -> ScheduleData:
    """Load a schedule file through the restricted loader and :func:`check_schedule` it."""
    from pipefisher.schedule import load_schedule

    return check_schedule(load_schedule(path), cfg, replicas, path)


def single_iteration_schedule(cfg: RunConfig, replicas: int = 1) -> ScheduleData:
    """A cycle of one iteration: the pipeline, then all K-FAC work in naive order, then ``-- end --``.

    It refreshes the curvature every step from that step's micro-batches, exactly as ``kfac`` mode
    with ``kfac.interval: 1`` does (a baseline, and the reference of the tests).
    """
    from pipefisher.runtime.engine import pipeline_ops

    out = []
    stages = cfg.pipeline.stages
    for node, names in enumerate(stage_kfac_names(cfg)):
        labels = [START, *pipeline_ops(cfg.pipeline.schedule, node, stages, cfg.data.num_micro_batches)]
        m = cfg.data.num_micro_batches
        for name in names:
            for f in "AB":
                labels += [f"cov_kron_{f}:{name}"] * m
        if replicas > 1:
            labels += [f"sync_kron_{f}:{name}" for name in names for f in "AB"]
        labels += [f"inv_kron_{f}:{name}" for name in names for f in "AB"]
        out.append([labels + [END, SAVE_OFF, SAVE_ON]])
    return out


# ----------------------------------------------------------------------------------------------------
# Running


class ScheduleExecutor:
    """Runs one node's iterations label by label on an engine, a K-FAC object and an end-of-step call.

    Each iteration is compiled once into a list of bound calls, so a step costs one Python call per
    label. ``span(label)`` wraps every K-FAC label (the profiler uses it; a no-op otherwise).
    """

    def __init__(self, iterations: Sequence[Sequence[str]], engine: Any, kfac: Any,
                 end_of_step: Callable[[], None], span: Callable[[str], ContextManager[Any]] | None = None) -> None:
        self.engine, self.kfac, self.end_of_step = engine, kfac, end_of_step
        self.span = span
        self.iterations = [list(it) for it in iterations]
        self._compiled = [[self._compile(label) for label in it] for it in self.iterations]
        self._step = 0
        self._loss: float | None = None

    @property
    def cycle(self) -> int:
        return len(self.iterations)

    def iteration_of(self, step: int) -> int:
        """The iteration that training step ``step >= 1`` runs."""
        return (step - 1) % self.cycle

    def _compile(self, label: str) -> Callable[[], None]:
        kind, factor, module = parse_label(label)
        if kind == START:
            return lambda: self.engine.begin_step(self._step)
        if kind == FORWARD:
            return self.engine.forward
        if kind == BACKWARD:
            return self.engine.backward
        if kind == END:
            return self._end
        if kind == SAVE_ON:
            return functools.partial(self.kfac.set_saving, True)
        if kind == SAVE_OFF:
            return functools.partial(self.kfac.set_saving, False)
        if kind in KFAC_KINDS and module is not None:
            work = {"cov_kron": self.kfac.cov, "sync_kron": self.kfac.sync, "inv_kron": self.kfac.inv}[kind]
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
        """Run the iteration of training step ``step >= 1``; the step's loss on the last stage."""
        if step < 1:
            raise ValueError("step 0 is a plain pipeline step with naive K-FAC, not a schedule iteration")
        self._step, self._loss = step, None
        for call in self._compiled[self.iteration_of(step)]:
            call()
        return self._loss


def null_span(label: str) -> ContextManager[Any]:
    return nullcontext()
