#!/usr/bin/env python3
"""Speed of the default packing policy against ``compat`` and the published tool, in one run.

Three simulated jobs (BERT-like block costs, 1F1B, heavy K-FAC work), written as timeline pickles:

* 8 nodes x 64 micro-batches x 36 K-FAC layers per node: times the new policy, the ``compat``
  policy and the published tool's data structures (``compat_reference``, about a minute; skip it with
  ``--no-reference``), each from loading the files to writing the schedule file;
* 16 nodes x 128 micro-batches x 48 K-FAC layers per node: the new policy and ``compat``;
* the same shape with K-FAC scale 5 (heavy: the work spills over about 40 iterations, no node's cycle
  meets its bound, so every construction of the policy's portfolio runs): the new policy against
  ``compat``, the ratio, and whether it stays under 1 second.

The new policy's figure includes loading the timelines, packing, the report and writing the schedule.

Then the regression job ``tests/data/regressions/heavy-16x128x48`` (or ``--heavy-job FOLDER``), timed
as a whole process exactly as the published script is run (``python scripts/auto_schedule.py <16 files
joined by commas> --save_path s.pickle``: interpreter start, imports, loading, packing, report,
writing), best of ``--repeat``, against the 1 second target. ``--process-only`` times only that.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import click

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.cli._common import staleness_for, staleness_option  # noqa: E402
from pipefisher.outputs.report import usage_lines  # noqa: E402
from pipefisher.policies import DEFAULT_POLICY, get_policy  # noqa: E402
from pipefisher.policies.compat_reference import ref_pack_job  # noqa: E402
from pipefisher.rules import validate  # noqa: E402
from pipefisher.schedule.file import load_schedule, save_schedule, schedule_margin  # noqa: E402
from pipefisher.schedule.problem import DEFAULT_MARGIN  # noqa: E402
from pipefisher.schedule.timeline import load_job, natural_key  # noqa: E402
from pipefisher.sim.simulator import write_timelines  # noqa: E402
from pipefisher.sim.synthetic import synthetic_timelines  # noqa: E402

HEAVY_SCALE = 5.0  # the heavy job: 16 x 128 x 48 K-FAC layers whose work spills over about 40 iterations
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY_JOB = os.path.join(ROOT, "tests", "data", "regressions", "heavy-16x128x48")
TARGET_S = 1.0  # the whole-process target on the heavy regression job


def build(folder: str, stages: int, micro_batches: int, layers_per_stage: int, kfac_scale: float) -> list[str]:
    timelines = synthetic_timelines("1f1b", stages, micro_batches, layers_per_stage, kfac_scale=kfac_scale, seed=0)
    return write_timelines(folder, f"bench{stages}x{micro_batches}", timelines)


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def end_to_end(paths: list[str], policy: str, out: str, staleness: object = None) -> None:
    job = load_job(paths)
    schedule = get_policy(policy, staleness=staleness).pack(job)
    usage_lines(schedule)
    save_schedule(out, schedule)


def whole_process(folder: str, repeat: int, policy: str, against: str | None = None,
                  staleness: str | None = None) -> None:
    """Time ``scripts/auto_schedule.py`` on the node files in ``folder`` as a fresh process: best and
    median of ``repeat`` runs after one untimed run, byte-code cached as a user's interpreter caches it.
    With ``against`` (a git revision), that revision's script runs too, alternating with this one's
    (``staleness``, the job's curve for ``target``, goes to this tree's script only)."""
    paths = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith("_timeline.pickle")),
                   key=natural_key)
    if not paths:
        raise click.ClickException(f"{folder}: no *_timeline.pickle files")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as out:
        roots = {"this tree": ROOT}
        if against:
            roots[against] = os.path.join(out, "against")
            os.makedirs(roots[against])
            archive = subprocess.run(["git", "-C", ROOT, "archive", against], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", roots[against]], input=archive, check=True)
        lines: dict[str, list[str]] = {}
        times: dict[str, list[float]] = {name: [] for name in roots}
        for rnd in range(repeat + 1):
            for name, root in roots.items():
                target = os.path.join(out, f"{name.replace(os.sep, '_')}-{rnd}.pickle")
                cmd = [sys.executable, os.path.join(root, "scripts", "auto_schedule.py"), ",".join(paths),
                       "--save_path", target, "--policy", policy]
                if staleness is not None and name == "this tree":
                    cmd += ["--staleness", staleness]
                t0 = time.perf_counter()
                res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=root)
                if rnd:  # the first round only warms the byte-code and file caches
                    times[name].append(time.perf_counter() - t0)
                lines[name] = res.stdout.splitlines()
                if name == "this tree":
                    saved = target
        job = load_job(paths)
        ok = not validate(load_schedule(saved), job, margin=schedule_margin(saved) or DEFAULT_MARGIN)
    click.echo(f"job: {os.path.basename(folder.rstrip(os.sep))} ({len(paths)} nodes), whole process "
               f"(python scripts/auto_schedule.py ... --save_path s.pickle), {repeat} runs each")
    for name in roots:
        cycles = sum(int(line.split(":")[1].split()[0]) for line in lines[name] if line.startswith("node"))
        best, median = min(times[name]), statistics.median(times[name])
        click.echo(f"  {policy} ({name}): best {best:.3f} s, median {median:.3f} s; best {best / TARGET_S:.2f} x the "
                   f"{TARGET_S:g} s target; total cycle {cycles}"
                   + (f"; validates: {'yes' if ok else 'NO'}" if name == "this tree" else ""))
    if against:
        click.echo(f"  this tree / {against}: best {min(times['this tree']) / min(times[against]):.3f}, median "
                   f"{statistics.median(times['this tree']) / statistics.median(times[against]):.3f}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--kfac-scale", default=4.0, show_default=True, help="multiplies every K-FAC cost (heavy work)")
@click.option("--repeat", default=3, show_default=True, help="runs of the fast policies (best is kept)")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="also time the published tool's data structures on the 8x64x36 job (about a minute)")
@click.option("--policy", default=DEFAULT_POLICY, show_default=True)
@click.option("--heavy-job", default=HEAVY_JOB, show_default=True, type=click.Path(file_okay=False, exists=True),
              help="folder of the heavy regression job's node files (timed as a whole process)")
@click.option("--process-only", is_flag=True, help="time only the heavy regression job, as a whole process")
@click.option("--against", default=None, metavar="REV",
              help="also time that git revision's scripts/auto_schedule.py on the heavy job, alternating")
@staleness_option()
def main(kfac_scale: float, repeat: int, reference: bool, policy: str, heavy_job: str, process_only: bool,
         against: str | None, staleness: str | None) -> None:
    curve = staleness_for(staleness, policy)
    whole_process(heavy_job, repeat, policy, against, staleness)
    if process_only:
        return
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "schedule.pickle")
        heavy = (16, 128, 8, HEAVY_SCALE)
        jobs = [(8, 64, 6, kfac_scale), (16, 128, 8, kfac_scale), heavy]
        for stages, mb, lps, scale in dict.fromkeys(jobs):  # once each, should --kfac-scale be the heavy one
            paths = build(os.path.join(folder, f"{stages}x{mb}x{scale}"), stages, mb, lps, scale)
            note = " -- heavy, about 40 iterations" if (stages, mb, lps, scale) == heavy else ""
            click.echo(f"job: {stages} nodes x {mb} micro-batches x {lps * 6} K-FAC layers per node "
                       f"(K-FAC scale {scale}){note}")
            t_new = best_of(repeat, lambda: end_to_end(paths, policy, out, curve))
            t_compat = best_of(1 if not note else repeat, lambda: end_to_end(paths, "compat", out))
            job = load_job(paths)
            packed = get_policy(policy, staleness=curve).pack(job)
            ok = not validate(packed.to_file_data(), job, margin=packed.margin)
            cycles = sum(n.figures.iterations for n in packed.nodes)
            bound = sum(n.figures.lower_bound or 1 for n in packed.nodes)
            compat_packed = get_policy("compat").pack(job)
            compat_cycles = sum(n.figures.iterations for n in compat_packed.nodes)
            compat_bad = len({v.node for v in validate(compat_packed.to_file_data(), job)})
            click.echo(f"  {policy} (load + pack + report + write): {t_new:8.3f} s  (best of {repeat}); "
                       f"validates: {'yes' if ok else 'NO'}; total cycle {cycles} (bound {bound}; compat {compat_cycles}, "
                       f"{stages - compat_bad}/{stages} nodes valid)")
            if note:
                click.echo(f"  compat (load + pack + report + write): {t_compat:8.3f} s  (best of {repeat}); "
                           f"{policy} / compat: {t_new / t_compat:.2f}")
                longest = max(n.figures.iterations for n in packed.nodes)
                click.echo(f"  {policy}: total cycle {cycles} vs bound {bound} (+{cycles - bound}); longest node "
                           f"{longest} iterations; validates: {'yes' if ok else 'NO'}")
            else:
                click.echo(f"  compat (load + pack + report + write): {t_compat:8.3f} s  "
                           f"-> {t_compat / t_new:.1f}x slower")
            if reference and stages == 8:
                t0 = time.perf_counter()
                ref_pack_job(load_job(paths))
                t_ref = time.perf_counter() - t0
                click.echo(f"  published tool (compat_reference):     {t_ref:8.3f} s  -> {t_ref / t_new:.1f}x slower")
            if stages == 16:
                click.echo(f"  under 1 second: {'yes' if t_new < 1.0 else 'no'}")


if __name__ == "__main__":
    main()
