"""Gantt charts: real images of the expected size, with colours, for timelines and packed schedules."""
from __future__ import annotations

import re
import struct
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.outputs.plot import (COLOURS, DPI, EXTRA_IN, ROW_IN, WIDTH_IN, chart_from_job, chart_from_schedule,
                                     chart_size_px, render)
from pipefisher.policies import get_policy
from pipefisher.schedule.timeline import job_from_dicts
from pipefisher.sim import simulate_timelines, synthetic_model, write_timelines


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
    timelines, _ = simulate_timelines(synthetic_model(stages=2, micro_batches=4, layers_per_stage=1, order="zb-h1"))
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
    model = synthetic_model(stages=4, micro_batches=4, layers_per_stage=1, order="chimera")
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


def test_the_update_and_its_preconditioning_have_their_own_colours_and_count_once(tmp_path):
    node = {"start_end": [(0, 100)], "call_forward": [(0, 10)], "call_backward": [(10, 30)],
            "update": [(30, 70)], "precondition": [(30, 60)]}
    chart = chart_from_job(job_from_dicts([node]))
    assert {b.label: b.category for b in chart.bars if b.label in ("update", "precondition")} == \
        {"update": "update", "precondition": "precondition"}
    # the step ends with the update at 70: 30 of pipeline and 40 of update, the preconditioning in it (not 142.9 %)
    assert chart.rows == ("node0\nbusy 100.0 %",)
    colours = check_png(render(chart, tmp_path / "update.png"), rows=1)
    assert hex_rgb(COLOURS["precondition"]) in colours


# ----------------------------------------------------------------------------------------------------
# readable at any size: collections, merging, edges, units, limits, context, validity, idle fill

from pipefisher.outputs.plot import (IDLE, INVALID, PLOT_PX, Bar, Chart, figure, merge_bars,  # noqa: E402
                                     violations_per_node)
from pipefisher.schedule.timeline import load_job  # noqa: E402


