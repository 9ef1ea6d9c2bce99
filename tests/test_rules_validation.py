"""The dependency rules ``validate`` checks, and its room rules."""
from __future__ import annotations

import copy

import pytest

from conftest import COMPAT_CASES, case_timelines, small_node
from pipefisher.errors import InputError
from pipefisher.rules import validate
from pipefisher.schedule.file import load_schedule
from pipefisher.schedule.timeline import job_from_dicts, load_job

M = "layer.0"
GOOD = [[
    "-- start --", "call_forward", f"cov_kron_A:{M}", "call_forward", f"cov_kron_A:{M}",
    "call_backward", f"cov_kron_B:{M}", "call_backward", f"cov_kron_B:{M}",
    f"sync_kron_A:{M}", f"inv_kron_A:{M}", f"sync_kron_B:{M}", "-- end --", "turn_off_save_inputs_outgrads",
], [
    "-- start --", "call_forward", "call_forward", f"inv_kron_B:{M}", "call_backward", "call_backward",
    "-- end --", "turn_on_save_inputs_outgrads",
]]


@pytest.fixture
def job():
    return job_from_dicts([small_node(module=M)])


def rules(schedule, job) -> list[str]:
    return [v.rule for v in validate([schedule], job, room=False)]


def test_a_dependency_correct_two_iteration_cycle_passes(job) -> None:
    assert validate([GOOD], job, room=False) == []


def test_covariance_before_its_forward_or_backward_is_caught(job) -> None:
    s = copy.deepcopy(GOOD)
    s[0][1:9] = [
        f"cov_kron_A:{M}", "call_forward", "call_forward", f"cov_kron_A:{M}",  # piece 0 before forward 0
        "call_backward", f"cov_kron_B:{M}", f"cov_kron_B:{M}", "call_backward",  # piece 1 before backward 1
    ]
    got = validate([s], job, room=False)
    assert [v.rule for v in got] == ["cov-before-forward", "cov-before-backward"]
    assert str(got[0]) == (f"node0 iteration 0: cov_kron_A:{M}: cov-before-forward: "
                           "piece 0 needs forward 0 of the first iteration, which has not run yet")


def test_sync_before_all_pieces_and_inverse_before_sync_are_caught(job) -> None:
    s = copy.deepcopy(GOOD)
    s[0].remove(f"sync_kron_A:{M}")
    s[0].insert(3, f"sync_kron_A:{M}")
    assert rules(s, job) == ["sync-before-cov"]
    s = copy.deepcopy(GOOD)
    s[0].remove(f"inv_kron_A:{M}")
    s[0].insert(9, f"inv_kron_A:{M}")
    assert rules(s, job) == ["inv-before-sync"]


def test_inverse_without_sync_waits_for_all_pieces() -> None:
    d = small_node(module=M)
    del d[f"sync_kron_A:{M}"], d[f"sync_kron_B:{M}"]
    job = job_from_dicts([d])
    s = copy.deepcopy(GOOD)
    s[0].remove(f"sync_kron_A:{M}")
    s[0].remove(f"sync_kron_B:{M}")
    assert validate([s], job, room=False) == []
    s[0].remove(f"inv_kron_A:{M}")
    s[0].insert(4, f"inv_kron_A:{M}")
    assert rules(s, job) == ["inv-before-cov"]


def test_counts_markers_and_unknown_labels(job) -> None:
    s = copy.deepcopy(GOOD)
    s[1].remove(f"inv_kron_B:{M}")        # work missing
    s[1].append("cov_kron_A:layer.9")      # a module this node does not have
    s[1].remove("call_forward")            # an iteration without its whole pipeline step
    s[0].remove("turn_off_save_inputs_outgrads")
    got = {v.rule for v in validate([s], job, room=False)}
    assert got == {"work-count", "unknown-label", "pipeline-count", "save-off", "save-on"}


def test_collapsed_queue_is_a_count_violation(job) -> None:
    s = copy.deepcopy(GOOD)
    s[0] = [x for x in s[0] if x != f"cov_kron_A:{M}"]
    s[0].insert(-3, f"cov_kron_A:{M}")     # one label where two pieces are due
    got = [v for v in validate([s], job, room=False) if v.rule == "work-count"]
    assert len(got) == 1 and "appears 1 pieces in the cycle, the timeline asks for 2" in str(got[0])


