"""Per-node timelines in the profiled format: intervals per micro-batch, per K-FAC piece, per step.

All workers start their clocks together: a barrier, then each takes its time base. Times are integer
nanoseconds from that base: wall-clock (``perf_counter_ns``) on CPU, CUDA-event device times on GPU.
The clocks of different hosts are never compared. Every profiled step starts after another barrier
(:meth:`Profiler.barrier`), so that step starts line up across nodes and the median step
(:func:`pipefisher.schedule.timeline.median_step`) that :meth:`Profiler.write` writes has one reference on all.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from pipefisher.safe_io import dump_pickle_atomic
from pipefisher.schedule.timeline import COV_MICRO_BATCHES_KEY, STEP_KEY, median_step

__all__ = ["Profiler", "STEP_KEY", "steps_filename", "timeline_filename"]


class Profiler:
    """Records ``(start, end)`` per key; disabled it costs one branch per span."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._base_ns = 0
        self._base_event: Any = None
        self._records: dict[str, list[Any]] = {}

    def barrier(self, group: Any = None, distributed: bool = True) -> None:
        """Wait until every worker (of ``group``, default all) gets here, keeping the time base: called
        before each profiled step so that its ``start_end`` starts at the same moment on every node.
        Not profiling, or in one process, it does nothing."""
        if not self.enabled:
            return
        if self.cuda:
            torch.cuda.synchronize()
        if distributed and dist.is_initialized():
            dist.barrier(group=group)
            if self.cuda:
                torch.cuda.synchronize()

    def align(self, group: Any = None, distributed: bool = True) -> None:
        """Take the time base right after a barrier with every other worker."""
        if not self.enabled:
            return
        self.barrier(group, distributed)
        if self.cuda:
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record()
        self._base_ns = time.perf_counter_ns()

    @contextlib.contextmanager
    def span(self, key: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._records.setdefault(key, []).append((start, end))
        else:
            t0 = time.perf_counter_ns() - self._base_ns
            yield
            self._records.setdefault(key, []).append((t0, time.perf_counter_ns() - self._base_ns))

    def timeline(self) -> dict[str, list[tuple[int, int]]]:
        """The recorded intervals as ``{key: [(start_ns, end_ns), ...]}``."""
        if not self.cuda:
            return {k: list(v) for k, v in self._records.items()}
        torch.cuda.synchronize()

        def ns(ev: Any) -> int:
            return int(round(self._base_event.elapsed_time(ev) * 1e6))

        return {k: [(ns(s), ns(e)) for s, e in v] for k, v in self._records.items()}

    def write(self, folder: str | os.PathLike[str], name: str, node: int, cov_micro_batches: int | None = None) -> str:
        """Write the node's timeline, the median of its profiled steps (:func:`median_step`: one step,
        steadier than the last step the loader would keep), and beside it every profiled step as recorded
        (:func:`steps_filename`); returns the timeline's path. The timeline is written last, so where it
        exists, so do the steps. ``cov_micro_batches``: the profiled steps' covariance covered only that
        many micro-batches of each pipe (``kfac.cov_micro_batches``), which the timeline records
        (:data:`COV_MICRO_BATCHES_KEY`) so that it is packed with as many covariance pieces."""
        raw = self.timeline()
        folder = os.fspath(folder)
        dump_pickle_atomic(os.path.join(folder, steps_filename(name, node)), raw)
        path = os.path.join(folder, timeline_filename(name, node))
        step = median_step(raw)
        if cov_micro_batches is not None:
            step[COV_MICRO_BATCHES_KEY] = [(cov_micro_batches, cov_micro_batches)]
        dump_pickle_atomic(path, step)
        return path


def timeline_filename(name: str, node: int) -> str:
    return f"{name}_node{node}_timeline.pickle"


def steps_filename(name: str, node: int) -> str:
    """The raw multi-step profile of a node, in the timeline format, for anyone checking its median
    step. Its name has no timeline suffix, so a folder argument (which stands for its ``*_timeline.*``
    files) leaves it out."""
    return f"{name}_node{node}_steps.pickle"
