"""The simulator's timelines: profiled format, K-FAC phase, cost models, and the packer on top."""
from __future__ import annotations

import json
import os
import pickle

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.policies import get_policy
from pipefisher.rules import validate
from pipefisher.sim import (
    cost_model_from_dict, load_cost_model, simulate_timelines, synthetic_model, synthetic_timelines, write_timelines,
)
from pipefisher.schedule.timeline import KFAC_KINDS, load_job
from pipefisher.sim.costs import NS_PER_MS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "pipefisher", "bundled", "cost_models", "bert-base-4stages.yaml")
LARGE = os.path.join(ROOT, "pipefisher", "bundled", "cost_models", "bert-large-8stages.yaml")


def kfac_keys(node, kind="cov_kron_A"):
    return [k for k in node if k.startswith(kind + ":")]


def test_synthetic_job_has_36_kfac_modules_per_node_in_integer_nanoseconds():
    timelines = synthetic_timelines("1f1b", stages=8, micro_batches=16, layers_per_stage=6, kfac_scale=1.0, seed=0)
    assert len(timelines) == 8
    for i, node in enumerate(timelines):
        assert len(node["call_forward"]) == len(node["call_backward"]) == 16
        for kind in KFAC_KINDS:
            assert len(kfac_keys(node, kind)) == 36
        assert f"cov_kron_A:encoder.layer.{6 * i}.attention.self.query" in node
        assert len(node["start_end"]) == 1
        for key, intervals in node.items():
            for s, e in intervals:
                assert type(s) is int and type(e) is int and 0 <= s <= e, key


def test_kfac_phase_follows_the_pipeline_and_covers_all_micro_batches():
    model = synthetic_model(stages=2, micro_batches=4, layers_per_stage=1, seed=None)
    timelines, result = simulate_timelines(model)
    node = timelines[0]
    pipeline_end = max(e for _, e in node["call_backward"])
    query = model.modules[0]
    s, e = node["cov_kron_A:encoder.layer.0.attention.self.query"][0]
    assert s == pipeline_end
    assert e - s == 4 * round(query.cov_A_ms * NS_PER_MS)
    ends = [iv[0][1] for k, iv in node.items() if k.split(":")[0] in KFAC_KINDS]
    assert node["start_end"] == [(0, max(ends))]
    # covariance first, then all-reduces, then inverses
    first = {kind: min(node[k][0][0] for k in kfac_keys(node, kind)) for kind in KFAC_KINDS}
    assert first["cov_kron_A"] < first["sync_kron_A"] < first["inv_kron_A"]


def test_kfac_scale_multiplies_kfac_work_only():
    light, _ = simulate_timelines(synthetic_model(kfac_scale=0.5))
    heavy, _ = simulate_timelines(synthetic_model(kfac_scale=2.0))
    assert light[0]["call_forward"] == heavy[0]["call_forward"]
    key = "inv_kron_B:encoder.layer.0.output.dense"
    dl, dh = (t[0][key][0][1] - t[0][key][0][0] for t in (light, heavy))
    assert dh == pytest.approx(4 * dl, rel=1e-6)


def test_interleaved_nodes_hold_one_interval_per_chunk_and_micro_batch():
    model = load_cost_model(BASE)
    timelines, result = simulate_timelines(model, "interleaved", micro_batches=8)
    assert result.order.chunks == 3
    node = timelines[1]
    for suffix in ("", ":chunk1", ":chunk2"):  # the chunk format: chunk j >= 1 gets ':chunk<j>'
        assert len(node["call_forward" + suffix]) == len(node["call_backward" + suffix]) == 8
    assert "call_forward:chunk3" not in node
    layers = sorted({int(k.split(".")[2]) for k in kfac_keys(node)})
    assert layers == [1, 5, 9]  # chunk c of device 1 is virtual stage 4c + 1
    assert "cov_kron_A:encoder.layer.1.attention.self.query" in node  # chunk 0: today's keys
    assert "cov_kron_A:encoder.layer.5.attention.self.query:chunk1" in node
    assert "inv_kron_B:encoder.layer.9.output.dense:chunk2" in node


