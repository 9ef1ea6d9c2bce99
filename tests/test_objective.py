"""The time-to-target objective and the ``target`` policy, checked against hand computations.

The hand-made job: one node, a forward at 0-100 and a backward at 300-400, so one 200-long bubble and
a 400 pipeline time with no tail; one layer's K-FAC work (covariances 50, inverses 150); an end-of-step
update of 30 of which 10 is preconditioning.
"""
from __future__ import annotations

import math

import pytest

from pipefisher.cost.objective import (
    NO_CURVE_TOLERANCE,
    Candidate,
    StepCost,
    choose,
    choose_without_curve,
    end_of_step,
    step_cost,
    tradeoff,
)
from pipefisher.cost.staleness import StalenessCurve
from pipefisher.outputs.report import usage_lines
from pipefisher.policies import get_policy
from pipefisher.rules import validate
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.packed import JobSchedule, NodeFigures, NodeSchedule
from pipefisher.schedule.timeline import job_from_dicts

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


def hand_packer(dense: list, sparse: list, turn: float = 0.1):
    """A packer that gives ``dense`` below margin ``turn`` and ``sparse`` from it on."""
    def pack(job, margin):
        data = dense if margin < turn else sparse
        nodes = tuple(NodeSchedule(tuple(tuple(it) for it in node), (), NodeFigures(len(node), 0.0, 0, 0, 0, 0))
                      for node in data)
        return JobSchedule("hand", job.span, nodes, margin)

    return pack


def weighed(curve: StalenessCurve | None, dense=SHORTEST, sparse=LONGER, turn: float = 0.1, **options):
    """:func:`tradeoff` on the hand job with :func:`hand_packer` (the k = 1 schedule densely, k = 2 sparser)."""
    return tradeoff(hand_job(), hand_packer(dense, sparse, turn), 0.05, curve, slowdown=0, **options)


def test_the_longer_cycle_wins_where_the_shortest_overflows_more_per_step() -> None:
    w = weighed(StalenessCurve(((1, 0.5), (2, 0.55), (4, 0.6))))
    assert [c.cost.cycle for c in w.candidates] == [1, 2]  # the sparser margins give the same k = 2 schedule: once
    assert w.chosen.cost.cycle == 2
    assert w.chosen.relative_time == pytest.approx(0.55 * 455 / 420)
    assert w.candidates[0].relative_time == pytest.approx(0.5 * 630 / 420)


@pytest.mark.parametrize("ratio_at_2, chosen_k", [(0.69, 2), (0.695, 1)])
def test_the_choice_turns_where_the_hand_computation_says(ratio_at_2, chosen_k) -> None:
    # k = 1 costs 0.5 x 630/420 = 0.75; k = 2 costs r x 455/420: equal at r = 0.5 x 630/455 = 0.6923.
    # Below it k = 2 wins, above it k = 1.
    turn = 0.5 * 630 / 455
    assert (ratio_at_2 < turn) == (chosen_k == 2)
    assert weighed(StalenessCurve(((1, 0.5), (2, ratio_at_2)))).chosen.cost.cycle == chosen_k


def test_every_density_is_weighed_though_the_margin_does_not_move_k_one_way() -> None:
    # The dense margin packs k = 2 and every sparser one k = 1: the sparser one is still packed and
    # weighed, though the dense one never reaches the target on the curve (no early stop after it).
    w = weighed(StalenessCurve(((1, 0.5), (1.5, math.inf))), dense=LONGER, sparse=SHORTEST)
    assert [c.cost.cycle for c in w.candidates] == [2, 1]
    assert w.candidates[0].relative_time == math.inf
    assert w.chosen.cost.cycle == 1 and not w.warnings
    assert any("never" in line for line in w.lines()) and sum("<- chosen" in line for line in w.lines()) == 1


def test_an_all_infinite_curve_chooses_as_without_a_curve_and_says_why() -> None:
    never = StalenessCurve(((1, math.inf),))
    w = weighed(never)
    plain = weighed(None)
    assert w.chosen.schedule.to_file_data() == plain.chosen.schedule.to_file_data()
    assert len(w.warnings) == 1 and "no density reaches the target" in w.warnings[0]
    assert any("no density reaches the target" in line for line in w.lines())


def test_without_a_curve_no_time_to_target_is_printed_and_the_rule_is_stated() -> None:
    w = weighed(None)
    text = "\n".join(w.lines())
    assert all(c.relative_time is None for c in w.candidates)
    assert "time-to-target vs" not in text and "never" not in text and "no time-to-target is predicted" in text
    assert "chosen: by planned step time alone" in text
    # k = 1: 630 a step, k = 2: 455 (floor 430: first-order 420 plus the 10 of preconditioning): the least
    # step, k = 2, is more than 2 % above the floor, so every density is weighed
    assert w.chosen.cost.cycle == 2 and w.chosen.cost.floor == 430


