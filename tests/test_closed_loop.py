"""Schedulers in the loop (:mod:`pipefisher.loop.closed_loop`), fed by the fake clock (:mod:`_fake_clock`): the
bundled example job is packed with ``tight`` from its profile, then runs on "true" timings that drifted
from it; after every cycle the scheduler sees the records and says which schedule runs next.

One observed cycle here is every node running its own cycle once (the largest k steps); the trainer
observes whole job cycles (the least common multiple of the ks), which only adds samples.
"""
from __future__ import annotations

import json
import os

import pytest

from _fake_clock import fake_records, slowed_job, true_models
from pipefisher.loop.closed_loop import (AdaptiveScheduler, Plan, StaticScheduler, cycle_seconds, job_models,
                                         make_scheduler)
from pipefisher.bundled import example_timelines
from pipefisher.cost.measure import gap_overruns, planned_gaps, step_overrun
from pipefisher.cost.staleness import StalenessCurve
from pipefisher.loop.drift import Refresh
from pipefisher.policies import get_policy
from pipefisher.rules import validate
from pipefisher.schedule.problem import DEFAULT_MARGIN
from pipefisher.schedule.timeline import load_job, read_node_file

SLOW_KEY = "cov_kron_A:encoder.layer.3.attention.self.query"  # on node 1 of the example
CURVE = StalenessCurve.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         "examples", "staleness", "small-300-steps.json"))
"""The trials as they are with a staleness curve (k weighed by it); without one the drift rule sets k
(the tests at the end)."""
NS = 1e-9
"""Overruns below a nanosecond are float noise: a call that waited less than ``WAIT_EPS`` counts as not
having waited, and its gap's upper bound then equals the planned bubble up to rounding."""


@pytest.fixture(scope="module")
def job():
    return load_job(example_timelines())


@pytest.fixture(scope="module")
def initial(job) -> Plan:
    """The profile's tight schedule, with the profile it was packed on."""
    raws = [read_node_file(p) for p in example_timelines()]
    return Plan(get_policy("tight").pack(job, DEFAULT_MARGIN).to_file_data(), timelines=raws)


class Loop:
    """The trainer's side of the loop, on the fake clock: run the current plan for a cycle, report it."""

    def __init__(self, scheduler, true_job) -> None:
        self.scheduler, self.models, self.step = scheduler, true_models(true_job), 1

    def cycle(self, aging: float | None = None) -> tuple[list, Plan]:
        """One observed cycle (whose curvature refresh measured ``aging``, if given): its records, and the
        plan the scheduler hands out next. The refresh's distances to the two before it are the cycle's k
        and 2k where the plan ran the two cycles before as well (as the runtime measures them), else not."""
        plan = self.scheduler.current
        k = max(plan.cycles)
        records = fake_records(plan.data, self.models, self.step, k)
        self.step += k
        self.ran = (getattr(self, "ran", []) + [plan.digest])[-3:]
        self.scheduler.observe(records)
        if aging is not None:
            lags = (k, 2 * k) if self.ran == [plan.digest] * 3 else (k, 2 * k + 1)
            self.scheduler.observe_drift([Refresh(self.step - 1, 0.4, aging, lags=lags)])
        return records, self.scheduler.next_schedule()


def gaps_of(plan: Plan, node: int) -> list[float]:
    """The bubbles ``plan`` was packed for on ``node``, in seconds."""
    return [g / 1e9 for g in planned_gaps(plan.models[node])]


def overrun(plan: Plan, records) -> float:
    """Seconds of K-FAC work that delayed calls beyond the bubbles ``plan`` was packed for."""
    return sum(step_overrun(r, gaps_of(plan, r.node)) for r in records)


def test_static_scheduler_keeps_its_schedule_whatever_it_sees(job, initial) -> None:
    loop = Loop(make_scheduler("static", initial, 4), slowed_job(job, every_kfac=3.0))
    for _ in range(3):
        records, nxt = loop.cycle()
        assert overrun(initial, records) > 0
        assert nxt is initial
    assert isinstance(loop.scheduler, StaticScheduler) and loop.scheduler.state_dict() == {}


