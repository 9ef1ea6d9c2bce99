"""Schedulers in the loop (:mod:`pipefisher.closed_loop`), fed by the fake clock (:mod:`_fake_clock`): the
bundled example job is packed with ``tight`` from its profile, then runs on "true" timings that drifted
from it; after every cycle the scheduler sees the records and says which schedule runs next.

One observed cycle here is every node running its own cycle once (the largest k steps); the trainer
observes whole job cycles (the least common multiple of the ks), which only adds samples.
"""
from __future__ import annotations

import json

import pytest

from _fake_clock import fake_records, slowed_job, true_models
from pipefisher.closed_loop import (AdaptiveScheduler, Plan, StaticScheduler, cycle_seconds, job_models,
                                    make_scheduler)
from pipefisher.examples import example_timelines
from pipefisher.measure import gap_overruns, planned_gaps, step_overrun
from pipefisher.policies import get_policy
from pipefisher.problem import DEFAULT_MARGIN
from pipefisher.rules import validate
from pipefisher.timeline import load_job, read_node_file

SLOW_KEY = "cov_kron_A:encoder.layer.3.attention.self.query"  # on node 1 of the example
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

    def cycle(self) -> tuple[list, Plan]:
        """One observed cycle: its records, and the plan the scheduler hands out next."""
        plan = self.scheduler.current
        records = fake_records(plan.data, self.models, self.step, max(plan.cycles))
        self.step += max(plan.cycles)
        self.scheduler.observe(records)
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
    loop = Loop(AdaptiveScheduler(initial, 4), job)
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
    loop = Loop(AdaptiveScheduler(initial, 4), slowed_job(job, {(1, SLOW_KEY): 2.0}))
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
    loop = Loop(AdaptiveScheduler(initial, 4), slowed_job(job, {(1, SLOW_KEY): 2.0}, every_kfac=1.2))
    for _ in range(3):
        loop.scheduler.observe(fake_records(loop.scheduler.current.data, loop.models, loop.step,
                                            max(loop.scheduler.current.cycles)))
        loop.step += max(loop.scheduler.current.cycles)
        state = json.loads(json.dumps(loop.scheduler.state_dict()))
        resumed = AdaptiveScheduler(initial, 4)
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
    loop = Loop(AdaptiveScheduler(initial, 4), slowed_job(job, every_kfac=3.0))
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
    loop = Loop(AdaptiveScheduler(initial, 4), slowed_job(job, every_kfac=0.5))
    plans = [loop.cycle()[1] for _ in range(8)]
    shorter = next(p for p in plans if "a shorter cycle, tried" in p.reason)
    assert max(shorter.cycles) < max(initial.cycles)
    assert plans[-1] is shorter and loop.scheduler.kept is shorter
    records, _ = loop.cycle()
    assert overrun(shorter, records) < NS


def _on_trial(job, initial, value_ratio: float, staleness=None):
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
    scheduler, trial = _on_trial(job, initial, 0.9)
    assert scheduler.staleness is None
    assert scheduler.value(trial) == scheduler.cost(trial) == pytest.approx(0.09)


def test_a_faster_step_with_staler_curvature_loses_where_the_staleness_costs_more(job, initial) -> None:
    """The closed loop's objective is the user's: step time x steps-to-target at the cycle's k."""
    from pipefisher.staleness import StalenessCurve

    steep = StalenessCurve(((1, 0.5), (4, 0.5), (5, 1.0), (64, 1.0)))
    scheduler, trial = _on_trial(job, initial, 1.0, staleness=steep)
    assert max(trial.cycles) > max(initial.cycles)  # more slack: a longer cycle
    # 5 % faster per step, but the longer cycle's curvature doubles the steps to the target
    scheduler.costs[trial.digest] = [0.095, 0.095]
    nxt = scheduler.next_schedule()
    assert nxt.digest == initial.digest and "back to the kept schedule" in nxt.reason
