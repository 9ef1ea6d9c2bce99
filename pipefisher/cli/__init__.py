"""The ``pipefisher`` command group, with every command registered: the top layer.

Each command lives in its own module and imports its heavy dependencies (matplotlib, torch) inside
the command function, so ``pipefisher --help`` and ``pipefisher schedule`` start fast and never
import torch. The command modules are imported (and so register themselves on ``main``) only when
``main`` is first asked for: a process that needs one command's code, such as
``scripts/auto_schedule.py`` (which imports :mod:`pipefisher.cli.schedule`), does not pay for the
others' imports (``train``'s run configuration alone is some 20 ms of a 1 s packing run).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import click

COMMAND_MODULES = ("schedule", "validate", "train", "sim", "run", "export")
"""The command modules, in help order: each registers its commands on ``main`` when imported."""


def _group() -> "click.Group":
    """The command group with every command module imported (so registered), once."""
    import importlib

    from pipefisher.cli.group import main

    for name in COMMAND_MODULES:
        importlib.import_module(f"pipefisher.cli.{name}")
    return main


def __getattr__(name: str) -> object:
    """``pipefisher.cli.main``: the group, every command registered (PEP 562, imported on first use)."""
    if name == "main":
        return _group()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def console() -> None:
    """The ``pipefisher`` console script: the command group, in a process that ends with it."""
    from pipefisher.cli import _common

    _common.ENDS_WITH_COMMAND = True
    _group()()
