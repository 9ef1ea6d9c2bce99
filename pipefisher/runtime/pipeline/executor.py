"""Running a schedule: where a label becomes a call, walked label by label, one bound call each.

A schedule file is ``schedules[node][iteration] = [label, ...]`` (see the format spec). Training step 0
is a plain pipeline step plus naive K-FAC; step ``s >= 1`` runs iteration ``(s - 1) % k`` of the node's
cycle, one call per label (:mod:`pipefisher.runtime.pipeline.checks` has refused, before any step,
a schedule this run cannot run):

=====================================  ===========================================================
label                                  call
=====================================  ===========================================================
``-- start --``                        ``engine.begin_step(step)``
``call_forward`` / ``call_backward``   ``engine.forward()`` / ``engine.backward()`` (with p2p)
``call_backward:weight``               ``engine.weight()``: a zero-bubble W pass (no p2p)
``cov/sync/inv_kron_A|B:<module>``     ``kfac.cov / sync / inv(factor, module)``
any of these with ``:up_pipe``         the same on the up pipe's engine / stage copy (Chimera)
any of these with ``:chunk<j>``        the same on chunk j's engine / stage copy (interleaved)
``-- end --``                          ``engine.finish_step()``, then the trainer's end of step
``turn_off/on_save_inputs_outgrads``   ``kfac.set_saving(False / True)``
=====================================  ===========================================================

A factor's refresh may run in pieces (``kfac.refresh_pieces``): its inverse label then appears once per
piece in the cycle, and the executor marks each factor's *completion* (its first ``sync_kron`` label, or where
the node has none for it, its last ``cov_kron`` piece of the cycle: :func:`completion_points`) so that
K-FAC knows which inverse label begins a refresh and which continue one (:meth:`pipefisher.kfac.KFAC.inv`;
an overlapping schedule's inverse labels before the completion continue the previous cycle's refresh).
A schedule whose inverse labels per factor differ from the pieces this run's K-FAC splits into is refused
(:meth:`ScheduleExecutor.switch`); at a switch to another schedule every refresh under way ends at once
(the switch rule: :meth:`ScheduleExecutor.switch`).

Before the K-FAC work of a bubble (the first of a run of K-FAC labels followed, within the step, by a
pipeline call), the executor has the engine post that call's receives (``engine.prepost``): with gloo
a neighbour's send completes only once its receive is posted, so posting it only when the call comes
would hold the neighbour for the whole bubble (:func:`prepost_points`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

from pipefisher.errors import InputError
from pipefisher.runtime.pipeline.contracts import Curvature, CurvatureWork, Engine, Span
from pipefisher.runtime.pipeline.labels import BACKWARD, FORWARD, KFAC_WORK, PIPELINE_CALLS, WEIGHT, parse_label
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.problem import completions
from pipefisher.schedule.timeline import STEP_KEY


def plain_step(engine: Engine, ops: Sequence[str], step: int, kfac: Curvature | None, refresh: bool,
               end_of_step: Callable[[], None], span: Span) -> Any:
    """A step without a schedule (step 0 of a scheduled run, every step of a ``first-order`` or ``kfac``
    run, a profiled step of :mod:`pipefisher.runtime.torch_pp`): the pipeline order ``ops``, then, with
    ``refresh``, all K-FAC work (``kfac``'s saving follows ``refresh``), then ``end_of_step`` (gradient
    all-reduce and update); timed as one :data:`STEP_KEY` interval. Returns the engine's loss of the step."""
    if kfac is not None:
        kfac.set_saving(refresh)
    engine.begin_step(step)
    with span(STEP_KEY):
        engine.run(ops)
        loss = engine.finish_step()
        if kfac is not None:
            if refresh:
                kfac.update_curvature(span=span)
            kfac.clear_saved()
        end_of_step()
    return loss


def prepost_points(labels: Sequence[str]) -> dict[int, str]:
    """Where the executor posts a pipeline call's receives ahead: label index -> the call's label.

    At the first K-FAC label of every bubble (a run of K-FAC labels, after a pipeline call or the
    step's start) whose step goes on with a forward or backward: that call's receives, so the
    neighbour's send completes while this node works (a weight pass receives nothing: the search goes
    past it). Each call is posted for at most once; work after ``-- end --`` (the next step's call lies
    beyond the step's end) posts nothing.
    """
    kinds = [parse_label(label)[0] for label in labels]
    out: dict[int, str] = {}
    claimed: set[int] = set()
    for i, kind in enumerate(kinds):
        if kind not in KFAC_WORK or (i > 0 and kinds[i - 1] in KFAC_WORK):
            continue
        for j in range(i + 1, len(kinds)):
            if kinds[j] == WEIGHT:
                continue
            if kinds[j] in (FORWARD, BACKWARD):
                if j not in claimed:
                    out[i] = labels[j]
                    claimed.add(j)
                break
            if kinds[j] in (START, END):
                break
    return out


