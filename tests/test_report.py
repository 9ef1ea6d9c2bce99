"""Report formats: the published usage line, the workload listing, JSON data."""
from __future__ import annotations

import json

from conftest import small_node
from pipefisher.policies import get_policy
from pipefisher.report import report_data, usage_lines, workload_lines
from pipefisher.timeline import job_from_dicts


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
    from pipefisher.policies.base import NodeFigures, NodeSchedule
    from pipefisher.report import usage_line

    node = NodeSchedule((), (), NodeFigures(3, 88.49, 0, 0, 0, 0, overflow=224_768_000, lower_bound=3))
    assert usage_line(0, node, 2.0) == ("node0:3 pipeline iterations (usage: 88.49 %) [lower bound 3 at margin 2, "
                                        "optimal; overflow 74.923 ms per step, 224.768 ms per cycle]")
    gap = NodeSchedule((), (), NodeFigures(7, 80.0, 0, 0, 0, 0, lower_bound=6))
    assert usage_line(1, gap, 0.05).endswith("[lower bound 6 at margin 0.05, gap 1]")
    packed = get_policy("tight").pack(job_from_dicts([small_node()]), 0.3)
    assert "at margin 0.3" in usage_lines(packed)[0]
