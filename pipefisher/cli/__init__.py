"""The ``pipefisher`` command group, with every command registered: the top layer.

Each command lives in its own module and imports its heavy dependencies (matplotlib, torch) inside
the command function, so ``pipefisher --help`` and ``pipefisher schedule`` start fast and never
import torch.
"""
from __future__ import annotations

from pipefisher.cli import _common
from pipefisher.cli.group import main

# Commands register themselves on `main` when their module is imported (order = help order).
from pipefisher.cli import schedule as _schedule  # noqa: E402,F401
from pipefisher.cli import validate as _validate  # noqa: E402,F401
from pipefisher.cli import train as _train  # noqa: E402,F401
from pipefisher.cli import sim as _sim  # noqa: E402,F401
from pipefisher.cli import run as _run  # noqa: E402,F401
from pipefisher.cli import export as _export  # noqa: E402,F401


def console() -> None:
    """The ``pipefisher`` console script: the command group, in a process that ends with it."""
    _common.ENDS_WITH_COMMAND = True
    main()
