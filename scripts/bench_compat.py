#!/usr/bin/env python3
"""Speed of the ``compat`` policy against the published tool's data structures, in one run.

Builds a simulated job of 8 nodes x 64 micro-batches x 36 K-FAC layers per node (BERT-Large-like
block costs, 6 transformer layers of 6 Linear modules per stage, 1F1B), writes it as timeline pickles,
then times (a) ``pipefisher.policies.compat_reference``, a literal transcription of the published
packer (deep copies, whole-list rescans), and (b) the ``compat`` policy, both from loading the files to
the schedule. It checks that both produce the same schedule and report and prints the times and ratio.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import click
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.outputs.report import usage_lines  # noqa: E402
from pipefisher.policies import get_policy  # noqa: E402
from pipefisher.policies.compat_reference import ref_pack_job  # noqa: E402
from pipefisher.schedule.timeline import load_job  # noqa: E402
from pipefisher.sim.costs import cost_model_from_dict  # noqa: E402
from pipefisher.sim.simulator import simulate_timelines, write_timelines  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipefisher", "bundled",
                      "cost_models", "bert-large-8stages.yaml")


def build_job(folder: str, stages: int, micro_batches: int, layers_per_stage: int, kfac_scale: float) -> list[str]:
    with open(CONFIG) as f:
        data = yaml.safe_load(f)
    data.update(stages=stages, micro_batches=micro_batches, layers=stages * layers_per_stage, order="1f1b")
    data.pop("chunks", None)
    data["kfac"]["scale"] = kfac_scale
    timelines, _ = simulate_timelines(cost_model_from_dict(data, CONFIG))
    return write_timelines(folder, "bench", timelines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--stages", default=8, show_default=True)
@click.option("--micro-batches", default=64, show_default=True)
@click.option("--layers-per-stage", default=6, show_default=True, help="6 Linear modules (K-FAC layers) each")
@click.option("--kfac-scale", default=1.0, show_default=True, help="multiplies every K-FAC cost")
@click.option("--repeat", default=3, show_default=True, help="runs of the fast policy (best is kept)")
def main(stages: int, micro_batches: int, layers_per_stage: int, kfac_scale: float, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        paths = build_job(folder, stages, micro_batches, layers_per_stage, kfac_scale)
        job = load_job(paths)
        modules = sum(1 for k in job.nodes[0].entries if k.startswith("cov_kron_A"))
        click.echo(f"job: {stages} nodes x {micro_batches} micro-batches x {modules} K-FAC layers per node")

        t0 = time.perf_counter()
        ref_schedules, ref_lines = ref_pack_job(load_job(paths))
        t_ref = time.perf_counter() - t0
        click.echo(f"published data structures (compat_reference): {t_ref:8.3f} s")

        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            packed = get_policy("compat").pack(load_job(paths))
            best = min(best, time.perf_counter() - t0)
        same = packed.to_file_data() == ref_schedules and usage_lines(packed) == ref_lines
        click.echo(f"compat policy:                                {best:8.3f} s  (best of {repeat})")
        click.echo(f"identical schedule and report: {'yes' if same else 'NO'}")
        click.echo(f"speed-up: {t_ref / best:.1f}x")
        iters = [n.figures.iterations for n in packed.nodes]
        click.echo(f"cycle lengths per node: {iters}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
