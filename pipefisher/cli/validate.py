"""``pipefisher validate``: check a schedule file against the spec's dependency rules and counts."""
from __future__ import annotations

import sys

import click

from pipefisher.cli import main


@main.command("validate")
@click.option("--schedule", "schedule_path", required=True, type=click.Path(dir_okay=False),
              help="the schedule file to check")
@click.argument("timelines", nargs=-1, required=True)
def validate_command(schedule_path: str, timelines: tuple[str, ...]) -> None:
    """Check SCHEDULE against the job's TIMELINES; print every violation, exit 1 if there is any."""
    from pipefisher.schedule import load_schedule, validate
    from pipefisher.timeline import load_job

    job = load_job(timelines)
    schedule = load_schedule(schedule_path)
    violations = validate(schedule, job, schedule_path)
    for v in violations:
        click.echo(str(v))
    nodes_bad = len({v.node for v in violations})
    if violations:
        click.echo(f"{len(violations)} violation(s) on {nodes_bad} of {len(job.nodes)} node(s)", err=True)
        sys.exit(1)
    click.echo(f"ok: {len(job.nodes)} node(s), no violations", err=True)
