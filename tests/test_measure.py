"""Measured steps (:mod:`pipefisher.cost.measure`): gaps, planned placements, overruns, measured timelines and
the per-instruction CSV, on hand-made records and on the fake clock (:mod:`_fake_clock`) running the
bundled example job."""
from __future__ import annotations

from typing import Sequence

import pytest

from _fake_clock import FakeRecorder, fake_records, period, slowed_job, true_models
from pipefisher.bundled import example_timelines
from pipefisher.cost.measure import (CSV_COLUMNS, END, START, LabelTime, StepRecord, append_csv, cycle_summary,
                                     gap_overruns, gaps, instruction_rows, is_pipeline, lay_out, measured_timeline,
                                     planned_gaps, read_csv, step_overrun, window_timelines)
from pipefisher.errors import InputError
from pipefisher.policies import get_policy
from pipefisher.rules import validate
from pipefisher.schedule.format import MARKERS
from pipefisher.schedule.problem import DEFAULT_MARGIN, node_model
from pipefisher.schedule.timeline import load_job, job_from_dicts

SLOW_KEY = "cov_kron_A:encoder.layer.3.attention.self.query"  # on node 1 of the example
TIGHT = get_policy("tight")


@pytest.fixture(scope="module")
def job():
    return load_job(example_timelines())


@pytest.fixture(scope="module")
def packed(job):
    return TIGHT.pack(job, DEFAULT_MARGIN)


def seconds(gap_list):
    """Planned gaps of a model in nanoseconds, as the seconds the records are in."""
    return [g / 1e9 for g in gap_list]


def step_of(node, records, step):
    return next(r for r in records if r.node == node and r.step == step)


# ----------------------------------------------------------------------------------------------------
# Gaps


def test_a_gap_is_exact_where_the_call_waited_or_nothing_ran_before_it() -> None:
    """Where K-FAC work ran and the call did not wait, the input came at some point during the work: the
    gap seen is only an upper bound on the bubble."""
    record = StepRecord(0, 0, 1, 0, (
        LabelTime(START, 0.0, 0.0),
        LabelTime("call_forward", 0.0, 0.012, wait=0.002),   # waited, nothing before it
        LabelTime("cov_kron_A:l", 0.012, 0.017),
        LabelTime("call_forward", 0.017, 0.030, wait=0.003),  # work ran, and it still waited
        LabelTime("cov_kron_A:l", 0.030, 0.035),
        LabelTime("call_backward", 0.035, 0.045),             # work ran, no wait: the work overran
        LabelTime("call_backward", 0.045, 0.055),             # back to back, nothing before it
        LabelTime(END, 0.055, 0.056),
    ))
    got = gaps(record)
    assert [g.exact for g in got] == [True, True, False, True, True]
    assert [round(g.seen, 9) for g in got] == [0.002, 0.008, 0.005, 0.0, 0.0]
    assert [round(g.kfac, 9) for g in got] == [0.0, 0.005, 0.005, 0.0, 0.0]
    # the overrun is counted only where the work kept the call waiting past the plan
    assert [round(x, 9) for x in gap_overruns(record, [0.002, 0.008, 0.004, 0.0, 0.0])] == [0, 0, 0.001, 0, 0]


# ----------------------------------------------------------------------------------------------------
# Planned placements


@pytest.mark.parametrize("slower", [1.0, 3.0], ids=["profiled", "kfac-3x-with-overflow"])
def test_lay_out_of_a_packed_schedule_is_the_packers_placement(job, slower) -> None:
    """The runtime's plan and the packer's agree on every call and every item placed in a bubble; forced
    overflow (work that fits no bubble) the packer puts at the pipeline time, the runtime runs it right
    after the label before it."""
    j = slowed_job(job, every_kfac=slower)
    schedule = TIGHT.pack(j, DEFAULT_MARGIN)
    overflow = 0
    for n, (node, model) in enumerate(zip(schedule.nodes, true_models(j))):
        by_iteration: dict[int, list] = {}
        for p in node.placements:
            by_iteration.setdefault(p.iteration, []).append(p)
        for i, placed in enumerate(lay_out(node.iterations, model)):
            theirs = by_iteration[i]
            assert [p.label for p in placed] == [p.label for p in theirs]
            for k, (mine, packer) in enumerate(zip(placed, theirs)):
                if mine.label in MARKERS:
                    continue
                if packer.end > model.base:  # forced overflow
                    overflow += 1
                    assert mine.start == placed[k - 1].end
                    continue
                assert (mine.start, mine.end) == (packer.start, packer.end), (n, i, mine.label)
    assert (overflow > 0) == (slower > 1)