def test_zb_h1_counts_stay_equal_and_deferred_weight_passes_are_their_own_key():
    timelines, _ = simulate_timelines(load_cost_model(BASE), "zb-h1", micro_batches=8)
    assert "call_backward:weight" not in timelines[0]  # node 0 runs W right after B: merged
    last = timelines[-1]
    assert len(last["call_forward"]) == len(last["call_backward"]) == len(last["call_backward:weight"]) == 8


def test_zb_v_nodes_hold_both_chunks_with_their_b_and_w_passes():
    """Chunk 1's forwards, B and W passes carry ':chunk1'; every chunk has m forwards and m B passes,
    and its W passes are either deferred (their own key) or merged into the B right before them."""
    m = 8
    timelines, result = simulate_timelines(load_cost_model(BASE), "zb-v", micro_batches=m)
    assert (result.order.name, result.order.chunks) == ("zb-v", 2)
    deferred = 0
    for node in timelines:
        pipeline = {k for k in node if k.startswith("call_")}
        assert pipeline <= {"call_forward", "call_backward", "call_backward:weight",
                            "call_forward:chunk1", "call_backward:chunk1", "call_backward:weight:chunk1"}
        for suffix in ("", ":chunk1"):
            assert len(node["call_forward" + suffix]) == len(node["call_backward" + suffix]) == m
            assert len(node.get("call_backward:weight" + suffix, [])) <= m
        deferred += len(node.get("call_backward:weight:chunk1", []))
    assert "call_backward:weight:chunk1" not in timelines[0]  # the first node runs each W right after its B
    assert deferred > 0


def test_zb_v_puts_each_nodes_chunk_1_layers_on_the_way_back_up():
    """6 layers, 3 nodes, 6 virtual stages of one layer: node d holds layer d (chunk 0) and layer 5 - d
    (chunk 1, ':chunk1' keys), not layer d + 3 as interleaving would."""
    model = synthetic_model(stages=3, micro_batches=4, layers_per_stage=2, order="zb-v")
    timelines, _ = simulate_timelines(model)
    for d, node in enumerate(timelines):
        layers = {(int(k.split(".")[2]), k.endswith(":chunk1")) for k in kfac_keys(node)}
        assert layers == {(d, False), (5 - d, True)}, d
    interleaved, _ = simulate_timelines(model, "interleaved", chunks=2)
    assert {int(k.split(".")[2]) for k in kfac_keys(interleaved[0])} == {0, 3}


def test_zb_v_turns_on_the_last_node_without_latency():
    """The last node hands micro-batch 0 from its chunk 0 (stage p - 1) to its chunk 1 (stage p) at once;
    between nodes every hand-off waits the latency."""
    model = synthetic_model(stages=3, micro_batches=4, layers_per_stage=2, order="zb-v", latency_ms=2.0)
    _, result = simulate_timelines(model)
    start = {(t.op.kind, t.op.micro_batch, t.op.stage): (t.start, t.end) for ops in result.devices for t in ops}
    latency = round(2.0 * NS_PER_MS)
    assert start["F", 0, 3][0] == start["F", 0, 2][1]  # node 2: chunk 0 -> chunk 1
    assert start["F", 0, 1][0] == start["F", 0, 0][1] + latency  # node 0 -> node 1
    assert start["F", 0, 4][0] == start["F", 0, 3][1] + latency  # node 2 -> node 1, on the way up


def test_chimera_up_pipe_keys():
    timelines, _ = simulate_timelines(load_cost_model(BASE), "chimera", micro_batches=8)
    node = timelines[0]
    assert len(node["call_forward"]) == len(node["call_forward:up_pipe"]) == 4
    assert "cov_kron_A:encoder.layer.0.attention.self.query" in node
    assert "cov_kron_A:encoder.layer.9.attention.self.query:up_pipe" in node  # up stage 3 = layers 9..11