def completion_points(iterations: Sequence[Sequence[str]]) -> dict[tuple[int, int], tuple[int, str, str]]:
    """Where each factor of each stage copy completes in the cycle: ``(iteration, label index) -> (copy,
    factor, module)``, as the packing problem defines it (:func:`pipefisher.schedule.problem.completions`:
    its first ``sync_kron`` label, or where it has none, its last ``cov_kron`` piece)."""
    where = [(i, j) for i, labels in enumerate(iterations) for j in range(len(labels))]
    out: dict[tuple[int, int], tuple[int, str, str]] = {}
    for at in completions([(label, 1) for labels in iterations for label in labels]).values():
        i, j = where[at]
        _, factor, module, copy = parse_label(iterations[i][j])
        if factor is not None and module is not None:
            out[i, j] = (copy, factor, module)
    return out


def inverse_counts(iterations: Sequence[Sequence[str]]) -> dict[tuple[int, str, str], list[str]]:
    """Every ``inv_kron`` label of the cycle by ``(copy, factor, module)``: one per piece of its refresh."""
    out: dict[tuple[int, str, str], list[str]] = {}
    for labels in iterations:
        for label in labels:
            kind, factor, module, copy = parse_label(label)
            if kind == "inv_kron" and module is not None:
                out.setdefault((copy, factor, module), []).append(label)
    return out


