"""What every command shares: bad input becomes one line on stderr and exit code 2."""
from __future__ import annotations

import sys
from typing import Any

import click

from pipefisher.errors import InputError

EXIT_BAD_INPUT = 2


class PipefisherGroup(click.Group):
    """A click group that turns :class:`InputError` into ``error: <file>: <problem>`` and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InputError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_BAD_INPUT)
