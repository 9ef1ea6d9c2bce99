"""``pipefisher train``'s command line: what it refuses before torch loads, and what Ctrl-C says."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError

from _commands import torch_free as _torch_free
from _schedules import ROOT, TINY


def test_an_output_that_cannot_be_written_is_refused_before_torch_loads(tmp_path):
    (tmp_path / "FILE").write_text("a file, not a folder")
    cases = [("--metrics", "/proc/m.csv", "cannot be written"), ("--out", "/proc/out", "is not writable"),
             ("--checkpoint-dir", "FILE/ck", "cannot be created"), ("--metrics", "MISSING/m.csv", "does not exist"),
             # a file where a folder goes: one line naming the option, not click's usage text
             ("--out", "FILE", "is a file; --out needs a folder"),
             ("--checkpoint-dir", "FILE", "is a file; --checkpoint-dir needs a folder"),
             ("--tensorboard", "FILE", "is a file; --tensorboard needs a folder"),
             ("--metrics", "FILE/m.csv", f"cannot be written: {tmp_path / 'FILE'} is a file, not a folder")]
    paths = [where.replace("FILE", str(tmp_path / "FILE")).replace("MISSING", str(tmp_path / "missing"))
             for _, where, _ in cases]
    results = _torch_free([["train", "--config", TINY, "--no-progress", "--steps", "2", option, path]
                           for (option, _, _), path in zip(cases, paths)])
    for (option, _, says), path, (code, err, torch_loaded) in zip(cases, paths, results):
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
        assert option in err and says in err and not torch_loaded, err


def test_a_bad_config_a_missing_pretrained_folder_or_data_file_are_refused_before_torch_loads(tmp_path):
    """By train and by run alike (run read its config only after loading torch: 2.2 s against 0.2 s)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hidden_size: 30, num_heads: 4}\n")
    missing = str(tmp_path / "gone")
    results = _torch_free([
        ["train", "--config", TINY, "--config", str(bad)],  # the later --config wins
        ["train", "--config", TINY, "--set", f"model.pretrained={missing}"],
        ["train", "--config", TINY, "--set", f"data.text={missing}.txt"],
        ["run", "--config", str(bad), "--out", str(tmp_path / "runs")],
        ["run", "--config", TINY, "--out", str(tmp_path / "runs"), "--set", f"model.pretrained={missing}"],
    ])
    assert [(code, torch_loaded) for code, _, torch_loaded in results] == [(2, False)] * 5, results
    assert [err for _, err, _ in results] == [
        f"error: {bad}: model.hidden_size must be a multiple of model.num_heads\n",
        f"error: {missing}: model.pretrained: no such file or folder (a folder save_pretrained or pipefisher "
        "export wrote)\n",
        f"error: {missing}.txt: data.text: no such file or folder\n",
        f"error: {bad}: model.hidden_size must be a multiple of model.num_heads\n",
        f"error: {missing}: model.pretrained: no such file or folder (a folder save_pretrained or pipefisher "
        "export wrote)\n"]
    assert not (tmp_path / "runs").exists()