def test_a_cycle_longer_than_the_run_is_never_chosen() -> None:
    short_run = weighed(StalenessCurve(((1, 0.5), (2, 0.55))), max_cycle=1)
    assert short_run.chosen.cost.cycle == 1 and "the run's 1 steps" in "\n".join(short_run.lines())
    assert weighed(None, max_cycle=1).chosen.cost.cycle == 1
    # no density fits a run of 1 step: the shortest cycle, flagged, and the report says so (not that it
    # kept to the run's steps) with the cycle and planned overhead of that schedule
    both_long = weighed(None, dense=LONGER, sparse=LONGER, max_cycle=1)
    assert both_long.chosen.cost.cycle == 2 and not both_long.within_run and not both_long.data()["within_run"]
    text = "\n".join(both_long.lines())
    assert "cycles up to the run's" not in text and "<- chosen" not in text
    assert "chosen: none: no packing's cycle fits the run's 1 steps; the shortest is k = 2 at margin 0.05 " \
           f"(planned {100 * (455 / 420 - 1):.1f} % over first-order)" in text
    assert "needs at least 2 steps" in both_long.warnings[0]
    assert short_run.within_run and "<- chosen" in "\n".join(short_run.lines())


def candidate(margin: float, cycle: int, step: float, overflow: int = 0, floor: float = 100.0,
              first_order: float = 100.0) -> Candidate:
    """A candidate of hand-set figures: ``overflow`` per step on its one node."""
    node = NodeSchedule((), (), NodeFigures(cycle, 0.0, 0, 0, 0, 0, overflow=overflow * cycle))
    return Candidate(margin, JobSchedule("hand", 1000, (node,), margin), StepCost(cycle, first_order, step, floor), None)


def test_the_rule_without_a_curve_keeps_the_densest_at_the_floor() -> None:
    densest = candidate(0.05, 9, 101.9)  # 1.9 % above the floor: within the tolerance
    shorter = candidate(2.0, 3, 101.0)  # a shorter cycle and a lower step, sparser: not looked at
    assert NO_CURVE_TOLERANCE == 0.02
    assert choose_without_curve([densest, shorter]).chosen is densest


def test_the_rule_without_a_curve_takes_the_shortest_cycle_near_the_least_step() -> None:
    densest = candidate(0.05, 7, 125.0)  # 25 % above the floor
    least = candidate(0.5, 9, 103.0)
    near = candidate(1.0, 8, 104.5)  # within 2 % of 103: the shorter cycle wins
    far = candidate(2.0, 3, 106.0)  # beyond 2 % of 103
    assert choose_without_curve([densest, least, near, far]).chosen is near
    # overflow beyond the densest packing's only where it has the least step
    overflowing = candidate(1.0, 8, 104.5, overflow=5)
    assert choose_without_curve([densest, least, overflowing, far]).chosen is least
    assert choose_without_curve([densest, candidate(0.5, 9, 103.0, overflow=5)]).chosen.cost.cycle == 9


def test_choose_needs_candidates_and_the_curve_decides_where_it_can() -> None:
    with pytest.raises(ValueError):
        choose([])
    a, b = candidate(0.05, 2, 110.0), candidate(0.5, 8, 101.0)
    curve = StalenessCurve(((1, 0.5), (4, 0.6), (8, 0.9)))
    with_curve = [Candidate(c.margin, c.schedule, c.cost, curve.at(c.cost.cycle)) for c in (a, b)]
    assert choose(with_curve, curve).chosen is with_curve[0]  # 0.55 x 1.10 = 0.605 < 0.9 x 1.01
    assert choose([a, b]).chosen is b  # without it: the least step, 10 % above the floor
    # a wider tie buys the shorter cycle: 110 is within 10 % of 101
    assert choose([a, b], tolerance=0.1).chosen is a


def small_two_node_job():
    return job_from_dicts([small_node(offset=i * 50, m=4, module=f"layer.{i}") for i in range(2)])


def test_the_target_policy_keeps_the_least_time_to_target_and_validates() -> None:
    job = small_two_node_job()
    packed = get_policy("target", staleness="1:0.5,4:0.6,16:0.9").pack(job)
    assert packed.policy == "target"
    w = packed.tradeoff
    assert w.chosen.relative_time == min(c.relative_time for c in w.candidates)
    assert w.chosen.margin == packed.margin
    assert w.chosen.schedule.to_file_data() == packed.to_file_data()
    assert not validate(packed.to_file_data(), job, margin=packed.margin)
    lines = usage_lines(packed)
    assert sum("<- chosen" in line for line in lines) == 1
    # 2 nodes, a gap, a header of 2, the candidates, why, what was not packed
    assert len(lines) == 2 + 1 + 2 + len(w.candidates) + 1 + len(w.unpacked)


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
    from _fake_clock import fake_step, first_pieces, period, true_models

    job = hand_job(update=0)
    (model,) = true_models(job)
    ran = [fake_step(labels, model, period([model]), first=first_pieces(schedule[0], i, model))[-1].end
           for i, labels in enumerate(schedule[0])]
    assert sum(ran) / len(ran) == pytest.approx(step_cost(schedule, job, slowdown=0).step * 1e-9)


