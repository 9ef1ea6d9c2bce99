"""Training end to end: loss goes down in each mode, profiles feed the scheduler, failures are loud."""
from __future__ import annotations

import json
import os
import statistics
import time

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.job.dist import StageMismatchError, single_process
from pipefisher.runtime.launch.local import WorkerFailed, launch_local, run_worker, spawn_local
from pipefisher.runtime.train.trainer import Trainer, TrainOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _went_down(losses: list[float], margin: float = 0.2) -> bool:
    return statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - margin


@pytest.mark.parametrize("mode", ["first-order", "kfac"])
def test_loss_goes_down_in_one_process(mode):
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    result = Trainer(cfg, single_process(), TrainOptions.of(mode=mode, steps=30, progress=False)).run()
    assert len(result.losses) == 30 and _went_down(result.losses), result.losses


@pytest.mark.parametrize("mode,schedule", [("first-order", "gpipe"), ("kfac", "1f1b")])
def test_cli_train_two_stages_loss_goes_down(tmp_path, mode, schedule):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--nproc-per-node", "2", "--mode", mode,
                                    "--order", schedule, "--steps", "30", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert f"mode {mode}, 2 stage(s) x 1 replica(s)" in res.output and "step    25  loss" in res.output
    report = json.loads((out / "tiny_losses.json").read_text())
    assert report["mode"] == mode and _went_down(report["losses"]), report["losses"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A profile of 3 kfac steps on 2 workers, with the progress lines (start-up phases) shown."""
    out = tmp_path_factory.mktemp("profile")
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--profile", "--steps", "3", "--out", str(out),
                                    "--nproc-per-node", "2"])
    assert res.exit_code == 0, res.output
    return out, [str(out / f"tiny_node{i}_timeline.pickle") for i in range(2)], res.output.splitlines()


def test_profile_writes_one_timeline_per_node_in_the_profiled_format(profiled):
    """Beside each node's timeline (the median step) lie all its profiled steps as recorded."""
    from pipefisher.safe_io import load_pickle
    from pipefisher.schedule.timeline import median_step

    _, paths, _ = profiled
    for node, path in enumerate(paths):
        raw = load_pickle(path.replace("_timeline.pickle", "_steps.pickle"))
        tl = load_pickle(path)
        assert tl == median_step(raw)
        for steps, d in ((3, raw), (1, tl)):
            assert len(d["start_end"]) == len(d["update"]) == len(d["precondition"]) == steps
            assert len(d["call_forward"]) == len(d["call_backward"]) == steps * 4
            layers = sorted({k.split(":", 1)[1] for k in d if k.startswith("cov_kron_A:")})
            assert len(layers) == 12 and all(f"encoder.layer.{2 * node}." in n or f"encoder.layer.{2 * node + 1}."
                                             in n for n in layers)
            for kind in ("cov_kron_A", "cov_kron_B", "inv_kron_A", "inv_kron_B"):
                assert all(len(d[f"{kind}:{n}"]) == steps for n in layers)
            assert not any(k.startswith("sync_kron") for k in d)  # one replica: nothing to all-reduce
            for intervals in d.values():
                assert all(isinstance(s, int) and isinstance(e, int) and 0 <= s <= e for s, e in intervals)
            for j, (s0, e0) in enumerate(d["start_end"]):
                (u0, u1), (p0, p1) = d["update"][j], d["precondition"][j]
                # the update ends the step, after its last backward; preconditioning lies inside it
                assert s0 <= d["call_backward"][4 * j + 3][1] <= u0 <= p0 <= p1 <= u1 <= e0
                assert all(s0 <= s <= e <= e0 for s, e in d["call_forward"][4 * j:4 * j + 4])


def test_profile_loads_and_packs_in_the_scheduler(profiled):
    from pipefisher.schedule.timeline import load_job

    out, paths, _ = profiled
    assert len(load_job(paths).nodes) == 2
    assert [n.path for n in load_job([str(out)]).nodes] == paths  # the folder: the raw steps left out
    res = CliRunner().invoke(main, ["schedule", *paths, "--save-path", str(out / "sched.pickle")])
    assert res.exit_code == 0, res.output
    assert "node0:" in res.output and "node1:" in res.output


@pytest.mark.parametrize("policy", ["tight", "best-fit"])
def test_profile_schedule_validates_with_a_dependency_correct_policy(profiled, policy):
    out, paths, _ = profiled
    sched = str(out / f"sched-{policy}.pickle")
    res = CliRunner().invoke(main, ["schedule", *paths, "--policy", policy, "--save-path", sched])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["validate", *paths, "--schedule", sched])
    assert res.exit_code == 0, res.output


def _dies_at_start(cfg_path: str) -> None:
    """Rank 1 vanishes after joining; rank 0 trains and must fail on its timeout, not hang."""
    from pipefisher.runtime.job.dist import init_from_env

    cfg = load_config(cfg_path).replace(pipeline={"timeout_s": 3.0})
    ctx = init_from_env(2, cfg.pipeline.timeout_s)
    if ctx.grid.rank == 1:
        os._exit(0)
    Trainer(cfg, ctx, TrainOptions.of(steps=2, progress=False)).run()


