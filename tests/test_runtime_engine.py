"""Pipelined gradients and K-FAC state equal those of the same model in one process.

Each layout runs once in real worker processes (gloo, one thread each): one step in GPipe order and
one in 1F1B order on the same batch, then naive K-FAC on the 1F1B step's micro-batches.
"""
from __future__ import annotations

import pytest
import torch

from pipefisher.kfac import KFAC
from pipefisher.runtime.config import RunConfig
from pipefisher.runtime.data import MLMData
from pipefisher.runtime.dist import init_from_env, shutdown
from pipefisher.runtime.engine import BACKWARD, FORWARD, PipelineEngine, pipeline_ops
from pipefisher.runtime.launch import spawn_local
from pipefisher.runtime.model import PipelineStage

BASE = RunConfig().replace(
    model=dict(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, intermediate_size=32, max_position=8),
    data=dict(seq_len=8, micro_batch_size=2, num_micro_batches=3, text="stdlib"),  # real text, BPE
    kfac=dict(damping=1e-2),
    pipeline=dict(timeout_s=30.0),
)


def _worker(cfg: RunConfig) -> dict:
    """One worker: gradients of a GPipe step and a 1F1B step, then K-FAC on the 1F1B micro-batches."""
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    g, m = ctx.grid, cfg.data.num_micro_batches
    stage = PipelineStage(cfg.model, g.stage, g.stages, seed=cfg.data.seed)
    engine = PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), m)
    kfac = KFAC(stage, damping=cfg.kfac.damping, loss_scale=m, dp_group=ctx.dp_group, dp_size=g.replicas)
    out: dict = {"stage": g.stage, "replica": g.replica}
    for kind in ("gpipe", "1f1b"):
        stage.zero_grad(set_to_none=True)
        kfac.set_saving(kind == "1f1b")
        engine.begin_step(0)
        engine.run(pipeline_ops(kind, g.stage, g.stages, m))
        engine.finish_step()
        engine.allreduce_gradients()
        out[kind] = {n: p.grad.clone() for n, p in stage.named_parameters()}
    factors, inverses = {}, {}
    for n in kfac.names:
        for f in "AB":
            kfac.cov_all(f, n)
            kfac.sync(f, n)
            factors[n, f] = kfac.factor(n, f).clone()
        for f in "AB":
            kfac.inv(f, n)
            inverses[n, f] = kfac.inverse(n, f).clone()
    kfac.precondition_all()
    out.update(factors=factors, inverses=inverses,
               precond={n: p.grad.clone() for n, p in stage.named_parameters()})
    shutdown(ctx)
    return out


