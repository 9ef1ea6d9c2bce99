"""Hugging Face models through the whole runtime: a one-iteration schedule trains exactly as kfac mode,
a profile of them packs (``tight``) into a schedule ``validate`` accepts, and a Llama trains with K-FAC
in every pipeline order."""
from __future__ import annotations

import dataclasses
import glob
import math
import os

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.pipeline.checks import single_iteration_schedule
from pipefisher.schedule.file import save_schedule

from _schedules import train_runs

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"gpt2": os.path.join(ROOT, "configs", "hf-gpt2-small.yaml"),
           "bert": os.path.join(ROOT, "configs", "hf-bert-small.yaml"),
           "llama": os.path.join(ROOT, "configs", "hf-llama-small.yaml")}
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
    # ... and the runtime trains it (one launch of forked workers: a second command would start python and
    # import torch and transformers in each worker again)
    results = spawn_local(train_runs, 2, CONFIGS[kind], [("scheduled", sched)], 3, TINY, timeout_s=180)
    losses = next(r for r in results if r["stage"] == 1)["s.pickle"][1]
    assert len(losses) == 3 and all(map(math.isfinite, losses))


LLAMA_TINY = dict(TINY, model=dict(TINY["model"], num_layers=4, num_heads=4, layer_norm_eps=1e-6,
                                   options={"num_key_value_heads": 2}))
"""configs/hf-llama-small.yaml at test size: 4 layers (2 chunks per device under interleaved, ZB-V and DualPipeV),
grouped-query attention kept (2 key/value heads for 4 query heads)."""


def _kfac_in_every_order(cfg_path: str, overrides: dict, steps: int, folder: str) -> dict:
    """In each worker: ``steps`` kfac steps of the config under every pipeline order, one after the
    other in the same process group (Chimera's pair groups made once; the one-pipe orders take the
    context without them), then a profile of 1F1B into ``folder``/prof checkpointed to ``folder``/ck.
    Per order: the losses, K-FAC's layers on this device, and whether every factor was inverted."""
    from pipefisher.runtime.job.config import PIPELINE_ORDERS
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    base = load_config(cfg_path).replace(**overrides)
    ctx = init_from_env(base.pipeline.stages, base.pipeline.timeout_s, chimera=True)
    plain = dataclasses.replace(ctx, chimera=False, stage_group=ctx.dp_group, stage_group_size=ctx.grid.replicas)
    out = {}
    try:
        for order in PIPELINE_ORDERS:
            cfg = base.replace(pipeline={"order": order})
            trainer = Trainer(cfg, ctx if order == "chimera" else plain,
                              TrainOptions.of(mode="kfac", steps=steps, progress=False, log_every=10**9))
            res = trainer.run()
            layers = [st for k in trainer.kfacs.values() for st in k.refresher.state.values()]
            out[order] = (res.losses, len(layers), all(st.inversions["A"] == st.inversions["B"] == steps
                                                       for st in layers))
        Trainer(base, plain, TrainOptions.of(mode="kfac", steps=3, profile=True, out=os.path.join(folder, "prof"),
                                             checkpoint_dir=os.path.join(folder, "ck"), progress=False,
                                             log_every=10**9)).run()
    finally:
        shutdown(ctx)
    return out


def test_a_llama_trains_with_k_fac_on_two_stages_in_every_pipeline_order_profiles_packs_and_exports(tmp_path):
    """configs/hf-llama-small.yaml at test size, all in one launch of two workers: K-FAC in each of the
    pipeline orders (PIPELINE_ORDERS); its 1F1B profile packs into a schedule validate accepts; its checkpoint
    exports to a folder transformers' AutoModelForCausalLM loads."""
    from pipefisher.runtime.job.config import PIPELINE_ORDERS

    (tmp_path / "prof").mkdir()
    results = spawn_local(_kfac_in_every_order, 2, CONFIGS["llama"], LLAMA_TINY, 2, str(tmp_path), timeout_s=240)
    for order in PIPELINE_ORDERS:
        # 4 layers x 7 projections (q, k, v, o; gate, up, down) over the two devices (Chimera: both copies),
        # each factor inverted every step
        copies = 2 if order == "chimera" else 1
        assert sum(r[order][1] for r in results) == 28 * copies and all(r[order][2] for r in results), order
        losses = [r[order][0] for r in results if r[order][0]]  # where the loss is (Chimera: both ends)
        assert losses and all(len(x) == 2 and all(map(math.isfinite, x)) for x in losses), (order, losses)
    timelines = sorted(glob.glob(str(tmp_path / "prof" / "*_timeline.pickle")))
    sched = str(tmp_path / "s.pickle")
    for args in (["schedule", *timelines, "--save-path", sched], ["validate", "--schedule", sched, *timelines],
                 ["export", str(tmp_path / "ck"), "--out", str(tmp_path / "model")]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, (args[0], res.output)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
