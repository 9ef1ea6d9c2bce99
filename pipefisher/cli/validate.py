"""``pipefisher validate``: check a schedule file against the spec's dependency rules and counts, and
against the bubbles' room."""
from __future__ import annotations

import sys

import click

from pipefisher.cli._common import margin_option
from pipefisher.cli.group import main


@main.command("validate", options_metavar="--schedule FILE [OPTIONS]")
@click.option("--schedule", "schedule_path", required=True, type=click.Path(dir_okay=False),
              help="the schedule file to check (pipefisher schedule --save-path)")
@click.option("--room/--no-room", default=True, show_default=True,
              help="also check that the work between two pipeline items fits the idle time between them, "
                   "and that only work no bubble can hold runs past the pipeline time")
@click.option("--layout", type=click.Choice(["auto", "chimera", "none"]), default="auto", show_default=True,
              help="which nodes hold replicas of one stage and must share the order of their syncs, inverses "
                   "and '-- end --' (sync groups): auto infers Chimera's pairs (d, D-1-d) from the timelines' "
                   "up-pipe modules, chimera forces those pairs, none checks no groups")
@margin_option(recorded=True)
@click.option("--allow-mixed", is_flag=True,
              help="load TIMELINES even if they look like several jobs' (other name prefixes, a node index "
                   "missing or twice, a file twice, or another run's start_end)")
@click.argument("timelines", nargs=-1, required=True)
def validate_command(schedule_path: str, room: bool, layout: str, margin: float | None,
                     timelines: tuple[str, ...], allow_mixed: bool = False) -> None:
    """Check the schedule file (--schedule FILE) against the job's TIMELINES (one per node, pickle or
    JSON); print every violation, exit 1 if there is any.

    The spec's rules: each covariance piece after the forward or backward whose data it needs, syncs
    after all pieces, inverses after their sync (where the metadata says the cycles overlap, an inverse
    piece may also come before it: the previous cycle's refresh), every piece, sync and inverse as often as the timeline
    asks. A schedule whose metadata (FILE.meta.json) says it was packed for another job (another pipeline
    order, node or micro-batch count, other K-FAC modules) is refused in one line. With --room (the
    default), also the room rule, with its margin: the K-FAC work between two
    pipeline items runs back to back, and each item must start early enough that its length times
    (1 + margin) ends before the next pipeline item; only work no bubble can hold runs past the
    pipeline time. A schedule that packs more than that into a bubble makes its iterations longer than
    it reports. Per sync group (--layout), every
    iteration's syncs, inverses and '-- end --' must come in the same order on every member, up-pipe
    suffixes aside, or the all-reduces deadlock and the replicas drift apart; and a schedule whose
    waits (an inverse for its peers' syncs, '-- end --' for its peers' ends, a forward or backward for
    its input) form a cycle in some training step is reported as 'deadlock'.
    """
    from pipefisher.errors import InputError
    from pipefisher.rules import validate
    from pipefisher.rules.groups import chimera_groups
    from pipefisher.schedule.problem import DEFAULT_MARGIN
    from pipefisher.schedule.file import (load_schedule, schedule_kfac_margin, schedule_margin, schedule_overlap,
                                          schedule_timelines, timelines_mismatch)
    from pipefisher.schedule.timeline import inflate_kfac, load_job

    job = load_job(timelines, allow_mixed=allow_mixed)
    schedule = load_schedule(schedule_path)
    if diff := timelines_mismatch(schedule_path, job):  # one line, not a violation for every label that cannot fit
        packed_from = schedule_timelines(schedule_path)
        raise InputError(schedule_path, f"was packed for another job than these timelines: {diff}; check it against "
                                        "the timelines it was packed from"
                                        + (f" (its metadata names {packed_from[0]}, ...)" if packed_from else ""))
    kfac_margin = schedule_kfac_margin(schedule_path)  # the job it was packed against: the one it is checked on
    if kfac_margin != 1.0:
        job = inflate_kfac(job, kfac_margin)
        click.echo(f"(K-FAC times x {kfac_margin:g}, as recorded beside the schedule)", err=True)
    if margin is None:
        margin = schedule_margin(schedule_path)
        if margin is None:
            margin = DEFAULT_MARGIN
        elif margin != DEFAULT_MARGIN:
            click.echo(f"(room rule with margin {margin:g}, as recorded beside the schedule)", err=True)
    groups = {"auto": None, "chimera": chimera_groups(len(job.nodes)), "none": []}[layout]
    overlap = schedule_overlap(schedule_path)
    if overlap:
        click.echo("(cycles that overlap, as recorded beside the schedule: refresh pieces may come before "
                   "their factor's completion)", err=True)
    violations = validate(schedule, job, schedule_path, room=room, groups=groups, margin=margin, overlap=overlap)
    for v in violations:
        click.echo(str(v))
    nodes_bad = len({v.node for v in violations})
    if violations:
        click.echo(f"{len(violations)} violation(s) on {nodes_bad} of {len(job.nodes)} node(s)", err=True)
        sys.exit(1)
    click.echo(f"ok: {len(job.nodes)} node(s), no violations", err=True)
