"""``pipefisher schedule``: pack profiled timelines into a schedule file and print the usage report."""
from __future__ import annotations

from typing import Callable, Sequence

import click

from pipefisher.cli._common import (kept_until_exit, margin_option, overlap_option, staleness_for,
                                    staleness_option)
from pipefisher.cli.group import main
from pipefisher.schedule.problem import DEFAULT_MARGIN


def run_schedule(
    paths: Sequence[str],
    save_path: str | None,
    policy: str | None,
    print_workloads: bool,
    json_path: str | None = None,
    echo: Callable[[str], None] = click.echo,
    compare: bool = False,
    margin: float = DEFAULT_MARGIN,
    time_limit: float | None = None,
    allow_mixed: bool = False,
    staleness: str | None = None,
    slowdown: float | None = None,
    overlap: bool | None = None,
) -> None:
    """Load, pack, report, then write the outputs; nothing is written unless everything before worked.

    Options and output folders are checked first, so a typo there refuses before any packing or report.
    ``allow_mixed`` loads timelines that look like several jobs' (:func:`pipefisher.schedule.timeline.load_job`).
    ``overlap``: cycles may overlap (the policies that take the option: :func:`pipefisher.policies.check_overlap`); None: the
    policy's default.
    """
    from pipefisher.cli._outputs import check_out_file
    from pipefisher.errors import InputError
    from pipefisher.bundled import example_timelines
    from pipefisher.policies import DEFAULT_POLICY, check_overlap, get_policy, packs_overlapping
    from pipefisher.policies.packing import pack_job
    from pipefisher.outputs.report import report_data, usage_lines, workload_lines
    from pipefisher.safe_io import dump_json_atomic
    from pipefisher.schedule.timeline import load_job

    name = policy or DEFAULT_POLICY
    if time_limit is not None and name != "exact":
        raise InputError(None, f"--time-limit applies to the 'exact' policy only, not to '{name}'")
    if slowdown is not None and name != "target":
        raise InputError(None, f"--kfac-slowdown applies to the 'target' policy only, not to '{name}'")
    check_overlap(overlap, name)
    chosen = get_policy(name, time_limit=time_limit, staleness=staleness_for(staleness, name), slowdown=slowdown,
                        overlap=overlap)
    check_out_file(save_path, "--save-path")
    check_out_file(json_path, "--json")
    if not paths:
        paths = example_timelines()
        echo(f"(no timelines given: packing the bundled example, {len(paths)} nodes)")
    with kept_until_exit():
        job = load_job(paths, allow_mixed=allow_mixed)
        packing = pack_job(job, chosen, margin)
    schedule = packing.schedule
    if margin != DEFAULT_MARGIN:
        echo(f"(margin {margin:g}: an item fits where start + {1 + margin:g} x length < the bubble's end)")
    if print_workloads:
        for line in workload_lines(schedule):
            echo(line)
    for line in usage_lines(schedule, job):
        echo(line)
    if compare:
        from pipefisher.outputs.report import compare_lines

        others = [get_policy(name, overlap=overlap if packs_overlapping(name) else None).pack(job, margin)
                  for name in ("compat", DEFAULT_POLICY) if name != chosen.name]
        pair = [s for s in [schedule, *others] if s.policy == "compat"] + \
            [s for s in [schedule, *others] if s.policy != "compat"]
        echo("")
        for line in compare_lines(job, pair):
            echo(line)
    data = report_data(schedule, job) if json_path else None
    if save_path:
        packing.save(save_path)
    if json_path:
        dump_json_atomic(json_path, data)


def _policy_help() -> str:
    from pipefisher.policies import DEFAULT_POLICY, POLICIES

    return f"packing policy: {', '.join(sorted(POLICIES))} (default: {DEFAULT_POLICY})"


@main.command("schedule")
@click.argument("timelines", nargs=-1)
@click.option("--save-path", "--save_path", "save_path", type=click.Path(dir_okay=False),
              help="write the schedule file here (atomically)")
@click.option("--policy", default=None, help=_policy_help())
@click.option("--print-workloads", "--print_workloads", "print_workloads", is_flag=True,
              help="list every placed item and bubble per node")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the report as JSON here")
@click.option("--compare", is_flag=True,
              help="also pack with 'compat' (or the default policy) and print both side by side per node")
@margin_option()
@click.option("--time-limit", type=click.FloatRange(0, min_open=True), default=None,
              help="seconds the 'exact' policy may search, for the whole job (default: 5)")
@staleness_option()
@click.option("--kfac-slowdown", "slowdown", type=click.FloatRange(0, 10), default=None,
              help="for 'target': how much longer than profiled K-FAC work runs in a bubble, as a fraction "
                   "(default: 0.1, measured)")
@click.option("--allow-mixed", is_flag=True,
              help="load TIMELINES even if they look like several jobs' (other name prefixes, a node index "
                   "missing or twice, a file twice, or another run's start_end)")
@overlap_option()
def schedule_command(timelines: tuple[str, ...], save_path: str | None, policy: str | None,
                     print_workloads: bool, json_path: str | None, compare: bool, margin: float,
                     time_limit: float | None, allow_mixed: bool, staleness: str | None,
                     slowdown: float | None, overlap: bool | None) -> None:
    """Pack per-node TIMELINES (pickle or JSON; comma-separated lists work too) into bubbles.

    With no TIMELINES, packs the bundled example job. With --save-path, the schedule's metadata (policy,
    margin, cycle and bound per node) is written beside it as FILE.meta.json.
    """
    run_schedule(timelines, save_path, policy, print_workloads, json_path, compare=compare, margin=margin,
                 time_limit=time_limit, allow_mixed=allow_mixed, staleness=staleness, slowdown=slowdown,
                 overlap=overlap)
