"""TensorBoard logs of a training run (``pipefisher train/run --tensorboard DIR``), beside the metrics CSV.

The reporting worker (the one holding the loss) writes, per step (the global step is the step's index,
as in the CSV): ``loss/train``, ``loss/held_out`` (when evaluated), ``optim/lr``, ``time/step_seconds``,
and in scheduled mode ``kfac/cycle`` (the K-FAC cycle k of the schedule the step ran) and
``kfac/overrun_seconds`` (known only once the step's job cycle is gathered, so written then, under the
step it belongs to); with K-FAC, ``kfac/drift`` and ``kfac/aging`` under the step each curvature refresh
completed in (known once gathered: in scheduled mode with the measurements, every cycle under
``--adapt``; in kfac mode at checkpoints and the end; :mod:`pipefisher.loop.drift`);
at the end ``memory/peak_mib`` (and ``memory/kfac_saved_peak_mib`` with K-FAC).

A resumed run appends to the same folder: its writer purges (``purge_step``) whatever an earlier run
wrote from the first step it runs again, so no step is there twice. Overruns and drift of steps before that
(measured by the earlier run, gathered again from the checkpoint) are left to the earlier run, as the
metrics CSV keeps its rows.

Importing this module costs nothing; the writer (``torch.utils.tensorboard``, which needs the
``tensorboard`` package: the ``tensorboard`` extra) is imported when one is made.
"""
from __future__ import annotations

from typing import Any, Mapping

from pipefisher.errors import install_hint

EVENT_FILES = "events.out.tfevents."
"""How TensorBoard names its event files: a folder holding one holds a TensorBoard run."""

MISSING = "--tensorboard needs the tensorboard package: " + install_hint("tensorboard")

TAGS = {"loss": "loss/train", "val_loss": "loss/held_out", "lr": "optim/lr", "step_seconds": "time/step_seconds",
        "cycle": "kfac/cycle", "overrun_seconds": "kfac/overrun_seconds", "drift": "kfac/drift",
        "aging": "kfac/aging", "peak_mib": "memory/peak_mib", "kfac_saved_peak_mib": "memory/kfac_saved_peak_mib"}
"""Column (as in the metrics CSV, where it has one) -> TensorBoard tag."""


def holds_run(folder: str) -> bool:
    """Whether ``folder`` already holds a TensorBoard run (event files), which another run would mix with."""
    import os

    return os.path.isdir(folder) and any(e.startswith(EVENT_FILES) for e in os.listdir(folder))


class TensorBoardLog:
    """One run's TensorBoard writer in ``logdir``; ``first_step``: the first step this run trains (a
    resumed run's; everything an earlier run wrote from there on is purged)."""

    def __init__(self, logdir: str, first_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.first_step = first_step
        self._writer: Any = SummaryWriter(log_dir=logdir, purge_step=first_step or None)
        self._late_done: dict[str, set[int]] = {}

    def _add(self, key: str, value: float | None, step: int) -> None:
        if value is not None:
            self._writer.add_scalar(TAGS[key], value, step)

    def log_step(self, step: int, *, loss: float | None, val_loss: float | None, lr: float, step_seconds: float,
                 cycle: int | None) -> None:
        """One step's figures (None: not known for it, nothing written)."""
        for key, value in (("loss", loss), ("val_loss", val_loss), ("lr", lr), ("step_seconds", step_seconds),
                           ("cycle", cycle)):
            self._add(key, value, step)

    def log_late(self, key: str, values: Mapping[int, float]) -> None:
        """Figures known only after their step (``overrun_seconds``, ``drift``, ``aging``: step -> value) not written
        yet, each under its own step, in step order."""
        done = self._late_done.setdefault(key, set())
        for step in sorted(s for s in values if s >= self.first_step and s not in done):
            self._add(key, values[step], step)
            done.add(step)

    def log_peak_memory(self, step: int, peak_bytes: int, kfac_saved_bytes: int | None = None) -> None:
        """The run's peak memory (and K-FAC's saved tensors', with K-FAC), in MiB, under its last step."""
        self._add("peak_mib", peak_bytes / 2**20, step)
        self._add("kfac_saved_peak_mib", None if kfac_saved_bytes is None else kfac_saved_bytes / 2**20, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
