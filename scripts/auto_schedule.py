#!/usr/bin/env python3
"""Drop-in for the published PipeFisher auto-scheduler: same arguments, same output.

    python scripts/auto_schedule.py run_node0_timeline.pickle,run_node1_timeline.pickle \
        --save_path schedule.pickle [--print_workloads] [--policy NAME] [--staleness FILE|K:RATIO,...]
"""
from __future__ import annotations

import os
import sys

import click

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.cli import _common  # noqa: E402
from pipefisher.cli._common import EXIT_BAD_INPUT, staleness_option  # noqa: E402
from pipefisher.cli.schedule import _policy_help, run_schedule  # noqa: E402
from pipefisher.errors import InputError  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("timelines", nargs=-1)
@click.option("--save_path", "--save-path", "save_path", type=click.Path(dir_okay=False),
              help="write the schedule file here")
@click.option("--print_workloads", "--print-workloads", "print_workloads", is_flag=True,
              help="list every placed item and bubble per node")
@click.option("--policy", default=None, help=_policy_help())
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the report as JSON here")
@click.option("--compare", is_flag=True, help="also print 'compat' and the default policy side by side")
@staleness_option()
def auto_schedule(timelines: tuple[str, ...], save_path: str | None, print_workloads: bool,
                  policy: str | None, json_path: str | None, compare: bool, staleness: str | None) -> None:
    """Pack comma-separated per-node TIMELINES into pipeline bubbles."""
    try:
        run_schedule(timelines, save_path, policy, print_workloads, json_path, compare=compare, staleness=staleness)
    except InputError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    _common.ENDS_WITH_COMMAND = True  # this process ends with the command (see kept_until_exit)
    auto_schedule()
