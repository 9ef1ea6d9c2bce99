"""The default policy ``target`` on real jobs: what it chooses with and without a staleness curve, and
that packing only the densities that can be chosen gives the schedule weighing all of them gives."""
from __future__ import annotations

import math
import os

import pytest

from pipefisher.cost.objective import Candidate, choose, tradeoff
from pipefisher.cost.staleness import StalenessCurve
from pipefisher.outputs.report import usage_lines
from pipefisher.policies import get_policy
from pipefisher.policies.target import cycle_bound
from pipefisher.policies.tight import TightPolicy
from pipefisher.rules import validate
from pipefisher.schedule.problem import DEFAULT_MARGIN
from pipefisher.schedule.timeline import Job, job_from_dicts, load_job

BERT_LARGE = os.path.join(os.path.dirname(__file__), "data", "regressions", "bert-large-8stages-m12-bs8")
AT_1000_STEPS = "1:0.718,2:0.718,4:0.769,8:0.923,16:0.846"
"""The convergence benchmark's staleness curve at 1000 steps (docs/benchmarks.md)."""
PAST_6_NEVER = "1:0.5,2:0.533,4:0.567,6:inf"


@pytest.fixture(scope="module")
def bert_large() -> Job:
    return load_job([BERT_LARGE])


def test_without_a_curve_bert_large_keeps_its_dense_schedule(bert_large) -> None:
    packed = get_policy("target").pack(bert_large)
    w = packed.tradeoff
    assert w.staleness is None and w.chosen.cost.overhead <= 0.05
    assert w.chosen.cost.cycle == 7 and packed.margin == DEFAULT_MARGIN
    text = "\n".join(usage_lines(packed))
    assert "never" not in text and "time-to-target vs" not in text and "chosen: by planned step time alone" in text
    assert not validate(packed.to_file_data(), bert_large, margin=packed.margin)


def test_margins_do_not_move_bert_larges_cycle_one_way(bert_large) -> None:
    tight = TightPolicy()
    cycles = {m: max(n.figures.iterations for n in tight.pack(bert_large, m).nodes) for m in (0.05, 2.0)}
    assert cycles == {0.05: 7, 2.0: 3}


@pytest.mark.parametrize("curve, k, margin", [(AT_1000_STEPS, 7, DEFAULT_MARGIN), (PAST_6_NEVER, 3, 2.0)])
def test_a_curve_decides_bert_larges_cycle(bert_large, curve, k, margin) -> None:
    packed = get_policy("target", staleness=curve).pack(bert_large)
    w = packed.tradeoff
    assert w.chosen.cost.cycle == k and packed.margin == margin and not w.warnings
    assert math.isfinite(w.chosen.relative_time)
    assert {c.cost.cycle for c in w.candidates} >= {3, 7}  # the k = 7 packings were weighed, and went on
    assert not validate(packed.to_file_data(), bert_large, margin=packed.margin)


def test_no_cycle_longer_than_the_run_is_chosen(bert_large) -> None:
    packed = get_policy("target", max_cycle=5).pack(bert_large)
    assert packed.tradeoff.chosen.cost.cycle <= 5 and "the run's 5 steps" in "\n".join(usage_lines(packed))


@pytest.fixture(scope="module")
def weighed_fully() -> list[tuple[str, Job, list]]:
    """Jobs where the choice goes different ways (BERT-Large, where no density is at the floor, the bundled
    example, simulated pipelines, a few of the realistic family), each with every density packed."""
    from _realistic_jobs import realistic_family
    from pipefisher.bundled import cost_model_path, example_timelines
    from pipefisher.sim import load_cost_model, simulate_timelines

    jobs = [("bert-large regression", load_job([BERT_LARGE])), ("example", load_job(example_timelines()))]
    model = load_cost_model(cost_model_path("bert-base-4stages"))
    for order, m in (("interleaved", 16), ("zb-v", 8), ("chimera", 8)):
        jobs.append((order, job_from_dicts(simulate_timelines(model, order, None, m)[0])))
    jobs += list(realistic_family(every=36))
    return [(name, job, list(tradeoff(job, TightPolicy().pack, DEFAULT_MARGIN, prune=False).candidates))
            for name, job in jobs]


@pytest.mark.parametrize("curve, max_cycle", [(None, None), (AT_1000_STEPS, None), (PAST_6_NEVER, None),
                                               ("1:0.5,4:0.6,8:inf", None), ("1:inf", None), (None, 5),
                                               (AT_1000_STEPS, 5)])
def test_packing_only_what_can_be_chosen_gives_the_schedule_weighing_every_density_gives(weighed_fully, curve,
                                                                                         max_cycle) -> None:
    """The reference: every density packed, and the whole rule (:func:`choose`) applied to them all."""
    staleness = None if curve is None else StalenessCurve.parse(curve)
    pruned = 0
    for name, job, every in weighed_fully:
        scored = [Candidate(c.margin, c.schedule, c.cost, None if staleness is None else staleness.at(c.cost.cycle))
                  for c in every]
        want = choose(scored, staleness, max_cycle).chosen
        fast = tradeoff(job, TightPolicy().pack, DEFAULT_MARGIN, staleness, max_cycle=max_cycle, bound=cycle_bound)
        assert fast.chosen.schedule.to_file_data() == want.schedule.to_file_data(), name
        assert fast.chosen.margin == want.margin, name
        pruned += bool(fast.unpacked)
    if max_cycle is None:  # (in a run of 5 steps most densest packings are too long: every density is packed)
        assert pruned > 0  # the proofs did spare some packing


def test_weighing_each_node_as_soon_as_it_is_packed_gives_the_same_figures(weighed_fully) -> None:
    # the policy's way (each_node: a node is evaluated while the packer works on the others, and again
    # where aligning sync groups changes it) and the plain one (every node after the whole job)
    for name, job, every in weighed_fully:
        early = tradeoff(job, TightPolicy().pack, DEFAULT_MARGIN, prune=False, each_node=True).candidates
        assert [c.margin for c in early] == [c.margin for c in every], name
        assert [c.cost for c in early] == [c.cost for c in every], name
        assert [c.schedule.to_file_data() for c in early] == [c.schedule.to_file_data() for c in every], name
