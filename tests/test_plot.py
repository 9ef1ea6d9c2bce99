"""Gantt charts: real images of the expected size, with colours, for timelines and packed schedules."""
from __future__ import annotations

import re
import struct
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.plot import COLOURS, DPI, EXTRA_IN, ROW_IN, WIDTH_IN, chart_from_job, chart_from_schedule, chart_size_px, render
from pipefisher.policies import get_policy
from pipefisher.sim import simulate_timelines, synthetic_model, write_timelines
from pipefisher.timeline import job_from_dicts


@pytest.fixture(scope="module")
def job():
    timelines, _ = simulate_timelines(synthetic_model(stages=3, micro_batches=6, layers_per_stage=1))
    return job_from_dicts(timelines)


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", head[16:24])


def distinct_colours(path):
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    rgb = np.round(pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    return {tuple(c) for c in np.unique(rgb, axis=0)}


def hex_rgb(h):
    return tuple(int(h[i:i + 2], 16) for i in (1, 3, 5))


def check_png(path, rows):
    assert png_size(path) == chart_size_px(rows) == (round(WIDTH_IN * DPI), round((EXTRA_IN + ROW_IN * rows) * DPI))
    colours = distinct_colours(path)
    assert len(colours) > 1
    return colours


def test_timeline_chart_is_a_png_of_the_expected_size_with_each_kind_in_its_colour(tmp_path, job):
    path = render(chart_from_job(job), tmp_path / "timelines.png")
    colours = check_png(path, rows=3)
    for kind in ("forward", "backward", "cov_kron_A", "cov_kron_B", "inv_kron_A", "inv_kron_B"):
        assert hex_rgb(COLOURS[kind]) in colours, kind


def test_packed_schedule_chart_labels_rows_with_usage_and_marks_iterations(tmp_path, job):
    packed = get_policy("compat").pack(job)
    chart = chart_from_schedule(packed, job)
    assert chart.rows[0].startswith(f"node0: {packed.nodes[0].figures.iterations} it.") and "usage" in chart.rows[0]
    assert len(chart.boundaries) == max(n.figures.iterations for n in packed.nodes) + 1
    assert {b.category for b in chart.bars} >= {"forward", "backward", "cov_kron_A", "inv_kron_B"}
    check_png(render(chart, tmp_path / "packed.png"), rows=3)


def test_svg_output_by_suffix(tmp_path, job):
    path = render(chart_from_job(job), tmp_path / "chart.svg")
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    assert root.get("width") == f"{WIDTH_IN * 72:g}pt"
    assert root.get("height") == f"{(EXTRA_IN + ROW_IN * 3) * 72:g}pt"
    text = open(path).read()
    fills = set(re.findall(r"fill:\s*(#[0-9a-fA-F]{6})", text))
    assert len(fills) > 1 and COLOURS["forward"] in fills


def test_plot_cli_draws_timelines_or_the_packed_schedule(tmp_path):
    timelines, _ = simulate_timelines(synthetic_model(stages=2, micro_batches=4, layers_per_stage=1, schedule="zb-h1"))
    paths = write_timelines(tmp_path, "zb", timelines)
    runner = CliRunner()
    res = runner.invoke(main, ["plot", *paths, "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    colours = check_png(tmp_path / "t.png", rows=2)
    assert hex_rgb(COLOURS["weight"]) in colours  # ZB-H1's deferred weight-gradient passes
    res = runner.invoke(main, ["plot", *paths, "--policy", "compat", "--out", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    check_png(tmp_path / "p.png", rows=2)
    res = runner.invoke(main, ["plot", *paths, "--out", str(tmp_path / "p.jpg")])
    assert res.exit_code == 2 and "png or .svg" in res.output


def test_demo_chart_is_a_real_image(tmp_path):
    res = CliRunner().invoke(main, ["demo", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in ("chart.png", "timelines.png"):
        colours = check_png(tmp_path / name, rows=4)
        assert hex_rgb(COLOURS["cov_kron_A"]) in colours


def test_chimera_up_pipe_work_is_drawn_hatched(tmp_path):
    model = synthetic_model(stages=4, micro_batches=4, layers_per_stage=1, schedule="chimera")
    job = job_from_dicts(simulate_timelines(model)[0])
    chart = chart_from_job(job)
    up = [b for b in chart.bars if b.up_pipe]
    assert up and all(b.label.endswith(":up_pipe") for b in up)
    assert any(not b.up_pipe and b.category == "forward" for b in chart.bars)
    check_png(render(chart, tmp_path / "chimera.png"), rows=4)
    # matplotlib writes hatches as SVG patterns: there are some only when up-pipe bars exist
    render(chart, tmp_path / "chimera.svg")
    assert "<pattern" in (tmp_path / "chimera.svg").read_text()
    down_only = chart.__class__(chart.title, chart.rows, tuple(b for b in chart.bars if not b.up_pipe),
                                chart.boundaries, chart.end, chart.unit)
    render(down_only, tmp_path / "down_only.svg")
    assert "<pattern" not in (tmp_path / "down_only.svg").read_text()
