"""Report formats: the published usage line, the workload listing, JSON data."""
from __future__ import annotations

import json

from conftest import small_node
from pipefisher.outputs.report import report_data, usage_lines, workload_lines
from pipefisher.policies import get_policy
from pipefisher.schedule.timeline import job_from_dicts


def test_usage_line_is_the_published_format() -> None:
    job = job_from_dicts([small_node(), small_node(offset=10)])
    lines = usage_lines(get_policy("compat").pack(job))
    assert lines[0].startswith("node0:1 pipeline iterations (usage: ") and lines[0].endswith(" %)")
    assert lines[1].startswith("node1:")


def test_workload_listing_shows_bubbles_between_items() -> None:
    job = job_from_dicts([small_node()])
    lines = list(workload_lines(get_policy("compat").pack(job)))
    bubbles = [line for line in lines if "(bubble)" in line]
    assert bubbles, lines
    assert "duration=" in bubbles[0]


def test_report_data_is_json_and_float_seconds_say_so() -> None:
    d = {k: [(s / 1e9, e / 1e9) for s, e in v] for k, v in small_node().items()}
    job = job_from_dicts([d])
    data = report_data(get_policy("compat").pack(job), job)
    json.dumps(data)
    assert data["time_unit"] == "seconds"
    assert data["nodes"][0]["timeline"] == "<node0>"


def test_a_bound_says_the_margin_it_holds_at_and_overflow_is_given_per_step() -> None:
    from pipefisher.outputs.report import usage_line
    from pipefisher.schedule.packed import NodeFigures, NodeSchedule

    node = NodeSchedule((), (), NodeFigures(3, 88.49, 0, 0, 0, 0, overflow=224_768_000, lower_bound=3))
    assert usage_line(0, node, 2.0) == ("node0:3 pipeline iterations (usage: 88.49 %) [lower bound 3 at margin 2, "
                                        "optimal; overflow 74.923 ms per step, 224.768 ms per cycle]")
    gap = NodeSchedule((), (), NodeFigures(7, 80.0, 0, 0, 0, 0, lower_bound=6))
    assert usage_line(1, gap, 0.05).endswith("[lower bound 6 at margin 0.05, gap 1]")
    packed = get_policy("tight").pack(job_from_dicts([small_node()]), 0.3)
    assert "at margin 0.3" in usage_lines(packed)[0]


def test_the_report_separates_kfac_in_bubbles_from_the_update_at_the_steps_end() -> None:
    from pipefisher.bundled import cost_model_path
    from pipefisher.sim import load_cost_model, simulate_timelines
    from pipefisher.sim.costs import NS_PER_MS

    model = load_cost_model(cost_model_path("bert-base-4stages"))
    prec = round(3 * model.block_prec_ms * NS_PER_MS)  # 3 layers per node: 20.416 ms
    job = job_from_dicts(simulate_timelines(model, "1f1b")[0])
    packed = get_policy("tight").pack(job)
    published = usage_lines(packed)
    lines = usage_lines(packed, job)
    assert lines[:4] == published and lines[4] == ""  # the published lines first, as they were
    ends = lines[5:9]
    assert lines[9] == "" and all(line.startswith(f"node{i}: curvature age ") for i, line in enumerate(lines[10:]))
    for i, line in enumerate(ends):
        assert line.startswith(f"node{i}: K-FAC in bubbles ") and f"per cycle of {len(packed.nodes[i].iterations)}" in line
        assert "at the step's end: update 20.416 ms (preconditioning 20.416 ms of it), exposed " in line
    assert ends[0].endswith("exposed 20.416 ms per step")  # node 0 ends the pipeline: no tail bubble hides it
    data = report_data(packed, job)
    json.dumps(data)
    for node, entry in zip(packed.nodes, data["nodes"]):
        assert entry["kfac_in_bubbles_time"] == node.figures.kfac_placed - node.figures.overflow
        assert entry["update_time"] == entry["precondition_time"] == prec
        assert 0 < entry["update_exposed_time"] <= prec
    assert data["nodes"][0]["update_exposed_time"] == prec


def test_without_end_of_step_records_the_report_is_the_published_one() -> None:
    job = job_from_dicts([small_node(), small_node(offset=10)])
    packed = get_policy("compat").pack(job)
    assert usage_lines(packed, job) == usage_lines(packed)
    entry = report_data(packed, job)["nodes"][0]
    assert (entry["update_time"], entry["precondition_time"], entry["update_exposed_time"]) == (0, 0, 0)


def test_the_report_gives_the_curvature_s_age_over_the_cycle_overlapping_or_not() -> None:
    from conftest import overlapping_node

    job = job_from_dicts([overlapping_node()])
    # k = 3, the refresh done in iteration 2: ages 3, 4, 5; overlapping, k = 2 and the refresh done in the
    # next cycle's iteration 0 (k + 0): ages 3 and 4, younger on average, though built a cycle earlier
    for overlap, k, age, mean in ((False, 3, "3..5", "4.00"), (True, 2, "3..4", "3.50")):
        packed = get_policy("tight", overlap=overlap).pack(job)
        assert packed.nodes[0].figures.iterations == k
        line = usage_lines(packed, job)[-1]
        assert line.startswith(f"node0: curvature age {age} steps (mean {mean}) over its cycle of {k}"), line
        data = report_data(packed, job)
        low, high = map(int, age.split(".."))
        assert data["overlap"] is overlap
        assert data["nodes"][0]["curvature_age"] == {"min": low, "mean": float(mean), "max": high}


def test_the_curvature_s_age_from_a_layout_is_the_age_from_the_labels() -> None:
    """The report reads the age from a schedule's :data:`KfacLayout` (the K-FAC work alone, not every label
    of a big job's cycle): on random jobs and the overlapping fixture, packed overlapping or not, it
    equals the age worked out from the labels."""
    from conftest import overlapping_node
    from pipefisher.schedule.problem import curvature_age
    from pipefisher.sim.random_jobs import random_raw_job

    jobs = [job_from_dicts(random_raw_job(seed)) for seed in range(12)] + [job_from_dicts([overlapping_node()])]
    overlapped = compared = 0
    for job in jobs:
        for policy in (get_policy("tight", overlap=True), get_policy("tight", overlap=False), get_policy("best-fit")):
            packed = policy.pack(job)
            overlapped += packed.overlap
            for node, timeline in zip(packed.nodes, job.nodes):
                assert node.layout is not None
                ages = curvature_age(timeline, node.iterations), curvature_age(timeline, node.iterations, node.layout)
                assert ages[0] == ages[1], (policy.name, ages)
                compared += ages[0] is not None
    assert overlapped and compared > 50