def test_without_drift_the_adaptive_scheduler_tries_more_slack_and_comes_back(job, initial) -> None:
    """Measured as profiled, nothing overruns: no repair. After two cycles the scheduler tries more K-FAC
    slack; on this clock the step is no faster with it (the pipeline is the same), so it goes back to
    the very schedule it kept (not a re-pack of it) and stays there: a re-pack needs as many iterations,
    so there is no shorter cycle to try either. (The measured frame keeps the plan's head bubbles:
    judged without them, the profile's head work looked like a 7 % delay.)"""
    loop = Loop(AdaptiveScheduler(initial, 4, staleness=CURVE), job)
    plans = []
    for _ in range(8):
        records, nxt = loop.cycle()
        assert overrun(loop.scheduler.current, records) < NS
        plans.append(nxt)
    assert plans[0] is initial
    assert "trying K-FAC slack x1.25" in plans[1].reason and max(plans[1].cycles) > max(initial.cycles)
    assert plans[3].digest == initial.digest and "back to the kept schedule" in plans[3].reason
    assert all(p is plans[3] for p in plans[3:])  # settled
    assert not loop.scheduler.climbing and loop.scheduler.trial is None


def test_an_item_twice_as_slow_gets_a_schedule_where_it_fits(job, initial) -> None:
    """One item of node 1 runs 2x its profiled time: the profile's schedule overruns there in every cycle
    (by little: ~1 ms a step), so after the second cycle the scheduler re-packs what it measured. The new
    plan's work fits the measured bubbles and runs without an overrun on the true timings."""
    loop = Loop(AdaptiveScheduler(initial, 4, staleness=CURVE), slowed_job(job, {(1, SLOW_KEY): 2.0}))
    records, nxt = loop.cycle()
    assert overrun(initial, records) > 0 and nxt is initial  # one cycle could be noise: wait for a second
    records, nxt = loop.cycle()
    assert nxt is not initial, loop.scheduler.last_decision
    assert "overran its bubbles two cycles in a row (node 1 iteration" in nxt.reason
    measured, _ = job_models(nxt.timelines, nxt.margin)
    assert validate(nxt.data, measured, margin=nxt.margin) == []
    records, again = loop.cycle()
    assert overrun(nxt, records) < NS
    assert again is nxt


def test_a_resumed_scheduler_decides_as_the_uninterrupted_one(job, initial) -> None:
    """Its state goes through JSON (a checkpoint) into a fresh scheduler: the same next plan, for the same
    reason, mid-run after a switch as well."""
    loop = Loop(AdaptiveScheduler(initial, 4, staleness=CURVE), slowed_job(job, {(1, SLOW_KEY): 2.0}, every_kfac=1.2))
    for _ in range(3):
        loop.scheduler.observe(fake_records(loop.scheduler.current.data, loop.models, loop.step,
                                            max(loop.scheduler.current.cycles)))
        loop.step += max(loop.scheduler.current.cycles)
        state = json.loads(json.dumps(loop.scheduler.state_dict()))
        resumed = AdaptiveScheduler(initial, 4, staleness=CURVE)
        resumed.load_state_dict(state)
        assert resumed.current.digest == loop.scheduler.current.digest
        theirs, ours = resumed.next_schedule(), loop.scheduler.next_schedule()
        assert (theirs.digest, theirs.reason, theirs.timelines) == (ours.digest, ours.reason, ours.timelines)
        assert resumed.last_decision == loop.scheduler.last_decision
        assert json.loads(json.dumps(resumed.state_dict())) == json.loads(json.dumps(loop.scheduler.state_dict()))


