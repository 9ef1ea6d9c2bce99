"""Every file name of a run, decided here: ``<folder>/<name>_<what>``, so that several runs sit side by side.

``pipefisher run`` puts all of them in its ``--out`` folder under the run's name; ``pipefisher train --out``
writes the trainer's under the config's name. The driver, the trainer, the closed loop and the export
all take their names from :class:`RunPaths`; no torch here (the CLI imports it)::

    <run>_config.yaml       the config used (after command-line overrides)
    <run>_tokenizer.json    the subword tokenizer trained on the corpus (the run's vocabulary)
    <run>_losses.json       a trainer's losses, options and memory figures (``train --out``)
    <run>_timelines/        one profiled timeline per pipeline node, nothing else (``pipefisher schedule`` reads it)
    <run>_profile_losses.json  the profiling steps' losses and options (the profiling trainer's <run>_losses.json)
    <run>_profile_steps/    every profiled step per node (<name>_node<i>_steps.pickle), whose median step the timelines hold
    <run>_schedule.pickle   the packed schedule (the trainer's input)
    <run>_report.json       usage report per node, policy, validation result, training summary
    <run>_chart.png         the packed cycle per node
    <run>_metrics.csv       step, loss, step time, mode, cycle k and measured overrun of every step
    <run>_measurements.csv  every label of every scheduled step: planned and measured start/end, wait
    <run>_cycles.jsonl      per cycle and node: step time, K-FAC label times, bubbles as they were, overruns
    <run>_measured/         the timelines measured over the last cycles (``pipefisher schedule`` reads them)
    <run>_schedules/        every schedule the training used and when it took over (``history.json``)
    <run>_checkpoints/      the last checkpoint(s) and the tokenizer (``pipefisher run --resume`` continues the run)
    <run>_workers.log       only after a failure: every worker's output and tracebacks
"""
from __future__ import annotations

import os
from dataclasses import dataclass

RUN_CHECKPOINTS = "_checkpoints"
"""The suffix of a run's checkpoint folder (``<run>_checkpoints``): how a run folder's runs are found."""

MEASURED = ("measurements.csv", "cycles.jsonl", "measured", "schedules")
"""What the closed loop writes (rank 0, scheduled mode), in the order runs list them."""


@dataclass(frozen=True)
class RunPaths:
    """The files of the run ``name`` in ``folder``."""

    folder: str
    name: str

    @classmethod
    def at(cls, prefix: str) -> RunPaths:
        """The run whose files start with ``prefix`` (``<folder>/<name>``)."""
        return cls(os.path.dirname(prefix), os.path.basename(prefix))

    @property
    def prefix(self) -> str:
        """``<folder>/<name>``: every file of the run is this plus ``_<what>``."""
        return os.path.join(self.folder, self.name)

    def _p(self, suffix: str) -> str:
        return f"{self.prefix}_{suffix}"

    @property
    def config(self) -> str:
        return self._p("config.yaml")

    @property
    def tokenizer(self) -> str:
        return self._p("tokenizer.json")

    @property
    def losses(self) -> str:
        """A trainer's losses, options and memory figures (``--out``)."""
        return self._p("losses.json")

    @property
    def timelines(self) -> str:
        return self._p("timelines")

    @property
    def profile_losses(self) -> str:
        """The profiling steps' ``<name>_losses.json``, kept beside the timelines, not among them."""
        return self._p("profile_losses.json")

    @property
    def profile_steps_dir(self) -> str:
        """The raw multi-step profiles (:func:`pipefisher.runtime.train.profiler.steps_filename`), kept beside
        the timelines, not among them."""
        return self._p("profile_steps")

    @property
    def schedule(self) -> str:
        return self._p("schedule.pickle")

    @property
    def report(self) -> str:
        return self._p("report.json")

    @property
    def chart(self) -> str:
        return self._p("chart.png")

    @property
    def metrics(self) -> str:
        return self._p("metrics.csv")

    @property
    def measurements(self) -> str:
        """The closed loop's per-label measurements of every scheduled step."""
        return self._p("measurements.csv")

    @property
    def cycles(self) -> str:
        """The closed loop's per-cycle, per-node summaries."""
        return self._p("cycles.jsonl")

    @property
    def measured(self) -> str:
        """The timelines measured over the last cycles, one per node."""
        return self._p("measured")

    @property
    def schedules(self) -> str:
        """Every schedule the training used, with ``history.json``."""
        return self._p("schedules")

    @property
    def history(self) -> str:
        """When each schedule took over, its digest, cycle k per node and why."""
        return os.path.join(self.schedules, "history.json")

    def measured_files(self) -> list[str]:
        """The closed loop's files (:data:`MEASURED`) of this run."""
        return [self._p(what) for what in MEASURED]

    @property
    def checkpoints(self) -> str:
        return self.prefix + RUN_CHECKPOINTS

    @property
    def workers_log(self) -> str:
        """Worker output and tracebacks of a run that failed (none after a run that succeeded)."""
        return self._p("workers.log")

    def taken(self) -> bool:
        prefix = f"{self.name}_"
        return os.path.isdir(self.folder) and any(e.startswith(prefix) for e in os.listdir(self.folder))
