#!/usr/bin/env python3
"""How close each packing policy gets to the lower bound, on two suites of jobs.

* realistic: BERT-Base and BERT-Large (costs from the published block measurements, through the
  simulator's cost models in pipefisher/bundled/cost_models/), GPipe and 1F1B, 4 and 8 stages, 4, 8 and 16 micro-batches;
* generated: ``pipefisher.sim.random_jobs.random_raw_job`` over many seeds (light and heavy K-FAC work,
  bare keys, up-pipe keys, float seconds, several steps, None times).

Per suite it prints the total cycle (pipeline iterations per curvature refresh, summed over nodes) of
``compat`` and of the new policy, how many nodes validate, and the totals of the lower bounds: the
volume bound ceil(W / C) and the tighter bound the new policy proves. It also counts the nodes where
the new policy's cycle is longer than a compat schedule that validates and is honest (see
``pipefisher.policies.tight.honest_compat``: its work really inside the bubbles), and those where it
is longer than one that only validates.

A second table sets ``tight`` beside ``exact`` (tight's cycles shortened or proven optimal by CP-SAT,
``--time-limit`` seconds per job; ``--no-exact`` leaves it out; it needs ``pipefisher[exact]``), with
exact's total solver time, ``best-fit`` ("-" where not registered) and ``compat``; the bound column
is the best proven bound (exact's where it ran), and the optimal counts are the nodes whose cycle
meets its proven bound. It also counts the nodes where any schedule that validates is shorter than
the proven bound: that must be 0.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import click
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.errors import InputError  # noqa: E402
from pipefisher.policies import DEFAULT_POLICY, Policy, get_policy  # noqa: E402
from pipefisher.policies.tight import honest_compat  # noqa: E402
from pipefisher.rules import validate  # noqa: E402
from pipefisher.schedule.timeline import Job, job_from_dicts  # noqa: E402
from pipefisher.sim.random_jobs import random_raw_job  # noqa: E402

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
    bound: int = 0  # the best proven bound: exact's where it ran (it raises tight's), else the policy's
    volume: int = 0
    honest_compared: int = 0
    new_longer: int = 0
    new_longer_than_valid: int = 0  # nodes where compat validates and is shorter
    new_longer_than_dep_valid: int = 0  # nodes where compat passes the dependency rules and is shorter
    longer_examples: list[str] = field(default_factory=list)
    tight: int = 0
    tight_optimal: int = 0  # tight's cycle meets tight's own bound
    exact: int | None = None
    exact_valid: int = 0
    exact_optimal: int = 0  # exact's cycle meets its proven bound
    exact_seconds: float = 0.0
    exact_shorter: int = 0  # nodes where exact's cycle is shorter than tight's
    exact_bound_raised: int = 0  # nodes where exact proved a bound above tight's
    exact_examples: list[str] = field(default_factory=list)
    below_bound: int = 0  # nodes where a schedule that validates is shorter than the proven bound: must be 0
    best_fit: int | None = None
    best_fit_valid: int = 0


def realistic_jobs() -> list[tuple[str, Job]]:
    from pipefisher.sim.costs import cost_model_from_dict
    from pipefisher.sim.simulator import simulate_timelines

    jobs = []
    for model_name, config in CONFIGS.items():
        path = os.path.join(ROOT, "pipefisher", "bundled", "cost_models", config)
        with open(path) as f:
            data = yaml.safe_load(f)
        model = cost_model_from_dict(data, path)
        for order in ("gpipe", "1f1b"):
            for stages in (4, 8):
                for mb in (4, 8, 16):
                    timelines, _ = simulate_timelines(model, order=order, stages=stages, micro_batches=mb)
                    jobs.append((f"{model_name} {order} {stages}x{mb}", job_from_dicts(timelines)))
    return jobs


def generated_jobs(seeds: int) -> list[tuple[str, Job]]:
    return [(f"seed {s}", job_from_dicts(random_raw_job(s))) for s in range(seeds)]


def optional_policy(name: str, **options: object) -> Policy | None:
    """The policy, or None where it is not registered or cannot run here (best-fit, exact without OR-Tools)."""
    try:
        return get_policy(name, **options)
    except InputError:
        return None


def tally(jobs: list[tuple[str, Job]], policy: str, exact: Policy | None, best_fit: Policy | None) -> Tally:
    compat, new, tight = get_policy("compat"), get_policy(policy), get_policy("tight")
    t = Tally()
    if exact is not None:
        t.exact = 0
    if best_fit is not None:
        t.best_fit = 0
    for name, job in jobs:
        c = compat.pack(job)
        n = new.pack(job)
        ti = n if policy == "tight" else tight.pack(job)
        bad_c = {v.node for v in validate(c.to_file_data(), job)}
        bad_c_dep = {v.node for v in validate(c.to_file_data(), job, room=False)}
        bad_n = {v.node for v in validate(n.to_file_data(), job)}
        e = bf = None
        bad_e: set[int] = set()
        bad_bf: set[int] = set()
        if exact is not None:
            t0 = time.perf_counter()
            e = exact.pack(job)
            t.exact_seconds += time.perf_counter() - t0
            bad_e = {v.node for v in validate(e.to_file_data(), job)}
        if best_fit is not None:
            bf = best_fit.pack(job)
            bad_bf = {v.node for v in validate(bf.to_file_data(), job)}
        for i, (cn, nn) in enumerate(zip(c.nodes, n.nodes)):
            tn = ti.nodes[i]
            t.nodes += 1
            t.compat += cn.figures.iterations
            t.new += nn.figures.iterations
            t.compat_valid += i not in bad_c
            t.compat_dep_valid += i not in bad_c_dep
            t.new_valid += i not in bad_n
            t.tight += tn.figures.iterations
            t.tight_optimal += tn.figures.iterations == tn.figures.lower_bound
            bound = nn.figures.lower_bound or 1
            if e is not None:
                en = e.nodes[i]
                assert t.exact is not None
                t.exact += en.figures.iterations
                t.exact_valid += i not in bad_e
                t.exact_optimal += bool(en.figures.extra.get("optimal"))
                bound = max(bound, en.figures.lower_bound or 1)
                if en.figures.iterations < tn.figures.iterations:
                    t.exact_shorter += 1
                    t.exact_examples.append(f"{name} node{i}: exact {en.figures.iterations} < tight "
                                            f"{tn.figures.iterations} ({en.figures.extra.get('exact_status')})")
                if (en.figures.lower_bound or 1) > (tn.figures.lower_bound or 1):
                    t.exact_bound_raised += 1
            if bf is not None:
                assert t.best_fit is not None
                t.best_fit += bf.nodes[i].figures.iterations
                t.best_fit_valid += i not in bad_bf
            t.bound += bound
            t.volume += int(nn.figures.extra.get("volume_bound", nn.figures.lower_bound or 1))  # type: ignore[arg-type]
            # no schedule that validates may be shorter than a proven bound
            valid_lengths = [s.nodes[i].figures.iterations for s, bad in ((c, bad_c), (n, bad_n), (e, bad_e), (bf, bad_bf))
                             if s is not None and i not in bad]
            if valid_lengths and min(valid_lengths) < bound:
                t.below_bound += 1
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
    click.echo("")
    click.echo(f"{'suite':<11} {'tight':>6} {'exact':>6} {'exact s':>8} {'best-fit':>8} {'compat':>7} {'bound':>6}  "
               f"{'optimal: tight':>14} {'exact':>6}  {'exact<tight':>11} {'bound raised':>12}  {'valid (exact)':>13}")
    for name, t in rows:
        ex = "-" if t.exact is None else str(t.exact)
        ex_s = "-" if t.exact is None else f"{t.exact_seconds:.1f}"
        ex_opt = "-" if t.exact is None else str(t.exact_optimal)
        ex_valid = "-" if t.exact is None else f"{t.exact_valid}/{t.nodes}"
        bf = "-" if t.best_fit is None else f"{t.best_fit}"
        click.echo(f"{name:<11} {t.tight:>6} {ex:>6} {ex_s:>8} {bf:>8} {t.compat:>7} {t.bound:>6}  "
                   f"{t.tight_optimal:>14} {ex_opt:>6}  {t.exact_shorter:>11} {t.exact_bound_raised:>12}  {ex_valid:>13}")
    for name, t in rows:
        click.echo(f"{name}: {policy} longer than a compat schedule that validates on {t.new_longer_than_valid} "
                   f"of {t.compat_valid} such nodes (honest ones: {t.new_longer} of {t.honest_compared}); "
                   f"compat passes the dependency rules alone (--no-room) on {t.compat_dep_valid} nodes, "
                   f"{policy} is longer on {t.new_longer_than_dep_valid} of them")
        for line in t.longer_examples[:5]:
            click.echo(f"  {line}")
        if t.best_fit is not None:
            click.echo(f"{name}: best-fit validates on {t.best_fit_valid} of {t.nodes} nodes")
        click.echo(f"{name}: nodes where a schedule that validates is shorter than the proven bound: {t.below_bound}")
        for line in t.exact_examples[:5]:
            click.echo(f"  {line}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--seeds", default=400, show_default=True, help="generated jobs (random_raw_job seeds 0..N-1)")
@click.option("--policy", default=DEFAULT_POLICY, show_default=True, help="the policy to measure against compat")
@click.option("--time-limit", default=5.0, show_default=True, help="seconds per job for the exact policy")
@click.option("--no-exact", is_flag=True, help="leave out the exact policy (CP-SAT)")
def main(seeds: int, policy: str, time_limit: float, no_exact: bool) -> None:
    exact = None if no_exact else optional_policy("exact", time_limit=time_limit)
    if exact is None and not no_exact:
        click.echo("(exact: OR-Tools is not installed, left out)")
    best_fit = optional_policy("best-fit")
    rows = [("realistic", tally(realistic_jobs(), policy, exact, best_fit)),
            ("generated", tally(generated_jobs(seeds), policy, exact, best_fit))]
    print_table(rows, policy)


if __name__ == "__main__":
    main()