def test_k_grows_when_kfac_work_gets_much_slower(job, initial) -> None:
    """3x K-FAC work cannot fit in 4 iterations: after two cycles the plan spreads it over more. Some
    inverses then fit no bubble at all (forced overflow): they run after the last call and lengthen
    their steps, the only overrun left, and the steps are faster than before the switch."""
    loop = Loop(AdaptiveScheduler(initial, 4, staleness=CURVE), slowed_job(job, every_kfac=3.0))
    before = loop.cycle()[0]
    assert loop.scheduler.current is initial  # one cycle could be noise
    loop.cycle()
    nxt = loop.scheduler.current
    assert min(nxt.cycles) > max(initial.cycles)
    after, _ = loop.cycle()
    assert all(x < NS for r in after for x in gap_overruns(r, gaps_of(nxt, r.node))[:-1])
    assert overrun(nxt, after) > 0  # the overflow, after the last call
    assert cycle_seconds(after) < 0.75 * cycle_seconds(before)


def test_k_shrinks_when_kfac_work_gets_faster(job, initial) -> None:
    """Half as long K-FAC work: nothing overruns; more slack does not pay, and then a re-pack of what was
    measured fits fewer iterations: tried, as fast, kept (fresher curvature wins a tie)."""
    loop = Loop(AdaptiveScheduler(initial, 4, staleness=CURVE), slowed_job(job, every_kfac=0.5))
    plans = [loop.cycle()[1] for _ in range(8)]
    shorter = next(p for p in plans if "a shorter cycle, tried" in p.reason)
    assert max(shorter.cycles) < max(initial.cycles)
    assert plans[-1] is shorter and loop.scheduler.kept is shorter
    records, _ = loop.cycle()
    assert overrun(shorter, records) < NS


def _on_trial(job, initial, value_ratio: float, staleness=CURVE):
    """A scheduler whose trial of more slack measured ``value_ratio`` times the kept schedule's objective
    (its step time 0.10 s times the staleness curve at its k), the kept schedule 0.10 s a step."""
    loop = Loop(AdaptiveScheduler(initial, 4, staleness=staleness), job)
    loop.cycle()
    _, trial = loop.cycle()
    assert loop.scheduler.trial == "slack"
    curve = loop.scheduler.staleness  # None: no curve, the step time alone
    stale = 1.0 if curve is None else curve.at(max(trial.cycles)) / curve.at(max(initial.cycles))
    loop.cycle()
    loop.scheduler.observe(fake_records(trial.data, loop.models, loop.step, max(trial.cycles)))
    loop.scheduler.costs[initial.digest] = [0.10, 0.10]
    loop.scheduler.costs[trial.digest] = [0.10 * value_ratio / stale] * 2
    return loop.scheduler, trial


@pytest.mark.parametrize("value_ratio, kept", [(0.9, True), (0.985, False), (1.1, False)])
def test_more_slack_is_kept_only_where_it_measures_faster(job, initial, value_ratio, kept) -> None:
    scheduler, trial = _on_trial(job, initial, value_ratio)
    nxt = scheduler.next_schedule()
    if kept:  # faster beyond the tie: kept, and the next slack is tried
        assert scheduler.kept is trial and scheduler.trial == "slack" and "x1.5" in nxt.reason
    else:  # within the tie, or slower: back to the schedule that was kept, no more climbing
        assert nxt.digest == initial.digest and scheduler.kept is initial
        assert not scheduler.climbing and "back to the kept schedule" in nxt.reason


def test_without_a_curve_a_schedule_is_worth_its_measured_step_time(job, initial) -> None:
    for drift in (False, True):
        scheduler = AdaptiveScheduler(initial, 4, drift=drift)
        scheduler.costs[initial.digest] = [0.09, 0.09]
        # k is the packing's, or the drift rule's where it is asked for
        assert scheduler.staleness is None and (scheduler.rule is not None) == drift
        assert scheduler.value(initial) == scheduler.cost(initial) == pytest.approx(0.09)


