"""``pipefisher train``'s command line: what it refuses before torch loads, and what Ctrl-C says."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipefisher.cli import main

from _schedules import ROOT, TINY


def _train_torch_free(args: list[str]) -> tuple[int, str, bool]:
    """``pipefisher train ARGS`` in a fresh interpreter: (exit code, stderr, whether torch was imported)."""
    code = ("import sys\nfrom pipefisher.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch' in sys.modules, code)\n")
    res = subprocess.run([sys.executable, "-c", code, "train", "--config", TINY, "--no-progress"] + args,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    torch_loaded, exit_code = res.stdout.split()[-2:]
    return int(exit_code), res.stderr, torch_loaded == "True"


@pytest.mark.parametrize("option, where", [("--metrics", "/proc/m.csv"), ("--out", "/proc/out"),
                                           ("--checkpoint-dir", "FILE/ck"), ("--metrics", "MISSING/m.csv")])
def test_an_output_that_cannot_be_written_is_refused_before_torch_loads(tmp_path, option, where):
    (tmp_path / "FILE").write_text("a file, not a folder")
    path = where.replace("FILE", str(tmp_path / "FILE")).replace("MISSING", str(tmp_path / "missing"))
    code, err, torch_loaded = _train_torch_free(["--steps", "2", option, path])
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {path}"), err
    assert option in err and not torch_loaded


def test_a_bad_config_is_refused_before_torch_loads(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hidden_size: 30, num_heads: 4}\n")
    code, err, torch_loaded = _train_torch_free(["--config", str(bad)])  # the later --config wins
    assert code == 2 and err.strip() == f"error: {bad}: model.hidden_size must be a multiple of model.num_heads"
    assert not torch_loaded


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
    code, err, torch_loaded = _train_torch_free(["--schedule", str(schedule), "--adapt", "--staleness",
                                                 str(tmp_path / "none.json")])
    assert code == 2 and err.strip() == f"error: {tmp_path / 'none.json'}: no such file" and not torch_loaded


def test_the_curve_reaches_the_adaptive_scheduler_through_the_workers_options():
    """``--staleness`` travels in the training options, as JSON, to the worker that runs the closed loop."""
    from pipefisher.closed_loop import Plan, make_scheduler
    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.launch.local import decode_spec, encode_spec
    from pipefisher.runtime.train.trainer import TrainOptions
    from pipefisher.staleness import StalenessCurve, staleness_data

    curve = StalenessCurve.parse("1:0.5,4:0.6")
    opts = TrainOptions(mode="scheduled", schedule="s.pickle", adapt=True, staleness=staleness_data(curve))
    _, back = decode_spec(encode_spec(load_config(TINY), opts))
    plan = Plan([[["-- start --", "-- end --"]]])
    scheduler = make_scheduler("adaptive", plan, 1, staleness=back.staleness_curve)
    assert scheduler.staleness.points == curve.points and scheduler.staleness.source == curve.source
    assert make_scheduler("adaptive", plan, 1, staleness=TrainOptions().staleness_curve).staleness is None


def test_ctrl_c_says_how_far_it_got_how_to_resume_and_where_the_worker_log_is(tmp_path):
    """Ctrl-C reaches the whole process group (the launcher and its two workers), as from a terminal."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.csv"
    args = ["train", "--config", TINY, "--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
            "--metrics", str(metrics), "--no-progress", "--log-every", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "pipefisher"] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step     2"):  # steps 0-2 done; the checkpoints of steps 1 and 2 are on their way
                os.killpg(proc.pid, signal.SIGINT)
                break
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Aborted!" not in err and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("interrupted after ") and " of 100000 steps; the checkpoint in " in err, err
    log = str(tmp_path / "tiny_workers.log")
    assert f"resume with: pipefisher {' '.join(args)} --resume {ck}; worker output in {log}\n" in err, err
    assert os.path.exists(log)


def test_ctrl_c_without_checkpoints_says_there_is_nothing_to_resume_from():
    from pipefisher.cli.train import interrupted_message
    from pipefisher.runtime.job.process import Interrupted

    line = interrupted_message(Interrupted(7), 20, None, ["pipefisher", "train", "--config", "c.yaml"])
    assert line == ("interrupted after 7 of 20 steps; no checkpoint to resume from (--checkpoint-dir DIR "
                    "writes them, --checkpoint-every N how often)")


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
