#!/usr/bin/env python3
"""The default policy's K-FAC cycle on paper-scale jobs, against the PipeFisher authors' model.

The authors' performance model (MLSys 2023) treats a step's K-FAC work as divisible: the refresh
interval of a node is at least its K-FAC work of one refresh over the idle time of one step,
``ratio = work / idle``; for GPipe and 1F1B with ``D`` stages and ``N`` micro-batches, per block,
``(time_inv + N * time_kron) / ((D - 1) * (time_f + time_b))``. A packer reaches that only where
every piece of work fits a bubble and a cycle's work may run wherever there is room.

The jobs are built from the published per-block costs (``tests/data/block-costs/``, one CSV per
model and GPU) through the simulator's bundled BERT cost models (``pipefisher/bundled/cost_models/``):
BERT-Base on 4 stages and BERT-Large on 8; P100, V100 and RTX 3090; micro-batch sizes 8 and 32;
``N = D`` and ``2D`` micro-batches; GPipe and 1F1B (and, with ``--chimera``, Chimera); no
data-parallel sync and no point-to-point latency, as the model assumes. Each row's preconditioning
(``time_prec``) runs at the step's end, outside the model's ratio, as in the bundled models. Each node's ratio is
measured on the simulated timeline itself (its K-FAC work over its idle time per iteration), which
for GPipe and 1F1B is the formula above; for Chimera it counts the inverses of both stage copies.

Per job it prints the cycle the policy chose (the longest over the nodes), the model's
``ceil(1.1 x ratio)`` (the largest over the nodes), whether every node's schedule validates, and
whether the cycle is within the model's; the last line counts the jobs within it:

    python scripts/bench_paper_jobs.py [--policy target] [--chimera] [--json out.json]
        [--overlap] [--pieces N|auto | --piece-ms X] [--piece-cost C] [--tolerance T]

``--overlap`` lets the cycles overlap (``tight`` and ``target``); ``--pieces`` / ``--piece-ms`` run every
inverse in pieces (the simulator's ``kfac.refresh_pieces`` / ``kfac.refresh_piece_ms``): the ratio is
the same, only the work's granularity changes. ``--piece-cost C`` makes an inverse run in pieces cost
``C`` times its whole time in all (on this project's CPU exact pieces cost 0.65-1.25x, docs/benchmarks.md), each piece still
within the width asked for (an inverse that fits the width whole stays whole, at its published cost); the
model's ratio stays that of whole inverses, the published costs.
``--tolerance T`` is ``target``'s tie without a staleness curve (its ``tolerance`` option).
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import click
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipefisher.policies import DEFAULT_POLICY, get_policy  # noqa: E402
from pipefisher.rules import validate  # noqa: E402
from pipefisher.schedule.problem import DEFAULT_MARGIN, node_model  # noqa: E402
from pipefisher.schedule.timeline import Interval, Job, NodeTimeline, inflate_kfac, job_from_dicts  # noqa: E402
from pipefisher.sim.costs import cost_model_from_dict  # noqa: E402
from pipefisher.sim.simulator import simulate_timelines  # noqa: E402

BLOCK_COSTS = os.path.join(ROOT, "tests", "data", "block-costs")
SIM = os.path.join(ROOT, "pipefisher", "bundled", "cost_models")
MODELS = {"bert-base": ("bert-base-4stages.yaml", 4), "bert-large": ("bert-large-8stages.yaml", 8)}
GPUS = ("p100", "v100", "rtx3090")
BATCHES = (8, 32)
SLACK = 1.1
"""The target's allowance over the model: a cycle within ``ceil(SLACK x ratio)`` meets it."""


@dataclass(frozen=True)
class PaperJob:
    """One job of the family: a model on a GPU, at a micro-batch size, in a pipeline order."""

    model: str
    gpu: str
    batch: int
    order: str
    stages: int
    micro_batches: int

    def __str__(self) -> str:
        return f"{self.model} {self.gpu} bs{self.batch} {self.order} D={self.stages} N={self.micro_batches}"


def block_costs(model: str, gpu: str, batch: int) -> dict[str, float]:
    """One row of the published measurements: one block of ``model`` on ``gpu`` at micro-batch ``batch``."""
    with open(os.path.join(BLOCK_COSTS, f"{model}_time_memory_{gpu}.csv")) as f:
        row = next(r for r in csv.DictReader(f) if int(r["bs"]) == batch)
    return {k: float(v) for k, v in row.items()}