def test_published_outputs_validate_only_where_the_published_tool_was_right() -> None:
    def valid(case, room):
        return validate(load_schedule(case / "expected_schedule.pickle"), load_job(case_timelines(case)),
                        room=room) == []

    by_name = {case.name: case for case in COMPAT_CASES}
    assert valid(by_name["case_05"], room=False) is True
    assert valid(by_name["case_01"], room=False) is False  # re-walking iteration 0: a cov_kron_B piece before any backward


def test_room_rules_catch_work_packed_into_time_a_bubble_does_not_have() -> None:
    # case_05 has float seconds: the published packer floors each covariance piece to 0.0 s and packs
    # them into the 24 us gaps between forwards, though each piece takes about 98 us
    case = next(c for c in COMPAT_CASES if c.name == "case_05")
    got = validate(load_schedule(case / "expected_schedule.pickle"), load_job(case_timelines(case)))
    assert got and {v.rule for v in got} == {"bubble-overfilled"}
    assert "of idle time precedes it" in str(got[0])


def test_room_rules_on_a_small_node() -> None:
    # forward [0, 10), backward [20, 30), pipeline time 100: a 10 bubble, then 70 after the backward
    d = {"start_end": [(0, 100)], "call_forward": [(0, 10)], "call_backward": [(20, 30)],
         "cov_kron_A:l": [(40, 48)], "inv_kron_A:l": [(50, 90)]}
    job = job_from_dicts([d])
    fits = [["-- start --", "call_forward", "cov_kron_A:l", "call_backward", "inv_kron_A:l", "-- end --",
             "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads"]]
    assert validate([fits], job) == []
    overfilled = [["-- start --", "call_forward", "cov_kron_A:l", "inv_kron_A:l", "call_backward", "-- end --",
                   "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads"]]
    assert [v.rule for v in validate([overfilled], job)] == ["bubble-overfilled"]
    assert validate([overfilled], job, room=False) == []
    # 8 + 40 + 40 after the backward: past the pipeline time, though an inverse fits the 70 bubble
    d2 = dict(d, **{"inv_kron_B:l": [(90, 130)]})
    job2 = job_from_dicts([d2])
    late = [["-- start --", "call_forward", "call_backward", "cov_kron_A:l", "inv_kron_A:l", "inv_kron_B:l",
             "-- end --", "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads"]]
    assert [v.rule for v in validate([late], job2)] == ["unforced-overflow"]


def _zero_bubble_node() -> dict:
    """Forwards [0, 10) and [100, 110), input-gradient passes B [110, 120) and [200, 210), and one
    deferred weight-gradient pass W [120, 180): bubbles [10, 100) and [180, 200) only."""
    return {"start_end": [(0, 240)], "call_forward": [(0, 10), (100, 110)], "call_backward": [(110, 120), (200, 210)],
            "call_backward:weight": [(120, 180)], "cov_kron_A:l": [(210, 220)], "cov_kron_B:l": [(220, 230)]}


def _cycle(first: list[str], second: list[str]) -> list[list[str]]:
    """A two-iteration cycle of ``first`` and ``second``'s labels between the markers."""
    return [["-- start --", *first, "-- end --", "turn_off_save_inputs_outgrads"],
            ["-- start --", *second, "-- end --", "turn_on_save_inputs_outgrads"]]


F, B, W, CA, CB = "call_forward", "call_backward", "call_backward:weight", "cov_kron_A:l", "cov_kron_B:l"
LATER = [F, F, B, W, CB, B]  # the second iteration: factor B's last piece in [180, 200)


def test_kfac_placed_over_a_weight_gradient_pass_is_refused() -> None:
    job = job_from_dicts([_zero_bubble_node()])
    assert validate([_cycle([F, CA, F, B, W, CA, CB, B], LATER)], job) == []  # both pieces fit [180, 200)
    # as packers that took W for idle time wrote it: the piece after B0 runs at [120, 125), over W
    over = {v.rule: str(v) for v in validate([_cycle([F, CA, F, B, CA, CB, B], LATER)], job)}
    assert "'call_backward:weight' at 120 ns..180 ns" in over["kfac-over-pipeline"]
    assert "pipeline-count" in over  # and W is missing from the iteration
    # with W listed after the work, the bubble before W has no room for it
    assert [v.rule for v in validate([_cycle([F, CA, F, B, CA, W, CB, B], LATER)], job)] == ["bubble-overfilled"]


def test_a_weight_gradient_pass_is_not_the_backward_factor_b_pieces_follow() -> None:
    job = job_from_dicts([_zero_bubble_node()])
    # factor B's second piece needs backward 1 (B1, [200, 210)); W0 before it is no backward
    early = _cycle([F, CA, F, B, W, CA, CB, CB, B], [F, F, B, W, B])
    assert [v.rule for v in validate([early], job, room=False)] == ["cov-before-backward"]