@pytest.mark.parametrize("config", [BASE, LARGE])
@pytest.mark.parametrize("order", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "chimera"])
def test_simulated_pickles_load_and_pack(tmp_path, config, order):
    timelines, _ = simulate_timelines(load_cost_model(config), order)
    paths = write_timelines(tmp_path, "sim", timelines)
    assert [os.path.basename(p) for p in paths] == [f"sim_node{i}_timeline.pickle" for i in range(len(timelines))]
    job = load_job(paths)
    packed = get_policy("compat").pack(job)
    assert len(packed.nodes) == len(timelines)
    assert all(n.figures.iterations >= 1 for n in packed.nodes)
    validate(packed.to_file_data(), job)  # runs without error (compat's own flaws may be reported)


def test_schedule_cli_packs_simulated_timelines(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["simulate", "--config", BASE, "--order", "gpipe", "--micro-batches", "4",
                               "--out", str(tmp_path / "tl")])
    assert res.exit_code == 0, res.output
    assert "bubble fraction" in res.output
    paths = sorted(str(p) for p in (tmp_path / "tl").iterdir())
    assert len(paths) == 4
    with open(paths[0], "rb") as f:
        assert len(pickle.load(f)["call_forward"]) == 4  # --micro-batches overrides the file's 8
    res = runner.invoke(main, ["schedule", *paths, "--save-path", str(tmp_path / "s.pickle")])
    assert res.exit_code == 0, res.output
    assert res.output.count("pipeline iterations (usage:") == 4
    assert res.output.count("at the step's end: update 20.416 ms (preconditioning 20.416 ms of it)") == 4


def test_bundled_cost_models_name_their_sources():
    for path, csv in [(BASE, "bert-base_time_memory_p100.csv"), (LARGE, "bert-large_time_memory_p100.csv")]:
        model = load_cost_model(path)
        assert csv in model.source and "bs=32" in model.source
        assert len(model.modules) == 6
    assert load_cost_model(BASE).stages == 4 and load_cost_model(LARGE).stages == 8


def test_bundled_cost_models_take_the_preconditioning_from_their_rows_time_prec():
    import csv

    for path, csv_name in [(BASE, "bert-base_time_memory_p100.csv"), (LARGE, "bert-large_time_memory_p100.csv")]:
        with open(os.path.join(ROOT, "tests", "data", "block-costs", csv_name)) as f:
            row = next(r for r in csv.DictReader(f) if r["bs"] == "32")
        model = load_cost_model(path)
        assert model.block_prec_ms == float(row["time_prec"]) and model.block_update_ms == 0.0


def test_each_node_ends_its_step_with_the_update_and_the_preconditioning_of_its_layers():
    model = load_cost_model(BASE)
    timelines, _ = simulate_timelines(model, "1f1b")
    prec = round(3 * model.block_prec_ms * NS_PER_MS)  # 3 layers per stage
    for node in timelines:
        [(s, e)] = node["precondition"]
        kfac_end = max(iv[-1][1] for k, iv in node.items() if k.split(":")[0] in KFAC_KINDS)
        pipeline_end = max(e for _, e in node["call_backward"] + node["call_forward"])
        assert e - s == prec and s == kfac_end > pipeline_end  # after the curvature refresh, as run profiles it
        assert node["update"] == [(s, e)]  # no update cost of its own: only the preconditioning
        assert node["start_end"] == [(0, e)]
    # the rest of the update after it, inside one update interval; K-FAC's scale applies to K-FAC work only
    more = model.replace(block_update_ms=2.0, kfac_scale=2.0)
    node = simulate_timelines(more, "1f1b")[0][0]
    [(s, e)], [(us, ue)] = node["precondition"], node["update"]
    assert (e - s, us, ue - us) == (2 * prec, s, 2 * prec + 3 * 2_000_000)
    # Chimera: a node holds two copies of a stage (down and up pipe) and preconditions both
    chimera, _ = simulate_timelines(model, "chimera")
    assert all(n["precondition"][0][1] - n["precondition"][0][0] == 2 * prec for n in chimera)


