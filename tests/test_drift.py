"""Curvature drift without torch (:mod:`pipefisher.drift`): a refresh's figures (drift, aging) from its
layers' samples, and the rule that turns refreshes' aging into the cycle k the closed loop runs at."""
from __future__ import annotations

import json
import math

import pytest

from pipefisher.drift import DriftRule, DriftSample, aging, refreshes, relative


def test_a_refresh_is_the_relative_change_of_the_whole_preconditioned_gradient():
    """Two layers: one moved by 3 in a step of norm 5 (ratio 0.6), one by 0 in a step of norm 1. The
    figure is sqrt((9 + 0) / (25 + 1)), the stacked gradient's relative change; each layer keeps its own."""
    samples = [DriftSample(4, 0, "0/a", 9.0, None, 25.0), DriftSample(4, 1, "1/b", 0.0, None, 1.0)]
    [r] = refreshes(samples)
    assert r.step == 4 and r.drift == pytest.approx(math.sqrt(9 / 26)) and r.aging is None
    assert r.layers == {"0/a": pytest.approx(0.6), "1/b": 0.0}
    assert relative(0.0, 0.0) == 0.0  # nothing preconditioned, nothing moved


def test_aging_is_how_much_more_the_preconditioner_moved_over_two_refreshes_than_over_one():
    """Refresh noise alone moves it as much over two refreshes as over one (aging 0); curvature that
    moves at a steady pace, ||P_n - P_{n-j}|| = j c, moves it 4x as much squared (aging 3). Layers add up
    before the ratio; a layer without a refresh two back is left out of it."""
    samples = [DriftSample(4, 0, "0/noise", 1.0, 1.0, 4.0), DriftSample(4, 0, "0/steady", 1.0, 4.0, 4.0),
               DriftSample(4, 1, "1/new", 9.0, None, 9.0)]
    [r] = refreshes(samples)
    assert r.layer_aging == {"0/noise": 0.0, "0/steady": 3.0, "1/new": None}
    assert r.aging == pytest.approx((5 - 2) / 2)
    assert r.drift == pytest.approx(math.sqrt(11 / 17))
    assert aging(0.0, 0.0) is None  # nothing moved: no ratio


def test_samples_group_into_refreshes_and_a_layer_measured_twice_counts_once():
    """A scheduled cycle's layers complete their refreshes at different steps: grouped by the cycle, the
    refresh is recorded at its last step. A Chimera pair (or a replica) measures the same layer at the same
    step: counted once. A node with a shorter cycle refreshes a layer twice in a job cycle: both count."""
    cycle = lambda step: 1 + (step - 1) // 4 * 4  # noqa: E731  (cycles of 4 from step 1)
    samples = [DriftSample(2, 0, "0/a", 1.0, 2.0, 4.0), DriftSample(2, 1, "0/a", 1.0, 2.0, 4.0),  # the same, twice
               DriftSample(3, 1, "1/b", 4.0, None, 4.0),
               DriftSample(6, 0, "0/a", 0.0, 1.0, 1.0), DriftSample(8, 0, "0/a", 1.0, 3.0, 1.0)]
    first, second = refreshes(samples, group=cycle)
    assert (first.step, second.step) == (3, 8)
    assert first.drift == pytest.approx(math.sqrt(5 / 8)) and first.layers == {"0/a": 0.5, "1/b": 1.0}
    assert first.aging == pytest.approx(1.0)  # 0/a only: (2 - 1) / 1
    assert second.drift == pytest.approx(math.sqrt(1 / 2)) and second.layers == {"0/a": pytest.approx(math.sqrt(0.5))}
    assert second.aging == pytest.approx(3.0)  # (1 + 3 - 1) / 1
    assert [r.step for r in refreshes(samples)] == [2, 3, 6, 8]  # by step (kfac mode)
    for sample in samples[:3]:
        assert DriftSample.from_state(json.loads(json.dumps(sample.state()))) == sample


