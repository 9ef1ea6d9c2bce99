"""``pipefisher run``: profile, pack, report and train with the schedule, in one command."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.launch.driver import config_yaml, run_paths

from _commands import torch_free
from _schedules import TINY, tiny


def _summary_of(rows: list[dict[str, str]], training: dict) -> bool:
    """Whether a report's training summary holds the figures of these metrics rows (every step of the run)."""
    import statistics

    losses = [float(r["loss"]) for r in rows if r["loss"]]
    return (training["first_loss"] == losses[0] and training["last_loss"] == losses[-1]
            and training["median_step_seconds"] == statistics.median(float(r["step_seconds"]) for r in rows[1:]))


def test_run_end_to_end_with_two_processes(tmp_path):
    """12 steps: a run trains no K-FAC cycle longer than itself, and a busy machine's profile packs longer."""
    out = tmp_path / "runs"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(out), "--steps", "12", "--profile-steps", "2",
                                    "--nproc-per-node", "2", "--name", "first", "--no-progress", "--log-every", "2",
                                    "--eval-every", "3"])
    assert res.exit_code == 0, res.output
    text = res.output
    assert "[1/3] profiling 2 kfac step(s)" in text and "[3/3] training 12 step(s)" in text
    assert "node0:" in text and "node1:" in text and "pipeline iterations (usage:" in text
    assert "mode scheduled, 2 stage(s) x 1 replica(s)" in text and "step     4  loss" in text
    names = sorted(os.listdir(out))
    assert names == ["first_chart.png", "first_checkpoints", "first_config.yaml", "first_cycles.jsonl", "first_measured",
                     "first_measurements.csv", "first_metrics.csv", "first_profile_losses.json", "first_profile_steps",
                     "first_report.json", "first_schedule.pickle", "first_schedule.pickle.meta.json", "first_schedules",
                     "first_timelines"]
    # the timelines folder holds the node files alone, so `pipefisher schedule <run>_timelines/*` reads one job
    assert sorted(os.listdir(out / "first_timelines")) == ["tiny_node0_timeline.pickle", "tiny_node1_timeline.pickle"]
    assert sorted(os.listdir(out / "first_profile_steps")) == ["tiny_node0_steps.pickle", "tiny_node1_steps.pickle"]
    assert CliRunner().invoke(main, ["schedule", *sorted(str(p) for p in (out / "first_timelines").iterdir())]).exit_code == 0
    assert json.loads((out / "first_profile_losses.json").read_text())["options"]["profile"] is True
    with open(out / "first_metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(12)) and {r["mode"] for r in rows} == {"scheduled"}
    assert all(float(r["loss"]) > 0 and float(r["step_seconds"]) > 0 for r in rows)
    assert [bool(r["val_loss"]) for r in rows] == [s % 3 == 2 for s in range(12)]  # held-out loss
    report = json.loads((out / "first_report.json").read_text())
    assert report["valid"] and report["policy"] == "target" and len(report["nodes"]) == 2
    assert report["tradeoff"]["candidates"]  # why its k: the run's report says it too
    assert report["training"]["cycle"] == max(n["iterations"] for n in report["nodes"])
    # the summary comes from the reporting worker (through the launcher), and says what the metrics say
    assert _summary_of(rows, report["training"])
    assert load_config(out / "first_config.yaml") == load_config(TINY)
    assert (out / "first_chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run name is taken now; the schedule it wrote runs with pipefisher train as well
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(out), "--name", "first"])
    assert res.exit_code == 2 and "already holds a run named 'first'" in res.output