def test_a_cost_model_without_end_of_step_costs_loads_and_writes_no_end_of_step_keys():
    model = cost_model_from_dict(MINIMAL)
    assert (model.block_prec_ms, model.block_update_ms) == (0.0, 0.0)
    timelines, _ = simulate_timelines(model)
    assert all("precondition" not in n and "update" not in n for n in timelines)


def test_per_module_split_adds_up_to_the_block_measurement():
    model = load_cost_model(BASE)
    assert sum(m.cov_A_ms + m.cov_B_ms for m in model.modules) == pytest.approx(25.546598434448242)
    assert sum(m.inv_A_ms + m.inv_B_ms for m in model.modules) == pytest.approx(71.66688442230225)


MINIMAL = {
    "layers": 4, "stages": 2, "micro_batches": 4,
    "stage": {"forward_ms": [1.0, 1.5], "backward_ms": [2.0, 3.0]},
    "kfac": {"modules": [{"name": "fc", "cov_A_ms": 0.1, "cov_B_ms": 0.1, "sync_A_ms": 0, "sync_B_ms": 0,
                          "inv_A_ms": 1, "inv_B_ms": 1}]},
}


def test_per_stage_costs_and_explicit_module_costs():
    model = cost_model_from_dict(MINIMAL)
    timelines, result = simulate_timelines(model)
    assert result.devices[1][0].end - result.devices[1][0].start == 1_500_000
    assert not [k for k in timelines[0] if k.startswith("sync")]  # no all-reduce cost: no sync keys


