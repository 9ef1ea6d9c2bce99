"""Pipelined gradients and K-FAC state equal those of the same model in one process.

Each layout runs once in real worker processes (gloo, one thread each): one step in GPipe order and
one in 1F1B order on the same batch, then naive K-FAC on the 1F1B step's micro-batches. The gradients
travel in several small buckets (:mod:`pipefisher.runtime.pipeline.buckets`).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipefisher.kfac import KFAC
from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job.config import RunConfig
from pipefisher.runtime.job.dist import init_from_env, shutdown
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.engine import PipelineEngine, pipeline_ops
from pipefisher.runtime.pipeline.labels import BACKWARD, FORWARD

BASE = RunConfig().replace(
    model=dict(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, intermediate_size=32, max_position=8),
    data=dict(seq_len=8, micro_batch_size=2, num_micro_batches=3, text="stdlib"),  # real text, BPE
    kfac=dict(damping=1e-2),
    pipeline=dict(timeout_s=30.0, grad_bucket_mb=0.01),  # gradients in several buckets (10 KiB each)
)


def _worker(cfg: RunConfig) -> dict:
    """One worker: gradients of a GPipe step and a 1F1B step, then K-FAC on the 1F1B micro-batches."""
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    g, m = ctx.grid, cfg.data.num_micro_batches
    stage = PipelineStage(cfg.model, g.stage, g.stages, seed=cfg.data.seed)
    engine = PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), m,
                            grad_bucket_mb=cfg.pipeline.grad_bucket_mb)
    kfac = KFAC(stage, damping=cfg.kfac.damping, loss_scale=m, dp_group=ctx.dp_group, dp_size=g.replicas)
    out: dict = {"stage": g.stage, "replica": g.replica, "storage": []}
    for kind in (PREPOSTED, "gpipe", "1f1b"):
        stage.zero_grad(set_to_none=True)
        kfac.set_saving(kind == "1f1b")
        engine.begin_step(0)
        if kind == PREPOSTED:  # 1F1B, every call's receives posted ahead of it, their waits logged
            waits: list = []
            engine.set_wait_log(waits)
            for label in pipeline_ops("1f1b", g.stage, g.stages, m):
                engine.prepost(label)
                assert engine.prepost(label) == 0  # posted once
                engine.op(label)()
            engine.set_wait_log(None)
            out["posted"], out["waits"] = engine.posted_ahead, len(waits)
        else:
            engine.run(pipeline_ops(kind, g.stage, g.stages, m))
        engine.finish_step()
        engine.allreduce_gradients()
        out[kind] = {n: p.grad.clone() for n, p in stage.named_parameters()}
        out["storage"].append(engine.grads.storage())
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
    if ctx.stage_group_size > 1:  # the buckets' average against one flat all-reduce of the same gradients
        params = [p for p in stage.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(g.rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=ctx.stage_group)
        flat /= g.replicas
        engine.grads.attach(0)
        engine.grads.ready(0)
        engine.grads.finish()
        out["buckets"] = len(engine.grads.buckets(0))
        out["one_flat"] = torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), flat)
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


def copies_step_worker(cfg: RunConfig) -> dict:
    """One kfac-mode step of a worker whose device holds stage copies (chunks, or one stage): every
    copy's gradients after the replicas' all-reduce, then naive K-FAC's inverses and the
    preconditioned gradients, the loss and a held-out loss."""
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        return copies_step(cfg, ctx)
    finally:
        shutdown(ctx)


def copies_step(cfg: RunConfig, ctx) -> dict:  # noqa: ANN001
    """:func:`copies_step_worker`'s step, in process groups already set up."""
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    trainer = Trainer(cfg, ctx, TrainOptions.of(mode="kfac", steps=1, progress=False))
    eng, kfac = trainer.engine, trainer.kfac
    copies, kfacs = dict(trainer.worker.copies), dict(trainer.kfacs)
    kfac.set_saving(True)
    eng.begin_step(0)
    eng.run(trainer.ops)
    loss = eng.finish_step()
    eng.allreduce_gradients()
    grads = {j: {n: t.grad.clone() for n, t in c.named_parameters()} for j, c in copies.items()}
    kfac.update_curvature()
    inverses = {j: {(n, f): k.inverse(n, f).clone() for n in k.names for f in "AB"} for j, k in kfacs.items()}
    kfac.precondition_all()
    precond = {j: {n: t.grad.clone() for n, t in c.named_parameters()} for j, c in copies.items()}
    val = trainer.worker.evaluate(trainer.data.validation_batches()[:2])
    return {"device": ctx.grid.stage, "replica": ctx.grid.replica, "index": {j: c.index for j, c in copies.items()},
            "grads": grads, "inverses": inverses, "precond": precond, "loss": loss, "val": val}


