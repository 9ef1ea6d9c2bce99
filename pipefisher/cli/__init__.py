"""The ``pipefisher`` command group.

Each command lives in its own module and imports its heavy dependencies (matplotlib, torch) inside
the command function, so ``pipefisher --help`` and ``pipefisher schedule`` start fast and never
import torch.
"""
from __future__ import annotations

import click

from pipefisher import __version__
from pipefisher.cli._common import PipefisherGroup


@click.group(cls=PipefisherGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pipefisher")
def main() -> None:
    """Pack K-FAC work into pipeline bubbles, check it, and run it."""


# Commands register themselves on `main` when their module is imported (order = help order).
from pipefisher.cli import schedule as _schedule  # noqa: E402,F401
from pipefisher.cli import validate as _validate  # noqa: E402,F401
from pipefisher.cli import train as _train  # noqa: E402,F401
from pipefisher.cli import sim as _sim  # noqa: E402,F401
from pipefisher.cli import run as _run  # noqa: E402,F401
