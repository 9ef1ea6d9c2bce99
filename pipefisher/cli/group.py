"""The ``pipefisher`` command group: what every command module registers itself on.

Its own module, so that the command modules import it and the package (which imports them all) is
above them, with no arrow back.
"""
from __future__ import annotations

import click

from pipefisher import __version__
from pipefisher.cli._common import PipefisherGroup


@click.group(cls=PipefisherGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pipefisher")
def main() -> None:
    """Pack K-FAC work into pipeline bubbles, check it, and run it."""
