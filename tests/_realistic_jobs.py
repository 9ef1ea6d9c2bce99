"""Realistic jobs for the packers' tests: the simulator's bundled BERT cost models, with their
forward, backward and K-FAC times taken from another row of the published V100 block costs
(``tests/data/block-costs/``, copied from the PipeFisher paper's measurements: one row per micro-batch
size), varying the pipeline order, stages and micro-batches, with and without data-parallel syncs.
"""
from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Iterator

import yaml

from pipefisher.schedule.timeline import Job, job_from_dicts
from pipefisher.sim.costs import cost_model_from_dict
from pipefisher.sim.simulator import simulate_timelines

SIM = Path(__file__).parent.parent / "pipefisher" / "bundled" / "cost_models"
BLOCK_COSTS = Path(__file__).parent / "data" / "block-costs"
MODELS = {"bert-base": "bert-base-4stages.yaml", "bert-large": "bert-large-8stages.yaml"}


def block_costs(model: str, batch: int) -> dict[str, float]:
    """One row of the published V100 measurements of one block of ``model`` at micro-batch ``batch``."""
    with open(BLOCK_COSTS / f"{model}_time_memory_v100.csv") as f:
        row = next(r for r in csv.DictReader(f) if int(r["bs"]) == batch)
    return {k: float(v) for k, v in row.items()}


def realistic_job(model: str, batch: int, order: str, stages: int, micro_batches: int, sync: bool,
                  piece_ms: float | None = None) -> Job:
    """A simulated job of ``model`` at micro-batch size ``batch`` (see the module's docstring); with
    ``piece_ms``, each inverse runs in pieces of at most that long (``kfac.refresh_piece_ms``)."""
    with open(SIM / MODELS[model]) as f:
        data = yaml.safe_load(f)
    row = block_costs(model, batch)
    data["layer"] = {"forward_ms": row["time_f"], "backward_ms": row["time_b"]}
    data["kfac"] = {**data["kfac"], "block_cov_ms": row["time_kron"], "block_inv_ms": row["time_inv"],
                    "block_prec_ms": row["time_prec"]}
    if not sync:
        data["kfac"].pop("sync", None)
    if piece_ms is not None:
        data["kfac"]["refresh_piece_ms"] = piece_ms
    timelines, _ = simulate_timelines(cost_model_from_dict(data, model), order=order, stages=stages,
                                      micro_batches=micro_batches)
    return job_from_dicts(timelines)


def realistic_shapes() -> list[tuple[str, int, str, int, int, bool]]:
    """The family's shapes, the arguments of :func:`realistic_job`: BERT-Base/Large, micro-batch size 4
    to 32, GPipe/1F1B, 4/8 stages, 4/8/12 micro-batches, with and without syncs."""
    return list(itertools.product(MODELS, (4, 8, 16, 32), ("1f1b", "gpipe"), (4, 8), (4, 8, 12), (False, True)))


def realistic_family(every: int = 1) -> Iterator[tuple[str, Job]]:
    """Every ``every``-th job of the family (:func:`realistic_shapes`)."""
    for shape in realistic_shapes()[::every]:
        yield " ".join(map(str, shape)), realistic_job(*shape)