@pytest.mark.parametrize("change,message", [
    ({"layers": None}, "needs 'layers'"),
    ({"bogus": 1}, "unknown key"),
    ({"stage": {"forward_ms": [1.0], "backward_ms": [2.0, 3.0]}}, "stage costs"),
    ({"latency_ms": -1}, "finite number >= 0"),
    ({"kfac": {"modules": []}}, "non-empty list"),
    ({"kfac": {"modules": [{"name": "fc", "in": 4}]}}, "needs 'in' and 'out'"),
    ({"micro_batches": 2.5}, "whole number"),
    ({"kfac": {**MINIMAL["kfac"], "block_prec_ms": -1}}, "'kfac.block_prec_ms' must be a finite number >= 0"),
    ({"block_update_ms": "fast"}, "'block_update_ms' must be a number"),
])
def test_bad_cost_models_are_input_errors(change, message):
    data = {**MINIMAL, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(InputError, match=message):
        cost_model_from_dict(data, "model.yaml")


def test_a_cost_models_order_key_names_the_pipeline_order_and_its_old_name_schedule_still_loads(capsys):
    """A cost model's pipeline order is its ``order`` key ("schedule" names only the packed K-FAC schedule);
    a file written with ``schedule:`` loads the same, and stderr says the new name in one line."""
    assert cost_model_from_dict({**MINIMAL, "order": "zb-h1"}, "model.yaml").order == "zb-h1"
    assert capsys.readouterr().err == ""
    old = cost_model_from_dict({**MINIMAL, "schedule": "zb-h1"}, "model.yaml")
    assert old == cost_model_from_dict({**MINIMAL, "order": "zb-h1"}, "model.yaml")
    assert capsys.readouterr().err == "note: model.yaml: schedule is now order (the old name still works)\n"
    with pytest.raises(InputError, match="has both schedule and order"):
        cost_model_from_dict({**MINIMAL, "schedule": "1f1b", "order": "1f1b"}, "model.yaml")
    with pytest.raises(InputError, match="'order' must be a pipeline order name"):
        cost_model_from_dict({**MINIMAL, "order": 3}, "model.yaml")
    for path in (BASE, LARGE):  # the bundled files use the new name
        assert load_cost_model(path).order == "1f1b" and capsys.readouterr().err == ""


def test_cli_reports_bad_input_in_one_line_with_exit_2(tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.yaml"
    bad.write_text("layers: [unclosed\n")
    for args in (["simulate", "--config", str(bad), "--out", str(tmp_path)],
                 ["simulate", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path)],
                 ["simulate", "--config", BASE, "--order", "interleaved", "-m", "9", "--out", str(tmp_path)],
                 ["simulate", "--config", BASE, "--order", "dualpipev", "-m", "7", "--out", str(tmp_path)],
                 ["simulate", "--config", BASE, "--order", "nope", "--out", str(tmp_path)]):
        res = runner.invoke(main, args)
        assert res.exit_code == 2, (args, res.output)
        assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output


@pytest.mark.parametrize("command", [["compare"], ["simulate", "--out", "OUT"]])
def test_a_run_config_given_for_a_cost_model_is_named_as_one(tmp_path, command):
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    args = [a.replace("OUT", str(tmp_path / "sim")) for a in command]
    res = CliRunner().invoke(main, [*args, "--config", tiny])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert res.output.startswith(f"error: {tiny}: is a run config (for pipefisher train and run), not a cost "
                                 "model: this --config takes a cost model"), res.output
    assert "bert-base-4stages" in res.output and "unknown key" not in res.output
    # a cost model with a stray key is still told its unknown key, not called a run config
    with pytest.raises(InputError, match="unknown key in the file: optim"):
        cost_model_from_dict({**MINIMAL, "optim": {}}, "model.yaml")


def test_compare_prints_one_row_per_order_and_micro_batch_count(tmp_path):
    res = CliRunner().invoke(main, ["compare", "--config", BASE, "--orders", "gpipe,1f1b,interleaved",
                                    "-m", "4,9", "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[1].split()[:2] == ["order", "m"]  # the pipeline order's column; "schedule" is the packed one
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(r["order"], r["micro_batches"]) for r in rows] == [
        ("gpipe", 4), ("gpipe", 9), ("1f1b", 4), ("1f1b", 9), ("interleaved", 4), ("interleaved", 9)]
    assert not any("schedule" in r for r in rows)
    assert any(line.startswith("gpipe") and " 4 " in line for line in lines)
    assert any(line.startswith("interleaved") and "n/a" in line and "rounds" in line for line in lines)
    assert "K-FAC cycle" in res.output and "bubble %" in res.output
    assert (tmp_path / "c.json").exists()


def test_compare_by_default_has_a_row_for_every_order_zero_bubble_ones_too():
    res = CliRunner().invoke(main, ["compare", "--config", BASE, "-m", "8"])
    assert res.exit_code == 0, res.output
    rows = [line.split()[0] for line in res.output.splitlines()[3:-1]]
    assert rows == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "chimera"]
    for name in ("zb-v", "dualpipev"):
        assert "n/a" not in next(line for line in res.output.splitlines() if line.startswith(name))


def test_compare_says_dualpipev_needs_two_micro_batches_per_stage():
    res = CliRunner().invoke(main, ["compare", "--config", BASE, "--orders", "dualpipev,zb-v", "-m", "4,8"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if line.startswith(("dualpipev", "zb-v"))]
    assert [r.split()[:2] for r in rows] == [["dualpipev", "4"], ["dualpipev", "8"], ["zb-v", "4"], ["zb-v", "8"]]
    assert "n/a: dualpipev: needs micro-batches >= 2 x stages = 8" in rows[0]
    assert "n/a" not in rows[1] + rows[2] + rows[3]


def test_demo_writes_everything_into_one_folder(tmp_path):
    out = tmp_path / "demo"
    res = CliRunner().invoke(main, ["demo", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "pipeline iterations (usage:" in res.output
    names = set(os.listdir(out))
    assert {"timelines", "schedule.pickle", "report.txt", "report.json", "chart.png", "trace.json"} <= names
    assert len(os.listdir(out / "timelines")) == 4
    # saved by the one pack path (pipefisher.policies.packing): the metadata `schedule` and `run` write
    meta = json.loads((out / "schedule.pickle.meta.json").read_text())
    assert len(meta["timelines"]) == 4 and meta["packed_for"]["pipeline.stages"] == 4
    assert meta["packed_for"]["layout"] == [1, False, False] and len(meta["packed_for"]["modules"]) == 4


def test_the_demo_predicts_no_time_to_target_without_the_jobs_staleness_curve(tmp_path):
    res = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "plain")])
    assert res.exit_code == 0, res.output
    report = (tmp_path / "plain" / "report.txt").read_text()
    for text in (res.output, report):
        assert "time-to-target" not in text.replace("no time-to-target is predicted", "") and "never" not in text
    given = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "given"), "--staleness", "1:0.5,4:0.6,16:0.9"])
    assert given.exit_code == 0 and "time-to-target trade-off" in given.output and "given as 1:0.5" in given.output
    bad = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "bad"), "--staleness", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and not (tmp_path / "bad").exists()


