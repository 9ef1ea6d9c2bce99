"""The runtime as a library: stage builders named in the config, and a step-at-a-time loop of one's own."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime import api
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.job.dist import single_process
from pipefisher.runtime.models.bert import PipelineStage, build_stage
from pipefisher.runtime.models.builders import check_builder, load_builder, make_stage
from pipefisher.runtime.pipeline.layout import stage_kfac_names
from pipefisher.runtime.train.trainer import Trainer, TrainOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
OWN = "tests._own_builders:build"


@pytest.fixture(autouse=True)
def _root_on_path(monkeypatch):
    """``tests._own_builders`` imports as it would from the repository root, where runs start."""
    monkeypatch.chdir(ROOT)


def _tiny(**model):
    return load_config(TINY).replace(model=model) if model else load_config(TINY)


@pytest.mark.parametrize("builder,problem", [
    ("tests._no_such_module:build", "cannot import 'tests._no_such_module'"),
    ("tests._own_builders:missing", "module 'tests._own_builders' has no function 'missing'"),
    ("tests._own_builders:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
    ("tests._own_builders:build_plain_module", "stage 0 of 2 lacks the stage attribute(s) is_first, is_last, "
                                               "hidden_size"),
])
def test_bad_builders_are_one_line_naming_the_config_and_the_builder(builder, problem):
    cfg = _tiny(builder=builder)
    with pytest.raises(InputError) as err:
        check_builder(cfg, "my.yaml")
    line = str(err.value)
    assert line.startswith(f"my.yaml: model.builder '{builder}'") and problem in line and "\n" not in line
    with pytest.raises(InputError, match="model.builder"):  # the workers' own check says the same
        make_stage(cfg, 0, 2)


def test_cli_refuses_a_bad_builder_before_any_worker_starts(tmp_path):
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--nproc-per-node", "2", "--no-progress",
                                    "--set", "model.builder=tests._own_builders:missing"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: {TINY}: model.builder 'tests._own_builders:missing': module 'tests._own_builders' has no "
        "function 'missing'"], res.output


def test_default_builder_is_the_built_in_bert():
    cfg = _tiny()
    assert load_builder(cfg.model.builder) is build_stage
    stage = make_stage(cfg, 1, 2)
    assert isinstance(stage, PipelineStage) and stage.is_last and not stage.is_first
    ref = PipelineStage(cfg.model, 1, 2, seed=cfg.data.seed)
    assert all(torch.equal(a, b) for a, b in zip(stage.state_dict().values(), ref.state_dict().values()))


def test_kfac_layers_of_a_custom_model_come_from_its_builder():
    names = stage_kfac_names(_tiny(builder=OWN))
    assert names == [[f"mlps.{i}.{j}" for i in range(2) for j in (0, 2)],
                     [f"mlps.{i}.{j}" for i in range(2) for j in (0, 2)] + ["head"]]
    assert "encoder.layer.0.attention.self.query" in stage_kfac_names(_tiny())[0]


def test_custom_builder_trains_two_stages_through_pipefisher_train(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--nproc-per-node", "2", "--mode", "kfac",
                                    "--steps", "6", "--out", str(out), "--no-progress",
                                    "--set", f"model.builder={OWN}", "--set", "model.options={width: 16}",
                                    "--set", "data.objective=clm", "--set", "optim.lr=0.05"])
    assert res.exit_code == 0, res.output
    assert "mode kfac, 2 stage(s) x 1 replica(s)" in res.output
    report = json.loads((out / "tiny_losses.json").read_text())
    losses = report["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert report["config"]["model"]["builder"] == OWN and report["config"]["model"]["options"] == {"width": 16}


@pytest.mark.parametrize("builder", ["pipefisher.runtime.models.bert:build_stage", OWN])
def test_own_step_loop_gives_the_parameters_pipefisher_train_gives(builder):
    torch.set_num_threads(1)
    cfg = _tiny(builder=builder).replace(pipeline={"stages": 1})
    trainer = Trainer(cfg, single_process(), TrainOptions.of(mode="kfac", steps=4, progress=False))
    trained = trainer.run()
    worker = api.build_worker(cfg, single_process(), mode="kfac", total_steps=4)
    losses = [worker.step(step) for step in range(4)]
    assert losses == trained.losses
    mine, theirs = worker.stage.state_dict(), trainer.stage.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not torch.equal(mine[next(iter(mine))], make_stage(cfg, 0, 1).state_dict()[next(iter(mine))])


def test_a_kfac_worker_tells_its_kfac_the_refresh_interval():
    """``kfac.interval`` (or ``kfac_interval``) is how often K-FAC refreshes in ``kfac`` mode: soap's
    unset running average weighs the old factor ``kfac.factor_decay_per_step`` a step (:func:`factor_decay_of`)."""
    cfg = _tiny().replace(pipeline={"stages": 1}, kfac={"update": "soap", "interval": 2, "factor_decay_per_step": 0.8})
    assert api.build_worker(cfg, single_process(), mode="kfac", total_steps=2).kfac.stats.factor_decay \
        == pytest.approx(0.8 ** 2)
    assert api.build_worker(cfg, single_process(), mode="kfac", total_steps=2, kfac_interval=3) \
        .kfac.stats.factor_decay == pytest.approx(0.8 ** 3)


def test_build_worker_refuses_a_schedule_without_scheduled_mode():
    with pytest.raises(ValueError, match=r"--schedule FILE trains in scheduled mode, not kfac"):
        api.build_worker(_tiny().replace(pipeline={"stages": 1}), single_process(), mode="kfac",
                         schedule="x.pickle", total_steps=1)


def test_one_check_of_the_options_serves_the_trainer_and_build_worker():
    from pipefisher.runtime.train.worker import check_options

    for mode, schedule, problem in (("nope", None, "--mode must be one of first-order, kfac, scheduled, not 'nope'"),
                                    ("scheduled", None, "--mode scheduled needs --schedule FILE")):
        with pytest.raises(ValueError, match=problem):
            check_options(mode, schedule)
        with pytest.raises(ValueError, match=problem):
            TrainOptions.of(mode=mode, schedule=schedule)
    with pytest.raises(ValueError, match="the grid has 1 stages but the config asks for 2"):
        api.build_worker(_tiny().replace(pipeline={"stages": 2}), single_process(), total_steps=1)
    with pytest.raises(ValueError, match="set up for another pipeline order than the config's"):
        check_options("kfac", None, _tiny().replace(pipeline={"stages": 1}),
                      dataclasses.replace(single_process(), chimera=True))


def test_the_engine_calls_an_unknown_order_a_pipeline_order():
    """The engine's refusal says "order": "schedule" names only the packed K-FAC schedule (issue 47)."""
    from pipefisher.runtime.pipeline.engine import device_plan

    with pytest.raises(ValueError, match="unknown pipeline order 'nope'"):
        device_plan("nope", 0, 2, 4)


