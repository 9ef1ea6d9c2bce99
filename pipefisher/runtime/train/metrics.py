"""What a training run reports per step, in one component beside the loop: the metrics CSV, the TensorBoard
log (:mod:`pipefisher.runtime.train.tensorboard`), the progress records (the CLI's bar, the launcher's
progress marks) and the loss lines, all logged (:mod:`pipefisher.runtime.job.progress`).

The loop hands it each step's figures (:meth:`Metrics.record`); :meth:`Metrics.should_log` is the one rule
for the steps whose loss is printed (every ``log_every`` steps, the last step, and every held-out
evaluation), so a loop that keeps its losses on the device knows where it has to read them back.
Every worker makes one; only the reporting worker (the one holding the loss) logs, writes the CSV and
the TensorBoard log. Importing this module costs nothing (no torch): TensorBoard's writer is imported
when the log is opened.
"""
from __future__ import annotations

import logging
import os
import statistics
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from pipefisher.runtime.job.progress import PROGRESS_ENV, report_progress, report_steps_over

logger = logging.getLogger(__name__)

CSV_HEADER = "step,loss,val_loss,lr,step_seconds,mode,cycle,overrun_seconds,drift,aging\n"
"""The metrics CSV's columns (see :meth:`Metrics.write_csv`)."""

Row = tuple[int, "float | None", "float | None", float, float, "int | None"]
"""One step's figures as the loop gives them: step, loss, held-out loss, lr, step seconds, K-FAC cycle k."""