def test_without_a_curve_or_the_drift_rule_k_stays_the_packings(job, initial) -> None:
    """The drift rule is opt-in (``drift``): without it and without a curve, refreshes that age as little as
    those that double k under the rule (test_without_a_curve_a_low_aging_lengthens_the_cycle_...) change
    nothing, no shorter cycle is tried, and a repair stays within the packing's k."""
    k = max(initial.cycles)
    loop = Loop(AdaptiveScheduler(initial, 4, aging_low=LOW, aging_high=HIGH), job)
    assert loop.scheduler.rule is None and loop.scheduler.fixed_k == k
    decisions = []
    for _ in range(24):
        assert max(loop.cycle(0.05)[1].cycles) == k
        decisions.append(dict(loop.scheduler.last_decision))
    assert all(d["cycle"] == k for d in decisions)
    assert "packs into 5 iterations, more than the k = 4 of the initial packing" in \
        next(filter(None, (d.get("blocked") for d in decisions)))
    slow = Loop(AdaptiveScheduler(initial, 4), slowed_job(job, every_kfac=3.0))
    blocked = []
    for _ in range(12):
        assert max(slow.cycle(0.01)[1].cycles) == k
        blocked.append(slow.scheduler.last_decision.get("repair_blocked"))
    assert "and no re-pack fits the k = 4 of the initial packing" in next(filter(None, blocked))


def test_a_faster_step_with_staler_curvature_loses_where_the_staleness_costs_more(job, initial) -> None:
    """The closed loop's objective is the user's: step time x steps-to-target at the cycle's k."""
    from pipefisher.cost.staleness import StalenessCurve

    steep = StalenessCurve(((1, 0.5), (4, 0.5), (5, 1.0), (64, 1.0)))
    scheduler, trial = _on_trial(job, initial, 1.0, staleness=steep)
    assert max(trial.cycles) > max(initial.cycles)  # more slack: a longer cycle
    # 5 % faster per step, but the longer cycle's curvature doubles the steps to the target
    scheduler.costs[trial.digest] = [0.095, 0.095]
    nxt = scheduler.next_schedule()
    assert nxt.digest == initial.digest and "back to the kept schedule" in nxt.reason


# -- without a staleness curve, with the drift rule (opt-in): the drift sets k --------------------------

LOW, HIGH = 0.1, 0.3


def _drifting(job, initial) -> Loop:
    return Loop(AdaptiveScheduler(initial, 4, aging_low=LOW, aging_high=HIGH, drift=True), job)


def _until_k(loop: Loop, aging: float, k: int, cycles: int = 40) -> list[Plan]:
    """Cycles whose refreshes age by ``aging`` until the plan handed out runs cycle ``k``; every plan."""
    plans = []
    for _ in range(cycles):
        plans.append(loop.cycle(aging)[1])
        if max(plans[-1].cycles) == k:
            return plans
    raise AssertionError(f"k never became {k}: {[max(p.cycles) for p in plans]} ({loop.scheduler.last_decision})")