def placed_figures(iterations, model) -> tuple[list[float], list[float]]:
    """Per iteration, from :func:`lay_out`'s placements: the node's pipeline time plus each call's delay
    beyond the one before it plus what runs past the pipeline time; and where the last label before
    ``-- end --`` ends (what :func:`planned_iterations` works out without placing anything)."""
    times, ready = [], []
    planned = {}
    for key, s, _ in model.pipeline:
        planned.setdefault(key, []).append(float(s))
    for placed in lay_out(iterations, model):
        seen: dict[str, int] = {}
        delay = grown = end = 0.0
        for p in placed:
            if p.label in planned:
                n = seen.get(p.label, 0)
                seen[p.label] = n + 1
                d = p.start - planned[p.label][n % len(planned[p.label])]
                grown += max(0.0, d - delay)
                delay = d
            end = max(end, p.end)
        times.append(float(model.base) + grown + max(0.0, end - float(model.base) - delay))
        cut = next((i for i, p in enumerate(placed) if p.label == END), len(placed))
        ready.append(max((p.end for p in placed[:cut]), default=0.0))
    return times, ready


def packed_jobs():
    """Jobs of every pipeline shape, packed at a dense and a sparse margin, on models whose K-FAC runs
    1.1x its profiled time (so that work outgrows its bubbles): (name, node schedules, models)."""
    from _realistic_jobs import realistic_family
    from pipefisher.bundled import cost_model_path
    from pipefisher.cost.objective import slowed_models
    from pipefisher.sim import load_cost_model, simulate_timelines

    jobs = list(realistic_family(every=24))
    model = load_cost_model(cost_model_path("bert-base-4stages"))
    for order in ("interleaved", "chimera", "zb-h1", "zb-v", "dualpipev"):
        timelines, _ = simulate_timelines(model, order, None, 8)
        jobs.append((order, job_from_dicts(timelines)))
    for name, j in jobs:
        models = slowed_models(j)
        for margin in (DEFAULT_MARGIN, 2.0):
            yield f"{name} margin {margin}", TIGHT.pack(j, margin).nodes, models


def test_planned_iterations_are_the_placements_figures_from_labels_or_layout() -> None:
    from pipefisher.cost.measure import iteration_time, planned_iterations

    layouts = 0
    for name, nodes, models in packed_jobs():
        for node, model in zip(nodes, models):
            want = placed_figures(node.iterations, model)
            assert planned_iterations(node.iterations, model) == want, name
            assert iteration_time(node.iterations, model) == want[0], name
            if node.layout is not None:
                layouts += 1
                assert planned_iterations(node.iterations, model, node.layout) == want, name
    assert layouts > 50


