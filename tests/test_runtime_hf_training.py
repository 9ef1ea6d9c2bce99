"""Hugging Face models through the whole runtime: a one-iteration schedule trains exactly as kfac mode,
and a profile of them packs (``tight``) into a schedule ``validate`` accepts."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.runtime.config import load_config
from pipefisher.runtime.executor import single_iteration_schedule
from pipefisher.runtime.launch import spawn_local
from pipefisher.runtime.trainer import Trainer, TrainOptions
from pipefisher.schedule import save_schedule

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


def _train(cfg_path: str, runs: list[tuple[str, str | None]]) -> dict:
    """In each worker, kfac mode and then each schedule, from the same start; their parameters."""
    from pipefisher.runtime.dist import init_from_env, shutdown

    cfg = load_config(cfg_path).replace(**TINY)
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    out: dict = {"stage": ctx.grid.stage}
    try:
        for mode, schedule in runs:
            torch.manual_seed(0)
            trainer = Trainer(cfg, ctx, TrainOptions(mode=mode, schedule=schedule, steps=STEPS, progress=False,
                                                     log_every=10**9))
            res = trainer.run()
            params = {n: p.detach().clone() for n, p in trainer.stage.named_parameters()}
            out[mode] = (params, res.losses)
    finally:
        shutdown(ctx)
    return out


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_one_iteration_schedule_equals_kfac_mode(tmp_path, kind):
    cfg = load_config(CONFIGS[kind]).replace(**TINY)
    sched = str(tmp_path / "one.pickle")
    save_schedule(sched, single_iteration_schedule(cfg))
    results = spawn_local(_train, 2, CONFIGS[kind], [("kfac", None), ("scheduled", sched)], timeout_s=180)
    for res in results:
        kfac, scheduled = res["kfac"][0], res["scheduled"][0]
        assert kfac.keys() == scheduled.keys()
        for name in kfac:
            assert torch.allclose(kfac[name], scheduled[name], rtol=1e-5, atol=1e-7), (kind, res["stage"], name)
    last = next(r for r in results if r["stage"] == 1)
    assert last["kfac"][1] == pytest.approx(last["scheduled"][1], rel=1e-6)
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