def test_compare_gives_a_time_to_target_column_only_with_a_staleness_curve():
    args = ["compare", "--config", BASE, "--orders", "1f1b", "-m", "8"]
    plain = CliRunner().invoke(main, args)
    given = CliRunner().invoke(main, [*args, "--staleness", "1:0.5,4:0.6,16:0.9"])
    assert plain.exit_code == 0 and given.exit_code == 0, (plain.output, given.output)
    assert "time to target" not in plain.output.lower() and "time to target" in given.output
    row = next(line for line in given.output.splitlines() if line.startswith("1f1b"))
    assert 0 < float(row.split()[-1]) < 1


def test_two_simulations_in_one_folder_cannot_be_packed_as_one_job(tmp_path):
    """The user's report: 5 stages, then 4 stages into one folder, then ``schedule OUT/*.pickle``."""
    runner = CliRunner()
    out = tmp_path / "s2"
    for stages in ("5", "4"):
        res = runner.invoke(main, ["simulate", "--config", BASE, "--stages", stages, "--out", f"{out}/"])
        assert res.exit_code == 0, res.output
        assert "//" not in res.output and f"_p{stages}_m8_node*_timeline.pickle" in res.output
    paths = sorted(str(p) for p in out.iterdir())
    assert len(paths) == 9
    res = runner.invoke(main, ["schedule", *paths])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "different name prefixes" in res.output and "pipeline iterations" not in res.output
    res = runner.invoke(main, ["schedule", *paths, "--allow-mixed"])
    assert res.exit_code == 0 and res.output.count("pipeline iterations") == 9, res.output


def test_a_smaller_job_under_the_same_prefix_removes_the_stale_node_files(tmp_path):
    runner = CliRunner()
    for stages in ("5", "4"):
        res = runner.invoke(main, ["simulate", "--config", BASE, "--stages", stages, "--out", str(tmp_path),
                                   "--prefix", "job"])
        assert res.exit_code == 0, res.output
    assert "removed 1 stale node file(s)" in res.output
    assert sorted(os.listdir(tmp_path)) == [f"job_node{i}_timeline.pickle" for i in range(4)]
    assert len(load_job(sorted(str(p) for p in tmp_path.iterdir())).nodes) == 4


def test_demo_checks_its_options_and_output_before_any_work(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["demo", "--policy", "foo", "--out", str(tmp_path / "d1")])
    assert res.exit_code == 2 and "unknown policy 'foo'" in res.output
    assert not (tmp_path / "d1").exists()
    (tmp_path / "afile").write_text("")
    res = runner.invoke(main, ["demo", "--out", str(tmp_path / "afile" / "d")])
    assert res.exit_code == 2 and "is a file" in res.output and res.output.count("\n") == 1
    res = runner.invoke(main, ["simulate", "--config", BASE, "--out", str(tmp_path / "afile" / "d")])
    assert res.exit_code == 2 and "is a file" in res.output and "bubble fraction" not in res.output


