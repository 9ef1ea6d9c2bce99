#!/usr/bin/env python3
"""How close each packing policy gets to the lower bound, on two suites of jobs.

* realistic: BERT-Base and BERT-Large (costs from the published block measurements, through the
  simulator's configs in configs/sim/), GPipe and 1F1B, 4 and 8 stages, 4, 8 and 16 micro-batches;
* generated: ``pipefisher.sim.random_jobs.random_raw_job`` over many seeds (light and heavy K-FAC work,
  bare keys, up-pipe keys, float seconds, several steps, None times).

Per suite it prints the total cycle (pipeline iterations per curvature refresh, summed over nodes) of
``compat`` and of the new policy, how many nodes validate, and the totals of the lower bounds: the
volume bound ceil(W / C) and the tighter bound the new policy proves. It also counts the nodes where
the new policy's cycle is longer than a compat schedule that validates and is honest (see
``pipefisher.policies.tight.honest_compat``: its work really inside the bubbles), and those where it
is longer than one that only validates.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import click
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.policies import DEFAULT_POLICY, get_policy  # noqa: E402
from pipefisher.policies.tight import honest_compat  # noqa: E402
from pipefisher.schedule import validate  # noqa: E402
from pipefisher.sim.random_jobs import random_raw_job  # noqa: E402
from pipefisher.timeline import Job, job_from_dicts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"bert-base": "bert-base-4stages.yaml", "bert-large": "bert-large-8stages.yaml"}


@dataclass
class Tally:
    nodes: int = 0
    compat: int = 0
    compat_valid: int = 0  # dependency rules and room rules (``pipefisher validate``)
    compat_dep_valid: int = 0  # dependency rules only (``--no-room``)
    new: int = 0
    new_valid: int = 0
    bound: int = 0
    volume: int = 0
    honest_compared: int = 0
    new_longer: int = 0
    new_longer_than_valid: int = 0  # nodes where compat validates and is shorter
    new_longer_than_dep_valid: int = 0  # nodes where compat passes the dependency rules and is shorter
    longer_examples: list[str] = field(default_factory=list)


def realistic_jobs() -> list[tuple[str, Job]]:
    from pipefisher.sim.costs import cost_model_from_dict
    from pipefisher.sim.simulator import simulate_timelines

    jobs = []
    for model_name, config in CONFIGS.items():
        path = os.path.join(ROOT, "configs", "sim", config)
        with open(path) as f:
            data = yaml.safe_load(f)
        model = cost_model_from_dict(data, path)
        for schedule in ("gpipe", "1f1b"):
            for stages in (4, 8):
                for mb in (4, 8, 16):
                    timelines, _ = simulate_timelines(model, schedule=schedule, stages=stages, micro_batches=mb)
                    jobs.append((f"{model_name} {schedule} {stages}x{mb}", job_from_dicts(timelines)))
    return jobs


def generated_jobs(seeds: int) -> list[tuple[str, Job]]:
    return [(f"seed {s}", job_from_dicts(random_raw_job(s))) for s in range(seeds)]


def tally(jobs: list[tuple[str, Job]], policy: str) -> Tally:
    compat, new = get_policy("compat"), get_policy(policy)
    t = Tally()
    for name, job in jobs:
        c = compat.pack(job)
        n = new.pack(job)
        bad_c = {v.node for v in validate(c.to_file_data(), job)}
        bad_c_dep = {v.node for v in validate(c.to_file_data(), job, room=False)}
        bad_n = {v.node for v in validate(n.to_file_data(), job)}
        for i, (cn, nn) in enumerate(zip(c.nodes, n.nodes)):
            t.nodes += 1
            t.compat += cn.figures.iterations
            t.new += nn.figures.iterations
            t.compat_valid += i not in bad_c
            t.compat_dep_valid += i not in bad_c_dep
            t.new_valid += i not in bad_n
            t.bound += nn.figures.lower_bound or 1
            t.volume += int(nn.figures.extra.get("volume_bound", nn.figures.lower_bound or 1))  # type: ignore[arg-type]
            if nn.figures.iterations > cn.figures.iterations:
                t.new_longer_than_valid += i not in bad_c
                t.new_longer_than_dep_valid += i not in bad_c_dep
            theirs = honest_compat(job.nodes[i], job.span)  # compat's cycle where valid and honest
            if theirs is not None:
                t.honest_compared += 1
                if nn.figures.iterations > theirs.figures.iterations:
                    t.new_longer += 1
                    t.longer_examples.append(f"{name} node{i}: {nn.figures.iterations} > {theirs.figures.iterations}")
    return t


def print_table(rows: list[tuple[str, Tally]], policy: str) -> None:
    click.echo(f"{'suite':<11} {'nodes':>5}  {'compat cycle (valid nodes)':>27}  {policy + ' cycle (valid)':>22}  "
               f"{'bound':>6} {'volume':>6}  {'compat/bnd':>10} {policy + '/bnd':>10} {policy + '/vol':>10}")
    for name, t in rows:
        click.echo(f"{name:<11} {t.nodes:>5}  {t.compat:>14} ({t.compat_valid:>4}/{t.nodes:<4})    "
                   f"{t.new:>10} ({t.new_valid:>4}/{t.nodes:<4})  {t.bound:>6} {t.volume:>6}  "
                   f"{t.compat / t.bound:>10.3f} {t.new / t.bound:>10.3f} {t.new / t.volume:>10.3f}")
    for name, t in rows:
        click.echo(f"{name}: {policy} longer than a compat schedule that validates on {t.new_longer_than_valid} "
                   f"of {t.compat_valid} such nodes (honest ones: {t.new_longer} of {t.honest_compared}); "
                   f"compat passes the dependency rules alone (--no-room) on {t.compat_dep_valid} nodes, "
                   f"{policy} is longer on {t.new_longer_than_dep_valid} of them")
        for line in t.longer_examples[:5]:
            click.echo(f"  {line}")


@click.command()
@click.option("--seeds", default=400, show_default=True, help="generated jobs (random_raw_job seeds 0..N-1)")
@click.option("--policy", default=DEFAULT_POLICY, show_default=True, help="the policy to measure against compat")
def main(seeds: int, policy: str) -> None:
    rows = [("realistic", tally(realistic_jobs(), policy)), ("generated", tally(generated_jobs(seeds), policy))]
    print_table(rows, policy)


if __name__ == "__main__":
    main()
