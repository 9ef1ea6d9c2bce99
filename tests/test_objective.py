"""The time-to-target objective and the ``target`` policy, checked against hand computations.

The hand-made job: one node, a forward at 0-100 and a backward at 300-400, so one 200-long bubble and
a 400 pipeline time with no tail; one layer's K-FAC work (covariances 50, inverses 150); an end-of-step
update of 30 of which 10 is preconditioning.
"""
from __future__ import annotations

import math

import pytest

from pipefisher.errors import InputError
from pipefisher.objective import (
    MEASURED_STALENESS,
    StalenessCurve,
    choose,
    end_of_step,
    step_cost,
    tradeoff,
)
from pipefisher.policies import get_policy
from pipefisher.policies.base import JobSchedule, NodeFigures, NodeSchedule
from pipefisher.report import usage_lines
from pipefisher.rules import validate
from pipefisher.rules.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.timeline import job_from_dicts

from tests.conftest import small_node

F, B = "call_forward", "call_backward"
COV_A, COV_B, INV_A, INV_B = "cov_kron_A:l", "cov_kron_B:l", "inv_kron_A:l", "inv_kron_B:l"


def hand_job(update: int = 30, precondition: int = 10):
    node = {"start_end": [(0, 440)], F: [(0, 100)], B: [(300, 400)],
            COV_A: [(0, 50)], COV_B: [(0, 50)], INV_A: [(0, 150)], INV_B: [(0, 150)]}
    if update:
        node["update"] = [(400, 400 + update)]
        node["precondition"] = [(405, 405 + precondition)]
    return job_from_dicts([node])


SHORTEST = [[[START, F, COV_A, INV_A, B, COV_B, INV_B, END, SAVE_OFF, SAVE_ON]]]
"""k = 1: inverse B can only follow covariance B, which follows the backward: 200 of overflow a step."""
LONGER = [[[START, F, COV_A, INV_A, B, COV_B, END, SAVE_OFF], [START, F, INV_B, B, END, SAVE_ON]]]
"""k = 2: inverse B waits for the next iteration's bubble; only covariance B (50) overflows, every other step."""


def test_end_of_step_is_the_update_less_preconditioning_and_the_preconditioning() -> None:
    assert end_of_step(hand_job().nodes[0]) == (20.0, 10.0)
    assert end_of_step(hand_job(update=0).nodes[0]) == (0.0, 0.0)  # profiles without the keys


def test_step_costs_equal_the_hand_computation() -> None:
    job = hand_job()
    # first-order: pipeline 400 + update 20 (no tail bubble hides it)
    # k = 1: 400 + 200 overflow + 30 end-of-step
    shortest = step_cost(SHORTEST, job, slowdown=0)
    assert (shortest.cycle, shortest.first_order, shortest.step) == (1, 420, 630)
    assert shortest.overhead == pytest.approx(630 / 420 - 1)
    # k = 2: iteration 0 400 + 50 + 30, iteration 1 400 + 30 (inverse B fits the bubble): mean 455
    longer = step_cost(LONGER, job, slowdown=0)
    assert (longer.cycle, longer.first_order, longer.step) == (2, 420, 455)


def test_a_slower_item_in_a_bubble_delays_the_call_after_it() -> None:
    # 10 % slower: covariance A 55 + inverse A 165 end at 320, so the backward starts 20 late; then
    # covariance B 55 and the 30 of end-of-step: 505 in iteration 0; iteration 1: inverse B 165 < 200.
    cost = step_cost(LONGER, hand_job(), slowdown=0.1)
    assert cost.step == pytest.approx((505 + 430) / 2)


def test_a_tail_bubble_hides_end_of_step_work() -> None:
    node = {F: [(0, 100)], B: [(300, 400)], "update": [(400, 430)]}
    other = {F: [(100, 200)], B: [(200, 300)], "update": [(300, 320)]}  # idle 300-400: hides its 20
    job = job_from_dicts([node, other])
    plain = [[[START, F, B, END, SAVE_OFF, SAVE_ON]]] * 2
    assert step_cost(plain, job, slowdown=0).step == 430
    assert step_cost(plain, job, slowdown=0).first_order == 430


def candidates_of(curve: StalenessCurve):
    """:func:`tradeoff` with a packer that gives the k = 1 schedule densely, the k = 2 one sparser."""
    def pack(job, margin):
        data = SHORTEST if margin < 0.1 else LONGER

        nodes = tuple(NodeSchedule(tuple(tuple(it) for it in node), (), NodeFigures(len(node), 0.0, 0, 0, 0, 0))
                      for node in data)
        return JobSchedule("hand", job.span, nodes, margin)

    return tradeoff(hand_job(), pack, 0.05, curve, slowdown=0)