def _zb_v_node() -> dict:
    """A ZB-V node's two chunks (m = 2), with chunk 1's first W deferred: forwards of chunk 0 and 1,
    chunk 1's B passes [120, 130) and [250, 260), its W passes [130, 190) and [260, 270), then chunk 0's
    backwards (W merged) [280, 300); bubbles [20, 100), [190, 250) and [270, 280). Chunk 1's layer has
    two covariance pieces of 5 ns per factor."""
    return {"start_end": [(0, 330)], "call_forward": [(0, 10), (100, 110)],
            "call_forward:chunk1": [(10, 20), (110, 120)], "call_backward:chunk1": [(120, 130), (250, 260)],
            "call_backward:weight:chunk1": [(130, 190), (260, 270)], "call_backward": [(280, 290), (290, 300)],
            "cov_kron_A:l:chunk1": [(300, 310)], "cov_kron_B:l:chunk1": [(310, 320)]}


F1, B1, W1 = "call_forward:chunk1", "call_backward:chunk1", "call_backward:weight:chunk1"
CA1, CB1 = "cov_kron_A:l:chunk1", "cov_kron_B:l:chunk1"


def _one_iteration(labels: list[str]) -> list[list[str]]:
    return [["-- start --", *labels, "-- end --", "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads"]]


def test_kfac_placed_over_a_chunk_1_weight_gradient_pass_is_refused() -> None:
    job = job_from_dicts([_zb_v_node()])
    assert validate([_one_iteration([F, F1, CA1, F, F1, B1, W1, CA1, CB1, B1, W1, CB1, B, B])], job) == []
    # as a packer that took chunk 1's W passes for idle time would write it: the work after each B1
    # runs over the W pass that follows it
    got = validate([_one_iteration([F, F1, CA1, F, F1, B1, CA1, CB1, B1, CB1, B, B])], job)
    over = [v.detail for v in got if v.rule == "kfac-over-pipeline"]
    assert len(over) == 2
    assert "runs 130 ns..140 ns, over 'call_backward:weight:chunk1' at 130 ns..190 ns" in over[0]
    assert "runs 260 ns..265 ns, over 'call_backward:weight:chunk1' at 260 ns..270 ns" in over[1]
    assert ("call_backward:weight:chunk1", "pipeline-count") in [(v.label, v.rule) for v in got]


def test_chunk_1_factor_b_pieces_follow_its_b_passes_not_its_w_passes() -> None:
    """A piece of factor B may run between its micro-batch's B pass and that B's deferred W; a W pass
    is no backward, so a piece after W1 of micro-batch 0 but before B1 of micro-batch 1 is early."""
    job = job_from_dicts([_zb_v_node()])
    between = [F, F1, CA1, F, F1, B1, CB1, W1, CA1, B1, CB1, W1, B, B]
    assert validate([_one_iteration(between)], job, room=False) == []
    after_w = [F, F1, CA1, F, F1, B1, W1, CA1, CB1, CB1, B1, W1, B, B]
    got = validate([_one_iteration(after_w)], job, room=False)
    assert [(v.label, v.rule) for v in got] == [(CB1, "cov-before-backward")]
    assert got[0].detail == ("piece 1 needs backward 1 of the first iteration of chunk 1 ('call_backward:chunk1'), "
                             "which has not run yet")
    before_b = [F, F1, CA1, F, F1, CB1, B1, W1, CA1, B1, CB1, W1, B, B]
    assert [v.rule for v in validate([_one_iteration(before_b)], job, room=False)] == ["cov-before-backward"]


def test_node_count_mismatch_is_an_input_error(job) -> None:
    with pytest.raises(InputError, match="has 2 node schedules but the job has 1 timelines"):
        validate([GOOD, GOOD], job, "s.pickle")


# -- interleaved jobs: chunk j >= 1's keys end in ':chunk<j>' (the format spec's chunk format) -------


def _two_chunk_node() -> dict:
    """Chunk 0 (``layer.0``) and chunk 1 (``layer.1:chunk1``), two micro-batches each; chunk 1's
    forwards come after all of chunk 0's, so the node's overall forward count runs ahead of chunk 1's."""
    d = small_node(module="layer.0")
    d["call_forward:chunk1"] = [(2000, 2050), (2100, 2150)]
    d["call_backward:chunk1"] = [(2200, 2300), (2400, 2500)]
    for kind in ("cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B", "inv_kron_A", "inv_kron_B"):
        d[f"{kind}:layer.1:chunk1"] = [(3000, 3020)]
    return d


