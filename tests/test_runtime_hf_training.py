"""Hugging Face models through the whole runtime: a one-iteration schedule trains exactly as kfac mode,
and a profile of them packs (``tight``) into a schedule ``validate`` accepts."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.pipeline.checks import single_iteration_schedule
from pipefisher.schedule_file import save_schedule

from _schedules import train_runs

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"gpt2": os.path.join(ROOT, "configs", "hf-gpt2-small.yaml"),
           "bert": os.path.join(ROOT, "configs", "hf-bert-small.yaml")}
TINY = dict(model={"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                   "max_position": 16, "dropout": 0.0},
            data={"text": "synthetic", "seq_len": 16, "micro_batch_size": 2, "num_micro_batches": 4},
            optim={"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
            kfac={"interval": 1, "damping": 0.01},
            pipeline={"stages": 2, "timeout_s": 60.0})
STEPS = 3


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_one_iteration_schedule_equals_kfac_mode(tmp_path, kind):
    cfg = load_config(CONFIGS[kind]).replace(**TINY)
    sched = str(tmp_path / "one.pickle")
    save_schedule(sched, single_iteration_schedule(cfg))
    results = spawn_local(train_runs, 2, CONFIGS[kind], [("kfac", None), ("scheduled", sched)], STEPS, TINY,
                          timeout_s=180)
    for res in results:
        kfac, scheduled = res["kfac"][0], res["one.pickle"][0]
        assert kfac.keys() == scheduled.keys()
        for name in kfac:
            assert torch.allclose(kfac[name], scheduled[name], rtol=1e-5, atol=1e-7), (kind, res["stage"], name)
    last = next(r for r in results if r["stage"] == 1)
    assert last["kfac"][1] == pytest.approx(last["one.pickle"][1], rel=1e-6)
    assert all(loss == loss for loss in last["kfac"][1])  # finite losses, the run trained


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_profile_packs_into_a_schedule_validate_accepts(tmp_path, kind):
    sets = [f"{section}.{key}={value}" for section, values in TINY.items() for key, value in values.items()]
    args = [a for s in sets for a in ("--set", s)]
    prof = tmp_path / "prof"
    res = CliRunner().invoke(main, ["train", "--config", CONFIGS[kind], *args, "--profile", "--steps", "2",
                                    "--nproc-per-node", "2", "--out", str(prof), "--no-progress"])
    assert res.exit_code == 0, res.output
    timelines = sorted(glob.glob(str(prof / "*_timeline.pickle")))
    assert len(timelines) == 2
    sched = str(tmp_path / "s.pickle")
    res = CliRunner().invoke(main, ["schedule", *timelines, "--save-path", sched])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["validate", "--schedule", sched, *timelines])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["train", "--config", CONFIGS[kind], *args, "--schedule", sched, "--steps", "3",
                                    "--nproc-per-node", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
