"""Mixed precision and activation recomputation (``train.precision``, ``train.recompute``).

bf16 trains like fp32 within a stated tolerance, with K-FAC factors in float32; recomputing each block
in its backward changes no gradient and no factor (K-FAC takes each micro-batch's inputs once), in
plain, zero-bubble and true-Fisher runs, and holds less memory at its peak.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pipefisher.kfac import KFAC
from pipefisher.runtime import api
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.job.dist import init_from_env
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.compute import LossScale, blocks, recompute_blocks, wire_dtype

TINY = load_config("configs/tiny.yaml")
BF16_LOSS_TOLERANCE = 0.02
"""How far (absolute, on losses near 4) a bf16 or fp16 run's loss may be from the fp32 run's at any step."""


def _kfac_run(cfg, steps: int) -> tuple[list[float], KFAC]:
    ctx = api.init_context(cfg)
    try:
        worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=steps)
        return [worker.step(s) for s in range(steps)], worker.kfac
    finally:
        api.shutdown(ctx)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_losses_track_fp32_and_factors_stay_float32_finite_and_symmetric(precision):
    cfg = TINY.replace(pipeline={"stages": 1})
    fp32, _ = _kfac_run(cfg, 12)
    bf16, kfac = _kfac_run(cfg.replace(train={"precision": precision}), 12)
    assert bf16 != fp32  # it did compute in bf16
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < BF16_LOSS_TOLERANCE, (fp32, bf16)
    assert bf16[-1] < bf16[0] - 0.2  # and it learns
    for name in kfac.layers:
        for f in "AB":
            factor, inverse = kfac.stats.state[name].running[f], kfac.inverse(name, f)
            assert factor.dtype == inverse.dtype == torch.float32, name
            assert bool(torch.isfinite(factor).all()) and torch.equal(factor, factor.t()), f"{name} {f}"


def test_a_recomputed_block_gives_kfac_each_micro_batch_once():
    cfg = TINY.model
    stage = PipelineStage(cfg, 0, 1, seed=0)
    kfac = KFAC(stage, loss_scale=3)
    assert [n for n, _ in blocks(stage)] == recompute_blocks(stage, kfac) == ["encoder.layer.0", "encoder.layer.1",
                                                                             "encoder.layer.2", "encoder.layer.3"]
    kfac.set_saving(True)
    ids = torch.randint(5, cfg.vocab_size, (3, 2, 8))
    for x in ids:
        labels = x.clone()
        stage(x, labels).backward()  # each backward recomputes every block
    for name in kfac.names:
        assert kfac.pending("A", name) == kfac.pending("B", name) == 3, name


def test_the_loss_scale_halves_on_overflow_and_doubles_after_a_finite_run():
    scale = LossScale(8.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([8.0, 16.0])
    assert scale.unscale([p]) and p.grad.tolist() == [1.0, 2.0]
    p.grad = torch.tensor([float("inf"), 1.0])
    assert not scale.unscale([p])
    scale.update(False)
    assert (scale.scale, scale.skipped) == (4.0, 1)
    for _ in range(3):
        scale.update(True)
    assert (scale.scale, scale.good_steps) == (8.0, 0)
    again = LossScale()
    again.load_state_dict(scale.state_dict())
    assert again.state_dict() == scale.state_dict()


def test_fp16_overflow_skips_the_update_and_kfac_drops_the_overflowed_pieces():
    cfg = TINY.replace(pipeline={"stages": 1}, train={"precision": "fp16", "loss_scale": 1e30})
    ctx = api.init_context(cfg)
    try:
        said: list[str] = []
        worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=3, warn=said.append)
        before = {n: p.detach().clone() for n, p in worker.stage.named_parameters()}
        for s in range(3):
            worker.step(s)
        assert all(torch.equal(p, before[n]) for n, p in worker.stage.named_parameters())
        assert worker.updater.scaler.state_dict() == {"scale": 1e30 / 8, "good_steps": 0, "skipped": 3}
        name = next(iter(worker.kfac.layers))
        assert worker.kfac.stats.state[name].overflowed["B"] == 3 * cfg.data.num_micro_batches
        assert worker.kfac.inverse(name, "B") is None
        assert len(said) == 1 and "overflowed in fp16" in said[0]
        # B^-1 was never there and no gradient was preconditioned: no drift is made up from the kept state
        assert worker.kfac.take_drift() == [] and worker.kfac.drift.state[name].last_grad is None
    finally:
        api.shutdown(ctx)


def test_recompute_needs_blocks():
    with pytest.raises(ValueError, match="transformer blocks"):
        recompute_blocks(torch.nn.Linear(2, 2))


def _variants_worker(variants: list[dict]) -> dict:
    """Two kfac steps of the tiny model per variant, in one process group: parameters and factors after."""
    ctx = init_from_env(TINY.pipeline.stages, TINY.pipeline.timeout_s)
    out = {}
    for v in variants:
        cfg = TINY.replace(pipeline={"order": v["order"]}, train=v["train"], kfac={"fisher": v["fisher"]})
        worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=2)
        start = [p.detach().clone() for p in worker.stage.parameters()]
        for s in range(2):
            worker.step(s)
        moved = any(not torch.equal(a, p) for a, p in zip(start, worker.stage.parameters()))
        params = {f"{j}.{n}": p.detach().clone() for j, c in worker.copies.items() for n, p in c.named_parameters()}
        factors = {f"{j}.{n}.{f}": st.running[f].clone() for j, k in worker.kfacs.items()
                   for n, st in k.stats.state.items() for f in "AB" if st.running[f] is not None}
        out[json.dumps(v, sort_keys=True)] = {"params": params, "factors": factors, "moved": moved}
    from pipefisher.runtime.job.dist import shutdown
    shutdown(ctx)
    return out


RUNS = [dict(order="1f1b", fisher="empirical", train={"precision": "fp32"}),
        dict(order="zb-v", fisher="empirical", train={"precision": "bf16"}),
        dict(order="1f1b", fisher="true", train={"precision": "fp32"}),
        dict(order="1f1b", fisher="empirical", train={"precision": "fp16"})]
OVERFLOWING = dict(order="1f1b", fisher="empirical", train={"precision": "fp16", "loss_scale": 1e30, "recompute": "none"})


@pytest.fixture(scope="module")
def two_stage_runs():
    variants = [dict(run, train={**run["train"], "recompute": r}) for run in RUNS for r in ("none", "layer")]
    variants.append(OVERFLOWING)
    return variants, spawn_local(_variants_worker, 2, variants, timeout_s=120)


@pytest.mark.parametrize("run", RUNS, ids=[f"{r['order']}-{r['train']['precision']}-{r['fisher']}" for r in RUNS])
def test_recomputation_changes_no_parameter_and_no_factor(two_stage_runs, run):
    _, results = two_stage_runs
    key = {r: json.dumps(dict(run, train={**run["train"], "recompute": r}), sort_keys=True) for r in ("none", "layer")}
    for res in results:
        plain, again = res[key["none"]], res[key["layer"]]
        assert plain["params"].keys() == again["params"].keys() and plain["factors"]
        for name, t in plain["params"].items():
            assert torch.allclose(t, again["params"][name], atol=1e-6, rtol=0), name
        for name, t in plain["factors"].items():
            assert t.dtype == torch.float32
            assert torch.allclose(t, again["factors"][name], atol=1e-6, rtol=1e-5), name


def test_an_fp16_overflow_skips_the_update_on_every_stage(two_stage_runs):
    _, results = two_stage_runs
    key = json.dumps(OVERFLOWING, sort_keys=True)
    assert [res[key]["moved"] for res in results] == [False, False]
    assert all(res[json.dumps(dict(RUNS[-1], train={**RUNS[-1]["train"], "recompute": "none"}), sort_keys=True)]["moved"]
               for res in results)


def test_bf16_activations_cross_stages_in_bf16():
    assert wire_dtype("bf16") == torch.bfloat16 and wire_dtype("fp32") == torch.float32


LIVE_RSS = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc gives every block of 64 KiB or more its own mapping, returned when freed (a fixed threshold:
glibc's own grows as large blocks are freed, which would keep freed activations resident), so the
resident set's high-water mark is the peak of live tensors."""