def _run_example(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "own_model.py"), *args],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def _own_model_worker(*args: object) -> None:
    """examples/own_model.py's worker (the user's loop) as spawn_local starts it: rank, world size and port
    from the environment spawn_local set up, the rest as the script's main() passes them."""
    from examples import own_model

    own_model.worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]), *args)


def test_the_own_model_example_trains_on_two_processes_and_resumes_exactly(tmp_path, monkeypatch, capfd):
    """4 steps straight, the script run as the docs run it; and 2 steps with a checkpoint, resumed to 4, by
    the script's worker in forked workers (no python, torch import and spawn of two workers per run): the
    same losses, bit for bit."""
    from pipefisher.runtime.launch.local import spawn_local

    out, ck, resumed = tmp_path / "losses.json", str(tmp_path / "ck"), tmp_path / "resumed.json"
    res = _run_example("--steps", "4", "--json", str(out))
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    assert "step   3  loss" in res.stdout
    monkeypatch.syspath_prepend(ROOT)  # the workers import the example by name, as its builder's path says
    spawn_local(_own_model_worker, 2, 2, None, ck, timeout_s=120)  # --steps 2 --checkpoint-dir ck
    assert json.loads((tmp_path / "ck" / "checkpoint.json").read_text())["steps_done"] == 2
    capfd.readouterr()
    spawn_local(_own_model_worker, 2, 4, str(resumed), None, 0, ck, timeout_s=120)  # --steps 4 --resume ck --json
    printed = capfd.readouterr().out
    assert "step   1  loss" not in printed and "step   2  loss" in printed
    assert json.loads(resumed.read_text())["losses"] == losses[2:]



def test_the_library_says_nothing_on_stdout_and_the_cli_says_what_it_always_said(capsys, caplog):
    """A library user's stdout is theirs: the runtime logs (start-up phases, what K-FAC covers, the loss lines)
    and shows nothing unless logging is configured; ``pipefisher train`` shows those very records as its lines,
    and only while it runs."""
    torch.set_num_threads(1)
    cfg = _tiny().replace(pipeline={"stages": 1})
    worker = api.build_worker(cfg, single_process(), mode="kfac", total_steps=2)
    for step in range(2):
        worker.step(step)
    Trainer(cfg, single_process(), TrainOptions.of(mode="kfac", steps=2, log_every=1)).run()
    assert capsys.readouterr().out == ""
    with caplog.at_level(logging.INFO, logger="pipefisher"):  # configured: the lines are the records
        Trainer(cfg, single_process(), TrainOptions.of(mode="kfac", steps=2, log_every=1)).run()
    assert capsys.readouterr().out == ""

    def timeless(lines: list[str]) -> list[str]:  # the step times and peak memory differ from run to run
        return [re.sub(r"\d+\.\d (ms|MiB)", "#", line) for line in lines]

    said = timeless([r.getMessage() for r in caplog.records if r.levelno >= logging.INFO])
    assert "... loading data (synthetic tokens)" in said and any(m.startswith("step     1  loss") for m in said), said
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--mode", "kfac", "--steps", "2",
                                    "--log-every", "1"])
    assert res.exit_code == 0, res.output
    assert timeless(res.stdout.splitlines()) == ["... loading torch"] + said, res.stdout
    Trainer(cfg, single_process(), TrainOptions.of(mode="kfac", steps=1)).run()  # after the command: quiet again
    assert capsys.readouterr().out == ""