def assert_copies_step_equals_reference(cfg: RunConfig, replicas: int, results: list[dict], ref: dict) -> None:
    """Every copy holds the stage :func:`pipefisher.runtime.pipeline.layout.node_pipes` places there, its
    gradients equal the one-process reference's, the loss comes from the device holding the last
    stage, once per replica, and every replica agrees on the held-out loss."""
    from pipefisher.runtime.pipeline.layout import loss_device, node_pipes

    seen = set()
    for res in results:
        for j, grads in res["grads"].items():
            assert res["index"][j] == node_pipes(cfg, res["device"])[j]
            for name, grad in grads.items():
                _assert_close(grad, ref["grads"][name], f"device {res['device']} copy {j} {name}")
                seen.add(name)
    assert seen == set(ref["grads"])
    losses = [res for res in results if res["loss"] is not None]
    assert len(losses) == replicas and all(res["device"] == loss_device(cfg) for res in losses)
    vals = [res["val"] for res in results if res["val"] is not None]
    assert len(vals) == replicas and all(v == pytest.approx(vals[0]) for v in vals)


def assert_copies_kfac_equals_reference(results: list[dict], ref: dict) -> None:
    """Every copy's K-FAC inverses and preconditioned gradients equal the one-process reference's."""
    for res in results:
        for j in res["inverses"]:
            for key, inv in res["inverses"][j].items():
                _assert_close(inv, ref["inverses"][key], f"inverse {key}", 1e-3)
            for name, grad in res["precond"][j].items():
                _assert_close(grad, ref["precond"][name], f"preconditioned {name}", 1e-3)


LAYOUTS = {"2 stages x 2 replicas": (2, 2), "4 stages x 1 replica": (4, 1)}
PREPOSTED = "1f1b, receives posted ahead"


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


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", PREPOSTED])
def test_pipelined_gradients_equal_single_process(layout_run, kind):
    cfg, replicas, results, ref = layout_run
    seen = set()
    for res in results:
        for name, grad in res[kind].items():
            _assert_close(grad, ref["grads"][name], f"{kind} stage {res['stage']} {name}")
            seen.add(name)
    assert seen == set(ref["grads"])  # every parameter lives on exactly the stages that computed it


def test_gradient_buckets_stay_put_and_average_as_one_flat_all_reduce_bit_for_bit(layout_run):
    """Over two replicas the buckets' sum is a + b element by element, as one flat all-reduce's; the
    buckets are allocated at the first step and reused by every later one."""
    cfg, replicas, results, ref = layout_run
    for res in results:
        if replicas == 1:
            assert "one_flat" not in res and res["storage"] == [[]] * 3  # nothing to average, nothing kept
            continue
        assert res["buckets"] >= 2 and res["one_flat"], res["stage"]
        assert res["storage"][0] and res["storage"] == [res["storage"][0]] * 3


def test_receives_posted_ahead_are_the_calls_own(layout_run):
    """Posting every call's receives ahead of it: each forward's activation (not on the first stage) and
    each backward's gradient (not on the last) once, waited for by its call (one wait each), and the
    gradients bit for bit those of the same 1F1B step receiving as it goes."""
    cfg, replicas, results, ref = layout_run
    m, last = cfg.data.num_micro_batches, cfg.pipeline.stages - 1
    for res in results:
        want = m * (res["stage"] > 0) + m * (res["stage"] < last)
        assert res["posted"] == res["waits"] == want, res["stage"]
        for name, grad in res[PREPOSTED].items():
            assert torch.equal(grad, res["1f1b"][name]), (res["stage"], name)


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


