"""How the CLI shows what a run logs: its records as lines, its progress as a step bar with an ETA.

The runtime only logs (:mod:`pipefisher.runtime.job.progress`); every command shows the ``pipefisher``
loggers' records through :class:`CliLines` while it runs (:class:`pipefisher.cli._common.PipefisherGroup`),
so a library user of the runtime gets no output they did not ask for, and the CLI's is what it always was.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

import click

from pipefisher.runtime.job.progress import LineHandler


def format_eta(seconds: float) -> str:
    """``ETA 1:05`` / ``ETA 2:03:04``: what is left, whole seconds."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"ETA {h}:{m:02d}:{s:02d}" if h else f"ETA {m}:{s:02d}"


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


class CliLines(LineHandler):
    """The CLI's handler: each line through ``click.echo`` (standard output, as every command writes), and
    the progress as a :class:`StepBar`, one per run of steps, wiped before each line and when the steps
    are over. The runtime reports progress only where a run shows it (not with ``--no-progress``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bar: StepBar | None = None

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.clear()  # the line takes the bar's line; the next step redraws the bar
        click.echo(text)

    def progress(self, mark: tuple[int, int] | None) -> None:
        if mark is None:
            if self.bar is not None:
                self.bar.clear()
            self.bar = None
            return
        if self.bar is None:
            self.bar = StepBar()
        self.bar.update(*mark)
