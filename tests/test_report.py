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