class Metrics:
    """One run's per-step reporting. ``steps``: the run's last step + 1; ``first``: the first step this
    run trains (a resumed run's); ``evaluates(step)``: whether the step ends with a held-out evaluation
    (:meth:`pipefisher.runtime.train.evaluator.Evaluator.due`); ``overruns`` and ``refreshes``: the
    closed loop's overrun per step and the curvature refreshes by step, known after their step."""

    def __init__(self, *, reporter: bool, mode: str, steps: int, first: int = 0, log_every: int = 5,
                 progress: bool = True, csv: str | None = None, tensorboard: str | None = None,
                 evaluates: Callable[[int], bool] = lambda step: False,
                 overruns: Callable[[], Mapping[int, float]] = dict,
                 refreshes: Callable[[], Mapping[int, Any]] = dict) -> None:
        self.reporter, self.mode, self.steps, self.first = reporter, mode, steps, first
        self.log_every, self.evaluates = log_every, evaluates
        self.overruns, self.refreshes = overruns, refreshes
        self.csv = csv if reporter else None
        # the local launcher counts the steps done from the progress marks, with progress shown or not
        self.reports = reporter and (progress or os.environ.get(PROGRESS_ENV) == "1")
        self.rows: list[Row] = []
        self.tensorboard: Any = None
        if reporter and tensorboard:
            from pipefisher.runtime.train.tensorboard import TensorBoardLog  # imports its writer

            self.tensorboard = TensorBoardLog(tensorboard, first)

    @property
    def todo(self) -> int:
        """How many steps this run trains."""
        return max(0, self.steps - self.first)

    def should_log(self, step: int) -> bool:
        """Whether ``step``'s loss is printed (and so read back from the device): every ``log_every``
        steps, the last step and every step with a held-out evaluation."""
        return step % self.log_every == 0 or step == self.steps - 1 or self.evaluates(step)

    @contextmanager
    def progress(self) -> Iterator[None]:
        """While the steps run: their progress records end with one saying they are over, however they end
        (the CLI wipes its bar)."""
        try:
            yield
        finally:
            if self.reports:
                report_steps_over()

    def stepped(self, step: int) -> None:
        """Step ``step`` is done: a progress record (the CLI's bar moves, or the launcher's, through its
        marks). Needs no figure of the step, so it moves every step while the figures wait for a logging
        step (:meth:`record`)."""
        if self.reports:
            report_progress(step + 1 - self.first, self.todo)

    def record(self, step: int, *, loss: float | None, val: float | None, lr: float, seconds: float,
               cycle: int | None) -> None:
        """One step's figures: a CSV row, TensorBoard scalars and, when :meth:`should_log`, its line. A loop
        that keeps its losses on the device records the steps since the last logging step at the next one."""
        self.rows.append((step, loss, val, lr, seconds, cycle))
        tb = self.tensorboard
        if tb is not None:
            tb.log_step(step, loss=loss, val_loss=val, lr=lr, step_seconds=seconds, cycle=cycle)
            self.log_late()
        if self.reporter and loss is not None and self.should_log(step):
            held = f"  held-out {val:.4f}" if val is not None else ""
            logger.info(f"step {step:>5}  loss {loss:.4f}{held}  {seconds * 1e3:.1f} ms")

    def log_late(self) -> None:
        """TensorBoard: the overruns and the refreshes' drift and aging not logged yet, each under its step."""
        tb = self.tensorboard
        if tb is None:
            return
        fresh = self.refreshes()
        tb.log_late("overrun_seconds", self.overruns())
        tb.log_late("drift", {s: r.drift for s, r in fresh.items()})
        tb.log_late("aging", {s: r.aging for s, r in fresh.items() if r.aging is not None})

    def flush(self) -> None:
        """At a checkpoint: the CSV so far, and the TensorBoard log to disk."""
        self.write_csv()
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def report_end(self, seconds: list[float], rank_line: str, peak_bytes: int, saved_bytes: int | None,
                   scaler: Any = None) -> None:
        """The run's closing lines (median step, peak memory, fp16 skips) and its peak memory in TensorBoard."""
        if not (self.reporter and self.todo):
            return
        times = seconds[1:] or seconds
        from pipefisher.runtime.job import memory

        logger.info(f"median step {statistics.median(times) * 1e3:.1f} ms, peak memory {memory.mib(peak_bytes)} "
                    f"({rank_line})" + (f", K-FAC saved tensors {memory.mib(saved_bytes)} at most"
                                        if saved_bytes is not None else ""))
        if scaler is not None:
            logger.info(f"fp16: {scaler.skipped} update(s) skipped for overflow over the run, loss scale now "
                        f"{scaler.scale:g}")
        if self.tensorboard is not None:
            self.tensorboard.log_peak_memory(self.steps - 1, peak_bytes, saved_bytes)

    def csv_lines(self) -> list[str]:
        """The metrics CSV's rows (no header): those of earlier runs of the file (steps before a resume), then
        this run's.

        ``cycle``: the K-FAC cycle k of the schedule the step ran (scheduled mode); ``overrun_seconds``:
        how long K-FAC work delayed the step's calls past their planned bubbles (the slowest node's;
        known once the step's job cycle is gathered); ``drift`` and ``aging``: the curvature drift and
        aging of the refresh that completed in the step (:mod:`pipefisher.loop.drift`; empty on other steps)."""
        kept: list[str] = []
        if self.csv is not None and os.path.exists(self.csv):
            with open(self.csv, encoding="utf-8") as f:
                lines = f.read().splitlines()
            first = self.rows[0][0] if self.rows else 0
            kept = [ln for ln in lines[1:] if ln and ln.split(",", 1)[0].isdigit()
                    and int(ln.split(",", 1)[0]) < first]

        def num(x: float | None) -> str:
            return "" if x is None else f"{x:.6f}"

        over, fresh = self.overruns(), self.refreshes()
        return kept + [
            f"{s},{num(l)},{num(v)},{lr:.6g},{t:.6f},{self.mode},{'' if k is None else k},{num(over.get(s))},"
            f"{num(fresh[s].drift if s in fresh else None)},{num(fresh[s].aging if s in fresh else None)}"
            for s, l, v, lr, t, k in self.rows]

    def write_csv(self) -> None:
        """The metrics CSV (reporting worker, with a path): :meth:`csv_lines` under :data:`CSV_HEADER`."""
        if self.csv is None:
            return
        from pipefisher.safe_io import write_atomic

        write_atomic(self.csv, CSV_HEADER + "".join(line + "\n" for line in self.csv_lines()))

    def figures(self) -> dict[str, list[float]]:
        """What a run's summary needs, over every step of the run (a resumed run's earlier ones included,
        with a CSV) as the CSV writes them: ``step_seconds``, ``losses`` (steps with a loss), ``overruns``
        and ``drifts`` (steps with one). The reporting worker hands them to the launcher
        (:data:`pipefisher.runtime.job.progress.SUMMARY_MARK`), so that the driver's summary needs no CSV."""
        import csv

        rows = list(csv.DictReader([CSV_HEADER, *self.csv_lines()]))
        return {"step_seconds": [float(r["step_seconds"]) for r in rows],
                "losses": [float(r["loss"]) for r in rows if r["loss"]],
                "overruns": [float(r["overrun_seconds"]) for r in rows if r["overrun_seconds"]],
                "drifts": [float(r["drift"]) for r in rows if r["drift"]]}

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