_PEAK = textwrap.dedent("""
    import json, torch
    from pipefisher.runtime.job.config import ModelConfig
    from pipefisher.runtime.job import memory
    from pipefisher.runtime.models.bert import PipelineStage
    from pipefisher.runtime.pipeline.compute import recompute_blocks
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=6, num_heads=2, intermediate_size=256, max_position=256)
    stage, cpu = PipelineStage(cfg, 0, 1), torch.device("cpu")
    x = torch.randint(5, 64, (8, 256))
    peaks = {}
    for recompute in ("none", "layer"):
        if recompute == "layer":
            recompute_blocks(stage)
        stage(x, x).backward()  # warm-up: libraries and kernels paged in
        stage.zero_grad(set_to_none=False)
        memory.reset_peak(cpu)  # the high-water mark now: the model, its gradients, no activations
        before = memory.peak_bytes(cpu)
        stage(x, x).backward()
        peaks[recompute] = memory.peak_bytes(cpu) - before
    print(json.dumps(peaks))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is Linux's VmHWM")
def test_recomputation_lowers_the_peak_memory_of_a_backward():
    run = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, check=True,
                         env={**os.environ, **LIVE_RSS})
    peaks = json.loads(run.stdout.splitlines()[-1])
    print(f"peak memory of one forward and backward above its start: {peaks}")
    assert peaks["layer"] < 0.6 * peaks["none"], peaks


def _replicas_worker(overflow_on: int) -> dict:
    """Two data-parallel replicas of one stage in fp16, the loss scale of replica ``overflow_on`` set to
    overflow: one kfac step; every factor after it and whether the parameters moved."""
    from pipefisher.runtime.job.dist import shutdown

    cfg = TINY.replace(pipeline={"stages": 1}, train={"precision": "fp16"})
    ctx = init_from_env(1, cfg.pipeline.timeout_s)
    try:
        worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=1)
        if ctx.grid.replica == overflow_on:
            worker.updater.scaler.scale = 1e30  # one object: the engine, K-FAC and the update share it
        kfac, local = worker.kfac, {}
        sync = kfac.sync

        def keep_local(factor: str, name: str) -> None:  # this replica's own factor, before the average
            local[f"{name}.{factor}"] = kfac.stats.state[name].factor(factor)
            sync(factor, name)
        kfac.sync = keep_local
        start = [p.detach().clone() for p in worker.stage.parameters()]
        worker.step(0)
        moved = any(not torch.equal(a, p) for a, p in zip(start, worker.stage.parameters()))
        return {"moved": moved, "overflowed": sum(st.overflowed["B"] for st in kfac.stats.state.values()), "local": local,
                "factors": {f"{n}.{f}": st.running[f] for n, st in kfac.stats.state.items() for f in "AB"}}
    finally:
        shutdown(ctx)


def test_fp16_replicas_average_the_factors_of_those_that_did_not_overflow():
    clean, overflowed = spawn_local(_replicas_worker, 2, 1, timeout_s=120)
    assert overflowed["overflowed"] > 0 and clean["overflowed"] == 0
    assert not clean["moved"] and not overflowed["moved"]  # one replica's overflow skips the update of both
    for name, factor in clean["factors"].items():
        assert factor is not None and bool(torch.isfinite(factor).all()), name
        assert torch.equal(factor, overflowed["factors"][name]), name
        if name.endswith(".B"):  # only the clean replica had one: the average is its own
            assert bool(torch.isnan(overflowed["local"][name]).all())  # its own is none (0 pieces, on the device)
            assert torch.allclose(factor, clean["local"][name], rtol=1e-6, atol=0), name
        else:  # both had one: their mean
            want = (clean["local"][name] + overflowed["local"][name]) / 2
            assert torch.allclose(factor, want, rtol=1e-5, atol=1e-7), name