def test_the_planned_step_of_a_simulated_job_grows_by_its_exposed_preconditioning() -> None:
    """The bundled BERT-Base model preconditions 3 layers per node at the step's end (its CSV row's
    ``time_prec``): node 0 ends the pipeline, so no tail bubble hides any of it there."""
    from pipefisher.bundled import cost_model_path
    from pipefisher.cost.objective import exposed_end_of_step, slowed_models
    from pipefisher.sim import load_cost_model, simulate_timelines
    from pipefisher.sim.costs import NS_PER_MS

    model = load_cost_model(cost_model_path("bert-base-4stages"))
    prec = round(3 * model.block_prec_ms * NS_PER_MS)
    assert prec > 0
    job = job_from_dicts(simulate_timelines(model, "1f1b")[0])
    bare = job_from_dicts(simulate_timelines(model.replace(block_prec_ms=0.0), "1f1b")[0])
    packed = get_policy("tight").pack(job)
    assert packed.to_file_data() == get_policy("tight").pack(bare).to_file_data()  # packing ignores it
    with_prec, without = step_cost(packed.to_file_data(), job), step_cost(packed.to_file_data(), bare)
    assert with_prec.first_order == without.first_order  # first-order does not precondition
    assert with_prec.floor - without.floor == pytest.approx(prec)
    assert 0 < with_prec.step - without.step <= prec + 1e-6
    node0 = packed.nodes[0]
    _, exposed = exposed_end_of_step(node0.iterations, node0.layout, slowed_models(job)[0], job.nodes[0])
    assert exposed == [prec] * len(node0.iterations)


def test_best_pieces_keeps_the_shorter_cycle_among_planned_steps_within_the_tolerance() -> None:
    """``kfac.refresh_pieces: best``'s one rule (pipefisher run and the convergence benchmark): the planned
    steps within NO_CURVE_TOLERANCE (2 %) of the least count as equal, as the ``target`` policy counts them;
    among them the shorter cycle (fresher curvature), then the fewer pieces, then the shorter step, in any
    order given; a step beyond the tolerance never wins on its cycle."""
    from pipefisher.cost.objective import NO_CURVE_TOLERANCE, PIECE_CHOICES, PiecesPacked, best_pieces, pieces_line

    assert PIECE_CHOICES == (1, 2, 4) and NO_CURVE_TOLERANCE == 0.02
    race = [PiecesPacked(1, 136.3, 3), PiecesPacked(2, 135.2, 4), PiecesPacked(4, 134.6, 4)]
    assert best_pieces(race).pieces == 1  # the planned steps of the race on 5121b1b; 1 piece 1.3 % longer
    assert pieces_line(race, best_pieces(race)) == \
        "refresh pieces: 1 136.3 ms, 2 135.2 ms, 4 134.6 ms planned: 1 kept"
    small = [PiecesPacked(1, 157.7, 4), PiecesPacked(2, 151.3, 4), PiecesPacked(4, 152.2, 3)]
    assert best_pieces(small).pieces == 4  # 1 is 4.2 % longer: out; 4 is 0.6 % longer, its cycle shorter
    assert best_pieces(small, tolerance=0.0).pieces == 2  # no tolerance: the least step alone
    tied_step = [PiecesPacked(1, 150.0, 4), PiecesPacked(2, 150.0, 3), PiecesPacked(4, 150.0, 5)]
    assert best_pieces(tied_step).pieces == 2  # same step: the shorter cycle
    tied_all = [PiecesPacked(4, 150.0, 3), PiecesPacked(2, 150.0, 3), PiecesPacked(1, 151.0, 2)]
    assert best_pieces(tied_all).pieces == 1  # within 2 %: the shortest cycle, wherever it stands
    same_cycle = [PiecesPacked(4, 150.0, 3), PiecesPacked(2, 151.0, 3), PiecesPacked(1, 155.0, 2)]
    assert best_pieces(same_cycle).pieces == 2  # 1 is 3.3 % longer: out; same cycle: fewer pieces
    assert best_pieces([PiecesPacked(4, 140.0, 9), *tied_all]).pieces == 4  # the others 7 % longer: out
    with pytest.raises(ValueError, match="no piece count"):
        best_pieces([])