def test_without_a_curve_a_low_aging_lengthens_the_cycle_with_pipeline_only_iterations(job, initial) -> None:
    """k = 4 on the example. Eleven refreshes aging below the low threshold, all of them (the first two
    cycles' are left out: their refreshes before were not 4 and 8 steps back), are clearly more than three
    quarters and double k: the same packing, four pipeline-only iterations appended, saving turned back on
    at the new last one. More slack, which packs into more than 4 iterations, could not be tried at k = 4;
    at k = 8 it is, lengthened to 8 as well."""
    from pipefisher.schedule.format import SAVE_ON

    loop = _drifting(job, initial)
    k = max(initial.cycles)
    assert loop.cycle(0.05)[1] is initial and loop.cycle(0.05)[1] is initial
    assert "packs into 5 iterations, more than the k = 4 the drift allows" in loop.scheduler.last_decision["blocked"]
    for _ in range(10):  # ten refreshes in, all low: not yet clear (0.75^10 > 5 %)
        assert loop.cycle(0.05)[1] is initial
    longer = loop.cycle(0.05)[1]
    assert max(longer.cycles) == 2 * k
    assert ("curvature aging below 0.1 in 11 and above 0.3 in 0 of 11 refreshes at k = 4: below in clearly more "
            "than 75% (at 95% confidence): a longer cycle") in longer.reason
    assert "4 pipeline-only iterations appended" in longer.reason
    assert loop.scheduler.natural(longer) == initial.data and loop.scheduler.kept is longer
    for node, natural in zip(longer.data, initial.data):
        assert node[:k - 1] == natural[:k - 1] and node[k - 1] == [x for x in natural[-1] if x != SAVE_ON]
        assert all(not any("kron" in x for x in it) for it in node[k:]) and node[-1][-1] == SAVE_ON
    assert loop.scheduler.climbing  # more slack may fit the longer cycle
    trial = next(p for p in (loop.cycle(0.05)[1] for _ in range(4)) if loop.scheduler.trial == "slack")
    assert "trying K-FAC slack x1.25" in trial.reason and max(trial.cycles) == 2 * k
    assert len(loop.scheduler.natural(trial)[0]) > k


def test_a_high_aging_shortens_the_cycle_back_to_denser_packings_down_to_the_densest(job, initial) -> None:
    loop = _drifting(job, initial)
    k = max(initial.cycles)
    _until_k(loop, 0.05, 4 * k)
    shorter = _until_k(loop, 0.5, 2 * k)[-1]
    assert "above in clearly more than 50% (at 95% confidence): a shorter cycle: k 16 -> 8" in shorter.reason
    back = _until_k(loop, 0.5, k)[-1]
    assert back.data == loop.scheduler.natural(back) and max(back.cycles) == k  # the packing itself again
    floors = []
    for _ in range(12):  # nothing packs in fewer than 4 iterations: the rule's floor, no switch
        assert loop.cycle(0.5)[1] is back
        floors.append(loop.scheduler.last_decision.get("drift_floor"))
    assert loop.scheduler.rule.floor == k and "no packing needs fewer than 4 iterations" in next(filter(None, floors))


def test_between_the_thresholds_k_holds_and_refreshes_at_other_distances_are_left_out(job, initial) -> None:
    loop = Loop(AdaptiveScheduler(initial, 4, aging_low=LOW, aging_high=HIGH, ladder=(1.0,), drift=True),
                job)  # ladder: no trials
    k = max(initial.cycles)
    assert all(max(loop.cycle(0.2)[1].cycles) == k for _ in range(10))
    # the 8 refreshes counted in the band keep weighing: 47 low ones are clearly more than three quarters
    assert len(_until_k(loop, 0.05, 2 * k, cycles=80)) == 47
    loop.cycle(0.01)  # the first two cycles of the new schedule: the refreshes before ran the old one
    loop.cycle(0.01)
    assert loop.scheduler.rule.refreshes == 0
    loop.cycle(0.01)
    assert (loop.scheduler.rule.refreshes, loop.scheduler.rule.below) == (1, 1)
    scheduler = loop.scheduler  # only distances of k = 8 count now: 4 and 8 steps (the old k) do not
    scheduler.observe_drift([Refresh(loop.step, 0.4, 0.02, lags=(4, 8)), Refresh(loop.step, 0.4, None, lags=(8, 16)),
                             Refresh(loop.step, 0.4, 0.35, lags=(8, 16))])
    assert (scheduler.rule.refreshes, scheduler.rule.below, scheduler.rule.above) == (2, 1, 1)