def test_a_dead_worker_gives_a_clear_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as err:
        spawn_local(_dies_at_start, 2, TINY, timeout_s=60)
    assert time.monotonic() - t0 < 45
    assert "PeerLost" in str(err.value) and "stage 0 of replica 0 (rank 0) failed at step 0" in str(err.value)


def _mismatched(cfg_path: str) -> None:
    rank = int(os.environ["RANK"])
    cfg = load_config(cfg_path).replace(optim={"lr": 0.1 * (rank + 1)}, pipeline={"timeout_s": 10.0})
    run_worker(cfg, TrainOptions.of(steps=1, progress=False))


def test_workers_with_different_configs_refuse_to_start():
    with pytest.raises(WorkerFailed) as err:
        spawn_local(_mismatched, 2, TINY, timeout_s=60)
    assert StageMismatchError.__name__ in str(err.value) and "ranks [1] differ from rank 0" in str(err.value)


def test_launcher_reports_a_failing_worker(tmp_path):
    cfg = load_config(TINY).replace(data={"text": str(tmp_path / "missing.txt")})
    lines: list[str] = []
    with pytest.raises(WorkerFailed, match=r"worker rank \d of 2 exited with code 2: error: .*missing.txt"):
        launch_local(cfg, TrainOptions.of(steps=1, progress=False), 2, echo=lines.append)


def test_cli_rejects_a_bad_layout_as_input_error():
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--nproc-per-node", "3"])
    assert res.exit_code == 2 and "not a multiple of the 2 pipeline stages" in res.output



def _config_file(tmp_path, **sections) -> str:
    """configs/tiny.yaml with some sections changed, written as a YAML file for the CLI."""
    import yaml

    from pipefisher.runtime.launch.driver import config_yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(config_yaml(load_config(TINY).replace(**sections)))
    yaml.safe_load(path.read_text())
    return str(path)