def test_run_adapt_measures_repacks_and_writes_what_it_used(tmp_path):
    """--adapt: the run's steps are measured, the schedule is re-packed from them while it trains, every
    schedule used is kept with the step it took over, and the measured timelines pack like a profile."""
    out = tmp_path / "runs"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(out), "--steps", "24", "--profile-steps", "2",
                                    "--nproc-per-node", "2", "--name", "a", "--no-progress", "--adapt", "--overlap"])
    assert res.exit_code == 0, res.output
    assert "closed loop (adaptive scheduler):" in res.output and "gathers of the measurements" in res.output
    # --overlap taken with --adapt (whether tiny's packing overlaps depends on its profile's timings; the
    # re-packs' overlap is test_closed_loop's, on fixed timelines)
    history = json.loads((out / "a_schedules" / "history.json").read_text())["switches"]
    assert history[0]["step"] == 1 and history[0]["reason"] == "schedule file a_schedule.pickle"
    assert all((out / "a_schedules" / h["file"]).exists() for h in history)
    # each schedule used says whether its cycles overlap, beside it as the packer's do (validate reads it)
    from pipefisher.schedule.file import schedule_overlap

    assert history[0]["overlap"] == schedule_overlap(out / "a_schedule.pickle")
    assert all(h["overlap"] == schedule_overlap(out / "a_schedules" / h["file"]) for h in history)
    report = json.loads((out / "a_report.json").read_text())["training"]
    assert report["adapt"] and report["final_cycle"] == history[-1]["cycle"]
    assert len(report["switches"]) == len(history) - 1
    with open(out / "a_metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(r["cycle"] and r["overrun_seconds"] != "" for r in rows[1:])
    assert all(math.isfinite(float(r["loss"])) for r in rows)  # across every switch
    # the curvature drift of every complete cycle's refresh, in the metrics, the cycles and the report
    drift = {int(r["step"]): float(r["drift"]) for r in rows if r["drift"]}
    assert drift and all(d > 0 for d in drift.values()) and report["refreshes"] == len(drift)
    with open(out / "a_measurements.csv", newline="") as f:
        measured = list(csv.DictReader(f))
    assert {int(r["step"]) for r in measured} == set(range(1, 24)) and {r["node"] for r in measured} == {"0", "1"}
    assert all(float(r["measured_end"]) >= float(r["measured_start"]) for r in measured)
    cycles = [json.loads(line) for line in (out / "a_cycles.jsonl").read_text().splitlines()]
    assert {c["node"] for c in cycles} == {0, 1} and all(c["kfac_seconds"] and c["step_seconds"] > 0 for c in cycles)
    logged = {r["step"]: r for c in cycles for r in c["drift"]}
    assert {s: r["drift"] for s, r in logged.items()} == pytest.approx(drift, abs=1e-6)
    for c in cycles:  # each node's line names its own stage's layers
        assert all(name.startswith(f"{c['node']}/") for r in c["drift"] for name in r["layers"])
    res = CliRunner().invoke(main, ["schedule", *sorted(str(p) for p in (out / "a_measured").iterdir())])
    assert res.exit_code == 0 and "node1:" in res.output, res.output


def test_train_adapt_needs_a_schedule_and_a_known_policy(tmp_path):
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--adapt", "--no-progress"])
    assert res.exit_code == 2 and "--adapt re-packs a schedule while training: it needs --schedule FILE" in res.output
    from pipefisher.schedule.file import save_schedule

    from _schedules import packed_job_schedule, packed_schedule

    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, packed_schedule(tiny()))
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--schedule", sched, "--adapt", "--adapt-policy",
                                    "nope", "--no-progress", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "nope" in res.output and "Traceback" not in res.output
    # a schedule whose cycles overlap trains under --adapt too (a switch ends the refreshes under way), and
    # the run keeps it with its overlap recorded beside it
    import pickle

    from _schedules import fake_timelines
    from pipefisher.schedule.file import schedule_overlap

    timelines = []
    for n, raw in enumerate(fake_timelines(tiny())):
        timelines.append(str(tmp_path / f"tiny_node{n}_timeline.pickle"))
        with open(timelines[-1], "wb") as f:
            pickle.dump(raw, f)
    save_schedule(sched, packed_job_schedule(tiny(), overlap=True), timelines=timelines)
    assert schedule_overlap(sched)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--schedule", sched, "--adapt", "--no-progress",
                                    "--steps", "4", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    kept = sorted((tmp_path / "out").glob("*_schedules/step-00000001.pickle"))
    assert len(kept) == 1 and schedule_overlap(kept[0]), res.output


def test_default_run_names_sit_side_by_side(tmp_path):
    cfg = tiny()
    a = run_paths(str(tmp_path), cfg, "tight", now=lambda: 0.0)
    assert a.name.startswith("tiny-tight-") and a.schedule.endswith(f"{a.name}_schedule.pickle")
    (tmp_path / f"{a.name}_config.yaml").write_text("x")
    b = run_paths(str(tmp_path), cfg, "tight", now=lambda: 0.0)
    assert b.name == f"{a.name}-2"
    with pytest.raises(InputError, match="must be letters"):
        run_paths(str(tmp_path), cfg, "tight", name="../evil")


def test_config_yaml_round_trips():
    cfg = tiny(kfac={"ignore": ("embeddings", "cls")})
    import yaml

    from pipefisher.runtime.job.config import config_from_dict

    assert config_from_dict(yaml.safe_load(config_yaml(cfg))) == cfg


def test_run_rejects_bad_input_before_starting_workers(tmp_path):
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(tmp_path), "--policy", "nope"])
    assert res.exit_code == 2 and "unknown policy 'nope'" in res.output
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(tmp_path), "--nproc-per-node", "3"])
    assert res.exit_code == 2 and "not a multiple of the 2 pipeline stages" in res.output


def test_run_takes_the_jobs_staleness_curve_and_refuses_a_bad_one_before_starting_workers(tmp_path):
    for args, why in ((["--policy", "tight", "--staleness", "1:0.5"], "--staleness applies to the 'target' policy"),
                      (["--staleness", str(tmp_path / "none.json")], "none.json: no such file")):
        res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(tmp_path / "o"), *args])
        assert res.exit_code == 2 and why in res.output and res.output.count("\n") == 1, res.output


def test_cli_import_does_not_load_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pipefisher.cli"], capture_output=True,
                         text=True, check=True)
    assert "torch" not in out.stderr