def _after(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """One call that runs ``first``, then ``then``."""
    def both() -> None:
        first()
        then()
    return both


class ScheduleExecutor:
    """Runs one node's iterations label by label on an engine, its K-FAC states and an end-of-step call.

    ``kfacs`` maps a copy (0; 1 for ``:up_pipe`` labels; j for ``:chunk<j>`` labels) to the K-FAC
    state of that stage copy. Each iteration is compiled once into a list of bound calls, so a step costs one Python call
    per label. ``span(label)`` wraps every K-FAC label (the profiler uses it; a no-op otherwise).
    ``recorder`` (:mod:`pipefisher.runtime.train.recorder`) times every label of every step; its record of
    the last step is :attr:`last_record`. The cycle starts at step ``first_step``; :meth:`switch` puts
    another cycle in its place from a later step (a cycle boundary: see :class:`pipefisher.runtime.train.adapt.ScheduleLoop`).
    With ``prepost``, every bubble's K-FAC work is preceded by the engine posting the next pipeline call's
    receives (:func:`prepost_points`; an engine that cannot post ahead posts nothing, the contract's
    default); that is no label, not recorded. ``engine`` and ``kfacs`` keep the runtime's contracts
    (:mod:`pipefisher.runtime.pipeline.contracts`).
    """

    def __init__(self, iterations: Sequence[Sequence[str]], engine: Engine, kfacs: Mapping[int, CurvatureWork],
                 end_of_step: Callable[[], None], span: Span | None = None,
                 recorder: Any = None, first_step: int = 1, prepost: bool = True) -> None:
        self.engine, self.kfacs, self.end_of_step = engine, kfacs, end_of_step
        self.span = span
        self.prepost = prepost
        self.recorder = recorder
        if recorder is not None:
            recorder.attach(engine)
        self.last_record: Any = None
        self._step = 0
        self._loss: Any = None  # the step's loss, a 0-dim tensor on the last stage
        self._ran = False  # a step ran since the last switch (a switch then ends the refreshes in flight)
        self.switch(iterations, first_step)

    def switch(self, iterations: Sequence[Sequence[str]], first_step: int) -> None:
        """Run ``iterations`` from training step ``first_step`` on (its iteration 0).

        Refuses (:class:`InputError`) a cycle whose inverse labels per factor are not as many as the
        pieces this run's K-FAC refreshes that factor in. Where steps ran before (an ``--adapt`` switch,
        at a cycle boundary), the switch rule: every refresh under way ends at once (in flight, or of a
        factor completed but not begun, as an overlapping schedule leaves one:
        :meth:`pipefisher.kfac.refresher.Refresher.finish_refreshes`), so that the new schedule, overlapping
        or not, starts clean as a run does and every completed covariance is refreshed once; a switch
        before any step (a resumed run restoring its schedule) leaves the restored refreshes as they are."""
        if first_step < 1:
            raise ValueError("a schedule's cycle starts at step 1 or later (step 0 is a plain step)")
        self._plan_refreshes(iterations)
        for kfac in self.kfacs.values():
            if self._ran:
                kfac.finish_refreshes()  # the old cycle's covariance, folded in at the old cycle's weight
            kfac.refresh_every(len(iterations))
        self._ran = False
        self.iterations = [list(it) for it in iterations]
        self._completions = completion_points(self.iterations)
        self._compiled = [self._compile_iteration(i, it) for i, it in enumerate(self.iterations)]
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

    def _plan_refreshes(self, iterations: Sequence[Sequence[str]]) -> None:
        """Refuse a cycle whose inverse labels do not match the K-FAC's pieces, then have every K-FAC
        begin its refreshes at marked completions (:meth:`pipefisher.kfac.KFAC.plan_refresh`)."""
        counts = inverse_counts(iterations)
        for copy, kfac in self.kfacs.items():
            for name in kfac.names:
                for factor in "AB":
                    labels, want = counts.get((copy, factor, name), []), kfac.pieces(name, factor)
                    if labels and len(labels) != want:
                        raise InputError(None, f"the schedule has '{labels[0]}' {len(labels)} time(s) per cycle, "
                                               f"but this run's K-FAC refreshes that factor in {want} piece(s) "
                                               "(kfac.refresh_pieces; pack the schedule from a profile of this "
                                               "run's settings)")
        for kfac in self.kfacs.values():
            kfac.plan_refresh()

    def _compile_iteration(self, index: int, labels: Sequence[str]) -> list[Callable[[], None]]:
        """One bound call per label (a bubble's first K-FAC label posts the next pipeline call's receives
        first, unrecorded), as the engine runs them (its ``fold_iteration``)."""
        points = prepost_points(labels) if self.prepost else {}
        calls: list[Callable[[], None]] = []
        for i, label in enumerate(labels):
            call = self._compile(label, (index, i) in self._completions)
            if i in points:
                call = _after(functools.partial(self.engine.prepost, points[i]), call)
            calls.append(call)
        return self.engine.fold_iteration(labels, calls)

    def _compile(self, label: str, completes: bool = False) -> Callable[[], None]:
        call = self._bind(label, completes)
        return call if self.recorder is None else self.recorder.wrap(label, call)

    def _bind(self, label: str, completes: bool = False) -> Callable[[], None]:
        kind, factor, module, pipe = parse_label(label)
        if kind == START:
            return lambda: self.engine.begin_step(self._step)
        if kind in PIPELINE_CALLS:
            return self.engine.op(label)
        if kind == END:
            return self._end
        if kind == SAVE_ON:
            return functools.partial(self._set_saving, True)
        if kind == SAVE_OFF:
            return functools.partial(self._set_saving, False)
        if kind in KFAC_WORK and module is not None:
            kfac = self.kfacs[pipe]
            work = {"cov_kron": kfac.cov, "sync_kron": kfac.sync, "inv_kron": kfac.inv}[kind]
            call = functools.partial(work, factor, module)
            if completes:  # the factor's completion: K-FAC's next inverse label begins a refresh
                call = _after(call, functools.partial(kfac.complete, factor, module))
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

    def run_step(self, step: int) -> Any:
        """Run the iteration of training step ``step >= first_step``; the step's loss on the last stage
        (the engine's :meth:`~pipefisher.runtime.pipeline.engine.PipelineEngine.finish_step`)."""
        if step < self.first_step:
            raise ValueError(f"step {step} comes before this cycle's first step {self.first_step} "
                             "(step 0 is a plain pipeline step with naive K-FAC, not a schedule iteration)")
        self._step, self._loss, self._ran = step, None, True
        it = self.iteration_of(step)
        if self.recorder is not None:
            self.recorder.begin_step(step, it)
        try:
            for call in self._compiled[it]:
                call()
        except BaseException:
            self.engine.drop_preposted()  # receives posted ahead of a call the failed step never ran
            raise
        if self.recorder is not None:
            self.last_record = self.recorder.end_step()
        return self._loss