def paper_jobs(chimera: bool = False) -> Iterator[PaperJob]:
    """The family of the module's docstring, in a fixed order."""
    orders = ("gpipe", "1f1b", "chimera") if chimera else ("gpipe", "1f1b")
    for model, gpu, batch, order in itertools.product(MODELS, GPUS, BATCHES, orders):
        stages = MODELS[model][1]
        for n in (stages, 2 * stages):
            yield PaperJob(model, gpu, batch, order, stages, n)


def build(job: PaperJob, pieces: int | str = 1, piece_ms: float | None = None, piece_cost: float = 1.0) -> Job:
    """The simulated job: the bundled cost model with this row's block costs, no sync, no latency; each
    inverse in ``pieces`` pieces (``auto``: :func:`auto_piece_ms`), or, where it is longer than
    ``piece_ms``, in pieces of at most ``piece_ms``. An inverse run in more than one piece costs
    ``piece_cost`` times its whole time in all: with a width, cut into as many equal pieces as that
    takes to stay within it (an inverse that fits the width whole stays whole and costs what it costs)."""
    if pieces == "auto":
        piece_ms = auto_piece_ms(build(job))
        pieces = 1
    with open(os.path.join(SIM, MODELS[job.model][0])) as f:
        data = yaml.safe_load(f)
    row = block_costs(job.model, job.gpu, job.batch)
    data["layer"] = {"forward_ms": row["time_f"], "backward_ms": row["time_b"]}
    data["kfac"] = {**data["kfac"], "block_cov_ms": row["time_kron"], "block_inv_ms": row["time_inv"],
                    "block_prec_ms": row["time_prec"]}
    data["kfac"].pop("sync", None)
    data["kfac"]["refresh_pieces"] = int(pieces)
    if piece_ms is not None:
        data["kfac"]["refresh_piece_ms"] = piece_ms
    data["latency_ms"] = 0.0
    timelines, _ = simulate_timelines(cost_model_from_dict(data, job.model), order=job.order,
                                      stages=job.stages, micro_batches=job.micro_batches)
    built = job_from_dicts(timelines)
    if piece_cost == 1.0:
        return built
    if piece_ms is None:
        return inflate_kfac(built, piece_cost, which=split_refresh)
    width = piece_ms * 1e6
    return dataclasses.replace(built, nodes=tuple(
        NodeTimeline(n.path, {k: charge(v, piece_cost, width) if split_refresh(k, v) else v
                              for k, v in n.entries.items()}, n.cov_micro_batches) for n in built.nodes))


