"""The paper-scale benchmark measures each job's ratio on its simulated timeline; for GPipe and 1F1B
that must be the PipeFisher authors' per-block formula, or the benchmark measures against another model."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_paper_jobs as bench  # noqa: E402


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
def test_the_ratio_on_the_timeline_is_the_authors_formula(order: str) -> None:
    job = bench.PaperJob("bert-base", "p100", 8, order, stages=4, micro_batches=8)
    row = bench.block_costs("bert-base", "p100", 8)
    formula = (row["time_inv"] + 8 * row["time_kron"]) / (3 * (row["time_f"] + row["time_b"]))
    ratios = bench.model_ratios(bench.build(job))
    assert len(ratios) == 4
    assert ratios == pytest.approx([formula] * 4, rel=1e-3)


def test_the_family_is_48_gpipe_and_1f1b_jobs_and_24_more_with_chimera() -> None:
    jobs = list(bench.paper_jobs())
    assert len(jobs) == 48 and {j.order for j in jobs} == {"gpipe", "1f1b"}
    assert {(j.model, j.stages) for j in jobs} == {("bert-base", 4), ("bert-large", 8)}
    assert {j.micro_batches // j.stages for j in jobs} == {1, 2}
    assert len(list(bench.paper_jobs(chimera=True))) == 72


def test_one_job_is_packed_valid_and_compared_with_the_model() -> None:
    out = bench.measure(bench.PaperJob("bert-large", "p100", 32, "1f1b", 8, 8), "tight")
    assert out.valid
    assert out.model_cycle == 2 and out.cycle >= 1  # ceil(1.1 x 1.58)
    assert out.within == (out.cycle <= 2)


def test_pieces_and_overlap_pack_valid_and_no_longer_than_whole_refreshes() -> None:
    job = bench.PaperJob("bert-large", "rtx3090", 8, "gpipe", 8, 8)
    whole = bench.measure(job, "tight")
    auto = bench.measure(job, "tight", overlap=True, pieces="auto")
    assert whole.valid and auto.valid and auto.cycle <= whole.cycle
    assert auto.ratio == pytest.approx(whole.ratio, rel=1e-6)  # the same work, in other pieces
    built = bench.build(job, "auto")
    width = bench.auto_piece_ms(bench.build(job)) * 1e6
    inverses = [ivs for node in built.nodes for k, ivs in node.entries.items() if k.startswith("inv_kron_")]
    assert max(map(len, inverses)) > 1 and all(iv.end - iv.start <= width + 1 for ivs in inverses for iv in ivs)