def test_run_chimera_end_to_end(tmp_path):
    """The published workflow: profile Chimera with K-FAC, pack (pairs aligned), train from the schedule."""
    from pipefisher.safe_io import load_pickle
    from pipefisher.schedule.file import load_schedule, save_schedule

    out = tmp_path / "runs"
    # 30 steps: a pair's aligned cycle on a fresh profile is 4 to 7, and 13 on a busy machine; a run shorter
    # than every packing's cycle trains nothing (test_a_run_trains_no_cycle_longer_than_its_steps_chimera_pairs_aligned)
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--order", "chimera", "--out", str(out), "--steps", "30",
                                    "--profile-steps", "2", "--name", "c", "--no-progress", "--eval-every", "3",
                                    "--timeout", "30"])
    assert res.exit_code == 0, res.output
    assert "mode scheduled, 2 stage(s) x 1 replica(s), chimera" in res.output
    timelines = [str(out / "c_timelines" / f"tiny_node{i}_timeline.pickle") for i in range(2)]
    keys = set(load_pickle(timelines[0]))
    for kind in ("call_forward", "call_backward"):
        assert {kind, f"{kind}:up_pipe"} <= keys
    for kind in ("cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B", "inv_kron_A", "inv_kron_B"):
        assert any(k.startswith(kind + ":") and k.endswith(":up_pipe") for k in keys), kind
        assert any(k.startswith(kind + ":") and not k.endswith(":up_pipe") for k in keys), kind
    report = json.loads((out / "c_report.json").read_text())
    assert report["valid"] and report["training"]["steps"] == 30 and report["cycle"] <= 30
    schedule = str(out / "c_schedule.pickle")
    res = CliRunner().invoke(main, ["validate", "--schedule", schedule, *timelines])
    assert res.exit_code == 0, res.output
    data = load_schedule(schedule)
    for labels in data[1]:  # node 1 all-reduces two factors in the other order than node 0
        at = [i for i, label in enumerate(labels) if label.startswith("sync_kron")]
        if len(at) >= 2:
            labels[at[0]], labels[at[1]] = labels[at[1]], labels[at[0]]
            break
    bad = str(tmp_path / "bad.pickle")
    save_schedule(bad, data)
    res = CliRunner().invoke(main, ["validate", "--schedule", bad, *timelines])
    assert res.exit_code == 1 and "group-order" in res.output


def _chimera_profile() -> tuple:  # type: ignore[type-arg]
    """The profiled tiny Chimera job of tests/data, and the config it was profiled with."""
    import glob

    from pipefisher.schedule.timeline import load_job

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "profiles", "chimera_tiny_2")
    return load_job(sorted(glob.glob(os.path.join(here, "*.pickle")))), tiny(pipeline={"order": "chimera"})


def test_allow_invalid_trains_what_the_runtime_can_run_and_leaves_a_refused_schedule(tmp_path, monkeypatch):
    import pipefisher.policies.packing
    from pipefisher.policies import get_policy
    from pipefisher.rules.violations import Violation
    from pipefisher.runtime.launch.driver import RunPaths, pack_and_check

    job, cfg = _chimera_profile()
    quiet = {"margin": 0.05, "echo": lambda line: None}
    # compat breaks the dependency rules in a way no runtime can execute: refused even with the flag,
    # and the refused schedule stays beside its report for inspection
    paths = RunPaths(str(tmp_path), "c")
    with pytest.raises(InputError, match="the runtime cannot run .*cov-before-.*not even with --allow-invalid"):
        pack_and_check(job, get_policy("compat"), cfg, paths, 1, allow_invalid=True, **quiet)
    report = json.loads(open(paths.report).read())
    assert not report["valid"] and not report["runnable"] and "cov-before-" in report["runtime_refusal"]
    assert os.path.exists(paths.schedule) and os.path.exists(paths.chart)
    # a schedule validate rejects (a room rule, say) that the runtime can run: refused without the flag,
    # trained with it
    broken = Violation(0, 0, "-- end --", "bubble-overfilled", "made up for the test")
    monkeypatch.setattr(pipefisher.policies.packing, "validate", lambda *a, **k: [broken])  # the one check
    paths = RunPaths(str(tmp_path), "t")
    with pytest.raises(InputError, match="--allow-invalid trains it anyway: the runtime can run it"):
        pack_and_check(job, get_policy("tight"), cfg, paths, 1, allow_invalid=False, **quiet)
    assert os.path.exists(paths.schedule) and not json.loads(open(paths.report).read())["valid"]
    packed, report = pack_and_check(job, get_policy("tight"), cfg, RunPaths(str(tmp_path), "t2"), 1,
                                    allow_invalid=True, **quiet)
    assert not report["valid"] and report["runnable"] and len(packed.nodes) == 2


def test_a_run_trains_no_cycle_longer_than_its_steps_chimera_pairs_aligned(tmp_path):
    """The profiled Chimera pair packs k = 5 densely (3 per device before the pair is aligned): a 4-step
    run takes the shortest packing that fits, and says its cycle and planned overhead; a 3-step run,
    where no packing's aligned cycle fits, stops before training and says why and what it needs."""
    from pipefisher.policies import get_policy
    from pipefisher.runtime.launch.driver import RunPaths, pack_and_check

    job, cfg = _chimera_profile()
    lines: list[str] = []
    packed, report = pack_and_check(job, get_policy("target", max_cycle=4), cfg, RunPaths(str(tmp_path), "k4"), 1,
                                    margin=0.05, allow_invalid=False, steps=4, echo=lines.append)
    chosen = packed.tradeoff.chosen
    assert report["cycle"] == chosen.cost.cycle == max(n.figures.iterations for n in packed.nodes) <= 4
    assert report["within_run"] and report["planned_overhead"] == round(chosen.cost.overhead, 6)
    said = next(line for line in lines if "chosen:" in line)
    assert f"k = {report['cycle']} at margin {chosen.margin:g} (planned {100 * chosen.cost.overhead:.1f} % over " \
           "first-order)" in said and said.endswith("(cycles up to the run's 4 steps)")
    for policy in (get_policy("target", max_cycle=3), get_policy("tight")):  # tight: k = 5, from 3 and 3
        paths = RunPaths(str(tmp_path), policy.name)
        lines.clear()
        with pytest.raises(InputError, match=rf"policy '{policy.name}' packs no K-FAC cycle within the run's 3 steps "
                                             r"\(its shortest: k = \d+, \d before aligning Chimera's stage pairs\); "
                                             r"not training it.*give --steps \d+ or more"):
            pack_and_check(job, policy, cfg, paths, 1, margin=0.05, allow_invalid=False, steps=3, echo=lines.append)
        report = json.loads(open(paths.report).read())
        assert not report["within_run"] and report["cycle"] > 3 and report["steps"] == 3
        assert not any("cycles up to the run's" in line for line in lines)