def test_trace_refuses_two_jobs_unless_allow_mixed_and_checks_its_output_first(tmp_path):
    runner = CliRunner()
    for stages in ("3", "2"):
        assert runner.invoke(main, ["simulate", "--config", BASE, "--stages", stages, "--out", str(tmp_path / "s"),
                                    "-m", "4"]).exit_code == 0
    paths = sorted(str(p) for p in (tmp_path / "s").iterdir())
    res = runner.invoke(main, ["trace", *paths, "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 2 and "different name prefixes" in res.output
    res = runner.invoke(main, ["trace", *paths, "--out", str(tmp_path / "t.json"), "--allow-mixed"])
    assert res.exit_code == 0 and (tmp_path / "t.json").exists(), res.output
    res = runner.invoke(main, ["trace", "--out", str(tmp_path / "no" / "t.json"), "--policy", "nope"])
    assert res.exit_code == 2 and "unknown policy 'nope'" in res.output
    res = runner.invoke(main, ["trace", "--out", str(tmp_path / "no" / "t.json")])
    assert res.exit_code == 2 and "its folder does not exist (--out)" in res.output


def test_tight_packs_a_simulated_interleaved_job_in_the_chunk_format(tmp_path):
    """``pipefisher simulate --order interleaved --chunks 2``: chunk 1's keys end in ':chunk1', tight
    packs every node above its lower bound, and the packed schedule validates (per-chunk cov rule)."""
    res = CliRunner().invoke(main, ["simulate", "--config", BASE, "--order", "interleaved", "--chunks", "2",
                                    "--micro-batches", "4", "--out", str(tmp_path), "--prefix", "il"])
    assert res.exit_code == 0, res.output
    job = load_job(sorted(str(p) for p in tmp_path.glob("il_node*_timeline.pickle")))
    for node in job.nodes:
        assert node.chunks == (0, 1)
        assert node.micro_batches() == node.micro_batches(chunk=1) == 4
        assert any(k.endswith(":chunk1") and k.startswith("cov_kron_A:") for k in node.entries)
    packed = get_policy("tight").pack(job)
    assert validate(packed.to_file_data(), job, overlap=packed.overlap) == []
    for n in packed.nodes:
        assert n.figures.lower_bound is not None and n.figures.lower_bound <= n.figures.iterations


@pytest.mark.parametrize("order,policy", [("zb-v", "target"), ("zb-v", "tight"), ("dualpipev", "target"),
                                          ("dualpipev", "tight"), ("dualpipev", "best-fit"), ("dualpipev", "exact")])
def test_a_simulated_v_job_packs_validates_and_plots_end_to_end(tmp_path, order, policy):
    """``simulate --order zb-v`` (or ``dualpipev``, with every policy that packs ZB-V without violations:
    compat's own flaws show on ZB-V too), then ``schedule``, ``validate`` and ``plot`` on its files: the
    packed schedule keeps K-FAC off every W pass and validates; the default prefix says v2."""
    if policy == "exact":
        pytest.importorskip("ortools")
    runner = CliRunner()
    res = runner.invoke(main, ["simulate", "--config", BASE, "--order", order, "-m", "8", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert f"{order}, 4 stages, 8 micro-batches, 2 chunks" in res.output
    paths = sorted(str(p) for p in tmp_path.glob("*.pickle"))
    assert [os.path.basename(p) for p in paths] == [f"bert-base-4stages_{order}_p4_v2_m8_node{i}_timeline.pickle"
                                                    for i in range(4)]
    saved = str(tmp_path / "s.pickle")
    res = runner.invoke(main, ["schedule", *paths, "--policy", policy, "--save-path", saved])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["validate", "--schedule", saved, *paths])
    assert res.exit_code == 0 and "no violations" in res.output, res.output
    job = load_job(paths)
    assert {c for node in job.nodes for c in node.chunks} == {0, 1}
    assert any(node.weights(chunk=1) for node in job.nodes)
    res = runner.invoke(main, ["plot", *paths, "--packed", "--policy", policy, "--iterations", "1",
                               "--out", str(tmp_path / "c.png")])
    assert res.exit_code == 0 and (tmp_path / "c.png").stat().st_size > 0, res.output


def test_dualpipev_nodes_hold_full_backwards_as_one_interval_and_deferred_w_passes_apart():
    """Both chunks have m forwards and m backwards on every node; a full backward (B and W fused) is one
    ``call_backward`` interval, as is any W right after its B; the W passes the drain defers have their
    own key (none on the first node, which runs each W right after its B)."""
    m = 8
    timelines, result = simulate_timelines(load_cost_model(BASE), "dualpipe-v", micro_batches=m)
    s = result.order
    assert (s.name, s.chunks, s.layout, s.split_backward) == ("dualpipev", 2, "v", True)
    total = 0
    for d, node in enumerate(timelines):
        assert {k for k in node if k.startswith("call_")} <= {
            "call_forward", "call_backward", "call_backward:weight",
            "call_forward:chunk1", "call_backward:chunk1", "call_backward:weight:chunk1"}
        for suffix in ("", ":chunk1"):
            assert len(node["call_forward" + suffix]) == len(node["call_backward" + suffix]) == m
        deferred = len(node.get("call_backward:weight", [])) + len(node.get("call_backward:weight:chunk1", []))
        ops = s.devices[d]
        apart = sum(1 for a, b in zip(ops, ops[1:])
                    if b.kind == "W" and (a.kind, a.micro_batch, a.stage) != ("B", b.micro_batch, b.stage))
        assert deferred == apart, d
        total += deferred
    assert "call_backward:weight" not in timelines[0] and "call_backward:weight:chunk1" not in timelines[0]
    assert total > 0
    timed = {t.op: t for ops in result.devices for t in ops}
    for run in s.fused:  # a fused call runs without a gap on its device, its W right after its B
        for a, b in zip(run, run[1:]):
            assert timed[b].start == timed[a].end or a.kind == "F", run


def test_dualpipev_pair_sends_its_forward_after_its_backward():
    """An overlapped pair's forward output reaches the next stage after the pair's backward ends (plus
    the latency between nodes), not as the forward ends."""
    model = synthetic_model(stages=3, micro_batches=6, layers_per_stage=2, order="dualpipev", latency_ms=2.0)
    _, result = simulate_timelines(model)
    s = result.order
    timed = {t.op: t for ops in result.devices for t in ops}
    latency = round(2.0 * NS_PER_MS)
    f, b, w = next(run for run in s.fused if run[0].kind == "F" and run[0].stage < 2)
    nxt = next(op for op in timed if op.kind == "F" and op.micro_batch == f.micro_batch and op.stage == f.stage + 1)
    assert timed[nxt].start >= timed[w].end + latency > timed[f].end + latency


def test_a_refresh_in_pieces_writes_each_inverse_as_that_many_equal_back_to_back_intervals() -> None:
    import yaml

    with open(BASE) as f:
        data = yaml.safe_load(f)
    whole, _ = simulate_timelines(cost_model_from_dict(data, "base"))
    data["kfac"]["refresh_pieces"] = 3
    split, _ = simulate_timelines(cost_model_from_dict(data, "base"))
    inverses = [k for k in whole[0] if k.startswith("inv_kron_")]
    assert inverses
    for key in inverses:
        (s, e), = whole[0][key]
        pieces = split[0][key]
        assert len(pieces) == 3 and pieces[0][0] == split[0][key][0][0]
        assert sum(b - a for a, b in pieces) == e - s and max(b - a for a, b in pieces) - min(b - a for a, b in pieces) <= 1
        assert all(pieces[j][1] == pieces[j + 1][0] for j in range(2))
    # pieces of at most a width: as many as the inverse needs
    del data["kfac"]["refresh_pieces"]
    width = max(e - s for k in inverses for s, e in whole[0][k]) / NS_PER_MS / 2.5
    data["kfac"]["refresh_piece_ms"] = width
    wide, _ = simulate_timelines(cost_model_from_dict(data, "base"))
    assert max(len(wide[0][k]) for k in inverses) == 3
    assert all(b - a <= width * NS_PER_MS + 1 for k in inverses for a, b in wide[0][k])
    data["kfac"]["refresh_pieces"] = 0
    with pytest.raises(InputError, match="refresh_pieces"):
        cost_model_from_dict(data, "base")