def test_the_longer_cycle_wins_where_the_shortest_overflows_more_per_step() -> None:
    cands = candidates_of(StalenessCurve(((1, 0.5), (2, 0.55), (4, 0.6))))
    assert [c.cost.cycle for c in cands] == [1, 2]  # the sparser margins give the same k = 2 schedule: once
    best = choose(cands)
    assert best.cost.cycle == 2
    assert best.relative_time == pytest.approx(0.55 * 455 / 420)
    assert cands[0].relative_time == pytest.approx(0.5 * 630 / 420)


@pytest.mark.parametrize("ratio_at_2, chosen_k", [(0.69, 2), (0.695, 1)])
def test_the_choice_turns_where_the_hand_computation_says(ratio_at_2, chosen_k) -> None:
    # k = 1 costs 0.5 x 630/420 = 0.75; k = 2 costs r x 455/420: equal at r = 0.5 x 630/455 = 0.6923.
    # Below it k = 2 wins, above it k = 1.
    turn = 0.5 * 630 / 455
    assert (ratio_at_2 < turn) == (chosen_k == 2)
    cands = candidates_of(StalenessCurve(((1, 0.5), (2, ratio_at_2))))
    assert choose(cands).cost.cycle == chosen_k


def test_staleness_curves_interpolate_in_log_k_and_refuse_bad_text() -> None:
    curve = StalenessCurve(((1, 0.5), (4, 0.7), (8, math.inf)))
    assert curve.at(1) == 0.5 and curve.at(0.5) == 0.5
    assert curve.at(2) == pytest.approx(0.6)  # halfway in log k between 1 and 4
    assert curve.at(8) == math.inf and curve.at(5) == math.inf and curve.at(100) == math.inf
    assert StalenessCurve.parse("1:0.5,4:0.7").at(2) == pytest.approx(0.6)
    assert MEASURED_STALENESS.at(1) == 0.5
    for bad in ("1:x", "2:1,1:3", "0:1", "1:-1", ""):
        with pytest.raises(InputError, match="staleness curve"):
            StalenessCurve.parse(bad)


def small_two_node_job():
    return job_from_dicts([small_node(offset=i * 50, m=4, module=f"layer.{i}") for i in range(2)])


def test_the_target_policy_keeps_the_least_time_to_target_and_validates() -> None:
    job = small_two_node_job()
    packed = get_policy("target").pack(job)
    assert packed.policy == "target"
    weighed = packed.tradeoff
    assert weighed.chosen.relative_time == min(c.relative_time for c in weighed.candidates)
    assert weighed.chosen.margin == packed.margin
    assert weighed.chosen.schedule.to_file_data() == packed.to_file_data()
    assert not validate(packed.to_file_data(), job, margin=packed.margin)
    lines = usage_lines(packed)
    assert sum("<- chosen" in line for line in lines) == 1
    assert len(lines) == 2 + 1 + 2 + len(weighed.candidates)  # 2 nodes, a gap, a header of 2, the candidates


def test_a_flat_curve_buys_the_cheapest_step_and_a_steep_one_the_shortest_cycle() -> None:
    job = small_two_node_job()
    flat = get_policy("target", staleness="1:0.5,64:0.5").pack(job)
    steep = get_policy("target", staleness="1:0.5,2:5").pack(job)
    tight = get_policy("tight").pack(job)
    assert max(len(n.iterations) for n in steep.nodes) == max(len(n.iterations) for n in tight.nodes)
    costs = {c.margin: c.cost.step for c in flat.tradeoff.candidates}
    assert costs[flat.margin] == min(costs.values())


@pytest.mark.parametrize("schedule", [SHORTEST, LONGER], ids=["overflow-every-step", "overflow-every-other"])
def test_the_planned_step_is_the_fake_clock_runs_step(schedule) -> None:
    """The fake clock (tests/_fake_clock.py) runs each label for its model time, inputs coming on the
    pipeline's period; its mean step over a cycle is the objective's planned step (the profile is in ns).
    (The fake's period does not stretch for end-of-step work, so the job here records none: the tests
    above check that part by hand.)"""
    from _fake_clock import fake_step, period, true_models

    job = hand_job(update=0)
    (model,) = true_models(job)
    ran = [fake_step(labels, model, period([model]))[-1].end for labels in schedule[0]]
    assert sum(ran) / len(ran) == pytest.approx(step_cost(schedule, job, slowdown=0).step * 1e-9)