def _reference(cfg: RunConfig, replicas: int) -> dict:
    """The whole model in this process, fed every replica's micro-batches of step 0."""
    m = cfg.data.num_micro_batches
    model = PipelineStage(cfg.model, 0, 1, seed=cfg.data.seed)
    data = MLMData(cfg.data, cfg.model.vocab_size)
    kfac = KFAC(model, damping=cfg.kfac.damping, loss_scale=m * replicas)
    kfac.set_saving(True)
    for r in range(replicas):
        for i in range(m):
            mb = data.micro_batch(0, r, i)
            (model(mb.input_ids, mb.labels) / (m * replicas)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    factors, inverses = {}, {}
    for n in kfac.names:
        for f in "AB":
            kfac.cov_all(f, n)
            factors[n, f] = kfac.factor(n, f).clone()
        for f in "AB":
            kfac.inv(f, n)
            inverses[n, f] = kfac.inverse(n, f).clone()
    kfac.precondition_all()
    return dict(grads=grads, factors=factors, inverses=inverses,
                precond={n: p.grad.clone() for n, p in model.named_parameters()})


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    err = float((got.double() - want.double()).norm())
    assert err <= tol * max(1.0, float(want.double().norm())), f"{what}: off by {err:.3g}"


LAYOUTS = {"2 stages x 2 replicas": (2, 2), "4 stages x 1 replica": (4, 1)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request):
    stages, replicas = LAYOUTS[request.param]
    cfg = BASE.replace(pipeline=dict(stages=stages))
    results = spawn_local(_worker, stages * replicas, cfg, timeout_s=120)
    return cfg, replicas, results, _reference(cfg, replicas)


def test_pipeline_ops_orders():
    assert pipeline_ops("gpipe", 0, 2, 2) == [FORWARD, FORWARD, BACKWARD, BACKWARD]
    assert pipeline_ops("1f1b", 0, 3, 3) == [FORWARD, FORWARD, FORWARD, BACKWARD, BACKWARD, BACKWARD]
    assert pipeline_ops("1f1b", 1, 3, 3) == [FORWARD, FORWARD, BACKWARD, FORWARD, BACKWARD, BACKWARD]
    assert pipeline_ops("1f1b", 2, 3, 3) == [FORWARD, BACKWARD] * 3
    with pytest.raises(ValueError):
        pipeline_ops("zigzag", 0, 2, 2)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipelined_gradients_equal_single_process(layout_run, kind):
    cfg, replicas, results, ref = layout_run
    seen = set()
    for res in results:
        for name, grad in res[kind].items():
            _assert_close(grad, ref["grads"][name], f"{kind} stage {res['stage']} {name}")
            seen.add(name)
    assert seen == set(ref["grads"])  # every parameter lives on exactly the stages that computed it


def test_kfac_factors_inverses_and_preconditioned_gradients_equal_single_process(layout_run):
    cfg, replicas, results, ref = layout_run
    names = set()
    for res in results:
        for key, f in res["factors"].items():
            _assert_close(f, ref["factors"][key], f"factor {key}", 1e-4)
            _assert_close(res["inverses"][key], ref["inverses"][key], f"inverse {key}", 1e-3)
            names.add(key[0])
        for name, grad in res["precond"].items():
            _assert_close(grad, ref["precond"][name], f"preconditioned {name}", 1e-3)
    assert names == {k[0] for k in ref["factors"]}


def _true_fisher_step(cfg: RunConfig, distributed: bool) -> dict:
    """One saved 1F1B step with true-Fisher K-FAC: factor B of every layer, and the parameter gradients."""
    from pipefisher.runtime.dist import single_process
    from pipefisher.runtime.update import make_kfac

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s) if distributed else single_process()
    g, m = ctx.grid, cfg.data.num_micro_batches
    stage = PipelineStage(cfg.model, g.stage, g.stages, seed=cfg.data.seed)
    kfac = make_kfac(cfg.replace(kfac={"fisher": "true"}), stage)
    engine = PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), m, kfac=kfac)
    kfac.set_saving(True)
    engine.begin_step(0)
    engine.run(pipeline_ops("1f1b", g.stage, g.stages, m))
    engine.finish_step()
    factors = {}
    for n in kfac.names:
        assert kfac.cov_all("B", n) == m
        factors[n] = kfac.factor(n, "B").clone()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    if distributed:
        shutdown(ctx)
    return {"stage": g.stage, "factors": factors, "grads": grads}


def test_true_fisher_factors_and_gradients_equal_single_process():
    """Sampled-label gradients travel back through 4 stages beside the real ones: factor B equals the
    same engine's in one process, and the real gradients are untouched by the extra backward."""
    cfg = BASE.replace(pipeline=dict(stages=4))
    results = spawn_local(_true_fisher_step, 4, cfg, True, timeout_s=120)
    ref = _true_fisher_step(cfg.replace(pipeline=dict(stages=1)), False)
    plain = _reference(cfg, 1)
    for r in results:
        for n, f in r["factors"].items():
            _assert_close(f, ref["factors"][n], f"stage {r['stage']} true-Fisher B of {n}")
            # the sampled labels differ from the training labels: so does the factor
            assert float((f - plain["factors"][n, "B"]).norm()) > 1e-3 * float(f.norm())
        for n, gr in r["grads"].items():
            _assert_close(gr, plain["grads"][n], f"stage {r['stage']} gradient of {n}")