def bar_collections(fig):
    """The axes' collections that draw bars (PolyCollections), by face colour."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_hex

    ax = fig.axes[0]
    out = {}
    for c in ax.collections:
        if isinstance(c, PolyCollection):
            out.setdefault(to_hex(c.get_facecolor()[0]), []).append(c)
    return out


def sim_job(stages, m, order="1f1b"):
    return job_from_dicts(simulate_timelines(synthetic_model(stages=stages, micro_batches=m, layers_per_stage=1,
                                                             order=order))[0])


def test_each_kind_is_one_artist_whatever_the_number_of_rows_and_bars():
    small, large = chart_from_job(sim_job(2, 2)), chart_from_job(sim_job(6, 48))
    assert len(large.bars) > 5 * len(small.bars) and len(large.rows) == 3 * len(small.rows)
    counts = []
    for chart in (small, large):
        ax = figure(chart).axes[0]
        kinds = {(b.category, b.up_pipe) for b in chart.bars}
        # one collection per kind, the idle bands, the iteration lines, at most one forward-over-backward overlay
        assert len(ax.collections) <= len(kinds) + 3
        assert not ax.patches and len(ax.lines) == 0
        counts.append(len(ax.collections))
    assert counts[0] == counts[1]


def test_sub_pixel_bars_have_no_edge_and_are_drawn_a_pixel_wide():
    px = 1000 * 1.005 / PLOT_PX  # one pixel, in ms, of a chart ending at 1000 ms
    tiny = [Bar(0, 600 + 5 * i, 600 + 5 * i + 0.01, "sync_kron_A", f"sync_kron_A:l{i}") for i in range(20)]
    chart = Chart("t", ("node0",), (Bar(0, 0.0, 500.0, "forward", "call_forward"), *tiny), (0.0, 1000.0), 1000.0,
                  "ms")
    cols = bar_collections(figure(chart))
    (wide,) = cols["#4c78a8"]
    (sync,) = cols["#7a4fa3"]
    assert wide.get_linewidths()[0] > 0
    assert len(sync.get_paths()) == 20 and set(sync.get_linewidths()) == {0.0}
    widths = [p.vertices[:, 0].max() - p.vertices[:, 0].min() for p in sync.get_paths()]
    assert min(widths) >= px * 0.999


def test_merging_joins_items_closer_than_a_pixel_and_keeps_them_apart_at_high_resolution():
    starts = np.arange(1000) * 2.0
    r, s, e = merge_bars(np.zeros(1000), starts, starts + 1.0, px=10.0)
    assert (len(r), s[0], e[0]) == (1, 0.0, 1999.0)
    assert len(merge_bars(np.zeros(1000), starts, starts + 1.0, px=0.5)[0]) == 1000
    # rows never merge with each other; touching bars wide enough to see stay apart
    assert len(merge_bars([0, 1], [0.0, 1.0], [1.0, 2.0], px=10.0)[0]) == 2
    assert len(merge_bars([0, 0], [0.0, 100.0], [100.0, 200.0], px=1.0)[0]) == 2
    # in a chart: 5000 sub-pixel forwards draw as few bars, 20 wide ones as 20
    dense = Chart("t", ("n",), tuple(Bar(0, i * 0.2, i * 0.2 + 0.1, "forward", "call_forward") for i in range(5000)),
                  (0.0, 1000.0), 1000.0, "ms")
    (col,) = bar_collections(figure(dense))["#4c78a8"]
    assert len(col.get_paths()) < 10
    sparse = Chart("t", ("n",), tuple(Bar(0, i * 50.0, i * 50.0 + 40, "forward", "call_forward") for i in range(20)),
                   (0.0, 1000.0), 1000.0, "ms")
    (col,) = bar_collections(figure(sparse))["#4c78a8"]
    assert len(col.get_paths()) == 20


def test_dense_forward_and_backward_both_show():
    bars = []
    for i in range(2000):  # alternating, each far under a pixel
        bars += [Bar(0, i * 1.0, i * 1.0 + 0.4, "forward", "call_forward"),
                 Bar(0, i * 1.0 + 0.5, i * 1.0 + 0.9, "backward", "call_backward")]
    cols = bar_collections(figure(Chart("t", ("n",), tuple(bars), (0.0, 2000.0), 2000.0, "ms")))
    assert len(cols["#4c78a8"]) == 2  # the forwards, and the same over the backwards' upper half


def test_time_axis_switches_to_seconds_for_long_spans_and_has_no_offset():
    def axis(end):
        fig = figure(Chart("t", ("n",), (Bar(0, 0.0, end / 2, "forward", "call_forward"),), (0.0, end), end, "ms"))
        fig.canvas.draw()
        ax = fig.axes[0]
        return ax.get_xlabel(), ax.xaxis.get_offset_text().get_text(), [t.get_text() for t in ax.get_xticklabels()]

    label, offset, ticks = axis(3.05e6)  # the report's -m 256 cycle: 3050 s
    assert label == "time (s)" and offset == "" and "3000" in ticks
    label, offset, _ = axis(60_000.0)
    assert label == "time (s)" and offset == ""
    label, offset, _ = axis(800.0)
    assert label == "time (ms)" and offset == ""


def test_iterations_and_node_limit_what_is_drawn(tmp_path, job):
    packed = get_policy("tight").pack(job)
    full = chart_from_schedule(packed, job)
    n_iter = len(full.boundaries) - 1
    assert n_iter > 1
    one = chart_from_schedule(packed, job, iterations=1, node=1)
    assert len(one.rows) == 1 and one.rows[0].startswith("node1:")
    assert one.boundaries == full.boundaries[:2] and one.end == full.boundaries[1]
    assert one.bars and all(b.row == 0 and b.end <= one.end for b in one.bars)
    assert len(one.bars) < len(full.bars) / (2 * n_iter)
    assert f"first 1 of {n_iter} iterations" in one.title and "node 1" in one.title
    paths = write_timelines(tmp_path, "j", simulate_timelines(synthetic_model(stages=3, micro_batches=6,
                                                                             layers_per_stage=1))[0])
    runner = CliRunner()
    res = runner.invoke(main, ["plot", *paths, "--packed", "--iterations", "1", "--node", "2",
                               "--out", str(tmp_path / "one.png")])
    assert res.exit_code == 0, res.output
    check_png(tmp_path / "one.png", rows=1)
    res = runner.invoke(main, ["plot", *paths, "--packed", "--node", "3", "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 2 and res.output.strip().splitlines() == ["error: --node 3: the job has nodes 0 to 2"]
    res = runner.invoke(main, ["plot", *paths, "--iterations", "2", "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1 and "--iterations" in res.output
    assert not (tmp_path / "x.png").exists()


def test_titles_name_the_model_order_micro_batches_and_policy(tmp_path):
    model = synthetic_model(stages=2, micro_batches=4, layers_per_stage=1, order="gpipe")
    paths = write_timelines(tmp_path, "bert-x_gpipe_m4", simulate_timelines(model)[0])
    job = load_job(paths)
    title = chart_from_schedule(get_policy("compat").pack(job), job).title
    assert title.startswith("bert-x, gpipe, m=4:") and "policy compat" in title
    assert chart_from_job(job).title.startswith("bert-x, gpipe, m=4:")
    # pipefisher simulate's own prefix names the stages and the chunks too
    paths = write_timelines(tmp_path / "sim", "bert-x_interleaved_p2_v3_m4", simulate_timelines(model)[0])
    assert chart_from_job(load_job(paths)).title.startswith("bert-x, interleaved, 2 stages, v=3, m=4:")
    # any other name is shown as it is, with the forward passes per node
    other = write_timelines(tmp_path / "o", "myrun", simulate_timelines(model)[0])
    assert chart_from_job(load_job(other)).title.startswith("myrun, 2 nodes, 4 forward passes per node:")


def test_nodes_whose_schedule_does_not_validate_are_marked_red():
    job = sim_job(3, 6)  # compat breaks the rules on node 1 only
    packed = get_policy("compat").pack(job)
    bad = violations_per_node(packed, job)
    assert set(bad) == {1}
    chart = chart_from_schedule(packed, job)
    assert chart.invalid == (1,)
    assert chart.rows[1].endswith(f"\ninvalid: {bad[1]} violations") and "invalid" not in chart.rows[0] + chart.rows[2]
    labels = figure(chart).axes[0].get_yticklabels()  # drawn bottom-up
    from matplotlib.colors import to_hex

    assert [to_hex(t.get_color()) for t in labels] == ["#000000", INVALID, "#000000"]
    assert chart_from_schedule(get_policy("tight").pack(job), job).invalid == ()


def test_idle_time_has_its_own_fill_distinct_from_the_background(tmp_path, job):
    chart = chart_from_schedule(get_policy("tight").pack(job), job)
    fig = figure(chart)
    from matplotlib.colors import to_hex

    assert to_hex(fig.axes[0].get_facecolor()) != IDLE
    colours = check_png(render(chart, tmp_path / "idle.png"), rows=3)
    assert hex_rgb(IDLE) in colours and (255, 255, 255) in colours
    # each row's band covers its node's cycle, which ends at its last iteration
    assert [s for s, _ in chart.spans] == [0.0] * 3
    assert max(e for _, e in chart.spans) == chart.end


def test_job_name_is_the_files_common_prefix_or_nothing():
    from pipefisher.outputs.plot import job_name
    from pipefisher.schedule.timeline import Job, NodeTimeline

    def named(*paths):
        return job_name(Job(tuple(NodeTimeline(p, {}) for p in paths), 1))

    assert named("a/big_m8_node0_timeline.pickle", "a/big_m8_node1_timeline.pickle") == "big_m8"
    assert named("a/x_node0_timeline.pickle", "b/y_node1_timeline.pickle") is None  # two jobs, --allow-mixed
    assert named("run_a.pickle", "run_b.pickle") == "run"
    assert named("<node0>", "<node1>") is None


def test_interleaved_chunks_are_drawn_in_lighter_shades_and_named_in_the_trace(tmp_path):
    """Chunk 1's forwards and backwards (``:chunk1`` labels) get their own, lighter, collections and a
    legend entry; the trace names each event with its label, so the chunk is in its name."""
    from matplotlib.colors import to_hex

    from pipefisher.outputs.plot import chunk_colour
    from pipefisher.outputs.trace import trace_events

    model = synthetic_model(stages=2, micro_batches=4, layers_per_stage=2, order="interleaved")
    chart = chart_from_job(job_from_dicts(simulate_timelines(model)[0]))
    assert any(b.label == "call_forward:chunk1" and b.category == "forward" for b in chart.bars)
    fig = figure(chart)
    colours = bar_collections(fig)
    for cat in ("forward", "backward"):
        light = to_hex(chunk_colour(COLOURS[cat], 1))
        assert light != COLOURS[cat] and light in colours and COLOURS[cat] in colours
    assert "chunk 1 (lighter)" in [t.get_text() for t in fig.legends[0].get_texts()]
    names = {e["name"] for e in trace_events(chart)["traceEvents"] if e.get("ph") == "X"}
    assert {"call_forward", "call_forward:chunk1", "call_backward:chunk1"} <= names
    check_png(render(chart, tmp_path / "interleaved.png"), rows=2)


def test_zb_v_draws_each_chunks_weight_passes_in_a_colour_of_their_own(tmp_path):
    """ZB-V's deferred W passes of chunk 1 (``call_backward:weight:chunk1``) are drawn in the lighter
    shade of W, and both shades of W stay apart from each other and from every other colour: a
    lighter (chunk 1) backward must not read as a W."""
    import itertools
    import math

    from matplotlib.colors import to_hex, to_rgb

    from pipefisher.outputs.plot import chunk_colour

    model = synthetic_model(stages=3, micro_batches=6, layers_per_stage=2, order="zb-v")
    chart = chart_from_job(job_from_dicts(simulate_timelines(model)[0]))
    weights = {b.label for b in chart.bars if b.category == "weight"}
    assert weights == {"call_backward:weight", "call_backward:weight:chunk1"}
    colours = bar_collections(figure(chart))
    for chunk in (0, 1):
        assert to_hex(chunk_colour(COLOURS["weight"], chunk)) in colours
    w = [chunk_colour(COLOURS["weight"], chunk) for chunk in (0, 1)]
    others = [chunk_colour(COLOURS[cat], chunk) for cat in ("forward", "backward") for chunk in (0, 1)]
    others += [to_rgb(COLOURS[cat]) for cat in COLOURS if cat not in ("forward", "backward", "weight")]
    assert min(math.dist(a, b) for a, b in [*itertools.product(w, others), tuple(w)]) > 0.2
    check_png(render(chart, tmp_path / "zbv.png"), rows=3)


# ----------------------------------------------------------------------------------------------------
# planned vs measured: a run's per-instruction CSV (pipefisher.cost.measure.CSV_COLUMNS)

from pipefisher.cost.measure import LabelTime, StepRecord, append_csv, instruction_rows  # noqa: E402
from pipefisher.outputs.plot import OVERRUN, chart_from_measured, measured_steps, read_measured  # noqa: E402
from pipefisher.schedule.format import END, START  # noqa: E402
from pipefisher.schedule.packed import Placement  # noqa: E402


def measured_step(node, step, iteration, overrun=False):
    """One step: a forward that waited 4 ms for its input, a K-FAC label, a backward, ``-- end --``
    (the step lasts 40 + step ms). With ``overrun`` the K-FAC label runs to 30 ms instead of 18 ms and
    keeps the backward (planned at 25 ms) from starting before 30 ms: 5 ms past its 10 ms bubble."""
    kfac = "inv_kron_B:l1" if node else "cov_kron_A:l0"
    ms = 1e-3
    end = (40 + step) * ms
    labels = [  # label, planned (start, end), measured (start, end, wait)
        (START, (0.0, 0.0), (0.0, 0.0, 0.0)),
        ("call_forward", (5 * ms, 15 * ms), (0.0, 15 * ms, 4 * ms)),
        (kfac, (15 * ms, 20 * ms), (15 * ms, (30 if overrun else 18) * ms, 0.0)),
        ("call_backward", (25 * ms, 35 * ms), (30 * ms, 40 * ms, 0.0) if overrun else (18 * ms, 35 * ms, 7 * ms)),
        (END, (40 * ms, 40 * ms), (end, end, 0.0)),
    ]
    record = StepRecord(node, 0, step, iteration, tuple(LabelTime(lab, *m) for lab, _, m in labels))
    return instruction_rows(record, [Placement(lab, *p, iteration) for lab, p, _ in labels])


@pytest.fixture
def measured_csv(tmp_path):
    """2 nodes, steps 0-3 at iterations 0, 1, 0, 1; node 1's K-FAC work overruns in step 3."""
    path = tmp_path / "m.csv"
    for step in range(4):
        for node in (0, 1):
            append_csv(path, measured_step(node, step, step % 2, overrun=(node, step) == (1, 3)))
    return path


