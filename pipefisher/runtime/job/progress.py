"""What a training run says while it runs, through :mod:`logging`: start-up phase lines, progress records,
and the handler that shows them as lines (the CLI's and a launched worker's).

Start-up (spawning workers, importing torch, building the model, the first step) takes seconds on a
tiny model and minutes on BERT-Base; without these lines it is silent. The runtime and K-FAC only log
(each module to ``logging.getLogger(__name__)``, under the ``pipefisher`` logger): a library user sees
nothing unless they configure logging, and the CLI shows the records as the lines a run prints
(:class:`LineHandler`, installed by :func:`showing`). Progress is a record too (:func:`report_progress`):
the CLI draws it as its bar, a worker of the local launcher passes it on as a :data:`PROGRESS_MARK`
line. No torch and no click here, so the local launcher can say what it is doing before any worker has
imported torch.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

ROOT_LOGGER = "pipefisher"
"""The logger every pipefisher module's logger sits under: where :func:`showing` puts its handler."""
PROGRESS_ENV = "PIPEFISHER_RELAY_PROGRESS"
"""Set by the local launcher: the reporting worker reports its progress even with ``progress`` off (the
launcher counts the steps done from its marks) and ends with a :data:`SUMMARY_MARK` line."""
PROGRESS_MARK = "@@pipefisher-progress"
"""``@@pipefisher-progress DONE TOTAL``: steps done of this run's steps, for the launcher's bar."""
SUMMARY_MARK = "@@pipefisher-summary"
"""``@@pipefisher-summary JSON``: the reporting worker's run figures (:meth:`Metrics.figures
<pipefisher.runtime.train.metrics.Metrics.figures>`), its last line, for the launcher's caller."""
PROGRESS = "pipefisher_progress"
"""The attribute of a progress record (:func:`report_progress`): (done, total), or None once the steps are over."""


def phase(what: str, echo: Callable[[str], None] | None = None) -> None:
    """One start-up phase line, said as the phase begins (so a slow phase shows which it is): logged, or
    to ``echo``."""
    (echo or logger.info)(f"... {what}")


def report_progress(done: int, total: int) -> None:
    """``done`` of ``total`` steps are finished: a DEBUG record carrying them (:data:`PROGRESS`), which the
    CLI draws as its bar; DEBUG, so that a library user's INFO log gets no line per step."""
    logger.debug("%d of %d step(s) done", done, total, extra={PROGRESS: (done, total)})


def report_steps_over() -> None:
    """The steps are over (done, failed or stopped): the CLI wipes its bar before what follows."""
    logger.debug("steps over", extra={PROGRESS: None})


def parse_mark(line: str) -> tuple[int, int] | None:
    """(done, total) from a :data:`PROGRESS_MARK` line, else None."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != PROGRESS_MARK or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return int(parts[1]), int(parts[2])


class LineHandler(logging.Handler):
    """Shows the runtime's records as the lines a run prints: each message (INFO and above) on its own
    line on standard output, and each progress record as a :data:`PROGRESS_MARK` line (a launched
    worker's, for its launcher). The CLI's handler draws the progress as a bar instead (:meth:`progress`).

    Standard output is looked up at each line, not kept: a test runner that replaces ``sys.stdout`` gets
    the lines written while it holds it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if PROGRESS in record.__dict__:
                self.progress(record.__dict__[PROGRESS])
            elif record.levelno >= logging.INFO:
                self.line(self.format(record))
        except Exception:  # logging's rule: a failing handler reports itself, it never breaks the run
            self.handleError(record)

    def line(self, text: str) -> None:
        """One line of output."""
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def progress(self, mark: tuple[int, int] | None) -> None:
        """A progress record's (done, total), or None once the steps are over."""
        if mark is not None:
            self.line(f"{PROGRESS_MARK} {mark[0]} {mark[1]}")


@contextmanager
def showing(handler: logging.Handler) -> Iterator[None]:
    """``handler`` gets every record of the pipefisher loggers (progress records too) while the block runs;
    then the ``pipefisher`` logger is as it was (a test process runs many commands and library calls)."""
    root = logging.getLogger(ROOT_LOGGER)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