def test_a_yaml_syntax_error_and_a_missing_resume_folder_are_one_line_before_torch_loads(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: tiny\nmodel: {hidden_size: 32\n")
    gone = tmp_path / "gone"
    results = _torch_free([["train", "--config", str(bad), "--no-progress"],
                           ["train", "--config", TINY, "--steps", "2", "--no-progress", "--resume", str(gone)]])
    assert [(code, torch_loaded) for code, _, torch_loaded in results] == [(2, False)] * 2, results
    assert [err for _, err, _ in results] == [
        f"error: {bad}: is not valid YAML: line 3, column 1: expected ',' or '}}', but got '<stream end>' "
        "(while parsing a flow mapping from line 2, column 8)\n",
        f"error: {gone}: does not exist (no such folder, so no checkpoint to resume from)\n"]
    assert not gone.exists()  # not made into an empty folder to checkpoint in


def test_adapt_policy_without_adapt_is_refused_in_one_line():
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--steps", "1", "--no-progress",
                                    "--adapt-policy", "best-fit"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert res.output.startswith("error: --adapt-policy: ") and "no --adapt" in res.output


def test_a_staleness_curve_needs_adapt_and_a_bad_one_is_refused_before_torch_loads(tmp_path):
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--steps", "1", "--no-progress",
                                    "--staleness", "1:0.5,4:0.6"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert res.output.startswith("error: --staleness: ") and "no --adapt" in res.output
    schedule = tmp_path / "s.pickle"
    schedule.write_bytes(b"")
    [(code, err, torch_loaded)] = _torch_free([["train", "--config", TINY, "--stages", "1", "--no-progress",
                                                "--out", str(tmp_path / "out"), "--schedule", str(schedule),
                                                "--adapt", "--staleness", str(tmp_path / "none.json")]])
    assert code == 2 and err.strip() == f"error: {tmp_path / 'none.json'}: no such file" and not torch_loaded


def test_the_curve_reaches_the_adaptive_scheduler_through_the_workers_options():
    """``--staleness`` travels in the training options, as JSON, to the worker that runs the closed loop."""
    from pipefisher.cost.staleness import StalenessCurve, staleness_data
    from pipefisher.loop.closed_loop import Plan, make_scheduler
    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.launch.local import decode_spec, encode_spec
    from pipefisher.runtime.train.trainer import TrainOptions

    curve = StalenessCurve.parse("1:0.5,4:0.6")
    opts = TrainOptions.of(mode="scheduled", schedule="s.pickle", adapt=True, staleness=staleness_data(curve))
    _, back = decode_spec(encode_spec(load_config(TINY), opts))
    plan = Plan([[["-- start --", "-- end --"]]])
    scheduler = make_scheduler("adaptive", plan, 1, staleness=back.adapt.staleness_curve)
    assert scheduler.staleness.points == curve.points and scheduler.staleness.source == curve.source
    assert make_scheduler("adaptive", plan, 1, staleness=TrainOptions.of().adapt.staleness_curve).staleness is None


def test_without_a_curve_adapt_keeps_the_packings_cycle_and_adapt_drift_turns_the_drift_rule_on():
    """The drift rule is opt-in: ``--adapt`` alone gives the adaptive scheduler no rule (k stays the
    packing's); ``--adapt-drift`` travels in the workers' options and gives it one."""
    from pipefisher.loop.closed_loop import Plan, make_scheduler
    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.launch.local import decode_spec, encode_spec
    from pipefisher.runtime.train.trainer import TrainOptions, adaptive_options

    plan = Plan([[["-- start --", "cov_kron_A:l", "-- end --"], ["-- start --", "-- end --"]]])
    made = {}
    for drift in (False, True):
        opts = TrainOptions.of(mode="scheduled", schedule="s.pickle", adapt=True, adapt_drift=drift, steps=100)
        _, back = decode_spec(encode_spec(load_config(TINY), opts))
        made[drift] = make_scheduler("adaptive", plan, 1, **adaptive_options(back, 0.05))
    assert made[False].rule is None and made[False].fixed_k == 2
    assert made[True].rule is not None and made[True].rule.cycle == 2 and made[True].fixed_k is None
    with pytest.raises(InputError, match="--adapt-drift: lets the drift rule set --adapt's cycle, and there is no"):
        TrainOptions.of(mode="scheduled", schedule="s.pickle", adapt_drift=True)


@pytest.mark.parametrize("command", ["train", "run"])
def test_adapt_drift_needs_adapt_and_no_curve_in_one_line(tmp_path, command):
    where = ["--out", str(tmp_path / "o")] + (["--schedule", str(tmp_path / "s.pickle")] if command == "train" else [])
    (tmp_path / "s.pickle").write_bytes(b"")
    for extra, why in (([], "there is no --adapt"), (["--adapt", "--staleness", "1:0.5,4:0.6"], "the curve sets it")):
        res = CliRunner().invoke(main, [command, "--config", TINY, "--stages", "1", "--no-progress", *where,
                                        "--adapt-drift", *extra])
        assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
        assert res.output.startswith("error: --adapt-drift: ") and why in res.output


def test_ctrl_c_checkpoints_every_worker_at_one_step_and_prints_a_command_that_resumes(tmp_path):
    """Ctrl-C reaches the whole process group (the launcher and its two workers), as from a terminal: without
    --checkpoint-every, every worker stops at the same step boundary and the checkpoint is written there; the
    line says how far it got, the command that resumes (run here as printed: it trains to the end) and where
    the worker log is; the metrics so far are in their file.

    A terminal's Ctrl-C meets processes that handle SIGINT, so the command starts with SIGINT's default
    action: a test runner started in the background of a script (``pytest &``) ignores SIGINT, every
    process it starts inherits that, and the run would go on training after the Ctrl-C (the "hang" two
    whole-suite runs once showed)."""
    import csv
    import shlex

    ck, metrics = tmp_path / "ck", tmp_path / "m.csv"
    args = ["train", "--config", TINY, "--steps", "40", "--checkpoint-dir", str(ck), "--metrics", str(metrics),
            "--no-progress", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pipefisher"] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step     2"):  # steps 0-2 done
                os.killpg(proc.pid, signal.SIGINT)
                break
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say who was left, and where
            ps = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,etime,args", "-g", str(proc.pid)],
                                capture_output=True, text=True).stdout
            pytest.fail(f"still running 60 s after Ctrl-C:\n{ps}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Aborted!" not in err and "Traceback" not in err and err.count("\n") == 1, err
    done = int(err.split()[2])
    assert 3 <= done < 40 and err.startswith(f"interrupted after {done} of 40 training steps; the checkpoint in "
                                             f"{ck} has {done} steps done; resume with: "), err
    log = str(tmp_path / "tiny_workers.log")
    command = f"pipefisher {shlex.join(args)} --resume {ck}"
    assert err.endswith(f"resume with: {command}; worker output in {log}\n"), err
    assert os.path.exists(log) and sorted(os.listdir(ck)) == ["checkpoint.json", f"step-{done:08d}"]
    with open(metrics, newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(done))
    res = subprocess.run([sys.executable, "-m", *shlex.split(command)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 0 and f"resuming after step {done - 1}" in res.stdout, res.stdout + res.stderr
    with open(metrics, newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(40))


def test_ctrl_c_without_checkpoints_says_there_is_nothing_to_resume_from():
    from pipefisher.cli.train import interrupted_message
    from pipefisher.runtime.job.process import Interrupted

    line = interrupted_message(Interrupted(7), 20, None, ["pipefisher", "train", "--config", "c.yaml"])
    assert line == ("interrupted after 7 of 20 training steps; no checkpoint to resume from (--checkpoint-dir DIR "
                    "writes them, at the end, every --checkpoint-every N steps and on Ctrl-C or SIGTERM)")


def test_the_resume_command_is_the_command_line_with_resume_added():
    from pipefisher.cli.train import resume_command

    argv = ["/usr/bin/pipefisher", "train", "--config", "my run.yaml", "--checkpoint-dir", "ck"]
    assert resume_command(argv, "ck") == "pipefisher train --config 'my run.yaml' --checkpoint-dir ck --resume ck"
    assert resume_command(argv + ["--resume", "ck"], "ck").count("--resume") == 1


@pytest.mark.parametrize("command", ["train", "run"])
def test_muon_on_a_torch_without_it_is_refused_in_one_line_before_any_worker(tmp_path, monkeypatch, command):
    import torch

    from pipefisher.runtime.launch import local

    monkeypatch.delattr(torch.optim, "Muon")
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    monkeypatch.setattr(local, "spawn_local", lambda *a, **k: pytest.fail("a worker started"))
    args = ["--nproc-per-node", "2"] if command == "train" else ["--out", str(tmp_path / "out")]
    res = CliRunner().invoke(main, [command, "--config", TINY, "--no-progress", "--steps", "2",
                                    "--set", "optim.name=muon"] + args)
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: {TINY}: optim.name muon needs torch >= 2.9 (torch.optim.Muon); this torch is 2.8.0: "
                    "pip install 'torch>=2.9', or choose another optim.name\n"), res.output


def test_a_second_run_into_the_same_out_is_refused_and_the_first_ones_files_stay(tmp_path):
    """The new user's two runs into runs/s1 (here in one process, one stage): the second is refused in one
    line naming the fixes, before it trains, and the first run's files are as it left them."""
    out = tmp_path / "s1"
    base = ["train", "--config", TINY, "--stages", "1", "--no-progress", "--out", str(out)]
    res = CliRunner().invoke(main, base + ["--mode", "kfac", "--steps", "2"])
    assert res.exit_code == 0, res.output
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "tiny_losses.json" in before
    res = CliRunner().invoke(main, base + ["--mode", "first-order", "--steps", "1"])
    assert res.exit_code == 2 and res.output == (
        f"error: {out}: already holds the files of a run named 'tiny' (tiny_config.yaml, {len(before)} in all); a "
        "second run would overwrite them: choose another --out, or another name (--set name=NEW), or continue "
        "that run with --resume\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    res = CliRunner().invoke(main, base + ["--mode", "first-order", "--steps", "1", "--set", "name=second"])
    assert res.exit_code == 0, res.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before


@pytest.mark.parametrize("option, held, says", [
    ("--metrics", "m.csv", "already exists: a second run would overwrite its rows (--metrics); choose another file "
                           "or remove it (a run continued with --resume keeps the earlier rows)"),
    ("--tensorboard", "tb/events.out.tfevents.1.host", "already holds a TensorBoard run; a second run's curves would "
                                                       "interleave with it (--tensorboard): give each run its own "
                                                       "folder, e.g. --tensorboard TB/run2 (tensorboard --logdir TB "
                                                       "shows all), or continue that run with --resume"),
    ("--checkpoint-dir", "ck/checkpoint.json", "already holds a checkpoint (--checkpoint-dir): --resume CK continues "
                                               "that run; choose another folder or remove it to start anew"),
])
def test_an_earlier_runs_metrics_tensorboard_run_or_checkpoint_is_not_written_over(tmp_path, option, held, says):
    path = tmp_path / held
    path.parent.mkdir(exist_ok=True)
    path.write_text("the earlier run's")
    target = str(path if option == "--metrics" else path.parent)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--steps", "1", "--no-progress",
                                    option, target])
    says = says.replace("TB", str(tmp_path / "tb")).replace("CK", str(tmp_path / "ck"))
    assert (res.exit_code, res.output) == (2, f"error: {target}: {says}\n")
    assert path.read_text() == "the earlier run's"


def test_adapt_without_out_is_refused_in_one_line():
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--schedule", "s.pickle", "--adapt", "--no-progress"])
    assert (res.exit_code, res.output) == (2, "error: --adapt: writes the schedules it re-packs and the measurements "
                                              "they come from into --out DIR, and there is no --out: add --out DIR\n")


@pytest.mark.parametrize("command", ["train", "run"])
def test_a_pipeline_option_the_config_cannot_take_is_blamed_on_the_option(command, tmp_path):
    res = CliRunner().invoke(main, [command, "--config", TINY, "--order", "zb-v", "--chunks", "3", "--no-progress",
                                    *(["--out", str(tmp_path)] if command == "run" else [])])
    assert (res.exit_code, res.output) == (2, "error: --order zb-v --chunks 3: pipeline.order zb-v has exactly "
                                              "2 model chunks per device (its V): pipeline.chunks must be 2\n")


@pytest.mark.parametrize("command", ["train", "run"])
def test_dualpipev_with_fewer_than_two_micro_batches_per_stage_is_refused_in_one_line(command, tmp_path):
    res = CliRunner().invoke(main, [command, "--config", TINY, "--order", "dualpipev", "--set",
                                    "data.num_micro_batches=3", "--no-progress",
                                    *(["--out", str(tmp_path)] if command == "run" else [])])
    assert (res.exit_code, res.output) == (
        2, "error: --order dualpipev: pipeline.order dualpipev with data.num_micro_batches 3: dualpipev: "
           "needs micro-batches >= 2 x stages = 4 (one per virtual stage), got 3 (torch's ScheduleDualPipeV "
           "refuses it too)\n")


def test_a_relative_pretrained_path_is_made_absolute_where_the_run_starts(tmp_path, monkeypatch):
    from pipefisher.cli._runconfig import read_run_config

    (tmp_path / "gpt2-out").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = read_run_config(TINY, ("model.pretrained=gpt2-out",), "train", {})
    assert cfg.model.pretrained == str(tmp_path / "gpt2-out")


def test_ctrl_c_beside_an_older_formats_checkpoint_is_still_one_line(tmp_path):
    from pipefisher.cli.train import interrupted_message
    from pipefisher.runtime.job.process import Interrupted
    from pipefisher.runtime.train.checkpoint import MANIFEST

    (tmp_path / MANIFEST).write_text('{"format": 2, "steps_done": 3}')
    line = interrupted_message(Interrupted(7), 20, str(tmp_path), ["pipefisher", "train"])
    assert line.startswith("interrupted after 7 of 20 training steps; the checkpoint there cannot be resumed: ") and \
        "format 2" in line and "\n" not in line, line


def test_the_pipeline_order_is_order_and_its_old_spellings_still_train_saying_the_new_name():
    """``--set pipeline.order=`` and ``--order`` (issue 47's target command, here on one stage in this
    process), and the old ``--set pipeline.schedule=`` and ``--pipeline``: the same run, a notice each."""
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:  # click >= 8.2 keeps them apart anyway
        runner = CliRunner()
    spellings = {("--set", "pipeline.order=gpipe"): "", ("--order", "gpipe"): "",
                 ("--set", "pipeline.schedule=gpipe"): "note: --set pipeline.schedule is now --set pipeline.order",
                 ("--pipeline", "gpipe"): "note: --pipeline is now --order"}
    for args, notice in spellings.items():
        res = runner.invoke(main, ["train", "--config", TINY, *args, "--stages", "1", "--steps", "1", "--no-progress"])
        assert res.exit_code == 0, res.output
        assert "mode first-order, 1 stage(s) x 1 replica(s), gpipe," in res.stdout
        assert res.stderr == (notice + " (the old name still works)\n" if notice else "")


def _one_stage_config(tmp_path, settings: str) -> str:
    """configs/tiny.yaml on one stage (this process), with ``settings`` (run settings as sections) added."""
    path = tmp_path / "c.yaml"
    with open(TINY) as f:
        path.write_text(f.read() + "\n" + settings)
    return str(path)


def test_a_config_files_run_settings_train_as_the_flags_would_and_a_flag_overrides_the_file(tmp_path):
    """One stage in this process: the same losses from ``run:``/``log:`` sections as from the flags; a flag
    given wins over its key; a setting ``run`` has no flag for is one line naming the file and the key."""
    import csv

    runner = CliRunner()
    by_file = _one_stage_config(tmp_path, f"run: {{steps: 3, mode: kfac}}\nlog: {{every: 1, progress: false, "
                                          f"metrics: {tmp_path / 'file.csv'}}}\n")
    flags = ["--mode", "kfac", "--steps", "3", "--log-every", "1", "--no-progress", "--metrics", str(tmp_path / "flags.csv")]
    said = []
    for args in (["--config", by_file], ["--config", by_file, "--steps", "2", "--metrics", str(tmp_path / "over.csv"),
                                         "--progress"], ["--config", TINY, *flags]):
        res = runner.invoke(main, ["train", *args, "--stages", "1"])
        assert res.exit_code == 0, res.output
        said.append("loading torch" in res.output)
    assert said == [False, True, False]  # log.progress: false, and --progress over it
    losses = {name: [row["loss"] for row in csv.DictReader(open(tmp_path / f"{name}.csv"))]
              for name in ("file", "over", "flags")}
    assert len(losses["file"]) == 3 and losses["file"] == losses["flags"]
    assert losses["over"] == losses["file"][:2]
    res = runner.invoke(main, ["run", "--config", _one_stage_config(tmp_path, "run: {mode: kfac}\n"), "--out", "o"])
    assert res.exit_code == 2 and "c.yaml: run.mode: pipefisher run does not take this setting" in res.output