def test_measured_chart_has_a_planned_and_a_measured_row_per_node_over_the_last_cycle(measured_csv):
    chart = chart_from_measured(measured_csv)
    assert chart.rows == ("node0 planned", "node0 measured", "node1 planned", "node1 measured\n1 K-FAC overrun")
    assert chart.title == "m.csv: planned vs measured, steps 2-3" and chart.unit == "s"
    # step 3 starts after step 2's longer length over every row (its measured end, 42 ms)
    assert chart.boundaries == pytest.approx((0.0, 0.042, 0.085)) and chart.end == pytest.approx(0.085)
    for row in range(4):
        bars = sorted((b for b in chart.bars if b.row == row), key=lambda b: b.start)
        assert [b.category for b in bars] == ["forward", "cov_kron_A" if row < 2 else "inv_kron_B", "backward"] * 2
    # the measured forward covers its compute only: from start + wait (4 ms), not from its start (0) nor its plan (5 ms)
    fw = [b for b in chart.bars if b.row == 1 and b.category == "forward"]
    assert [x for b in fw for x in (b.start, b.end)] == pytest.approx([0.004, 0.015, 0.046, 0.057])
    planned_fw = [b for b in chart.bars if b.row == 0 and b.category == "forward"]
    assert [x for b in planned_fw for x in (b.start, b.end)] == pytest.approx([0.005, 0.015, 0.047, 0.057])
    # step 2's backward waited 7 ms: drawn from 25 ms; step 3's (overrun) did not wait: from 30 ms
    bw = sorted(b.start for b in chart.bars if b.row == 3 and b.category == "backward")
    assert bw == pytest.approx([0.025, 0.042 + 0.030])
    # only the overrunning K-FAC bar is outlined, where it ran
    (over,) = chart.outlined
    assert (over.row, over.label) == (3, "inv_kron_B:l1")
    assert (over.start, over.end) == pytest.approx((0.042 + 0.015, 0.042 + 0.030))
    assert over in chart.bars


