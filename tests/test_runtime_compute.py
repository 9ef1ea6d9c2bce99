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
from pipefisher.runtime.pipeline.compute import blocks, recompute_blocks, wire_dtype

TINY = load_config("configs/tiny.yaml")
BF16_LOSS_TOLERANCE = 0.02
"""How far (absolute, on losses near 4) a bf16 run's loss may be from the fp32 run's at any of its steps."""


def _kfac_run(cfg, steps: int) -> tuple[list[float], KFAC]:
    ctx = api.init_context(cfg)
    try:
        worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=steps)
        return [worker.step(s) for s in range(steps)], worker.kfac
    finally:
        api.shutdown(ctx)


def test_bf16_losses_track_fp32_and_factors_stay_float32_finite_and_symmetric():
    cfg = TINY.replace(pipeline={"stages": 1})
    fp32, _ = _kfac_run(cfg, 12)
    bf16, kfac = _kfac_run(cfg.replace(train={"precision": "bf16"}), 12)
    assert bf16 != fp32  # it did compute in bf16
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < BF16_LOSS_TOLERANCE, (fp32, bf16)
    assert bf16[-1] < bf16[0] - 0.2  # and it learns
    for name, st in kfac.layers.items():
        for f in "AB":
            factor, inverse = st.running[f], st.inverses[f]
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


def test_recompute_needs_blocks():
    with pytest.raises(ValueError, match="transformer blocks"):
        recompute_blocks(torch.nn.Linear(2, 2))


def _variants_worker(variants: list[dict]) -> dict:
    """Two kfac steps of the tiny model per variant, in one process group: parameters and factors after."""
    ctx = init_from_env(TINY.pipeline.stages, TINY.pipeline.timeout_s)
    out = {}
    for v in variants:
        cfg = TINY.replace(pipeline={"schedule": v["order"]}, train=v["train"], kfac={"fisher": v["fisher"]})
        worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=2)
        for s in range(2):
            worker.step(s)
        params = {f"{j}.{n}": p.detach().clone() for j, c in worker.copies.items() for n, p in c.named_parameters()}
        factors = {f"{j}.{n}.{f}": st.running[f].clone() for j, k in worker.kfacs.items()
                   for n, st in k.layers.items() for f in "AB"}
        out[json.dumps(v, sort_keys=True)] = {"params": params, "factors": factors}
    from pipefisher.runtime.job.dist import shutdown
    shutdown(ctx)
    return out


RUNS = [dict(order="1f1b", fisher="empirical", train={"precision": "fp32"}),
        dict(order="zb-v", fisher="empirical", train={"precision": "bf16"}),
        dict(order="1f1b", fisher="true", train={"precision": "fp32"})]


@pytest.fixture(scope="module")
def two_stage_runs():
    variants = [dict(run, train={**run["train"], "recompute": r}) for run in RUNS for r in ("none", "layer")]
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


def test_bf16_activations_cross_stages_in_bf16():
    assert wire_dtype("bf16") == torch.bfloat16 and wire_dtype("fp32") == torch.float32


LIVE_RSS = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc gives every block of 64 KiB or more its own mapping, returned when freed (a fixed threshold:
glibc's own grows as large blocks are freed, which would keep freed activations resident), so the
resident set's high-water mark is the peak of live tensors."""

_PEAK = textwrap.dedent("""
    import sys, torch
    from pipefisher.runtime.job.config import ModelConfig
    from pipefisher.runtime.job import memory
    from pipefisher.runtime.models.bert import PipelineStage
    from pipefisher.runtime.pipeline.compute import recompute_blocks
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=6, num_heads=2, intermediate_size=256, max_position=512)
    stage = PipelineStage(cfg, 0, 1)
    if sys.argv[1] == "layer":
        recompute_blocks(stage)
    x = torch.randint(5, 64, (8, 512))
    stage(x, x).backward()  # warm-up: libraries and kernels paged in
    stage.zero_grad(set_to_none=False)
    memory.reset_peak(torch.device("cpu"))  # the high-water mark now: the model, its gradients, no activations
    before = memory.peak_bytes(torch.device("cpu"))
    stage(x, x).backward()
    print(memory.peak_bytes(torch.device("cpu")) - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is Linux's VmHWM")
def test_recomputation_lowers_the_peak_memory_of_a_backward():
    peaks = {r: int(subprocess.run([sys.executable, "-c", _PEAK, r], capture_output=True, text=True, check=True,
                                   env={**os.environ, **LIVE_RSS}).stdout.split()[-1])
             for r in ("none", "layer")}
    print(f"peak memory of one forward and backward above its start: {peaks}")
    assert peaks["layer"] < 0.6 * peaks["none"], peaks
