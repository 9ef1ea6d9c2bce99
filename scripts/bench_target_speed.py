#!/usr/bin/env python3
"""Speed of the default policy ``target`` against ``tight``, whole process, in the same run.

``target`` packs ``tight`` at several densities and weighs them (:func:`pipefisher.cost.objective.tradeoff`),
so ``tight`` is its baseline: both are timed as fresh processes, alternating, after one untimed run
each (byte code and file caches warm, as a user's are), best and median of ``--repeat``:

* the heavy regression job ``tests/data/regressions/heavy-16x128x48``, exactly as the published script
  is run (``python scripts/auto_schedule.py <16 files joined by commas> --save_path s.pickle``); the
  target: ``target`` under 1 s;
* the interleaved job ``pipefisher simulate --config bert-large-8stages --order interleaved -m 256``
  (simulated here into a temporary folder), packed by ``python -m pipefisher schedule <files>``; the
  target: ``target`` within 1.5x ``tight``;
* the BERT-Large regression job (``tests/data/regressions/bert-large-8stages-m12-bs8``), where no
  density is at the floor, so ``target`` packs all of them.

Each line: best and median seconds per policy (and the processor seconds of the best run, its
workers' included: on a busy machine the wall clock mostly measures the neighbours), ``target / tight``
(best, median), the cycle k each chose. With ``--check``, each job's ``target`` schedule is also compared with the one the unpruned
weighing gives (every density packed, :func:`~pipefisher.cost.objective.tradeoff` with ``prune=False``).

    python scripts/bench_target_speed.py [--repeat 5] [--check]
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import click

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipefisher.schedule.timeline import natural_key  # noqa: E402

REGRESSIONS = os.path.join(ROOT, "tests", "data", "regressions")
HEAVY_TARGET_S = 1.0
INTERLEAVED_TARGET = 1.5


def node_files(folder: str) -> list[str]:
    paths = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith("_timeline.pickle")),
                   key=natural_key)
    if not paths:
        raise click.ClickException(f"{folder}: no *_timeline.pickle files")
    return paths


def command(paths: list[str], policy: str, out: str, published: bool) -> list[str]:
    """The published script's command line (files joined by commas), or ``pipefisher schedule``'s."""
    if published:
        return [sys.executable, os.path.join(ROOT, "scripts", "auto_schedule.py"), ",".join(paths),
                "--save_path", out, "--policy", policy]
    return [sys.executable, "-m", "pipefisher", "schedule", *paths, "--save-path", out, "--policy", policy]


Runs = dict[str, tuple[list[tuple[float, float]], int]]
"""Per policy: (wall, processor) seconds of each timed run, and the cycle k it chose."""


def time_policies(paths: list[str], repeat: int, published: bool) -> Runs:
    """Every policy's whole process, alternating, after one untimed round (caches warm)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    times: dict[str, list[tuple[float, float]]] = {"tight": [], "target": []}
    cycles: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as out:
        for rnd in range(repeat + 1):
            for policy in times:
                cmd = command(paths, policy, os.path.join(out, f"{policy}.pickle"), published)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
                wall = time.perf_counter() - t0
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                if rnd:  # the first round only warms the caches
                    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                    times[policy].append((wall, cpu))
                cycles[policy] = max(int(line.split(":")[1].split()[0]) for line in res.stdout.splitlines()
                                     if line.startswith("node") and " pipeline iterations " in line)
    return {p: (times[p], cycles[p]) for p in times}


def report(name: str, runs: Runs) -> tuple[float, float]:
    """Print one job's lines; returns target's best seconds and target / tight (best)."""
    best = {p: min(t) for p, (t, _) in runs.items()}
    median = {p: statistics.median(w for w, _ in t) for p, (t, _) in runs.items()}
    click.echo(f"{name}:")
    for p, (_, k) in runs.items():
        click.echo(f"  {p:6}: best {best[p][0]:.3f} s ({best[p][1]:.3f} s of processor time), median "
                   f"{median[p]:.3f} s (k = {k})")
    ratio = best["target"][0] / best["tight"][0]
    click.echo(f"  target / tight: best {ratio:.3f} (processor time {best['target'][1] / best['tight'][1]:.3f}), "
               f"median {median['target'] / median['tight']:.3f}")
    return best["target"][0], ratio


def same_as_unpruned(paths: list[str]) -> bool:
    """Whether ``target``'s schedule is the one the unpruned weighing (every density packed) chooses."""
    from pipefisher.cost.objective import tradeoff
    from pipefisher.policies import get_policy
    from pipefisher.policies.target import cycle_bound
    from pipefisher.policies.tight import TightPolicy
    from pipefisher.schedule.problem import DEFAULT_MARGIN
    from pipefisher.schedule.timeline import load_job

    job = load_job(paths)
    fast = get_policy("target").pack(job)
    full = tradeoff(job, TightPolicy().pack, DEFAULT_MARGIN, bound=cycle_bound, prune=False)
    return fast.to_file_data() == full.chosen.schedule.to_file_data() and fast.margin == full.chosen.margin


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--repeat", default=5, show_default=True, help="timed runs per policy and job (best and median)")
@click.option("--check", is_flag=True, help="also check each job's schedule against the unpruned weighing")
def main(repeat: int, check: bool) -> None:
    from pipefisher.bundled import cost_model_path
    from pipefisher.sim import load_cost_model, simulate_timelines, write_timelines
    from pipefisher.sim.simulator import default_prefix

    with tempfile.TemporaryDirectory() as sim:
        model = load_cost_model(cost_model_path("bert-large-8stages"))
        timelines, result = simulate_timelines(model, "interleaved", None, 256)
        interleaved = write_timelines(sim, default_prefix(model.name, result.order), timelines)
        jobs = [("heavy-16x128x48, python scripts/auto_schedule.py (whole process)",
                 node_files(os.path.join(REGRESSIONS, "heavy-16x128x48")), True),
                ("bert-large-8stages interleaved m=256, python -m pipefisher schedule (whole process)",
                 interleaved, False),
                ("bert-large-8stages-m12-bs8, python -m pipefisher schedule (whole process)",
                 node_files(os.path.join(REGRESSIONS, "bert-large-8stages-m12-bs8")), False)]
        verdicts = []
        for name, paths, published in jobs:
            best, ratio = report(name, time_policies(paths, repeat, published))
            if check:
                click.echo(f"  same schedule as the unpruned weighing: {'yes' if same_as_unpruned(paths) else 'NO'}")
            verdicts.append((best, ratio))
    (heavy_s, _), (_, inter_ratio), _ = verdicts
    click.echo(f"heavy job, target under {HEAVY_TARGET_S:g} s: {'yes' if heavy_s < HEAVY_TARGET_S else 'no'} "
               f"({heavy_s:.3f} s); interleaved m=256, target within {INTERLEAVED_TARGET:g}x tight: "
               f"{'yes' if inter_ratio <= INTERLEAVED_TARGET else 'no'} ({inter_ratio:.3f}x)")


if __name__ == "__main__":
    main()