def test_measured_chart_draws_the_overrun_outline_and_says_so_in_the_legend(tmp_path, measured_csv):
    from matplotlib.colors import to_hex

    chart = chart_from_measured(measured_csv)
    fig = figure(chart)
    assert "K-FAC overrunning its bubble" in [t.get_text() for t in fig.legends[0].get_texts()]
    red = [c for c in fig.axes[0].collections
           if len(c.get_edgecolor()) and to_hex(c.get_edgecolor()[0]) == OVERRUN and len(c.get_facecolor()) == 0]
    assert len(red) == 1 and len(red[0].get_paths()) == 1
    calm = chart_from_measured(measured_csv, step=0)  # steps 0-1: nothing overran
    assert calm.outlined == () and calm.rows[3] == "node1 measured"
    assert "K-FAC overrunning its bubble" not in [t.get_text() for t in figure(calm).legends[0].get_texts()]
    check_png(render(chart, tmp_path / "m.png"), rows=4)


def test_measured_step_selection_last_complete_cycle_step_and_iterations(measured_csv):
    data = read_measured(measured_csv)
    assert measured_steps(data, [0, 1]) == [2, 3]
    assert measured_steps(data, [0, 1], iterations=3) == [1, 2, 3]
    assert measured_steps(data, [0, 1], step=0) == [0, 1]
    assert measured_steps(data, [0, 1], step=1, iterations=3) == [1, 2, 3]
    assert measured_steps(data, [0, 1], step=3) == [3]
    # a cycle begun but not finished at the end of the file: the last complete one is still drawn
    for node in (0, 1):
        append_csv(measured_csv, measured_step(node, 4, 0))
    data = read_measured(measured_csv)
    assert measured_steps(data, [0, 1]) == [2, 3]
    assert measured_steps(data, [0, 1], iterations=2) == [3, 4]
    one = chart_from_measured(measured_csv, node=1, step=3, iterations=2)
    assert one.rows == ("node1 planned", "node1 measured\n1 K-FAC overrun") and {b.row for b in one.bars} == {0, 1}
    assert one.title == "m.csv: planned vs measured, steps 3-4, node 1" and len(one.boundaries) == 3


