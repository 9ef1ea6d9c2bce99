"""What a training run shows while it runs: start-up phase lines and a step bar with an ETA.

Start-up (spawning workers, importing torch, building the model, the first step) takes seconds on a
tiny model and minutes on BERT-Base; without these lines it is silent. No torch here, so the local
launcher can say what it is doing before any worker has imported it.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

import click

PROGRESS_ENV = "PIPEFISHER_RELAY_PROGRESS"
"""Set by the local launcher: the reporting worker prints :data:`PROGRESS_MARK` lines instead of a bar."""
PROGRESS_MARK = "@@pipefisher-progress"
"""``@@pipefisher-progress DONE TOTAL``: steps done of this run's steps, for the launcher's bar."""
SUMMARY_MARK = "@@pipefisher-summary"
"""``@@pipefisher-summary JSON``: the reporting worker's run figures (:meth:`Metrics.figures
<pipefisher.runtime.train.metrics.Metrics.figures>`), its last line, for the launcher's caller."""


def phase(what: str, echo: Callable[[str], None] = click.echo) -> None:
    """One start-up phase line, printed as the phase begins (so a slow phase shows which it is)."""
    echo(f"... {what}")


def format_eta(seconds: float) -> str:
    """``ETA 1:05`` / ``ETA 2:03:04``: what is left, whole seconds."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"ETA {h}:{m:02d}:{s:02d}" if h else f"ETA {m}:{s:02d}"


def parse_mark(line: str) -> tuple[int, int] | None:
    """(done, total) from a :data:`PROGRESS_MARK` line, else None."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != PROGRESS_MARK or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return int(parts[1]), int(parts[2])


class StepBar:
    """click's progress bar over the training steps, with the position and an ETA, on a terminal only
    (elsewhere the loss lines show progress).

    The ETA is measured from the steps after the first one the bar sees: the first step compiles,
    allocates and warms up, and counting it would make the estimate far too long for many steps.
    """

    def __init__(self, file: TextIO | None = None, label: str = "training",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.file = file if file is not None else sys.stdout
        self.label, self.clock = label, clock
        try:
            self.tty = self.file.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.bar: click.progressbar | None = None  # type: ignore[valid-type]
        self.started: tuple[float, int] | None = None  # (when, steps done) at the first update
        self.eta: float | None = None  # seconds left, once two updates have been seen

    def update(self, done: int, total: int) -> None:
        """``done`` of ``total`` steps are finished."""
        now = self.clock()
        if self.started is None:
            self.started = (now, done)
        elif done > self.started[1]:
            self.eta = (now - self.started[0]) / (done - self.started[1]) * max(0, total - done)
        if not self.tty:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, show_pos=True, show_eta=False,
                                         item_show_func=lambda text: text, file=self.file)
            self.bar.__enter__()
        info = format_eta(self.eta) if self.eta is not None and done < total else ""
        self.bar.update(done - self.bar.pos, info)

    def clear(self) -> None:
        """Wipe the bar's line before other output, and at the end (the bar is transient: the loss lines
        stay); the next update draws it again, as its position or ETA has changed."""
        if self.bar is not None and self.tty:
            self.file.write("\r\033[K\033[?25h")  # click hides the cursor while it draws
            self.file.flush()