def _true_fisher_step(cfg: RunConfig, distributed: bool, prepost: bool = False, order: str = "1f1b") -> dict:
    """One saved step (1F1B, or ``order``) with true-Fisher K-FAC: factor B of every layer, and the
    parameter gradients (with ``prepost``, every call's receives posted ahead of it)."""
    from pipefisher.runtime.pipeline.engine import splits_backward
    from pipefisher.runtime.job.dist import single_process
    from pipefisher.runtime.train.update import make_kfac

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s) if distributed else single_process()
    g, m = ctx.grid, cfg.data.num_micro_batches
    stage = PipelineStage(cfg.model, g.stage, g.stages, seed=cfg.data.seed)
    kfac = make_kfac(cfg.replace(kfac={"fisher": "true"}), stage)
    engine = PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), m, kfac=kfac,
                            split=splits_backward(order))
    kfac.set_saving(True)
    engine.begin_step(0)
    for label in pipeline_ops(order, g.stage, g.stages, m):
        if prepost:
            engine.prepost(label)
        engine.op(label)()
    engine.finish_step()
    factors = {}
    for n in kfac.names:
        assert kfac.cov_all("B", n) == m
        factors[n] = kfac.factor(n, "B").clone()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    if distributed:
        shutdown(ctx)
    return {"stage": g.stage, "factors": factors, "grads": grads, "posted": engine.posted_ahead}


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


def test_true_fisher_in_a_zero_bubble_order_equals_single_process():
    """ZB-H1: the sampled-label backward runs in the B pass beside the input gradient, and the W pass
    adds the real weight gradients later; factors and gradients stay those of one process."""
    cfg = BASE.replace(pipeline=dict(stages=2))
    results = spawn_local(_true_fisher_step, 2, cfg, True, True, "zb-h1", timeout_s=120)
    ref = _true_fisher_step(cfg.replace(pipeline=dict(stages=1)), False)
    plain = _reference(cfg, 1)
    for r in results:
        for n, f in r["factors"].items():
            _assert_close(f, ref["factors"][n], f"stage {r['stage']} true-Fisher B of {n}")
        for n, gr in r["grads"].items():
            _assert_close(gr, plain["grads"][n], f"stage {r['stage']} gradient of {n}")


def test_true_fisher_with_receives_posted_ahead_equals_single_process():
    """Under the true Fisher a backward receives two gradients (sampled-label, then real): both are
    posted ahead, in that order, and the factors and gradients stay those of one process."""
    cfg = BASE.replace(pipeline=dict(stages=2))
    m = cfg.data.num_micro_batches
    results = spawn_local(_true_fisher_step, 2, cfg, True, True, timeout_s=120)
    ref = _true_fisher_step(cfg.replace(pipeline=dict(stages=1)), False)
    plain = _reference(cfg, 1)
    for r in results:
        assert r["posted"] == (2 * m if r["stage"] == 0 else m)  # stage 1: its forwards' activations
        for n, f in r["factors"].items():
            _assert_close(f, ref["factors"][n], f"stage {r['stage']} true-Fisher B of {n}")
        for n, gr in r["grads"].items():
            _assert_close(gr, plain["grads"][n], f"stage {r['stage']} gradient of {n}")


# ----------------------------------------------------------------------------------------------------
# Receives posted ahead, on a fake transport (one process)


class _Work:
    def __init__(self, buf: torch.Tensor, log: list) -> None:
        self.buf, self.log = buf, log

    def wait(self) -> bool:
        self.log.append("wait")
        self.buf.fill_(0.5)
        return True


@pytest.fixture
def fake_p2p(monkeypatch):
    """The engine's torch.distributed p2p calls, logged: irecv/recv fill the buffer, isend is done."""
    import pipefisher.runtime.pipeline.engine as eng

    log: list = []

    def irecv(buf, src, tag=0):
        log.append(("irecv", src, tag, tuple(buf.shape), buf.dtype))
        return _Work(buf, log)

    def recv(buf, src, tag=0):
        log.append(("recv", src, tag, tuple(buf.shape), buf.dtype))
        buf.fill_(0.5)

    def isend(t, dst, tag=0):
        log.append(("isend", dst, tag))
        return _Work(t.new_empty(0), [])

    monkeypatch.setattr(eng.dist, "irecv", irecv)
    monkeypatch.setattr(eng.dist, "recv", recv)
    monkeypatch.setattr(eng.dist, "isend", isend)
    return log


def _fake_engine(device: int, devices: int = 2, chunk: int | None = None) -> PipelineEngine:
    """Device ``device``'s engine (of chunk ``chunk``, two per device, when given) on the fake transport."""
    from pipefisher.runtime.job.dist import DistContext, Grid

    cfg = BASE.replace(data=dict(text="synthetic", num_micro_batches=2))
    ctx = DistContext(Grid(device, devices, devices), torch.device("cpu"), "gloo")
    virtual, count = (device, devices) if chunk is None else (device + chunk * devices, 2 * devices)
    stage = PipelineStage(cfg.model, virtual, count, seed=cfg.data.seed)
    return PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), 2, chunk=chunk)