def test_measured_rows_without_a_plan_have_no_planned_bars(tmp_path):
    path = tmp_path / "noplan.csv"
    for node in (0, 1):
        record = StepRecord(node, 0, 7, 0, (LabelTime(START, 0.0, 0.0), LabelTime("call_forward", 0.0, 0.01, 0.002),
                                            LabelTime(END, 0.01, 0.01)))
        append_csv(path, instruction_rows(record))
    chart = chart_from_measured(path)
    assert chart.rows[0] == "node0 planned\n(no plan in file)" and chart.title.endswith("step 7")
    assert [b.row for b in chart.bars] == [1, 3]
    assert [b.start for b in chart.bars] == pytest.approx([0.002, 0.002])


def test_plot_and_trace_cli_draw_measured_steps(tmp_path, measured_csv):
    import json

    runner = CliRunner()
    res = runner.invoke(main, ["plot", "--measured", str(measured_csv), "--out", str(tmp_path / "m.png")])
    assert res.exit_code == 0, res.output
    check_png(tmp_path / "m.png", rows=4)
    res = runner.invoke(main, ["trace", "--measured", str(measured_csv), "--node", "1", "--iterations", "4",
                               "--out", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    trace = json.loads((tmp_path / "m.json").read_text())["traceEvents"]
    names = [e["args"]["name"] for e in trace if e["name"] == "thread_name"]
    assert names == ["node1 planned", "node1 measured · 1 K-FAC overrun"]
    process = next(e["args"]["name"] for e in trace if e["name"] == "process_name")
    assert process == "m.csv: planned vs measured, steps 0-3, node 1"
    assert sum(e["ph"] == "X" for e in trace) == 2 * 4 * 3 and sum(e["ph"] == "i" for e in trace) == 5


def test_measured_input_errors_are_one_line_naming_the_file(tmp_path, measured_csv):
    runner = CliRunner()
    out = tmp_path / "x.png"
    bad = tmp_path / "bad.csv"
    bad.write_text("step,loss\n1,2.5\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    header = tmp_path / "header.csv"
    append_csv(header, [])
    cases = [
        (["--measured", str(bad)], f"error: {bad}: is not a pipefisher measurements CSV (no column 'node')"),
        (["--measured", str(empty)], f"error: {empty}: is empty, not a pipefisher measurements CSV"),
        (["--measured", str(header)], f"error: {header}: has no measurements (only a header)"),
        (["--measured", str(measured_csv), "--node", "2"], f"error: {measured_csv}: --node 2: the file has nodes 0 to 1"),
        (["--measured", str(measured_csv), "--step", "9"],
         f"error: {measured_csv}: --step 9 is not in the file (its steps common to all nodes: 0 to 3)"),
        (["--step", "1"], "error: --step applies to a measurements CSV: give --measured FILE.csv"),
        (["--measured", str(measured_csv), "--packed"],
         "error: --measured draws the measurements CSV on its own: give no TIMELINES, --packed, --policy or "
             "--staleness with it"),
    ]
    for args, line in cases:
        for command in ("plot", "trace"):
            res = runner.invoke(main, [command, *args, "--out", str(out if command == "plot" else out.with_suffix(".json"))])
            assert res.exit_code == 2 and res.output.strip().splitlines() == [line], (command, args, res.output)
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_measured_chart_path_imports_no_torch(measured_csv):
    import subprocess
    import sys

    code = ("import sys; from pipefisher.outputs.plot import chart_from_measured, figure; "
            f"figure(chart_from_measured({str(measured_csv)!r})); import pipefisher.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