def test_run_records_its_kfac_margin_and_validate_checks_the_same_job(tmp_path):
    """`run --kfac-margin 2` packs against K-FAC times x 2 and says `valid`; `pipefisher validate` reads
    the factor beside the schedule and checks the same job, so both give one answer."""
    from pipefisher.policies import get_policy
    from pipefisher.runtime.launch.driver import RunPaths, pack_and_check

    job, cfg = _chimera_profile()
    paths = RunPaths(str(tmp_path), "km2")
    packed, report = pack_and_check(job, get_policy("tight"), cfg, paths, 1, margin=0.05, allow_invalid=False,
                                    kfac_margin=2.0, echo=lambda line: None)
    assert report["valid"] and report["kfac_margin"] == 2.0
    meta_file = tmp_path / "km2_schedule.pickle.meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["kfac_margin"] == 2.0 and meta["packed_for"]["pipeline.order"] == "chimera"
    # the metadata every packing writes (torch_pp.wrap and `pipefisher schedule` too): the timelines' layout,
    # the config's shape over it
    assert set(meta) == {"format", "policy", "margin", "kfac_margin", "pipeline_time", "nodes", "timelines",
                         "packed_for"}
    assert meta["packed_for"]["layout"] == [1, True, False] and meta["packed_for"]["pipeline.stages"] == 2
    timelines = [n.path for n in job.nodes]
    res = CliRunner().invoke(main, ["validate", "--schedule", paths.schedule, *timelines])
    assert res.exit_code == 0, res.output
    assert "K-FAC times x 2, as recorded beside the schedule" in res.output
    # tampering: the same schedule checked on the profiled times (the record says x1) overflows ...
    meta_file.write_text(json.dumps({**meta, "kfac_margin": 1.0}))
    res = CliRunner().invoke(main, ["validate", "--schedule", paths.schedule, *timelines])
    assert res.exit_code == 1 and "unforced-overflow" in res.output
    # ... and a record that is no factor is refused in one line
    meta_file.write_text(json.dumps({**meta, "kfac_margin": "two"}))
    res = CliRunner().invoke(main, ["validate", "--schedule", paths.schedule, *timelines])
    assert res.exit_code == 2 and "holds no valid kfac_margin ('two'" in res.output


def test_run_offers_the_pipelines_and_chunks_train_offers():
    """One definition of --order's choices and --chunks for both commands; run applies --chunks."""
    def option(command: str, name: str):
        return next(p for p in main.commands[command].params if p.name == name)

    for name in ("order", "chunks"):
        run_opt, train_opt = option("run", name), option("train", name)
        assert run_opt.help == train_opt.help and run_opt.opts == train_opt.opts
    assert "interleaved" in option("run", "order").type.choices
    assert "interleaved" in option("run", "order").help
    # tiny has 4 layers: 2 stages x 3 chunks do not fit, which only an applied --chunks can say
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", "unused", "--order", "interleaved",
                                    "--chunks", "3", "--no-progress"])
    assert res.exit_code == 2 and "model.num_layers" in res.output and "Traceback" not in res.output, res.output


def test_the_profile_losses_leave_the_timelines_folder(tmp_path):
    from pipefisher.runtime.launch.driver import RunPaths, keep_only_timelines

    paths = RunPaths(str(tmp_path), "r")
    os.makedirs(paths.timelines)
    for name in ("tiny_node0_timeline.pickle", "tiny_losses.json", "tiny_tokenizer.json", "tiny_node0_steps.pickle",
                 "tiny_node1_steps.pickle"):
        (tmp_path / "r_timelines" / name).write_text(name)
    keep_only_timelines(paths, "tiny")
    assert os.listdir(paths.timelines) == ["tiny_node0_timeline.pickle"]
    assert open(paths.profile_losses).read() == "tiny_losses.json" and os.path.exists(paths.tokenizer)
    assert sorted(os.listdir(paths.profile_steps_dir)) == ["tiny_node0_steps.pickle", "tiny_node1_steps.pickle"]


