"""The ``compat`` policy reproduces the published packer: every vector, and the literal transcription."""
from __future__ import annotations

import pickle

import pytest

from conftest import COMPAT_CASES, case_timelines, small_node
from pipefisher.outputs.report import usage_lines
from pipefisher.policies import get_policy
from pipefisher.policies.compat_reference import ref_pack_job
from pipefisher.schedule.timeline import job_from_dicts, load_job
from pipefisher.sim.random_jobs import random_raw_job


@pytest.mark.parametrize("case", COMPAT_CASES, ids=lambda p: p.name)
def test_compat_matches_the_published_tool_label_for_label(case) -> None:
    schedule = get_policy("compat").pack(load_job(case_timelines(case)))
    expected = pickle.loads((case / "expected_schedule.pickle").read_bytes())
    assert schedule.to_file_data() == expected
    assert usage_lines(schedule) == (case / "expected_report.txt").read_text().splitlines()


@pytest.mark.parametrize("case", COMPAT_CASES, ids=lambda p: p.name)
def test_reference_transcription_matches_the_published_tool(case) -> None:
    schedules, lines = ref_pack_job(load_job(case_timelines(case)))
    assert schedules == pickle.loads((case / "expected_schedule.pickle").read_bytes())
    assert lines == (case / "expected_report.txt").read_text().splitlines()


@pytest.mark.parametrize("chunk", range(4))
def test_fast_compat_equals_the_literal_transcription_on_random_jobs(chunk: int) -> None:
    # Odd shapes on purpose: float seconds, bare and up-pipe keys, None times, several steps.
    policy = get_policy("compat")
    for seed in range(chunk * 150, (chunk + 1) * 150):
        job = job_from_dicts(random_raw_job(seed))
        schedules, lines = ref_pack_job(job)
        packed = policy.pack(job)
        assert packed.to_file_data() == schedules, f"seed {seed}"
        assert usage_lines(packed) == lines, f"seed {seed}"


def test_float_seconds_floor_covariance_pieces_to_nothing() -> None:
    # A known flaw kept on purpose: (e - s) // n on seconds is 0.0, so pieces have no length.
    d = {k: [(s / 1e9, e / 1e9) for s, e in v] for k, v in small_node().items()}
    node = get_policy("compat").pack(job_from_dicts([d])).nodes[0]
    pieces = [p for p in node.placements if p.label.startswith("cov_kron")]
    assert len(pieces) == 4 and all(p.duration == 0 for p in pieces)


def test_figures_break_usage_down() -> None:
    job = job_from_dicts([small_node()])
    f = get_policy("compat").pack(job).nodes[0].figures
    assert f.iterations == 1
    assert f.pipeline_busy == 2 * 100 + 2 * 200
    assert f.kfac_placed == 6 * 20
    assert f.cycle_time == job.span
    assert f.bubble_left == job.span - f.pipeline_busy - f.kfac_placed
    assert f.usage == pytest.approx((f.pipeline_busy + f.kfac_placed) / job.span * 100)


def test_giving_up_early_never_drops_a_shorter_cycle():
    """``pack_node_slots_below`` is the full construction, or None only when the cycle would reach
    the limit anyway (or end by appending work as it stands, which is never an honest cycle)."""
    from pipefisher.policies.compat import pack_node_slots, pack_node_slots_below
    from pipefisher.schedule.format import END
    from pipefisher.schedule.packed import split_iterations

    early = 0
    for seed in range(0, 240, 3):
        job = job_from_dicts(random_raw_job(seed))
        for node in job.nodes:
            full = pack_node_slots(node, job.span)
            k = len(split_iterations(full))
            for limit in (k - 3, k - 1, k, k + 1, k + 5):
                below = pack_node_slots_below(node, job.span, limit)
                if below is not None:
                    assert below == full
                    continue
                if k < limit:  # only a cycle that appended unplaced work as it stands, after its last end
                    last_end = max(i for i, s in enumerate(full) if s[0] == END)
                    assert any(s[0].startswith(("cov", "sync", "inv")) for s in full[last_end:])
                early += limit <= k
    assert early > 50  # and it does give up on cycles that reach the limit


def test_the_room_argument_on_integer_gaps_answers_as_the_walk_over_them():
    """``_cannot_finish_integral`` (a bisect and running sums per need) gives the walk's answer on
    integer gap lengths, at every need, with and without an added iteration's gaps."""
    import random

    from pipefisher.policies.compat import _cannot_finish, _cannot_finish_integral, _Lengths

    rng = random.Random(7)
    answers = set()
    for _ in range(3000):
        live = sorted((rng.randrange(0, 400) for _ in range(rng.randrange(0, 30))), reverse=True)
        fresh = sorted((rng.randrange(0, 400) for _ in range(rng.randrange(0, 8))), reverse=True)
        needs = sorted({rng.randrange(1, 300) * 1.05 for _ in range(rng.randrange(1, 8))}, reverse=True)
        work = [(need, rng.randrange(1, 900)) for need in needs]
        left = rng.randrange(0, 4)
        tolerance = rng.choice([0.0, 1e-9 * (sum(live) + sum(a for _, a in work))])
        for margin in (0.05, 0.5):
            walked = _cannot_finish(work, live, fresh, left, margin, tolerance)
            assert _cannot_finish_integral(work, _Lengths(live), _Lengths(fresh), left, margin, tolerance) == walked
            answers.add(walked)
    assert answers == {True, False}
