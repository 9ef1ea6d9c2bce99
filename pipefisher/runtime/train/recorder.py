"""Always-on measurement of scheduled steps: every label's start, end and receive wait, per node.

The executor runs each label through :meth:`StepRecorder.wrap` (bound once, when an iteration is
compiled), so recording costs two clock reads and an append per label. On CPU the clock is
``perf_counter``; on GPU every label gets a pair of CUDA events, and the step's record keeps them unread
(:class:`EventRecord`) until the closed loop gathers its records, once per cycle: never a synchronize
per label, nor per step. A receive's wait is timed the same way inside the pipeline engine
(:meth:`pipefisher.runtime.pipeline.engine.PipelineEngine.set_wait_log`). Tests and simulations inject another
:class:`StepRecorder` (a fake clock with deterministic durations).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

from pipefisher.cost.measure import LabelTime, StepRecord
from pipefisher.runtime.job.host import HostReads

if TYPE_CHECKING:
    from pipefisher.runtime.pipeline.contracts import Engine


class StepRecorder(ABC):
    """Times the labels of one node's steps; :meth:`end_step` returns the step's :class:`StepRecord`."""

    def __init__(self, node: int, replica: int) -> None:
        self.node, self.replica = node, replica

    @abstractmethod
    def begin_step(self, step: int, iteration: int) -> None:
        """A scheduled step begins (before its ``-- start --`` label)."""

    @abstractmethod
    def wrap(self, label: str, call: Callable[[], None]) -> Callable[[], None]:
        """``call`` (the label's work), recorded each time it runs."""

    @abstractmethod
    def end_step(self) -> StepRecord:
        """The step's record (after its last label)."""

    def attach(self, engine: Engine) -> None:
        """Let the recorder see the engine's receive waits (the wall clock's need; others may ignore it)."""


class ClockRecorder(StepRecorder):
    """The real clock: ``perf_counter`` on CPU, CUDA events on GPU; ``host`` (the worker's counter, None: a
    counter of its own) counts the wait where a GPU record is read before its last event is done."""

    def __init__(self, node: int, replica: int, cuda: bool = False, host: HostReads | None = None) -> None:
        super().__init__(node, replica)
        self.cuda = cuda
        self.host = host if host is not None else HostReads()
        self._waits: list[Any] = []  # the engine appends receive waits (seconds, or CUDA event pairs)
        self._labels: list[tuple[str, Any, Any, int, int]] = []  # label, start, end, waits from, to
        self._step = self._iteration = 0
        self._base: Any = 0.0

    def attach(self, engine: Engine) -> None:
        engine.set_wait_log(self._waits)

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin_step(self, step: int, iteration: int) -> None:
        self._step, self._iteration = step, iteration
        self._labels.clear()
        self._waits.clear()
        self._base = self._now()

    def wrap(self, label: str, call: Callable[[], None]) -> Callable[[], None]:
        now, labels, waits = self._now, self._labels, self._waits

        def recorded() -> None:
            w0 = len(waits)
            t0 = now()
            call()
            labels.append((label, t0, now(), w0, len(waits)))
        return recorded

    def end_step(self) -> StepRecord | EventRecord:
        if self.cuda:  # the events are read where the records are gathered
            return EventRecord(self.node, self.replica, self._step, self._iteration, self._base,
                               list(self._labels), list(self._waits), self.host)
        b = self._base
        out = tuple(LabelTime(label, s - b, e - b, sum(self._waits[a:z])) for label, s, e, a, z in self._labels)
        return StepRecord(self.node, self.replica, self._step, self._iteration, out)


class EventRecord:
    """A scheduled step's record on GPU with its CUDA events not read yet (reading them waits for the
    device): :meth:`resolve` makes it a :class:`StepRecord` where the records are gathered; a wait there
    counts in ``host``, the recording worker's counter."""

    def __init__(self, node: int, replica: int, step: int, iteration: int, base: Any,
                 labels: list[tuple[str, Any, Any, int, int]], waits: list[Any], host: HostReads) -> None:
        self.node, self.replica, self.step, self.iteration = node, replica, step, iteration
        self._base, self._labels, self._waits, self.host = base, labels, waits, host

    def resolve(self) -> StepRecord:
        """The record, its times read from the events (waiting, counted, only if the last is not done)."""
        if self._labels and not self._labels[-1][2].query():
            self.host.wait(self._labels[-1][2])
        base = self._base
        out = tuple(LabelTime(label, base.elapsed_time(s) / 1e3, base.elapsed_time(e) / 1e3,
                              sum(p[0].elapsed_time(p[1]) / 1e3 for p in self._waits[a:z]))
                    for label, s, e, a, z in self._labels)
        return StepRecord(self.node, self.replica, self.step, self.iteration, out)


def resolved(record: StepRecord | EventRecord) -> StepRecord:
    """A step's record with its times as numbers (an :class:`EventRecord` read now)."""
    return record.resolve() if isinstance(record, EventRecord) else record
