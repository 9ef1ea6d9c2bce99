"""Zero-bubble pipelines in the trainer: ZB-H1, ZB-V and DualPipeV, each backward split into a B and a W pass
(DualPipeV's full backwards: a B with its W right after it).

The engine runs the simulator's orders (:mod:`pipefisher.pipeline_orders`); in real worker processes
(gloo, one thread each) a step's gradients, K-FAC inverses and preconditioned gradients equal the
whole model's in one process, a one-iteration schedule trains as kfac mode, a multi-iteration one as
its one-process replay, and a resumed run continues bit for bit.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import generate
from pipefisher.runtime.job.dist import init_from_env, shutdown
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.pipeline.engine import device_plan, pipe_micro_batches, pipeline_ops, splits_backward
from pipefisher.runtime.pipeline.executor import prepost_points
from pipefisher.runtime.train.trainer import Trainer, TrainOptions

from _schedules import (assert_one_iteration_schedule_trains_as_kfac_mode, assert_schedule_trains_as_its_replay,
                        train_one_and_spread_schedules)

from test_runtime_engine import (BASE, _reference, assert_copies_kfac_equals_reference,
                                 assert_copies_step_equals_reference, copies_step_worker)

ZB_H1 = BASE.replace(pipeline=dict(order="zb-h1"), data=dict(num_micro_batches=4))
ZB_V = BASE.replace(pipeline=dict(order="zb-v"), data=dict(num_micro_batches=4))
DUALPIPEV = BASE.replace(pipeline=dict(order="dualpipev"), data=dict(num_micro_batches=4))
KIND = {"F": "call_forward", "B": "call_backward", "W": "call_backward:weight"}


@pytest.mark.parametrize("name,p,m", [("zb-h1", 2, 4), ("zb-h1", 4, 6), ("zb-v", 2, 4), ("zb-v", 4, 8), ("zb-v", 3, 2),
                                      ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 3, 11)])
def test_the_engine_runs_the_simulators_zero_bubble_orders(name, p, m):
    sim = generate(name, p, m)
    for d in range(p):
        plan = device_plan(name, d, p, m)
        assert [(label, copy, mb) for label, copy, mb in plan] == \
            [(KIND[op.kind] + (f":chunk{op.chunk}" if op.chunk else ""), op.chunk, op.micro_batch)
             for op in sim.devices[d]]
        assert pipe_micro_batches(name, d, p, m) == {c: list(range(m)) for c in range(sim.chunks)}
    assert splits_backward(name) and not splits_backward("1f1b") and not splits_backward("interleaved")


def test_the_engines_oldest_pending_w_is_dualpipevs_w_on_every_chunk():
    """The engine's W runs the oldest B pass of its chunk still without a W; DualPipeV's W is the oldest
    split B of the device, of either chunk: the same micro-batch on every W, for many shapes."""
    for p in range(1, 6):
        for m in range(2 * p, 4 * p + 2):
            for d, ops in enumerate(generate("dualpipev", p, m).devices):
                waiting: dict[int, list[int]] = {0: [], 1: []}
                for op in ops:
                    if op.kind == "B":
                        waiting[op.chunk].append(op.micro_batch)
                    elif op.kind == "W":
                        assert waiting[op.chunk].pop(0) == op.micro_batch, (p, m, d, op)


def test_config_checks_the_zero_bubble_layouts():
    with pytest.raises(InputError, match="zb-v needs model.num_layers >= 2 x pipeline.stages"):
        ZB_V.replace(pipeline=dict(stages=4))  # 4 layers, 8 chunks
    with pytest.raises(InputError, match="pipeline.chunks must be 2"):
        ZB_V.replace(pipeline=dict(chunks=3), model=dict(num_layers=6))
    assert ZB_V.pipeline.virtual_stages == 4 and ZB_V.pipeline.chunked
    assert ZB_H1.pipeline.virtual_stages == 2 and not ZB_H1.pipeline.chunked
    assert DUALPIPEV.pipeline.virtual_stages == 4 and DUALPIPEV.pipeline.chunked
    with pytest.raises(InputError, match="dualpipev needs model.num_layers >= 2 x pipeline.stages"):
        DUALPIPEV.replace(pipeline=dict(stages=4), data=dict(num_micro_batches=8))
    with pytest.raises(InputError, match="dualpipev has exactly 2 model chunks per device"):
        DUALPIPEV.replace(pipeline=dict(chunks=3), model=dict(num_layers=6))
    with pytest.raises(InputError, match="pipeline.order dualpipev with data.num_micro_batches 3: dualpipev: "
                                         "needs micro-batches >= 2 x stages = 4") as err:
        DUALPIPEV.replace(data=dict(num_micro_batches=3))
    assert "\n" not in str(err.value)


def test_a_bubbles_receives_are_posted_for_the_call_after_the_weight_passes():
    labels = ["-- start --", "call_forward", "cov_kron_A:x", "call_backward:weight", "call_backward", "-- end --"]
    assert prepost_points(labels) == {2: "call_backward"}


LAYOUTS = {"zb-h1 D=2 x 2 replicas": ("zb-h1", 2, 2, 4, 4), "zb-h1 D=3, m=5": ("zb-h1", 3, 1, 3, 5),
           "zb-v D=2 x 2 replicas": ("zb-v", 2, 2, 4, 3),
           "zb-v D=4, m=2 (fewer than the V's 2D-1)": ("zb-v", 4, 1, 8, 2),
           "dualpipev D=2 x 2 replicas": ("dualpipev", 2, 2, 4, 5), "dualpipev D=3, m=6": ("dualpipev", 3, 1, 6, 6)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def zero_bubble_step(request):
    name, stages, replicas, layers, micro_batches = LAYOUTS[request.param]
    cfg = BASE.replace(pipeline=dict(order=name, stages=stages), model=dict(num_layers=layers),
                       data=dict(num_micro_batches=micro_batches))
    results = spawn_local(copies_step_worker, stages * replicas, cfg, timeout_s=180)
    return cfg, replicas, results, _reference(cfg, replicas)


def test_zero_bubble_gradients_equal_single_process(zero_bubble_step):
    assert_copies_step_equals_reference(*zero_bubble_step)


def test_zero_bubble_kfac_inverses_and_preconditioned_gradients_equal_single_process(zero_bubble_step):
    _, _, results, ref = zero_bubble_step
    assert_copies_kfac_equals_reference(results, ref)


# ----------------------------------------------------------------------------------------------------
# Training: kfac mode, schedule files, a one-process replay


STEPS = 4  # step 0, a full 2-iteration cycle of the spread schedule, and the next one begun


@pytest.fixture(scope="module", params=["zb-h1", "zb-v", "dualpipev"])
def zero_bubble_runs(request, tmp_path_factory):
    from _schedules import tiny

    cfg = tiny(pipeline={"order": request.param, "timeout_s": 30.0})
    folder = tmp_path_factory.mktemp(request.param)
    results, files = train_one_and_spread_schedules(cfg, folder, STEPS)
    return cfg, results, files


def test_one_iteration_zero_bubble_schedule_equals_kfac_mode(zero_bubble_runs):
    _, results, _ = zero_bubble_runs
    assert_one_iteration_schedule_trains_as_kfac_mode(results, STEPS)


@pytest.mark.parametrize("name", ["one", "spread"])
def test_zero_bubble_schedule_equals_single_process_replay(zero_bubble_runs, name):
    cfg, results, files = zero_bubble_runs
    assert_schedule_trains_as_its_replay(cfg, results, files[name], STEPS)


def test_a_covariance_piece_of_factor_b_needs_the_b_pass_not_the_w_pass(tmp_path):
    """Factor B's output gradients come from the B pass: a cov_kron_B piece between a micro-batch's
    forward and its B pass has nothing saved; right after the B pass (before its W) it does."""
    from pipefisher.runtime.pipeline.checks import check_schedule, single_iteration_schedule

    from _schedules import tiny

    cfg = tiny(pipeline={"order": "zb-h1"})
    data = single_iteration_schedule(cfg)
    labels = data[0][0]  # the first stage: F0 F1 B0 W0 F2 B1 W1 ...
    piece = next(lb for lb in labels if lb.startswith("cov_kron_B:"))
    labels.remove(piece)
    labels.insert(labels.index("call_forward") + 1, piece)
    with pytest.raises(InputError, match="needs backward 0 of the first iteration, which has not run yet .cov-before-backward."):
        check_schedule(data, cfg)
    ok = single_iteration_schedule(cfg)
    labels = ok[0][0]
    labels.remove(piece)
    at = labels.index("call_backward:weight")
    assert labels[at - 1] == "call_backward"
    labels.insert(at, piece)  # after B0, before its W
    check_schedule(ok, cfg)


def test_weight_passes_are_refused_outside_zero_bubble_orders():
    from pipefisher.runtime.pipeline.checks import check_schedule, single_iteration_schedule

    from _schedules import tiny

    cfg = tiny()
    data = single_iteration_schedule(cfg)
    data[0][0].insert(data[0][0].index("call_backward") + 1, "call_backward:weight")
    with pytest.raises(InputError, match="1 call_backward:weight"):
        check_schedule(data, cfg)


def _profile_worker(cfg, out: str) -> None:
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        Trainer(cfg, ctx, TrainOptions.of(mode="kfac", profile=True, out=out, steps=1, progress=False)).run()
    finally:
        shutdown(ctx)


def test_profiled_timelines_carry_the_weight_passes_under_their_own_key(tmp_path):
    """ZB-V: both chunks' W passes, apart from their B passes (ZB-H1's: tests/test_cli_run.py)."""
    from pipefisher.runtime.pipeline.layout import node_kfac_names

    cfg = ZB_V

    spawn_local(_profile_worker, 2, cfg, str(tmp_path), timeout_s=120)
    m = cfg.data.num_micro_batches
    for node, by_copy in enumerate(node_kfac_names(cfg)):
        with open(tmp_path / f"{cfg.name}_node{node}_timeline.pickle", "rb") as f:
            timeline = pickle.load(f)
        for suffix in ("", ":chunk1"):
            for key in ("call_forward", "call_backward", "call_backward:weight"):
                assert len(timeline[key + suffix]) == m, key + suffix
        # a W pass of a micro-batch starts after its B pass ends, and the profile keeps them apart
        assert all(w[0] >= b[1] for b, w in zip(timeline["call_backward"], timeline["call_backward:weight"]))
        kfac = {k for k in timeline if k.startswith(("cov_kron", "inv_kron"))}
        assert kfac == {f"{kind}_{f}:{n}{':chunk1' if j else ''}" for j, names in by_copy.items() for n in names
                        for f in "AB" for kind in ("cov_kron", "inv_kron")}


def _resume_worker(cfg, folder: str) -> list:
    """Train 2 steps with a checkpoint, resume for a third; and 3 steps straight: the losses."""
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        def run(steps: int, resume: str | None, ck: str | None) -> list:
            torch.manual_seed(0)
            opts = TrainOptions.of(mode="kfac", steps=steps, progress=False, log_every=10**9,
                                   checkpoint_dir=ck, resume=resume)
            trainer = Trainer(cfg, ctx, opts)
            losses = trainer.run().losses
            params = {f"{j}.{n}": t.detach().clone()
                      for j, c in trainer.worker.copies.items() for n, t in c.named_parameters()}
            return [losses, params]

        straight = run(3, None, None)
        run(2, None, folder)
        return [straight, run(3, folder, folder)]
    finally:
        shutdown(ctx)


@pytest.mark.parametrize("cfg", [ZB_H1, ZB_V, DUALPIPEV], ids=["zb-h1", "zb-v", "dualpipev"])
def test_a_resumed_zero_bubble_run_continues_bit_for_bit(tmp_path, cfg):
    results = spawn_local(_resume_worker, 2, cfg, str(tmp_path / "ck"), timeout_s=120)
    for straight, resumed in results:
        assert set(resumed[1]) == set(straight[1])
        for name, t in straight[1].items():
            assert torch.equal(resumed[1][name], t), name
    (straight, resumed), = [r for r in results if r[0][0]]
    assert resumed[0] == straight[0][2:]