def test_a_resumed_drift_driven_scheduler_decides_as_the_uninterrupted_one(job, initial) -> None:
    """Its state (the rule's cycle, floor and counts, the packings lengthened plans come from) goes through
    JSON into a fresh scheduler, at each point of a run that lengthens and shortens."""
    loop = _drifting(job, initial)
    ks = []
    for aging in [0.05] * 28 + [0.5] * 22:
        plan = loop.scheduler.current
        loop.scheduler.observe(fake_records(plan.data, loop.models, loop.step, max(plan.cycles)))
        loop.step += max(plan.cycles)
        loop.scheduler.observe_drift([Refresh(loop.step - 1, 0.4, aging, lags=(max(plan.cycles), 2 * max(plan.cycles)))])
        state = json.loads(json.dumps(loop.scheduler.state_dict()))
        resumed = AdaptiveScheduler(initial, 4, aging_low=LOW, aging_high=HIGH, drift=True)
        resumed.load_state_dict(state)
        theirs, ours = resumed.next_schedule(), loop.scheduler.next_schedule()
        assert (theirs.digest, theirs.reason) == (ours.digest, ours.reason)
        assert resumed.natural(theirs) == loop.scheduler.natural(ours)
        assert json.loads(json.dumps(resumed.state_dict())) == json.loads(json.dumps(loop.scheduler.state_dict()))
        ks.append(max(ours.cycles))
    assert ks[0] == 4 and 16 in ks and ks[-1] < 16, ks  # lengthened, and shortened again


def test_with_a_curve_the_drift_decides_nothing(job, initial) -> None:
    """Given a staleness curve, k follows the curve, as before: drift figures change no decision."""
    plain, drifting = (Loop(AdaptiveScheduler(initial, 4, staleness=CURVE), job) for _ in range(2))
    assert drifting.scheduler.rule is None
    for _ in range(8):
        assert plain.cycle()[1].digest == drifting.cycle(0.01)[1].digest


def test_without_a_curve_a_repair_stays_within_the_cycle_the_drift_allows(job, initial) -> None:
    """3x slower K-FAC work fits no packing of 4 iterations. With a curve the repair lengthens k
    (test_k_grows_when_kfac_work_gets_much_slower); without one the drift set k = 4, and the overruns stay
    rather than the curvature growing staler, until the aging clearly says a longer cycle costs little (21
    low refreshes after the 2 in the band counted): then the work is re-packed within the longer cycle."""
    loop = _drifting(slowed_job(job, every_kfac=3.0), initial)
    blocked = []
    for _ in range(4):
        assert loop.cycle(0.2)[1] is initial  # aging in the band: k holds at 4
        blocked.append(loop.scheduler.last_decision.get("repair_blocked"))
    assert "and no re-pack fits the k = 4 the drift allows" in next(filter(None, blocked))
    plans = []
    for _ in range(36):
        plans.append(loop.cycle(0.01)[1])
        assert max(plans[-1].cycles) <= loop.scheduler.rule.cycle
    repaired = [p for p in plans if "overran its bubbles" in p.reason]
    assert repaired and max(repaired[0].cycles) > 4


def test_a_re_pack_overlaps_cycles_as_the_policy_does(monkeypatch) -> None:
    """``tight`` overlaps cycles by default, and so do the scheduler's re-packs (a switch ends the refreshes
    under way, whatever either schedule is); ``overlap=False`` keeps every refresh in its cycle. The plan says
    which, and keeps it through a checkpoint."""
    from conftest import overlapping_node
    from pipefisher.schedule.timeline import job_from_dicts

    raw = overlapping_node()
    job = job_from_dicts([raw])
    initial = Plan(get_policy("tight", overlap=False).pack(job).to_file_data(), timelines=[raw])
    for overlap, k in ((None, 2), (True, 2), (False, 3)):
        scheduler = AdaptiveScheduler(initial, 1, overlap=overlap)
        monkeypatch.setattr(scheduler, "measured_timelines", lambda: [raw])
        plan = scheduler._pack(0, "a test")
        assert plan.cycles == [k] and plan.overlap == (k == 2)
        assert validate(plan.data, job, overlap=plan.overlap) == []
        assert Plan.from_state(plan.state()).overlap == plan.overlap
    assert validate(plan.data, job) == [] and not Plan.from_state({"data": plan.data}).overlap
