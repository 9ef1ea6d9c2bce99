"""How the CLI and a launched worker show what the runtime logs: lines, a step bar with an ETA that leaves the
warm-up step out and is wiped before each line, progress marks for the launcher."""
from __future__ import annotations

import io
import logging
import sys

import pytest

from pipefisher.cli._progress import CliLines, StepBar, format_eta
from pipefisher.runtime.job.progress import LineHandler, parse_mark, report_progress, report_steps_over, showing

WIPE = "\r\033[K\033[?25h"
"""What the bar writes to leave its line to the next output: the line wiped, the cursor shown again."""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_step_bar_shows_position_and_an_eta_without_the_warm_up_step():
    now = [0.0]
    out = _Terminal()
    bar = StepBar(file=out, clock=lambda: now[0])
    now[0] = 100.0  # step 0 compiled for 100 s
    bar.update(1, 10)
    assert bar.eta is None and "1/10" in out.getvalue() and "ETA" not in out.getvalue()
    now[0] = 102.0  # then 2 s a step: 8 steps left
    bar.update(2, 10)
    assert bar.eta == pytest.approx(16.0)
    assert "2/10" in out.getvalue() and format_eta(16.0) == "ETA 0:16" and "ETA 0:16" in out.getvalue()
    bar.clear()
    assert out.getvalue().endswith(WIPE)  # wiped, cursor back, for the next output line


def test_step_bar_draws_nothing_off_a_terminal():
    out = io.StringIO()
    bar = StepBar(file=out)
    bar.update(1, 3)
    bar.update(2, 3)
    bar.clear()
    assert out.getvalue() == "" and bar.eta is not None


def test_eta_format():
    assert format_eta(65.4) == "ETA 1:05" and format_eta(3 * 3600 + 62) == "ETA 3:01:02" and format_eta(-1) == "ETA 0:00"


def test_the_cli_draws_progress_as_a_bar_and_wipes_it_before_each_line_and_when_the_steps_are_over(monkeypatch):
    out = _Terminal()
    monkeypatch.setattr(sys, "stdout", out)  # the handler writes where stdout is when it writes
    log = logging.getLogger("pipefisher.runtime.train.metrics")
    with showing(CliLines()):
        report_progress(1, 4)
        drawn = out.getvalue()
        log.info("step     1  loss 1.0000  1.0 ms")
        log.debug("a debug record")  # DEBUG shows only as progress
        report_progress(2, 4)
        report_steps_over()
        log.info("after the steps")
    log.info("after the command")  # the handler is gone with the command
    text = out.getvalue()
    assert "1/4" in drawn and "\n" not in drawn
    assert WIPE + "step     1  loss 1.0000  1.0 ms\n" in text and "2/4" in text.split("1.0 ms\n")[1]
    assert text.endswith(WIPE + "after the steps\n") and "debug" not in text and "after the command" not in text


def test_a_launched_worker_shows_lines_and_passes_progress_on_as_marks(capsys):
    log = logging.getLogger("pipefisher.runtime.train.trainer")
    with showing(LineHandler()):
        report_progress(3, 10)
        log.warning("stage 0 replica 0: K-FAC layer fc1 factor A: ...")
        report_steps_over()  # the launcher ends its own bar
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["@@pipefisher-progress 3 10", "stage 0 replica 0: K-FAC layer fc1 factor A: ..."]
    assert parse_mark(lines[0]) == (3, 10) and parse_mark(lines[1]) is None
    assert logging.getLogger("pipefisher").level == logging.NOTSET and not logging.getLogger("pipefisher").handlers