def test_a_forward_takes_its_receive_posted_ahead(fake_p2p):
    engine = _fake_engine(1)  # the last stage: forwards receive, backwards do not
    waits: list = []
    engine.set_wait_log(waits)
    engine.begin_step(0)
    with pytest.raises(ValueError, match="not a pipeline call"):
        engine.prepost("call_forward:up_pipe")
    assert engine.prepost(FORWARD) == 1 and engine.prepost(FORWARD) == 0
    assert engine.prepost(BACKWARD) == 0  # the last stage receives no gradient (and none is in flight)
    shape = (engine.data.cfg.micro_batch_size, engine.data.cfg.seq_len, engine.stage.hidden_size)
    assert fake_p2p == [("irecv", 0, 1, shape, torch.float32)]  # the call's own: peer, tag, shape, dtype
    engine.forward()
    assert fake_p2p[1:] == ["wait"] and len(waits) == 1  # waited on, not received again; the call's wait
    engine.forward()  # not posted ahead: received as before
    assert fake_p2p[2][0] == "recv" and len(waits) == 2
    assert engine.prepost(FORWARD) == 0  # every micro-batch ran forward: nothing left to receive
    assert engine.prepost(BACKWARD) == 0
    engine.backward()
    engine.backward()
    assert engine.finish_step() is not None


def test_a_backward_takes_its_gradient_posted_ahead_and_leftovers_are_refused(fake_p2p):
    engine = _fake_engine(0)  # the first stage: backwards receive, forwards do not
    engine.begin_step(0)
    assert engine.prepost(BACKWARD) == 0  # no forward in flight yet
    assert engine.prepost(FORWARD) == 0
    engine.forward()
    engine.forward()
    assert engine.prepost(BACKWARD) == 1
    assert ("irecv", 1, 2) == fake_p2p[-1][:3]
    engine.backward()
    assert fake_p2p[-1] == "wait"  # the first stage sends nothing back
    assert engine.prepost(BACKWARD) == 1  # the second backward's, posted and never taken:
    with pytest.raises(RuntimeError, match=r"posted ahead but taken by no call .*\(1, 2\)"):
        engine.finish_step()
    engine._stash.clear()  # the failed step's state, as a new run would start
    engine.begin_step(1)  # nothing left posted: the next step may begin
    engine.forward()
    engine.prepost(BACKWARD)
    assert engine.drop_preposted() == 1 and engine.drop_preposted() == 0


def test_interleaved_chunks_post_on_their_own_boundary_tags(fake_p2p):
    """Device 0's chunk 1 reads device 1's chunk 0 on the chunk-1 tags (the tag the call would use)."""
    engine = _fake_engine(0, chunk=1)
    engine.begin_step(0)
    assert engine.receives("call_forward:chunk1") == [(1, 1 + 16)]
    assert engine.prepost("call_forward:chunk1") == 1
    engine.forward()
    assert fake_p2p[0][:3] == ("irecv", 1, 17) and fake_p2p[1] == "wait"


def _silent_peer(cfg: RunConfig) -> tuple[float, str] | None:
    """Stage 1 posts its first forward's receive ahead, then runs the forward; stage 0 stays alive and
    sends nothing, past the process group's timeout: stage 1's wait on the posted receive must end there."""
    import time

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    m = cfg.data.num_micro_batches
    stage = PipelineStage(cfg.model, ctx.grid.stage, ctx.grid.stages, seed=cfg.data.seed)
    engine = PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), m)
    if ctx.grid.stage == 0:
        time.sleep(cfg.pipeline.timeout_s + 3)
        return None
    engine.begin_step(0)
    assert engine.prepost(FORWARD) == 1
    t0 = time.monotonic()
    try:
        engine.forward()
    except RuntimeError as err:
        return time.monotonic() - t0, str(err)
    return time.monotonic() - t0, "no error"


def test_a_wait_on_a_receive_posted_ahead_stays_bounded_by_the_timeout():
    cfg = BASE.replace(pipeline=dict(stages=2, timeout_s=2.0), data=dict(text="synthetic"))
    _, (waited, err) = spawn_local(_silent_peer, 2, cfg, timeout_s=60)
    assert 1.5 < waited < 10, waited
    assert "Timed out" in err or "timeout" in err.lower(), err
