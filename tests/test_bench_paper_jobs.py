"""The paper-scale benchmark measures each job's ratio on its simulated timeline; for GPipe and 1F1B
that must be the PipeFisher authors' per-block formula, or the benchmark measures against another model."""
from __future__ import annotations

import os
import sys

import pytest
from click.testing import CliRunner

from pipefisher.errors import InputError
from pipefisher.policies import get_policy

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


def test_a_wider_tie_without_a_curve_buys_the_shortest_cycle_within_it() -> None:
    """target's rule without a curve: the shortest cycle among the packings whose planned step is within
    its tolerance of the least; on this job the default 2 % keeps k = 10, 5 % reaches the model's 7."""
    built = bench.build(bench.PaperJob("bert-base", "v100", 8, "1f1b", 4, 8))
    default = get_policy("target").pack(built).tradeoff
    wide = get_policy("target", tolerance=0.05).pack(built).tradeoff
    assert default.tolerance == 0.02 and wide.tolerance == 0.05
    for w in (default, wide):
        least = min(c.cost.step for c in w.candidates)
        near = [c for c in w.candidates if c.cost.step <= least * (1 + w.tolerance)]
        assert w.chosen.cost.cycle == min(c.cost.cycle for c in near)
        assert w.data()["tolerance"] == w.tolerance
    assert wide.chosen.cost.cycle < default.chosen.cost.cycle
    assert wide.chosen.cost.cycle <= bench.measure(bench.PaperJob("bert-base", "v100", 8, "1f1b", 4, 8),
                                                   "target").model_cycle


def test_a_tolerance_must_be_a_fraction_and_is_targets_only() -> None:
    with pytest.raises(InputError, match="tolerance must be a fraction >= 0"):
        get_policy("target", tolerance=-0.1)
    with pytest.raises(InputError, match="takes only"):
        get_policy("tight", tolerance=0.05)
    out = CliRunner().invoke(bench.main, ["--policy", "tight", "--tolerance", "0.05"])
    assert out.exit_code != 0 and "'target' policy only" in out.output and "Traceback" not in out.output


def test_pieces_that_cost_more_than_the_whole_stay_within_their_width_and_leave_the_ratio() -> None:
    job = bench.PaperJob("bert-large", "rtx3090", 8, "gpipe", 8, 8)
    whole = bench.build(job)
    width = bench.auto_piece_ms(whole) * 1e6
    even, costly = bench.build(job, "auto"), bench.build(job, "auto", piece_cost=2.0)

    def inverses(j):
        return {(n.path, k): [iv.end - iv.start for iv in ivs] for n in j.nodes for k, ivs in n.entries.items()
                if k.startswith("inv_")}

    base, dear, one = inverses(even), inverses(costly), inverses(whole)
    split = [k for k, v in dear.items() if len(v) > 1]
    assert split and all(max(dear[k]) <= width + 1 for k in dear)
    for k, pieces in dear.items():  # split inverses cost twice the whole one, whole ones as published
        assert sum(pieces) == pytest.approx((2.0 if len(pieces) > 1 else 1.0) * sum(one[k]), rel=1e-3)
    assert len(base) == len(dear)
    assert bench.measure(job, "tight", pieces="auto", piece_cost=2.0).ratio == \
        pytest.approx(bench.measure(job, "tight").ratio, rel=1e-6)


def test_an_inverse_that_fits_the_width_whole_is_neither_split_nor_charged() -> None:
    job = bench.PaperJob("bert-large", "rtx3090", 8, "gpipe", 8, 8)

    def inverses(j):
        return {(n.path, k): [iv.end - iv.start for iv in ivs] for n in j.nodes for k, ivs in n.entries.items()
                if k.startswith("inv_")}

    one = inverses(bench.build(job))
    small = min(sum(v) for v in one.values())
    width_ms = 1.5 * small / 1e6  # the smallest inverse fits whole; at twice its cost it would not
    dear = inverses(bench.build(job, piece_ms=width_ms, piece_cost=2.0))
    fitting = [k for k, v in one.items() if sum(v) <= width_ms * 1e6]
    assert fitting and any(len(v) > 1 for v in dear.values())
    for k in fitting:
        assert dear[k] == one[k]
    for k, pieces in dear.items():
        assert max(pieces) <= width_ms * 1e6 + 1
        if len(pieces) > 1:
            assert sum(pieces) == pytest.approx(2.0 * sum(one[k]), rel=1e-3)
