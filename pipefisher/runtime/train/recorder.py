"""Always-on measurement of scheduled steps: every label's start, end and receive wait, per node.

The executor runs each label through :meth:`StepRecorder.wrap` (bound once, when an iteration is
compiled), so recording costs two clock reads and an append per label. On CPU the clock is
``perf_counter``; on GPU every label gets a pair of CUDA events, read once at the end of the step,
never a synchronize per label. A receive's wait is timed the same way inside the pipeline engine
(:meth:`pipefisher.runtime.pipeline.engine.PipelineEngine.set_wait_log`). Tests and simulations inject another
:class:`StepRecorder` (a fake clock with deterministic durations).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from pipefisher.measure import LabelTime, StepRecord


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

    def attach(self, engine: Any) -> None:
        """Let the recorder see the engine's receive waits (the wall clock's need; others may ignore it)."""


class ClockRecorder(StepRecorder):
    """The real clock: ``perf_counter`` on CPU, CUDA events on GPU."""

    def __init__(self, node: int, replica: int, cuda: bool = False) -> None:
        super().__init__(node, replica)
        self.cuda = cuda
        self._waits: list[Any] = []  # the engine appends receive waits (seconds, or CUDA event pairs)
        self._labels: list[tuple[str, Any, Any, int, int]] = []  # label, start, end, waits from, to
        self._step = self._iteration = 0
        self._base: Any = 0.0

    def attach(self, engine: Any) -> None:
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

    def end_step(self) -> StepRecord:
        if self.cuda:
            base = self._base
            if self._labels:
                self._labels[-1][2].synchronize()

            def rel(ev: Any) -> float:
                return base.elapsed_time(ev) / 1e3

            def wait(pair: Any) -> float:
                return pair[0].elapsed_time(pair[1]) / 1e3
        else:
            b = self._base

            def rel(t: Any) -> float:
                return t - b

            def wait(x: Any) -> float:
                return x
        out = tuple(LabelTime(label, rel(s), rel(e), sum(wait(x) for x in self._waits[a:z]))
                    for label, s, e, a, z in self._labels)
        return StepRecord(self.node, self.replica, self._step, self._iteration, out)