def test_train_on_real_text_evaluates_held_out_loss_and_records_the_run(tmp_path):
    cfg = _config_file(tmp_path, data={"text": "stdlib", "val_batches": 2},
                       optim={"name": "adamw", "lr": 3e-3, "warmup_steps": 2, "lr_schedule": "linear"})
    out, metrics = tmp_path / "out", tmp_path / "m.csv"
    res = CliRunner().invoke(main, ["train", "--config", cfg, "--nproc-per-node", "2", "--mode", "kfac",
                                    "--steps", "6", "--eval-every", "3", "--out", str(out), "--metrics",
                                    str(metrics), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "held-out" in res.output and "peak memory" in res.output and "K-FAC saved tensors" in res.output
    rows = [line.split(",") for line in metrics.read_text().splitlines()]
    assert rows[0] == ["step", "loss", "val_loss", "lr", "step_seconds", "mode", "cycle", "overrun_seconds", "drift",
                       "aging"]
    assert [r[2] != "" for r in rows[1:]] == [False, False, True, False, False, True]
    assert all(r[6] == r[7] == "" for r in rows[1:])  # no schedule: no cycle, nothing measured
    # a curvature refresh every step: its drift from step 1 on (step 0's has nothing to compare with), its
    # aging from step 2 on (against the refresh two back)
    assert [r[8] != "" for r in rows[1:]] == [False] + [True] * 5 and all(float(r[8]) > 0 for r in rows[2:])
    assert [r[9] != "" for r in rows[1:]] == [False] * 2 + [True] * 4
    lrs = [float(r[3]) for r in rows[1:]]
    assert lrs[0] == pytest.approx(1.5e-3) and lrs[1] == pytest.approx(3e-3) and lrs[-1] < lrs[1]  # warm-up, decay
    report = json.loads((out / "tiny_losses.json").read_text())
    assert [v[0] for v in report["val"]] == [3, 6] and report["peak_memory_bytes"] > 0
    assert [r["step"] for r in report["drift"]] == [1, 2, 3, 4, 5]  # every layer of both stages, per refresh
    assert {name.split("/")[0] for name in report["drift"][0]["layers"]} == {"0", "1"}
    assert [f"{r['drift']:.6f}" for r in report["drift"]] == [r[8] for r in rows[2:]]
    assert "curvature drift over 5 refresh(es)" in res.output
    vocab = json.loads((out / "tiny_tokenizer.json").read_text())["model"]["vocab"]
    assert vocab["[MASK]"] == 4 and len(vocab) <= 100


def test_a_factor_that_cannot_be_inverted_stops_the_run_with_one_line(tmp_path):
    # a learning rate that blows the weights up: the next factors are not positive definite
    sections = dict(model={"num_layers": 2}, optim={"name": "sgd", "lr": 1e12, "momentum": 0.0},
                    kfac={"damping": 1e-3})
    cfg = _config_file(tmp_path, **sections)
    res = CliRunner().invoke(main, ["train", "--config", cfg, "--stages", "1", "--mode", "kfac", "--steps", "4",
                                    "--no-progress"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("Error: K-FAC layer encoder.layer.0.") and "factor" in last
    res = CliRunner().invoke(main, ["train", "--config", cfg, "--nproc-per-node", "2", "--mode", "kfac",
                                    "--steps", "4", "--no-progress"])
    assert res.exit_code == 1 and "exited with code 1: error: K-FAC layer encoder.layer." in res.output


def test_skip_keeps_training_past_a_bad_factor(tmp_path):
    sections = dict(model={"num_layers": 2}, optim={"name": "sgd", "lr": 1e12, "momentum": 0.0},
                    kfac={"damping": 1e-3, "on_bad_factor": "skip"})
    res = CliRunner().invoke(main, ["train", "--config", _config_file(tmp_path, **sections), "--stages", "1",
                                    "--mode", "kfac", "--steps", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "kept the previous inverse (kfac.on_bad_factor: skip)" in res.output


# ----------------------------------------------------------------------------------------------------
# progress: start-up is not silent (the bar: tests/test_cli_progress.py)


def _phase_order(lines: list[str]) -> list[str]:
    """The start-up milestones in the order they were printed."""
    keys = ("... spawning", "... loading data", "... building the model", "pipefisher train:", "... first step",
            "step     0")
    return [k for line in lines for k in keys if line.startswith(k)]


def test_one_process_says_each_start_up_phase_before_the_first_step(capsys, cli_lines):
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    Trainer(cfg, single_process(), TrainOptions.of(steps=1)).run()
    order = _phase_order(capsys.readouterr().out.splitlines())
    assert order == ["... loading data", "... building the model", "pipefisher train:", "... first step",
                     "step     0"], order


def test_no_progress_keeps_start_up_quiet(capsys, cli_lines):
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    Trainer(cfg, single_process(), TrainOptions.of(steps=1, progress=False)).run()
    assert not [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("...")]


def test_local_launcher_says_it_spawns_and_relays_the_workers_phases(profiled):
    """The profile's run through the command line, progress on: the launcher's first line comes right
    after the command's own, then each worker phase it relays."""
    *_, lines = profiled
    assert _phase_order(lines) == ["... spawning", "... loading data", "... building the model",
                                   "pipefisher train:", "... first step", "step     0"], lines
    assert lines[:2] == ["... loading torch",
                         "... spawning 2 workers (each starts python, imports torch and joins the process group)"]
    assert not [ln for ln in lines if ln.startswith("@@")]  # progress marks feed the bar, never the output


def test_kfac_run_says_what_kfac_covers_at_start_and_first_order_does_not(capsys, cli_lines):
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    for mode in ("kfac", "first-order"):
        Trainer(cfg, single_process(), TrainOptions.of(mode=mode, steps=1, progress=False)).run()
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("K-FAC covers")]
        expect = (["K-FAC covers 24 layers (24 Linear) on stage 0; first-order only: Embedding (2), LayerNorm (10); "
                   "ignored by kfac.ignore: cls.predictions.transform.dense, cls.predictions.decoder"]
                  if mode == "kfac" else [])
        assert lines == expect, (mode, lines)


def test_the_peak_memory_line_says_which_worker_it_is(capsys, cli_lines):
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    Trainer(cfg, single_process(), TrainOptions.of(steps=1, progress=False)).run()
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "peak memory" in ln)
    assert line.endswith(" MiB (rank 0: stage 0, replica 0)"), line


def test_the_training_loop_reads_in_at_most_sixty_lines():
    """The loop stays a top-down read; reporting, evaluation, checkpoints and the closed loop live beside it."""
    import inspect

    assert len(inspect.getsource(Trainer._run).splitlines()) <= 60


@pytest.mark.parametrize("on_interrupt", [True, False])
def test_sigterm_checkpoints_at_the_next_step_unless_turned_off(tmp_path, monkeypatch, on_interrupt):
    """SIGTERM during step 1 with a checkpoint folder: the step ends, a checkpoint of 2 steps is written and
    the run stops there (checkpoint.on_interrupt, the default); turned off, it stops at once without one.
    Either way the metrics of the steps done are in their file."""
    import signal

    from pipefisher.runtime.job.process import Interrupted
    from pipefisher.runtime.train.checkpoint import MANIFEST, read_manifest

    cfg = load_config(TINY).replace(pipeline={"stages": 1}, checkpoint={"on_interrupt": on_interrupt})
    ck, metrics = tmp_path / "ck", tmp_path / "m.csv"
    trainer = Trainer(cfg, single_process(), TrainOptions.of(steps=5, progress=False, checkpoint_dir=str(ck),
                                                           metrics=str(metrics)))
    step = trainer.train_step

    def signalled_in_1(i: int):  # noqa: ANN202
        if i == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(i)

    monkeypatch.setattr(trainer, "train_step", signalled_in_1)
    with pytest.raises(Interrupted) as stop:
        trainer.run()
    done = 2 if on_interrupt else 1
    assert stop.value.steps_done == done
    assert (read_manifest(ck)["steps_done"] if (ck / MANIFEST).exists() else None) == (2 if on_interrupt else None)
    assert [int(line.split(",")[0]) for line in metrics.read_text().splitlines()[1:]] == list(range(done))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handler is gone with it