def test_a_profile_a_busy_machine_slowed_says_so_per_node(tmp_path):
    """Slowed steps (another process on the machine) that would have moved a node's median step by more
    than STEADY are named in one line per node, with its fastest and slowest step; a node with a slow step
    or two (the usual jitter, the median as good as unmoved) says nothing."""
    from pipefisher.runtime.launch.driver import RunPaths, unsteady_profile_lines
    from pipefisher.safe_io import dump_pickle_atomic

    paths = RunPaths(str(tmp_path), "r")
    os.makedirs(paths.profile_steps_dir)
    ms = 1_000_000
    for node, took in enumerate(([300, 230, 226, 228, 231], [300, 320, 330, 216, 226], [300, 230, 226, 290, 228])):
        steps = [(1000 * ms * j, 1000 * ms * j + t * ms // 10) for j, t in enumerate(took)]
        dump_pickle_atomic(os.path.join(paths.profile_steps_dir, f"tiny_node{node}_steps.pickle"), {"start_end": steps})
    assert unsteady_profile_lines(paths, "tiny", 4) == [
        "profile: node 1: 2 of its 4 steps ran more than 10 % slower than its fastest (21.6 ms; up to 33.0 ms: "
        "another process on the machine?) and are left out of its timeline, the median of the other 2"]
    # a step with no end recorded: no durations to rank, every step used, nothing said
    dump_pickle_atomic(os.path.join(paths.profile_steps_dir, "tiny_node0_steps.pickle"),
                       {"start_end": [(0, 3 * ms), (1000 * ms, None), (2000 * ms, 2300 * ms)]})
    assert unsteady_profile_lines(paths, "tiny", 1) == []


@pytest.mark.parametrize("pipeline", ["zb-h1", "zb-v", "dualpipev"])
def test_run_a_zero_bubble_pipeline_end_to_end(tmp_path, pipeline):
    """Profile (W passes under their own keys), pack, validate and train with the schedule: the loss falls."""
    from pipefisher.schedule.timeline import load_job

    out = tmp_path / "runs"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--order", pipeline, "--out", str(out), "--steps", "24",
                                    "--profile-steps", "2", "--nproc-per-node", "2", "--name", "zb", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert f"mode scheduled, 2 stage(s) x 1 replica(s), {pipeline}" in res.output
    timelines = sorted(str(p) for p in (out / "zb_timelines").iterdir())
    job = load_job(timelines)
    assert all(node.weights() for node in job.nodes)  # every node profiled its W passes
    if pipeline in ("zb-v", "dualpipev"):
        assert all(node.weights(chunk=1) and node.forwards(chunk=1) for node in job.nodes)
    assert json.loads((out / "zb_report.json").read_text())["valid"]
    check = CliRunner().invoke(main, ["validate", "--schedule", str(out / "zb_schedule.pickle"), *timelines])
    assert check.exit_code == 0, check.output
    with open(out / "zb_metrics.csv", newline="") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 24 and sum(losses[-3:]) < sum(losses[:3])  # 24: longer than a busy machine's cycle


def test_run_validates_a_schedule_under_the_margin_its_policy_chose(tmp_path):
    """``target`` may pack under another margin than the one it was given (its trade-off picks one): the
    run checks the schedule under that margin, as ``pipefisher validate`` does from the metadata. This
    one-stage profile (from a real run), with a flat staleness curve (only the step counts), packs at
    margin 0.75; such schedules once broke 21 rules checked under the default 0.05."""
    import glob

    from pipefisher.policies import get_policy
    from pipefisher.runtime.launch.driver import RunPaths, pack_and_check
    from pipefisher.schedule.problem import DEFAULT_MARGIN
    from pipefisher.schedule.timeline import load_job

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "profiles", "tiny_one_stage")
    job = load_job(sorted(glob.glob(os.path.join(here, "*.pickle"))))
    packed, report = pack_and_check(job, get_policy("target", staleness="1:0.5,64:0.5"), tiny(pipeline={"stages": 1}),
                                    RunPaths(str(tmp_path), "m"), 1, margin=DEFAULT_MARGIN, allow_invalid=False,
                                    echo=lambda line: None)
    assert packed.margin != DEFAULT_MARGIN and report["valid"]


def test_run_reports_kfac_in_the_bubbles_apart_from_the_preconditioning_at_the_steps_end(tmp_path):
    """The runtime's profile records the update and its preconditioning: the run's report prints them
    per node after the published line, and its JSON carries them."""
    import glob

    from pipefisher.cost.objective import end_of_step
    from pipefisher.policies import get_policy
    from pipefisher.runtime.launch.driver import RunPaths, pack_and_check
    from pipefisher.schedule.timeline import format_time, load_job

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "profiles", "tiny_one_stage")
    job = load_job(sorted(glob.glob(os.path.join(here, "*.pickle"))))
    rest, prec = end_of_step(job.nodes[0])
    assert prec > 0
    lines: list[str] = []
    packed, report = pack_and_check(job, get_policy("tight"), tiny(pipeline={"stages": 1}), RunPaths(str(tmp_path), "p"),
                                    1, margin=0.05, allow_invalid=False, echo=lines.append)
    assert lines[0].startswith("node0:") and "pipeline iterations (usage: " in lines[0] and lines[1] == ""
    assert lines[2].startswith("node0: K-FAC in bubbles ") and (
        f"at the step's end: update {format_time(round(rest + prec))} (preconditioning {format_time(round(prec))} "
        "of it), exposed ") in lines[2]
    assert report["nodes"][0]["precondition_time"] == round(prec)