def charge(pieces: tuple[Interval, ...], cost: float, width: float) -> tuple[Interval, ...]:
    """A split inverse's pieces at ``cost`` times their whole time in all, cut into the fewest equal
    pieces of at most ``width`` (nanoseconds), back to back from the first piece's start."""
    total = cost * sum(iv.end - iv.start for iv in pieces)
    count = math.ceil(total / width)
    start, each = pieces[0].start, int(total // count)
    return tuple(Interval(start + i * each, start + (i + 1) * each) for i in range(count))


def split_refresh(key: str, intervals: object) -> bool:
    """An inverse the simulator ran in more than one piece (what ``piece_cost`` lengthens)."""
    return key.startswith("inv_") and len(intervals) > 1  # type: ignore[arg-type]


def auto_piece_ms(job: Job) -> float:
    """A piece width that fits every bubble of every node with the room rule's margin (the pipeline's
    bubbles do not depend on how the K-FAC work is cut), in milliseconds: no bubble is then too short
    for inverse work. (It was half the smallest node's largest bubble, which left every bubble below
    that width to the covariance: 38 of 48 jobs within the model against 44, docs/policies.md.)"""
    smallest = min(min(b.length for b in node_model(node, job.span).bubbles) for node in job.nodes)
    return smallest / (1.0 + DEFAULT_MARGIN) / 1e6 * (1.0 - 1e-9)


def model_ratios(job: Job) -> list[float]:
    """Per node: its K-FAC work of one refresh over its idle time of one iteration."""
    out = []
    for node in job.nodes:
        m = node_model(node, job.span)
        work = sum(sum(w.pieces) for w in m.work)
        out.append(work / (m.length - m.pipeline_busy))
    return out


@dataclass(frozen=True)
class Outcome:
    job: str
    cycle: int
    model_cycle: int
    ratio: float
    valid: bool
    seconds: float

    @property
    def within(self) -> bool:
        return self.cycle <= self.model_cycle


def measure(job: PaperJob, policy: str, overlap: bool | None = None, pieces: int | str = 1,
            piece_ms: float | None = None, piece_cost: float = 1.0, tolerance: float | None = None) -> Outcome:
    """One job packed by ``policy`` (``overlap``, ``tolerance``: its options, None: the policy's default),
    each inverse in ``pieces`` (or of at most ``piece_ms``, each costing ``piece_cost``: :func:`build`),
    and checked by the rule it was packed under; the model's ratio is the whole inverses'."""
    built = build(job, pieces, piece_ms, piece_cost)
    ratios = model_ratios(built if piece_cost == 1 else build(job))
    start = time.perf_counter()
    packed = get_policy(policy, overlap=overlap, tolerance=tolerance).pack(built)
    seconds = time.perf_counter() - start
    valid = not validate(packed.to_file_data(), built, margin=packed.margin, overlap=packed.overlap)
    cycle = max(n.figures.iterations for n in packed.nodes)
    return Outcome(str(job), cycle, math.ceil(SLACK * max(ratios)), max(ratios), valid, seconds)


@click.command(help=__doc__.split("\n\n")[0], context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--policy", default=DEFAULT_POLICY, show_default=True, help="Packing policy to measure.")
@click.option("--chimera", is_flag=True, help="Add Chimera to GPipe and 1F1B (its model counts both copies).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write every job's figures here.")
@click.option("--overlap/--no-overlap", default=None,
              help="Let cycles overlap (tight and target only; default: the policy's own, on for those two).")
@click.option("--pieces", default="1", show_default=True,
              help="Pieces each inverse runs in, or 'auto': pieces that fit every bubble of every node.")
@click.option("--piece-ms", type=click.FloatRange(0, min_open=True), default=None,
              help="Pieces of at most this many milliseconds (instead of --pieces).")
@click.option("--piece-cost", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="An inverse run in pieces costs this many times its whole time in all.")
@click.option("--tolerance", type=click.FloatRange(0), default=None,
              help="target only: without a staleness curve, planned steps this close (a fraction) tie and the "
                   "shorter cycle wins (default: the policy's, 0.02).")
def main(policy: str, chimera: bool, json_out: str | None, overlap: bool | None, pieces: str,
         piece_ms: float | None, piece_cost: float, tolerance: float | None) -> None:
    if pieces != "auto" and not (pieces.isdigit() and int(pieces) >= 1):
        raise click.BadParameter(f"{pieces!r} is neither a count >= 1 nor 'auto'", param_hint="--pieces")
    if tolerance is not None and policy != "target":
        raise click.BadParameter(f"applies to the 'target' policy only, not to {policy!r}", param_hint="--tolerance")
    split: int | str = pieces if pieces == "auto" else int(pieces)
    outcomes = []
    for job in paper_jobs(chimera):
        o = measure(job, policy, overlap, split, piece_ms, piece_cost, tolerance)
        outcomes.append(o)
        click.echo(f"{o.job:<44} cycle {o.cycle:>3}  model ceil({SLACK} x {o.ratio:6.2f}) = {o.model_cycle:>3}  "
                   f"{'valid' if o.valid else 'INVALID'}  {'within' if o.within else 'over'}  {o.seconds:.2f} s")
    if json_out:
        tmp = json_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump([{**asdict(o), "within": o.within} for o in outcomes], f, indent=1)
        os.replace(tmp, json_out)
    for order in sorted({o.job.split()[3] for o in outcomes}):
        mine = [o for o in outcomes if o.job.split()[3] == order]
        over = [o.cycle / o.model_cycle for o in mine]
        click.echo(f"{order}: {sum(o.within for o in mine)} of {len(mine)} within the model; "
                   f"cycle / model cycle median {sorted(over)[len(over) // 2]:.2f}, max {max(over):.2f}")
    within = sum(o.within for o in outcomes)
    valid = sum(o.valid for o in outcomes)
    click.echo(f"{policy}: {within} of {len(outcomes)} jobs within ceil({SLACK} x ratio) "
               f"({100 * within / len(outcomes):.0f} %), {valid} of {len(outcomes)} valid")


if __name__ == "__main__":
    main()
