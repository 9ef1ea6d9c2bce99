"""``--tensorboard DIR``: the reporting worker's TensorBoard log holds what the metrics CSV holds, one value
per step, also across a resume; without the tensorboard package the flag is refused before any work."""
from __future__ import annotations

import csv
import importlib.util
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.job.dist import single_process
from pipefisher.runtime.train.tensorboard import MISSING, TAGS
from pipefisher.runtime.train.trainer import Trainer, TrainOptions
from pipefisher.schedule.file import save_schedule

from _schedules import TINY, spread_schedule

pytest.importorskip("tensorboard")


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in ``folder``'s event files: (step, value) in the order TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _csv(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _column(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[name])) for r in rows if r[name]]


def _same(logged: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """float32 in TensorBoard, 6 decimals in the CSV."""
    return ([s for s, _ in logged] == [s for s, _ in expected]
            and all(abs(a - b) <= 2e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(logged, expected)))


def test_train_logs_every_step_as_the_metrics_csv_says(tmp_path):
    tb, metrics = tmp_path / "tb", tmp_path / "m.csv"
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--steps", "4", "--eval-every", "2",
                                    "--metrics", str(metrics), "--tensorboard", str(tb), "--no-progress"])
    assert res.exit_code == 0, res.output
    logged, rows = _scalars(tb), _csv(metrics)
    assert sorted(logged) == sorted(TAGS[k] for k in ("loss", "val_loss", "lr", "step_seconds", "peak_mib"))
    for key in ("loss", "val_loss", "lr", "step_seconds"):
        assert _same(logged[TAGS[key]], _column(rows, key)), key
    assert [s for s, _ in logged[TAGS["loss"]]] == [0, 1, 2, 3] and [s for s, _ in logged[TAGS["val_loss"]]] == [1, 3]
    [(step, mib)] = logged[TAGS["peak_mib"]]
    assert step == 3 and mib > 0


def _train(cfg, **opts) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(cfg, single_process(), TrainOptions.of(progress=False, log_every=10**9, **opts)).run()
    finally:
        torch.set_num_threads(threads)


def test_scheduled_runs_log_cycle_and_overruns_and_a_resume_replaces_the_steps_it_runs_again(tmp_path):
    """Run A: steps 0-2 and a checkpoint. Run B resumes from a copy of it to step 4; run C resumes from A's
    checkpoint again (as after a crash of B past it) to step 5: C's steps 3-5 replace B's, once each."""
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, spread_schedule(cfg))  # k = 3
    tb, metrics, ck, ck_b = (str(tmp_path / n) for n in ("tb", "m.csv", "ck", "ck-b"))
    common = dict(mode="scheduled", schedule=sched, metrics=metrics, tensorboard=tb)
    _train(cfg, steps=3, checkpoint_dir=ck, **common)
    shutil.copytree(ck, ck_b)
    _train(cfg, steps=5, resume=ck_b, checkpoint_dir=ck_b, **common)
    _train(cfg, steps=6, resume=ck, checkpoint_dir=ck, **common)
    logged, rows = _scalars(tb), _csv(metrics)
    assert [int(r["step"]) for r in rows] == list(range(6))
    for key in ("loss", "lr", "step_seconds", "cycle", "overrun_seconds", "drift", "aging"):  # step times: C's, not B's
        assert _same(logged.get(TAGS[key], []), _column(rows, key)), (key, logged.get(TAGS[key]), _column(rows, key))
    assert [v for _, v in logged[TAGS["cycle"]]] == [3] * 6
    assert [s for s, _ in logged[TAGS["overrun_seconds"]]] == [1, 2, 3, 4, 5]  # measured from step 1 on
    # the curvature drift of the one complete cycle, steps 1-3 (refreshed across A's checkpoint), once; no
    # aging: the refresh before it was step 0's, the first
    [(step, drift)] = logged[TAGS["drift"]]
    assert 1 <= step <= 3 and drift > 0 and TAGS["aging"] not in logged
    assert [s for s, _ in logged[TAGS["peak_mib"]]] == [2, 5] == [s for s, _ in logged[TAGS["kfac_saved_peak_mib"]]]


def test_run_logs_its_scheduled_training(tmp_path):
    out, tb = tmp_path / "runs", tmp_path / "tb"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--stages", "1", "--out", str(out), "--steps", "20",
                                    "--profile-steps", "1", "--name", "r", "--tensorboard", str(tb), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert f"wrote {tb}" in res.output
    logged, rows = _scalars(tb), _csv(out / "r_metrics.csv")
    for key in ("loss", "cycle", "overrun_seconds"):
        assert _same(logged[TAGS[key]], _column(rows, key)), key
    # 20 steps: a run trains no K-FAC cycle longer than itself
    steps = list(range(20))
    assert [s for s, _ in logged[TAGS["cycle"]]] == steps and [s for s, _ in logged[TAGS["overrun_seconds"]]] == steps[1:]


def test_the_log_is_closed_when_training_stops(tmp_path, monkeypatch):
    """Ctrl-C at step 2: the writer is closed, steps 0 and 1 are in the log."""
    from pipefisher.runtime.job.process import Interrupted

    tb = tmp_path / "tb"
    trainer = Trainer(load_config(TINY).replace(pipeline={"stages": 1}), single_process(),
                      TrainOptions.of(steps=5, progress=False, tensorboard=str(tb)))
    step = trainer.train_step

    def interrupted_at_2(i: int):  # noqa: ANN202
        if i == 2:
            raise KeyboardInterrupt
        return step(i)
    monkeypatch.setattr(trainer, "train_step", interrupted_at_2)
    with pytest.raises(Interrupted):
        trainer.run()
    tensorboard = trainer.metrics.tensorboard  # the metrics component holds the log
    assert tensorboard is not None and tensorboard._writer.file_writer is None  # closed
    assert [s for s, _ in _scalars(tb)[TAGS["loss"]]] == [0, 1]


@pytest.mark.parametrize("command", [["train", "--stages", "1"], ["run", "--stages", "1", "--out", "OUT"]])
def test_without_the_package_the_flag_is_refused_before_any_work(tmp_path, monkeypatch, command):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    tb, out = tmp_path / "tb", tmp_path / "out"
    args = [a.replace("OUT", str(out)) for a in command]
    res = CliRunner().invoke(main, [*args, "--config", TINY, "--steps", "1", "--tensorboard", str(tb),
                                    "--no-progress"])
    assert res.exit_code == 2 and res.output == f"error: {MISSING}\n", res.output  # as every missing extra
    assert not os.path.exists(tb) and not os.path.exists(out)