@pytest.mark.parametrize("slower", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("margin", [DEFAULT_MARGIN, 2.0])
def test_calls_that_overlap_delay_the_next_one_from_labels_or_layout(slower, margin) -> None:
    """A node whose calls overlap (a profile's own jitter): a call starts when the one before it ends, a
    delay the layout's evaluation must not skip though no K-FAC work comes before it."""
    from pipefisher.cost.measure import planned_iterations
    from pipefisher.cost.objective import slowed_models

    node = {"call_forward": [(0, 100), (80, 200), (400, 500)], "call_backward": [(600, 700), (650, 800), (900, 1000)],
            "cov_kron_A:l": [(0, 90)], "cov_kron_B:l": [(0, 60)], "inv_kron_A:l": [(0, 150)],
            "inv_kron_B:l": [(0, 120)], "cov_kron_A:m": [(0, 30)], "cov_kron_B:m": [(0, 33)],
            "inv_kron_A:m": [(0, 250)], "inv_kron_B:m": [(0, 80)]}
    overlapping = job_from_dicts([node])
    (model,) = slowed_models(overlapping, slower)
    (packed_node,) = TIGHT.pack(overlapping, margin).nodes
    want = placed_figures(packed_node.iterations, model)
    assert min(want[0]) > model.base  # the overlaps delay every iteration
    assert planned_iterations(packed_node.iterations, model) == want
    assert planned_iterations(packed_node.iterations, model, packed_node.layout) == want


def test_an_overlapping_cycle_s_inverse_runs_take_their_own_pieces_in_the_plan() -> None:
    """Issue 46: the j-th run of an inverse label after its factor's completion runs piece j, and in an
    overlapping cycle the runs before it are the previous refresh's last pieces (the packing problem's rule,
    as the executor runs them). Planned placements, and the figures from labels or layout, give each run its
    own piece's length: here iteration 0's run is piece 2 (30), not piece 0 (80)."""
    import random

    from conftest import overlapping_node
    from pipefisher.cost.measure import planned_iterations
    from pipefisher.cost.objective import slowed_models

    raw = overlapping_node()
    raw["inv_kron_B:l"] = [(0, 80), (0, 70), (0, 30)]
    job = job_from_dicts([raw])
    packed = get_policy("tight", overlap=True).pack(job)
    (node,) = packed.nodes
    assert validate(packed.to_file_data(), job, overlap=True) == []
    assert node.iterations[0].count("inv_kron_B:l") == 1  # before the completion (iteration 1's sync)
    (slowed,) = slowed_models(job, 0.3)  # the plan's models carry no overlap flag: the rule holds regardless
    for model in (node_model(job.nodes[0], job.span, overlap=True), slowed):
        pieces = model.durations["inv_kron_B:l"]
        runs = [p.end - p.start for it in lay_out(node.iterations, model) for p in it if p.label == "inv_kron_B:l"]
        assert runs == [pieces[2], pieces[0], pieces[1]]
        want = placed_figures(node.iterations, model)
        assert planned_iterations(node.iterations, model) == want
        assert planned_iterations(node.iterations, model, node.layout) == want
    # at 1.3x the 30 piece (39) fits iteration 0's first bubble (100): no delay; the 80 one (104) would not
    assert want[0][0] == slowed.base
    rng = random.Random(3)  # any order of the labels: the labels' figures are still the placements'
    for _ in range(20):
        labels = [list(it) for it in node.iterations]
        for it in labels:
            rng.shuffle(it)
        assert planned_iterations(labels, slowed) == placed_figures(labels, slowed)


def test_planned_iterations_of_any_label_order_are_the_placements_figures(job, packed) -> None:
    """Labels a policy would never write: calls out of order or missing, ``-- end --`` early or twice,
    work after it, labels no model knows, an empty iteration, times in float seconds."""
    import random

    from pipefisher.cost.measure import planned_iterations

    rng = random.Random(7)
    for n, node in enumerate(packed.nodes):
        model = node_model(job.nodes[n], job.span)
        labels = [list(it) + ["no_such_label"] for it in node.iterations]
        for it in labels:
            rng.shuffle(it)
        labels.append([])
        assert planned_iterations(labels, model) == placed_figures(labels, model)
    seconds_job = job_from_dicts([{"call_forward": [(0.0, 0.1), (0.15, 0.25)],
                                   "call_backward": [(0.5, 0.7), (0.75, 0.9)],
                                   "cov_kron_A:l": [(0.0, 0.125)], "inv_kron_A:l": [(0.0, 0.3)]}])
    model = node_model(seconds_job.nodes[0], seconds_job.span)
    labels = [[START, "call_forward", "cov_kron_A:l", "call_forward", "inv_kron_A:l", "call_backward",
               "call_backward", END]] * 2
    mine, want = planned_iterations(labels, model), placed_figures(labels, model)
    assert mine[0] == pytest.approx(want[0]) and mine[1] == pytest.approx(want[1])


# ----------------------------------------------------------------------------------------------------
# Measured timelines


def test_measured_timeline_of_an_unchanged_job_gives_back_its_pipeline_and_idle_time(job, packed) -> None:
    """Running the profile's own schedule on the profile: the measured job has the profile's calls and
    the same idle time per node, and a schedule packed on it runs without an overrun."""
    models = true_models(job)
    data = packed.to_file_data()
    records = fake_records(data, models, first_step=1, steps=8)
    for planned in (models, None):  # with the plan, its head bubbles are kept; without, all idle is a tail
        measured = job_from_dicts(window_timelines(records, len(models), planned))
        assert measured.span == job.span
        for n, (node, model) in enumerate(zip(measured.nodes, models)):
            mm = node_model(node, measured.span)
            assert [e - s for _, s, e in mm.pipeline] == [e - s for _, s, e in model.pipeline]
            assert abs((mm.base - mm.pipeline_busy) - (model.base - model.pipeline_busy)) <= len(model.pipeline)
            if planned is not None:
                assert [b.length for b in mm.bubbles] == [b.length for b in model.bubbles]
            for w in model.work:  # every K-FAC key as long as profiled (a covariance key: all its pieces)
                got = node.intervals(w.label)[0]
                assert abs(got.duration - sum(w.pieces)) <= len(w.pieces)

    repacked = TIGHT.pack(measured, DEFAULT_MARGIN)
    assert validate(repacked.to_file_data(), measured) == []
    again = fake_records(repacked.to_file_data(), models, first_step=9, steps=8)
    planned_on = [node_model(node, measured.span) for node in measured.nodes]
    assert all(step_overrun(r, seconds(planned_gaps(planned_on[r.node]))) < 1e-9 for r in again)


def test_an_item_twice_as_slow_overruns_exactly_where_it_is_placed(job, packed) -> None:
    """The overrun points at the gap that holds the slowed item, by how much its work outgrew the
    bubble; every other gap, node and iteration shows none."""
    models = true_models(job)
    slow = true_models(slowed_job(job, {(1, SLOW_KEY): 2.0}))
    data = packed.to_file_data()
    records = fake_records(data, slow, first_step=1, steps=len(data[1]))
    hit = 0
    for r in records:
        planned = seconds(planned_gaps(models[r.node]))
        over = gap_overruns(r, planned)
        holding = set()  # gaps (pipeline calls before the label) that run the slowed key
        calls = 0
        for label in data[r.node][r.iteration]:
            calls += is_pipeline(label)
            if r.node == 1 and label == SLOW_KEY:
                holding.add(calls)
        assert all(x == 0 for i, x in enumerate(over) if i not in holding), (r.node, r.iteration)
        for g, x in zip(gaps(r), over):
            if x > 0:
                hit += 1
                assert x == pytest.approx(g.kfac - planned[g.index], abs=1e-9)
    assert hit > 0


def test_one_outlier_step_does_not_move_the_median(job, packed) -> None:
    """A step that ran twice as slow (a hiccup) leaves the q=0.5 timeline as it was; q=1 follows it.
    Syncs and inverses run once per cycle, so the window holds five cycles: three samples of a key are
    the fewest whose median ignores one outlier."""
    models = true_models(job)
    records = fake_records(packed.to_file_data(), models, first_step=1, steps=5 * len(packed.nodes[1].iterations))
    clean = [r for r in records if r.node == 1]
    hiccup = StepRecord(1, 0, clean[2].step, clean[2].iteration,
                        tuple(LabelTime(lt.label, 2 * lt.start, 2 * lt.end, 2 * lt.wait) for lt in clean[2].labels))
    noisy = clean[:2] + [hiccup] + clean[3:]

    def durations(timeline):
        return {k: [e - s for s, e in v] for k, v in timeline.items()}

    assert durations(measured_timeline(noisy, models[1])) == durations(measured_timeline(clean, models[1]))
    top = [durations(measured_timeline(r, models[1], q=1.0)) for r in (noisy, clean)]
    assert top[0] != top[1]


def test_the_fake_recorder_records_what_fake_records_fakes_even_resumed(job, packed) -> None:
    """The fixture's two faces agree: driven label by label as the executor drives a recorder, it gives
    :func:`fake_records`' records; a fresh recorder (a resumed run) from a later step gives the same."""
    models = true_models(job)
    data = packed.to_file_data()
    expected = fake_records(data, models, first_step=3, steps=6, end_seconds=0.004)

    def drive(recorder, node, steps):
        out, ran = [], []
        calls = [[recorder.wrap(label, lambda label=label: ran.append(label)) for label in it] for it in data[node]]
        for step in steps:
            recorder.begin_step(step, (step - 3) % len(data[node]))
            for call in calls[(step - 3) % len(data[node])]:
                call()
            out.append(recorder.end_step())
        return out, ran

    for node in range(len(models)):
        def recorder():
            return FakeRecorder(node, 0, models[node], period(models), lambda: data[node], end_seconds=0.004)
        got, ran = drive(recorder(), node, range(3, 9))
        assert got == [r for r in expected if r.node == node]
        assert ran == [label for r in got for label in (lt.label for lt in r.labels)]  # every call ran
        assert drive(recorder(), node, range(6, 9))[0] == got[3:]


def test_the_fake_clock_runs_each_inverse_piece_at_its_own_length_in_whichever_step() -> None:
    """Issue 46: the fake clock numbers a key's runs over the node's cycle, an inverse's from its factor's
    completion (the packing problem's rule, as ``lay_out`` and the executor count), not within the step:
    an overlapping cycle's refresh of unequal pieces runs piece 2 in iteration 0, pieces 0 and 1 in
    iteration 1, each at its own length, recorded or driven label by label."""
    from conftest import overlapping_node

    raw = overlapping_node()
    raw["inv_kron_B:l"] = [(0, 80), (0, 70), (0, 30)]
    job = job_from_dicts([raw])
    data = get_policy("tight", overlap=True).pack(job).to_file_data()
    models = true_models(job)
    records = fake_records(data, models, first_step=1, steps=4)
    runs = [lt.end - lt.start for r in records for lt in r.labels if lt.label == "inv_kron_B:l"]
    assert runs == pytest.approx([30e-9, 80e-9, 70e-9] * 2)
    planned = [p.end - p.start for it in lay_out(data[0], models[0]) for p in it if p.label == "inv_kron_B:l"]
    assert runs == pytest.approx([d * 1e-9 for d in planned] * 2)
    recorder = FakeRecorder(0, 0, models[0], period(models), lambda: data[0])
    driven = []
    for step in range(1, 5):
        recorder.begin_step(step, (step - 1) % len(data[0]))
        for label in data[0][(step - 1) % len(data[0])]:
            recorder.wrap(label, lambda: None)()
        driven.append(recorder.end_step())
    assert driven == records


# ----------------------------------------------------------------------------------------------------
# Per-instruction CSV


def test_csv_round_trip(tmp_path, job, packed) -> None:
    """What the runtime appends step by step reads back as the records it wrote (planned times are for
    people and plots, not read back)."""
    models = true_models(job)
    data = packed.to_file_data()
    records = fake_records(data, models, first_step=1, steps=2)
    path = tmp_path / "run_measurements.csv"
    for r in records:
        append_csv(path, instruction_rows(r, lay_out(data[r.node], models[r.node])[r.iteration]))
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(CSV_COLUMNS) and lines.count(lines[0]) == 1
    assert len(lines) == 1 + sum(len(r.labels) for r in records)
    assert all(row.split(",")[5] != "" for row in lines[1:])  # every label has its planned start
    back = read_csv(path)
    assert sorted(back, key=lambda r: (r.step, r.node)) == sorted(records, key=lambda r: (r.step, r.node))


def test_a_bad_csv_is_an_input_error_naming_the_file(tmp_path) -> None:
    not_ours = tmp_path / "other.csv"
    not_ours.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(InputError, match="other.csv.*no column 'node'"):
        read_csv(not_ours)
    bad_row = tmp_path / "bad.csv"
    append_csv(bad_row, [(0, 0, 1, 0, START, "", "", "0.0", "0.0", "0.0"),
                         (0, 0, 1, 0, END, "", "", "soon", "0.1", "0.0")])
    with pytest.raises(InputError, match=r"bad.csv: line 3"):
        read_csv(bad_row)
    with pytest.raises(InputError, match="missing.csv"):
        read_csv(tmp_path / "missing.csv")


def test_a_cycle_summary_says_what_each_label_took_and_where_work_overran() -> None:
    """Two steps of one node: a bubble seen exactly once (the call waited) and once overrun (it did not):
    the summary keeps the exact sighting, and the overrun past the planned bubble."""
    def step(s: int, cov_end: float, wait: float) -> StepRecord:
        return StepRecord(0, 0, s, s - 1, (
            LabelTime("-- start --", 0.0, 0.0), LabelTime("call_forward", 0.0, 0.010),
            LabelTime("cov_kron_A:l", 0.010, cov_end), LabelTime("call_backward", cov_end, cov_end + 0.020 + wait, wait),
            LabelTime("-- end --", cov_end + 0.020 + wait, cov_end + 0.021 + wait)))

    records = [step(1, 0.014, 0.002), step(2, 0.019, 0.0)]
    out = cycle_summary(records, planned=[0.0, 0.006, 0.0])
    assert out["node"] == 0 and out["steps"] == [1, 2]
    assert out["kfac_seconds"] == {"cov_kron_A:l": pytest.approx(0.0065)}
    assert out["bubble_seconds"][1] == pytest.approx(0.006)  # 4 ms of work + 2 ms waited: the bubble
    assert out["overrun_seconds"][1] == pytest.approx(0.003)  # 9 ms of work, no wait, 6 ms planned
    assert out["step_seconds"] == pytest.approx((0.037 + 0.040) / 2)
    assert cycle_summary(records)["overrun_seconds"] is None


def test_planned_bubbles_are_compared_in_seconds_whatever_the_profile_unit() -> None:
    """Profiles hold integer nanoseconds, hand-made ones may hold float seconds: the same bubble either way."""
    from pipefisher.cost.measure import planned_gap_seconds, unit_seconds
    from pipefisher.schedule.problem import node_model
    from pipefisher.schedule.timeline import job_from_dicts

    def gaps_of(scale, cast):
        raw = {"call_forward": [(cast(0 * scale), cast(1 * scale))], "call_backward": [(cast(3 * scale), cast(5 * scale))],
               "cov_kron_A:l": [(cast(5 * scale), cast(6 * scale))], "start_end": [(cast(0), cast(6 * scale))]}
        job = job_from_dicts([raw])
        model = node_model(job.nodes[0], job.span)
        return unit_seconds(model), planned_gap_seconds(model)

    ns_unit, ns_gaps = gaps_of(10**9, int)
    s_unit, s_gaps = gaps_of(1.0, float)
    assert (ns_unit, s_unit) == (1e-9, 1.0)
    assert ns_gaps == pytest.approx(s_gaps) and s_gaps[1] == pytest.approx(2.0)


# ----------------------------------------------------------------------------------------------------
# Inverses in pieces


def _piece_step(step: int, iteration: int, kfac: Sequence[tuple[str, float]]) -> StepRecord:
    """One step of a node: a forward, the K-FAC ``kfac`` (label, seconds) back to back, a backward."""
    labels, t = [LabelTime(START, 0.0, 0.0), LabelTime("call_forward", 0.0, 0.010)], 0.010
    for label, d in kfac:
        labels.append(LabelTime(label, t, t + d))
        t += d
    labels += [LabelTime("call_backward", t, t + 0.010), LabelTime(END, t + 0.010, t + 0.010)]
    return StepRecord(0, 0, step, iteration, tuple(labels))


def _inverse_lengths(timeline: dict, key: str = "inv_kron_A:l") -> list[int]:
    return [e - s for s, e in timeline[key]]


def test_an_inverse_in_pieces_keeps_its_pieces_each_at_its_own_quantile() -> None:
    """A refresh in 2 pieces (4 ms and 1 ms, run in the cycle's two steps after the factor's completion,
    its covariance): the measured timeline has 2 intervals in piece order, as profiles have it, not one
    of the median over both; a re-pack of it then holds the 2 labels per cycle the runtime runs."""
    records = []
    for c in range(3):
        jitter = 1e-4 * c
        records += [_piece_step(1 + 2 * c, 0, [("cov_kron_A:l", 0.001), ("inv_kron_A:l", 0.004 + jitter)]),
                    _piece_step(2 + 2 * c, 1, [("inv_kron_A:l", 0.001 + jitter)])]
    timeline = measured_timeline(records)
    assert _inverse_lengths(timeline) == [4_100_000, 1_100_000]
    assert _inverse_lengths(timeline, "cov_kron_A:l") == [1_000_000]  # one piece: one interval, as before
    model = node_model(job_from_dicts([timeline]).nodes[0], 10**9)
    assert model.durations["inv_kron_A:l"] == (4_100_000, 1_100_000)


def test_a_piece_before_the_completion_continues_the_cycle_before_only_where_one_ran() -> None:
    """Overlapping cycles: the run before the completion is the previous refresh's last piece (1 ms); in
    the schedule's first cycle K-FAC skips it (10 us), and it is no piece at all."""
    def cycle(c: int, before: float) -> list[StepRecord]:
        return [_piece_step(1 + 2 * c, 0, [("inv_kron_A:l", before), ("cov_kron_A:l", 0.001)]),
                _piece_step(2 + 2 * c, 1, [("inv_kron_A:l", 0.004)])]
    timeline = measured_timeline(cycle(0, 1e-5) + cycle(1, 0.001))
    assert _inverse_lengths(timeline) == [4_000_000, 1_000_000]


def test_pieces_never_identified_are_as_planned() -> None:
    """No whole cycle in the records (one step of iteration 1): a key in pieces keeps the plan's pieces."""
    plan = {"call_forward": [(0, 10_000_000)], "call_backward": [(10_000_000, 20_000_000)],
            "inv_kron_A:l": [(0, 3_000_000), (3_000_000, 5_000_000)]}
    planned = node_model(job_from_dicts([plan]).nodes[0], 20_000_000)
    timeline = measured_timeline([_piece_step(5, 1, [("inv_kron_A:l", 0.004)])], planned)
    assert _inverse_lengths(timeline) == [3_000_000, 2_000_000]