def _chunked(m0: str = "layer.0", m1: str = "layer.1:chunk1") -> list[str]:
    return [
        "-- start --", "call_forward", f"cov_kron_A:{m0}", "call_forward", f"cov_kron_A:{m0}",
        "call_backward", f"cov_kron_B:{m0}", "call_backward", f"cov_kron_B:{m0}",
        "call_forward:chunk1", f"cov_kron_A:{m1}", "call_forward:chunk1", f"cov_kron_A:{m1}",
        "call_backward:chunk1", f"cov_kron_B:{m1}", "call_backward:chunk1", f"cov_kron_B:{m1}",
        f"sync_kron_A:{m0}", f"sync_kron_B:{m0}", f"inv_kron_A:{m0}", f"inv_kron_B:{m0}",
        f"sync_kron_A:{m1}", f"sync_kron_B:{m1}", f"inv_kron_A:{m1}", f"inv_kron_B:{m1}",
        "-- end --", "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads",
    ]


def test_a_chunked_schedule_that_follows_each_chunks_calls_validates() -> None:
    assert validate([[_chunked()]], job_from_dicts([_two_chunk_node()]), room=False) == []


def test_covariance_before_the_forward_of_its_own_chunk_is_refused() -> None:
    """Chunk 0's two forwards have run, which would cover pieces 0 and 1 by the node's overall count;
    but chunk 1's layer sees only chunk 1's micro-batches."""
    it = _chunked()
    m1 = "cov_kron_A:layer.1:chunk1"
    it.remove(m1)
    it.remove(m1)
    at = it.index("call_forward:chunk1")
    it[at:at] = [m1, m1]  # both pieces after chunk 0's forwards, before chunk 1's first
    got = validate([[it]], job_from_dicts([_two_chunk_node()]), room=False)
    assert [v.rule for v in got] == ["cov-before-forward", "cov-before-forward"]
    assert got[0].detail == ("piece 0 needs forward 0 of the first iteration of chunk 1 ('call_forward:chunk1'), "
                             "which has not run yet")


def test_each_chunks_pipeline_calls_are_counted() -> None:
    it = _chunked()
    it.remove("call_backward:chunk1")
    got = validate([[it]], job_from_dicts([_two_chunk_node()]), room=False)
    assert ("call_backward:chunk1", "pipeline-count") in [(v.label, v.rule) for v in got]


def test_a_chunked_schedule_validates_with_room_and_packs_tightly() -> None:
    from pipefisher.policies import get_policy

    job = job_from_dicts([_two_chunk_node()])
    packed = get_policy("tight").pack(job)
    assert validate(packed.to_file_data(), job) == []


# ----------------------------------------------------------------------------------------------------
# Overlapping cycles (schedule metadata "overlap": true)

OVERLAPPING = [[
    ["-- start --", "call_forward", "call_backward", "inv_kron_B:l", "call_forward", "cov_kron_B:l", "call_backward",
     "-- end --", "turn_off_save_inputs_outgrads"],
    ["-- start --", "call_forward", "cov_kron_B:l", "sync_kron_B:l", "inv_kron_B:l", "call_backward", "call_forward",
     "inv_kron_B:l", "call_backward", "-- end --", "turn_on_save_inputs_outgrads"],
]]


def test_an_overlapping_cycle_is_valid_by_the_overlap_rule_only() -> None:
    from conftest import overlapping_node

    raw = overlapping_node()
    raw["inv_kron_B:l"] = [(0, 80), (0, 80), (0, 8)]
    job = job_from_dicts([raw])
    # the run before the sync is the previous refresh's last piece (8: it fits the bubble of 10)
    assert validate(OVERLAPPING, job, overlap=True) == []
    # by today's rules it is an inverse before its sync, and measured as the first piece (80) it overfills
    assert sorted(v.rule for v in validate(OVERLAPPING, job)) == ["bubble-overfilled", "inv-before-sync"]
    # the pieces after the completion are still measured in their order: 8 first does not fit there
    raw["inv_kron_B:l"] = [(0, 80), (0, 8), (0, 80)]
    assert [v.rule for v in validate(OVERLAPPING, job_from_dicts([raw]), overlap=True)] == ["bubble-overfilled"]
    # counts are checked as always
    short = copy.deepcopy(OVERLAPPING)
    short[0][0].remove("inv_kron_B:l")
    assert [v.rule for v in validate(short, job, overlap=True)] == ["work-count"]