def test_run_resume_continues_a_run_where_its_checkpoint_stopped_with_its_schedule(tmp_path):
    """A one-stage run (in this process), resumed from 20 steps to 22: the run's schedule, config and
    options go on, its metrics hold every step once, and the model is the one a 22-step training with
    that schedule gives. (20 steps: a run trains no K-FAC cycle longer than itself, and a busy machine's
    profile of tiny packs to cycles of 5-7 and more.)"""
    import torch

    out = tmp_path / "runs"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--stages", "1", "--out", str(out), "--name", "r",
                                    "--steps", "20", "--profile-steps", "2", "--eval-every", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    schedule = (out / "r_schedule.pickle").read_bytes()
    res = CliRunner().invoke(main, ["run", "--resume", str(out), "--steps", "22", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert f"run r: resuming from {out / 'r_checkpoints'}, training up to 22 step(s) with its schedule" in res.output
    assert "mode scheduled, 1 stage(s) x 1 replica(s)" in res.output and "resuming after step 19" in res.output
    with open(out / "r_metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(22))
    assert [bool(r["val_loss"]) for r in rows] == [s % 2 == 1 for s in range(22)]  # --eval-every 2 went on
    training = json.loads((out / "r_report.json").read_text())["training"]
    assert training["steps"] == 22 and _summary_of(rows, training)  # the first run's steps included
    assert (out / "r_schedule.pickle").read_bytes() == schedule
    ck = str(tmp_path / "ck")
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--schedule", str(out / "r_schedule.pickle"),
                                    "--steps", "22", "--checkpoint-dir", ck, "--no-progress"])
    assert res.exit_code == 0, res.output
    whole = torch.load(os.path.join(ck, "step-00000022", "stage0-replica0.pt"), weights_only=True)["model"]
    resumed = torch.load(out / "r_checkpoints" / "step-00000022" / "stage0-replica0.pt", weights_only=True)["model"]
    assert all(torch.equal(t, resumed[k]) for k, t in whole.items())
    # nothing left to do, and a --set that changes more than the learning rate: said before torch loads,
    # the latter with the real reason (not the schedule's --allow-schedule-mismatch, which run has not)
    (done, said, torch_loaded), (code, err, torch_too) = torch_free([
        ["run", "--resume", str(out), "--steps", "22"],
        ["run", "--resume", str(out), "--steps", "24", "--set", "model.hidden_size=64", "--set", "optim.lr=0.5"]])
    assert (done, said, torch_loaded) == (0, f"nothing to do: the checkpoint in {out / 'r_checkpoints'} has 22 steps "
                                             "done, --steps is 22\n", False), said
    assert code == 2 and err.count("\n") == 1 and not torch_too, err
    assert err.startswith(f"error: {out / 'r_checkpoints'}: was written by a run with another config (differs in "
                          "model.hidden_size: 32 there, 64 here); a resumed run may change only its learning-rate "
                          "schedule and run-time settings (optim.lr, "), err
    assert "kfac.lr" in err and "allow-schedule-mismatch" not in err, err
    res = CliRunner().invoke(main, ["run", "--resume", str(out), "--steps", "6", "--stages", "2", "--policy", "tight"])
    assert (res.exit_code, res.output) == (2, "error: --policy, --stages: set a run up, which --resume continues as it "
                                              "was set up: drop them\n")
    res = CliRunner().invoke(main, ["run", "--resume", str(tmp_path), "--steps", "6"])
    assert (res.exit_code, res.output) == (2, f"error: {tmp_path}: holds no run's checkpoints (<run>_checkpoints); "
                                              "--resume takes the --out folder of a pipefisher run\n")


def _steps(path) -> list[int]:
    with open(path, newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_sigterm_in_run_checkpoints_this_run_and_prints_a_command_that_resumes_it(tmp_path):
    """SIGTERM (a cluster's notice before preemption) while a run trains, in a --out folder that holds an
    earlier run's checkpoint: this run stops at the next step boundary with a checkpoint there, its metrics
    so far kept, and one line names its own checkpoint and the command that resumes it (its --steps, not the
    default; --name, as the folder holds two runs), which, run as printed, trains to the end."""
    import shlex
    import signal

    from pipefisher.runtime.train.checkpoint import FORMAT, MANIFEST

    out = tmp_path / "runs"
    (out / "older_checkpoints").mkdir(parents=True)
    (out / "older_checkpoints" / MANIFEST).write_text(json.dumps({"format": FORMAT, "steps_done": 50}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["run", "--config", TINY, "--stages", "1", "--out", str(out), "--steps", "30", "--profile-steps", "1",
            "--no-progress", "--log-every", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "pipefisher", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step     2"):
                proc.send_signal(signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    [name] = [e[: -len("_checkpoints")] for e in os.listdir(out)
              if e.endswith("_checkpoints") and e != "older_checkpoints"]
    assert proc.returncode == 130 and err.count("\n") == 1, err
    done = int(err.split()[2])
    command = f"pipefisher run --steps 30 --no-progress --log-every 1 --resume {out} --name {name}"
    assert err == (f"interrupted after {done} of 30 training steps; the checkpoint in {out}/{name}_checkpoints has "
                   f"{done} steps done; resume with: {command}\n"), err
    assert 3 <= done < 30 and _steps(out / f"{name}_metrics.csv") == list(range(done))
    res = subprocess.run([sys.executable, "-m", *shlex.split(command)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and f"resuming after step {done - 1}" in res.stdout, res.stdout + res.stderr
    assert _steps(out / f"{name}_metrics.csv") == list(range(30))


def test_ctrl_c_while_profiling_says_so_and_leaves_no_half_run_behind(tmp_path, monkeypatch):
    """Stopped before its first checkpoint, a run cannot be resumed: the line says what was stopped and that
    its files are removed, and they are; an earlier run's files stay."""
    from pipefisher.runtime.launch import driver

    def launcher(*a, **k):  # noqa: ANN202
        def launch(opts):  # noqa: ANN202
            raise KeyboardInterrupt
        return launch

    out = tmp_path / "runs"
    out.mkdir()
    (out / "older_config.yaml").write_text("name: older\n")
    monkeypatch.setattr(driver, "launcher", launcher)
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(out), "--name", "r", "--no-progress"])
    assert res.exit_code == 130 and res.output.endswith(
        "[1/3] profiling 10 kfac step(s)\ninterrupted while profiling, before its first profiling step ended; "
        "nothing to resume: run r stopped before its first checkpoint, and its files are removed\n"), res.output
    assert os.listdir(out) == ["older_config.yaml"]


def test_ctrl_c_while_profiling_a_refresh_piece_count_removes_the_counts_profiles_too(tmp_path, monkeypatch):
    """``kfac.refresh_pieces=best`` profiles each count in ``<run>_pieces/``: a Ctrl-C there is said as any
    profile's, and the run's files, those folders included, are removed."""
    from pipefisher.runtime.launch import driver

    def launcher(*a, **k):  # noqa: ANN202
        def launch(opts):  # noqa: ANN202
            assert os.path.isdir(opts.log.out) and "r_pieces" in opts.log.out  # the count's own folder
            raise KeyboardInterrupt
        return launch

    out = tmp_path / "runs"
    monkeypatch.setattr(driver, "launcher", launcher)
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(out), "--name", "r", "--no-progress",
                                    "--set", "kfac.refresh_pieces=best"])
    assert res.exit_code == 130 and res.output.endswith(
        "[1/3] profiling 10 kfac step(s) (refresh in 1 piece; 1 of 3 counts)\ninterrupted while profiling, before "
        "its first profiling step ended; nothing to resume: run r stopped before its first checkpoint, and its "
        "files are removed\n"), res.output
    assert os.listdir(out) == []


def test_what_a_stop_stopped_is_said_by_phase():
    from pipefisher.cli.train import stopped_what
    from pipefisher.runtime.job.process import Interrupted

    assert stopped_what(Interrupted(3, phase="profiling", total=10), 200) == \
        "while profiling, after 3 of 10 profiling steps"
    assert stopped_what(Interrupted(None, phase="packing"), 200) == "while packing the schedule"
    assert stopped_what(Interrupted(45), 200) == "after 45 of 200 training steps"
    assert stopped_what(Interrupted(None), 200) == "before its first training step ended"
    assert stopped_what(Interrupted(None, phase="starting"), 200) == "while starting"


def test_overlap_is_refused_in_one_line_where_it_cannot_apply(tmp_path):
    """--overlap needs a policy that packs overlapping cycles: said before any work; --no-overlap is what the
    other policies do anyway; with --resume both are set-up options like --policy."""
    said = "--overlap applies to the 'target' and 'tight' policies only, not to 'compat'"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(tmp_path / "o"), "--overlap", "--policy", "compat"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and said in res.output, res.output
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(main, ["schedule", "--policy", "compat", "--no-overlap"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["run", "--resume", str(tmp_path), "--overlap"])
    assert res.exit_code == 2 and "--overlap: sets a run up" in res.output, res.output


@pytest.mark.parametrize("pieces", ["2", "auto"])
def test_refresh_pieces_under_chimera_go_on_to_the_run(tmp_path, monkeypatch, pieces):
    """Chimera's pair alignment keeps a refresh's pieces in order (test_policies_align), so `run` no longer
    refuses them: the job goes on to be profiled, packed and trained as set (run_job, stood in for here;
    a real run of 20 steps trains with a valid aligned cycle)."""
    import pipefisher.runtime.launch.driver

    jobs: list = []
    monkeypatch.setattr(pipefisher.runtime.launch.driver, "run_job", lambda cfg, out, **kw: jobs.append(cfg))
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--order", "chimera", "--out", str(tmp_path / "o"),
                                    "--set", f"kfac.refresh_pieces={pieces}", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert [(c.pipeline.order, str(c.kfac.refresh_pieces)) for c in jobs] == [("chimera", pieces)]


def test_run_takes_its_settings_from_the_config_file_and_refuses_a_bad_one_before_torch_loads(tmp_path):
    """``log.out`` stands for ``--out`` and ``adapt.staleness`` for ``--staleness`` (read, and refused,
    before any worker); a bad value is one line naming the file and the key, and torch is not loaded."""
    with open(TINY) as f:
        tiny_text = f.read()
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(tiny_text + f"log: {{out: {tmp_path / 'o'}}}\nadapt: {{staleness: {tmp_path / 'none.json'}}}\n")
    bad.write_text(tiny_text + "log: {out: o, every: 0}\n")
    (code, out, _), (bad_code, bad_out, torch_loaded) = torch_free([["run", "--config", str(good)],
                                                                     ["run", "--config", str(bad)]])
    assert code == 2 and "none.json: no such file" in out and out.count("\n") == 1, out
    assert bad_code == 2 and bad_out == f"error: {bad}: log.every must be at least 1 step, not 0\n" and not torch_loaded


def test_the_printed_resume_keeps_the_steps_a_config_files_run_section_gave(tmp_path, monkeypatch):
    """``run.steps: 30`` in the file and no ``--steps``: ``run --resume`` reads no config file, so the printed
    command says ``--steps 30`` (without it the resume would aim at the default)."""
    import json

    from pipefisher.cli.run import _interrupted
    from pipefisher.runtime.job.files import RunPaths
    from pipefisher.runtime.job.process import Interrupted
    from pipefisher.runtime.train.checkpoint import FORMAT, MANIFEST

    paths = RunPaths(str(tmp_path), "r")
    os.makedirs(paths.checkpoints)
    with open(os.path.join(paths.checkpoints, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "steps_done": 12}, f)
    monkeypatch.setattr(sys, "argv", ["pipefisher", "run", "--config", "c.yaml", "--out", str(tmp_path)])
    line = _interrupted(Interrupted(12, paths=paths), str(tmp_path), 30)
    assert line.endswith(f"resume with: pipefisher run --resume {tmp_path} --steps 30"), line
    monkeypatch.setattr(sys, "argv", ["pipefisher", "run", "--config", "c.yaml", "--steps", "30", "--out", str(tmp_path)])
    assert _interrupted(Interrupted(12, paths=paths), str(tmp_path), 30).count("--steps") == 1


def test_run_with_best_refresh_pieces_profiles_and_packs_each_count_and_trains_the_shortest_planned_step(tmp_path):
    """``kfac.refresh_pieces=best``: 1, 2 and 4 pieces each profiled and packed, one line with every count's
    planned step and the count kept by best_pieces; the report records them, the saved config holds the
    number, and the run folder is a normal run's, its timelines the kept count's (that many intervals per
    inverse key), which pipefisher schedule reads as one job."""
    from pipefisher.cost.objective import PiecesPacked, best_pieces, pieces_line
    from pipefisher.schedule.problem import INV_PREFIX
    from pipefisher.schedule.timeline import load_job

    out = tmp_path / "runs"  # 12 steps: room for every count's cycle (one profiled step is noisy: 4 pieces once packed at k = 5)
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(out), "--steps", "12", "--profile-steps", "1",
                                    "--name", "b", "--no-progress", "--set", "kfac.refresh_pieces=best"])
    assert res.exit_code == 0, res.output
    for i, p in enumerate((1, 2, 4), 1):
        assert f"[1/3] profiling 1 kfac step(s) (refresh in {p} piece{'s' if p > 1 else ''}; {i} of 3 counts)\n" \
            in res.output
    report = json.loads((out / "b_report.json").read_text())
    tried = [PiecesPacked(t["pieces"], t["planned_step_ms"], t["cycle"]) for t in report["pieces_tried"]]
    assert [t.pieces for t in tried] == [1, 2, 4]
    kept = best_pieces(tried).pieces
    line = next(x for x in res.output.splitlines() if x.startswith("refresh pieces: "))
    assert line == pieces_line(tried, best_pieces(tried)) and line.endswith(f"planned: {kept} kept")
    assert load_config(out / "b_config.yaml").kfac.refresh_pieces == kept  # what --resume and the fingerprint see
    assert sorted(os.listdir(out)) == ["b_chart.png", "b_checkpoints", "b_config.yaml", "b_cycles.jsonl", "b_measured",
                                       "b_measurements.csv", "b_metrics.csv", "b_profile_losses.json",
                                       "b_profile_steps", "b_report.json", "b_schedule.pickle",
                                       "b_schedule.pickle.meta.json", "b_schedules", "b_timelines"]
    timelines = sorted(str(p) for p in (out / "b_timelines").iterdir())
    job = load_job(timelines)
    counts = {len(node.intervals(k)) for node in job.nodes for k in node.entries if k.startswith(INV_PREFIX)}
    assert counts == {kept}
    assert report["planned_step_ms"] == next(t.step_ms for t in tried if t.pieces == kept)  # packed as tried
    assert CliRunner().invoke(main, ["schedule", *timelines]).exit_code == 0


def test_best_refresh_pieces_is_refused_in_one_line_where_nothing_resolves_it(tmp_path):
    """Before torch loads: pipefisher train (its schedule comes from a profile of one count) and a refresh that
    is not split (eigen)."""
    best = ["--set", "kfac.refresh_pieces=best"]
    results = torch_free([["train", "--config", TINY, "--mode", "kfac", *best],
                          ["run", "--config", TINY, "--out", str(tmp_path / "e"), *best, "--set", "kfac.inverse=eigen"]])
    said = ["kfac.refresh_pieces: best is chosen by pipefisher run (it profiles and packs each piece count and keeps "
            "the shorter cycle among the shortest planned steps); pipefisher train takes a number or auto",
            "kfac.refresh_pieces: best tries refreshes in more than 1 piece, which need kfac.inverse cholesky"]
    for (code, out, torch_loaded), why in zip(results, said):
        assert code == 2 and why in out and out.count("\n") == 1 and not torch_loaded, out
    assert not (tmp_path / "e").exists()