def _feed(rule: DriftRule, *agings: float) -> list[int]:
    """Feed refreshes' aging one by one, taking every proposal; the cycle after each."""
    out = []
    for d in agings:
        rule.observe(d)
        proposal = rule.proposal()
        if proposal is not None:
            rule.moved(proposal[0])
        out.append(rule.cycle)
    return out


def test_the_cycle_doubles_while_the_drift_stays_low_and_halves_when_it_grows():
    rule = DriftRule(4, low=0.1, high=0.3, max_cycle=32, samples=2)
    # two low refreshes per doubling (the window starts afresh at every change), up to max_cycle
    assert _feed(rule, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05) == [4, 8, 8, 16, 16, 32, 32, 32]
    # the median of two decides: one high refresh among low ones is not enough
    assert _feed(rule, 0.5, 0.05) == [32, 32]
    assert _feed(rule, 0.5, 0.5, 0.5, 0.5) == [32, 16, 16, 8]
    rule.floor = 4
    assert _feed(rule, 0.9, 0.9, 0.9, 0.9) == [8, 4, 4, 4]  # never below the floor


def test_between_the_thresholds_the_cycle_holds():
    """Hysteresis: a drift in the band neither lengthens nor shortens, however long it lasts; a cycle
    whose drift is just above ``low`` (where doubling stopped) stays even if its double measured high."""
    rule = DriftRule(8, low=0.1, high=0.3, samples=2)
    assert _feed(rule, *[0.2] * 10) == [8] * 10
    assert _feed(rule, 0.08, 0.08) == [8, 16]
    assert _feed(rule, 0.35, 0.35) == [16, 8]  # too stale at 16
    assert _feed(rule, 0.15, 0.15, 0.15) == [8, 8, 8]  # at 8 it is in the band: it stays


def test_at_the_floor_the_rule_stops_proposing_a_shorter_cycle():
    rule = DriftRule(6, low=0.1, high=0.3, samples=1)
    rule.observe(0.5)
    assert rule.proposal() == (3, "curvature aging 0.500 (median of 1 refreshes at k = 6) above 0.3: a shorter cycle")
    rule.at_floor()  # nothing packs in fewer than 6
    rule.observe(0.5)
    assert rule.floor == 6 and rule.proposal() is None


def test_a_restored_rule_decides_as_the_uninterrupted_one():
    whole = DriftRule(4, low=0.1, high=0.3, samples=3)
    _feed(whole, 0.05, 0.05, 0.05, 0.05)  # doubled, one refresh into the next window
    restored = DriftRule(1, low=0.1, high=0.3, samples=3)
    restored.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert _feed(restored, 0.05, 0.05) == _feed(whole, 0.05, 0.05) == [8, 16]


@pytest.mark.parametrize("bad", [dict(low=0.3, high=0.1), dict(low=0.0), dict(high=math.inf), dict(samples=0),
                                 dict(max_cycle=0)])
def test_a_rule_without_a_band_is_refused(bad):
    with pytest.raises(ValueError, match="drift rule"):
        DriftRule(4, **{"low": 0.1, "high": 0.3, **bad})


def test_a_refresh_carries_its_layers_distances_to_the_refreshes_before_where_they_agree():
    """The rule trusts an aging only where every layer's refreshes one and two back were k and 2k steps
    before: after a switch that moved some layers' inverses within the cycle they are not."""
    same = [DriftSample(8, 0, "0/a", 1.0, 2.0, 4.0, (4, 8)), DriftSample(8, 1, "1/b", 1.0, 2.0, 4.0, (4, 8))]
    moved = [same[0], DriftSample(8, 1, "1/b", 1.0, 2.0, 4.0, (5, 9))]
    assert refreshes(same)[0].lags == (4, 8) and refreshes(moved)[0].lags is None
    assert refreshes([DriftSample(8, 0, "0/a", 1.0, None, 4.0, (4, 8))])[0].lags is None  # no aging to trust
