"""Chimera in the trainer: two stage copies per device, two pipes, one result.

Each layout runs in real worker processes (gloo, one thread each). A Chimera step's gradients,
K-FAC factors, inverses and preconditioned gradients equal the unsplit model's on the same batch;
the two copies of every stage hold bit-identical gradients and parameters.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from pipefisher.pipeline_orders import generate
from pipefisher.runtime.job.dist import init_from_env, shutdown
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.pipeline.engine import device_plan, pipe_micro_batches, pipeline_ops
from pipefisher.runtime.train.trainer import Trainer, TrainOptions

from _schedules import train_copies_every_step

from test_runtime_engine import BASE, _assert_close, _reference

CHIMERA = BASE.replace(pipeline=dict(order="chimera"), data=dict(num_micro_batches=4))


def _step_worker(cfg) -> dict:
    """One kfac-mode step: gradients after the pair's all-reduce, then naive K-FAC and preconditioning."""
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s, chimera=True)
    try:
        trainer = Trainer(cfg, ctx, TrainOptions.of(mode="kfac", steps=1, progress=False))
        eng, kfac, pair = trainer.engine, trainer.kfac, trainer.stage
        kfac.set_saving(True)
        eng.begin_step(0)
        eng.run(trainer.ops)
        eng.finish_step()
        eng.allreduce_gradients()
        grads = {p: {n: t.grad.clone() for n, t in pair.copy(p).named_parameters()} for p in (0, 1)}
        kfac.update_curvature()
        inverses = {p: {(n, f): kfac[p].inverse(n, f).clone() for n in kfac[p].names for f in "AB"}
                    for p in (0, 1)}
        kfac.precondition_all()
        precond = {p: {n: t.grad.clone() for n, t in pair.copy(p).named_parameters()} for p in (0, 1)}
        index = {p: pair.copy(p).index for p in (0, 1)}
        return {"device": ctx.grid.stage, "replica": ctx.grid.replica, "index": index, "grads": grads,
                "inverses": inverses, "precond": precond}
    finally:
        shutdown(ctx)


LAYOUTS = {"D=2": (2, 1), "D=2 x 2 replicas": (2, 2), "D=4": (4, 1)}
if os.environ.get("PIPEFISHER_SLOW") == "1":  # 8 processes on CI's 2 cores: depth and replicas are each covered above
    LAYOUTS["D=4 x 2 replicas"] = (4, 2)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def chimera_step(request):
    stages, replicas = LAYOUTS[request.param]
    cfg = CHIMERA.replace(pipeline=dict(stages=stages))
    results = spawn_local(_step_worker, stages * replicas, cfg, timeout_s=180)
    return cfg, replicas, results, _reference(cfg, replicas)


def test_the_stage_copies_k_fac_profiles_each_copy_under_its_label_suffix():
    """One class for every copy layout: Chimera's pipes (``:up_pipe``) and the chunks of interleaved
    1F1B and ZB-V (``:chunk<j>``)."""
    from pipefisher.runtime.pipeline.copies import StageCopiesKFAC

    assert StageCopiesKFAC({0: None, 1: None}, [1, 0]).suffixes == {0: "", 1: ":up_pipe"}
    chunks = StageCopiesKFAC({0: None, 1: None, 2: None}, [0, 1, 2], interleaved=True)
    assert chunks.suffixes == {0: "", 1: ":chunk1", 2: ":chunk2"}


def test_the_engine_runs_the_simulators_chimera_order():
    for d in range(4):
        plan = device_plan("chimera", d, 4, 8)
        sim = generate("chimera", 4, 8).devices[d]
        assert [(label.startswith("call_forward"), pipe, mb) for label, pipe, mb in plan] == \
            [(op.kind == "F", op.pipe, op.micro_batch) for op in sim]
        assert pipeline_ops("chimera", d, 4, 8) == [label for label, _, _ in plan]
        pipes = pipe_micro_batches("chimera", d, 4, 8)
        assert sorted(pipes[0] + pipes[1]) == list(range(8))  # every micro-batch on exactly one pipe
        assert len(pipes[0]) == len(pipes[1]) == 4


def test_chimera_gradients_equal_single_process(chimera_step):
    cfg, replicas, results, ref = chimera_step
    seen = set()
    for res in results:
        for pipe, grads in res["grads"].items():
            for name, grad in grads.items():
                _assert_close(grad, ref["grads"][name], f"device {res['device']} pipe {pipe} {name}")
                seen.add(name)
    assert seen == set(ref["grads"])


def test_chimera_kfac_inverses_and_preconditioned_gradients_equal_single_process(chimera_step):
    cfg, replicas, results, ref = chimera_step
    for res in results:
        for pipe in (0, 1):
            for key, inv in res["inverses"][pipe].items():
                _assert_close(inv, ref["inverses"][key], f"inverse {key}", 1e-3)
            for name, grad in res["precond"][pipe].items():
                _assert_close(grad, ref["precond"][name], f"preconditioned {name}", 1e-3)


def test_both_copies_of_every_stage_are_bit_identical(chimera_step):
    cfg, replicas, results, ref = chimera_step
    by_stage: dict[int, list[dict]] = {}
    for res in results:
        for pipe in (0, 1):
            by_stage.setdefault(res["index"][pipe], []).append(
                {k: res[k][pipe] for k in ("grads", "inverses", "precond")})
    assert sorted(by_stage) == list(range(cfg.pipeline.stages))
    for stage, copies in by_stage.items():
        assert len(copies) == 2 * replicas
        for other in copies[1:]:
            for what in ("grads", "inverses", "precond"):
                for key, t in copies[0][what].items():
                    assert torch.equal(t, other[what][key]), f"stage {stage} {what} {key}"


# ----------------------------------------------------------------------------------------------------
# Training: kfac mode, schedules, replicas identical after every step




STEPS = 7  # step 0, a full 5-iteration cycle of the packed schedule, and the next one begun


@pytest.fixture(scope="module")
def chimera_runs(tmp_path_factory):
    from pipefisher.runtime.pipeline.checks import check_schedule, single_iteration_schedule
    from pipefisher.schedule.file import save_schedule

    from _schedules import chimera_spread_schedule, tiny

    cfg = tiny(pipeline={"order": "chimera", "timeout_s": 30.0})
    folder = tmp_path_factory.mktemp("chimera")
    files = {}
    for name, data in (("one", single_iteration_schedule(cfg)), ("spread", chimera_spread_schedule(cfg)),
                       ("packed", _packed_from_profile())):
        check_schedule(data, cfg)
        files[name] = str(folder / f"{name}.pickle")
        save_schedule(files[name], data)
    runs = [("first-order", None), ("kfac", None)] + [("scheduled", files[n]) for n in ("one", "spread", "packed")]
    results = spawn_local(train_copies_every_step, 2, cfg, runs, STEPS, timeout_s=180)
    return cfg, results, files


def _packed_from_profile() -> list:
    """``tight`` on a real Chimera profile of configs/tiny.yaml (2 devices), pairs aligned."""
    import glob
    import os

    from pipefisher.policies import get_policy
    from pipefisher.rules import validate
    from pipefisher.schedule.timeline import load_job

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "profiles", "chimera_tiny_2")
    job = load_job(sorted(glob.glob(os.path.join(here, "*.pickle"))))
    data = get_policy("tight").pack(job).to_file_data()
    assert validate(data, job) == [] and min(len(node) for node in data) >= 2
    return data


def test_both_copies_of_every_stage_stay_identical_after_every_step(chimera_runs):
    cfg, results, _ = chimera_runs
    for run in ("first-order", "kfac", "one.pickle", "spread.pickle", "packed.pickle"):
        copies: dict[int, list] = {}
        for res in results:
            index, history, _ = res[run]
            for p in (0, 1):
                copies.setdefault(index[p], []).append([h[p] for h in history])
        for stage, (a, b) in copies.items():
            for step, (x, y) in enumerate(zip(a, b)):
                for n in x:
                    assert torch.equal(x[n], y[n]), f"{run}: stage {stage} {n} differs after step {step}"


def test_one_iteration_chimera_schedule_equals_kfac_mode(chimera_runs):
    from test_runtime_executor import _close

    cfg, results, _ = chimera_runs
    for res in results:
        _close(res["one.pickle"][1][-1][0], res["kfac"][1][-1][0])
        _close(res["one.pickle"][1][-1][1], res["kfac"][1][-1][1])
    last = [res for res in results if res["kfac"][2][0] is not None]
    assert last and last[0]["one.pickle"][2] == pytest.approx(last[0]["kfac"][2], rel=1e-6)
    assert last[0]["kfac"][2] != pytest.approx(last[0]["first-order"][2], rel=1e-4)  # K-FAC changed the run


@pytest.mark.parametrize("name", ["spread", "packed"])
def test_multi_iteration_chimera_schedule_equals_a_one_process_replay(chimera_runs, name):
    from pipefisher.schedule.file import load_schedule
    from test_runtime_executor import _close

    from _schedules import replay

    cfg, results, files = chimera_runs
    schedule = load_schedule(files[name])
    ref = replay(cfg, schedule, STEPS)
    for res in results:
        index, history, _ = res[f"{name}.pickle"]
        for p in (0, 1):
            _close(history[-1][p], ref[index[p]])
    with pytest.raises(AssertionError):  # a longer cycle really is another run than kfac mode
        _close(results[0][f"{name}.pickle"][1][-1][0], results[0]["kfac"][1][-1][0], tol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Refusals and resume, through the command line


def _swap_two_syncs(data: list, node: int) -> list:
    """The same schedule with two all-reduces of one device in the other order (its pair still has
    them in the first): the pair would deadlock or average the wrong factors."""
    import copy

    data = copy.deepcopy(data)
    for labels in data[node]:
        at = [i for i, label in enumerate(labels) if label.startswith("sync_kron")]
        if len(at) >= 2:
            labels[at[0]], labels[at[1]] = labels[at[1]], labels[at[0]]
            return data
    raise AssertionError("no iteration with two syncs")


def test_a_schedule_whose_pair_syncs_in_another_order_is_refused_before_training(tmp_path):
    from click.testing import CliRunner

    from pipefisher.cli import main
    from pipefisher.errors import InputError
    from pipefisher.runtime.pipeline.checks import check_schedule
    from pipefisher.schedule.file import save_schedule

    from _schedules import TINY, chimera_spread_schedule, tiny

    cfg = tiny(pipeline={"order": "chimera"})
    bad = _swap_two_syncs(chimera_spread_schedule(cfg), 1)
    with pytest.raises(InputError, match="group-order"):
        check_schedule(bad, cfg)
    path = str(tmp_path / "bad.pickle")
    save_schedule(path, bad)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--order", "chimera", "--schedule", path,
                                    "--nproc-per-node", "2", "--steps", "3", "--no-progress"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and "group-order" in lines[0], res.output
    # the same schedule, one pipe: its up-pipe work is refused
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--schedule", path, "--nproc-per-node", "2"])
    assert res.exit_code == 2 and "second (up) pipeline" in res.output


def _train_bad(cfg_path: str, schedule: str) -> None:
    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.launch.local import run_worker

    cfg = load_config(cfg_path).replace(pipeline={"order": "chimera", "timeout_s": 20.0})
    run_worker(cfg, TrainOptions.of(mode="scheduled", schedule=schedule, steps=3, progress=False))


def test_every_chimera_worker_refuses_the_mismatched_order_on_its_own(tmp_path):
    """Under torchrun there is no CLI pre-check: both workers refuse at once, none waits for the other."""
    import time

    from pipefisher.runtime.launch.local import WorkerFailed
    from pipefisher.schedule.file import save_schedule

    from _schedules import TINY, chimera_spread_schedule, tiny

    path = str(tmp_path / "bad.pickle")
    save_schedule(path, _swap_two_syncs(chimera_spread_schedule(tiny(pipeline={"order": "chimera"})), 0))
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as err:
        spawn_local(_train_bad, 2, TINY, path, timeout_s=60)
    assert time.monotonic() - t0 < 20
    assert str(err.value).count("group-order") >= 2


def test_a_resumed_chimera_run_is_bit_exact(tmp_path):
    """Stop after step 2 (saved micro-batches still waiting for their pieces), resume to step 5: both
    copies of every stage, their K-FAC state and the optimizer equal the uninterrupted run's."""
    from pipefisher.runtime.job.config import load_config
    from pipefisher.schedule.file import save_schedule

    from _schedules import TINY, chimera_spread_schedule, train_whole_and_resumed

    # keep 2: the stopped run's step 2 stays beside the resumed run's step 5
    cfg = load_config(TINY).replace(pipeline={"order": "chimera"}, model={"dropout": 0.1}, checkpoint={"keep": 2})
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, chimera_spread_schedule(cfg))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    spawn_local(train_whole_and_resumed, 2, cfg, a, b, 5, 2, {"mode": "scheduled", "schedule": sched}, timeout_s=180)
    mid = torch.load(os.path.join(b, "step-00000002", "stage0-replica0.pt"), weights_only=True)
    assert any(layer["inputs"] for layer in mid["kfac"][1]["curvature"]["layers"].values())  # pieces still to come
    for device in range(2):
        fa = torch.load(os.path.join(a, "step-00000005", f"stage{device}-replica0.pt"), weights_only=True)
        fb = torch.load(os.path.join(b, "step-00000005", f"stage{device}-replica0.pt"), weights_only=True)
        assert {n.split(".")[0] for n in fa["model"]} == {"down", "up"}
        for name, p in fa["model"].items():
            assert torch.equal(p, fb["model"][name]), (device, name)
        assert sorted(fa["kfac"]) == [0, 1]  # each copy of the device (down, up) as one entry
        for copy, state in fa["kfac"].items():
            for layer, st in state["refresh"].items():
                for f in "AB":
                    assert torch.equal(st["installed"][f], fb["kfac"][copy]["refresh"][layer]["installed"][f])


def test_a_schedule_that_would_deadlock_is_refused_before_training(tmp_path):
    """Node 0 waits at an inverse for node 1's sync, which node 1 reaches only after calls that need
    node 0's next transfers: same shared order, but a cycle of waits."""
    from pipefisher.errors import InputError
    from pipefisher.runtime.pipeline.checks import check_schedule

    from _schedules import chimera_spread_schedule, tiny

    cfg = tiny(pipeline={"order": "chimera"})
    data = chimera_spread_schedule(cfg)
    check_schedule(data, cfg)
    it = data[0][2]
    shared = [label for label in it[:it.index("-- end --")] if label.startswith(("sync_kron", "inv_kron"))]
    for label in shared[:4]:  # one layer's syncs and inverses, moved right after the first call
        it.remove(label)
    it[2:2] = shared[:4]
    with pytest.raises(InputError, match=r"deadlock: at training step 3 .* it would hang"):
        check_schedule(data, cfg)


def test_chimera_with_data_parallel_replicas_runs_the_schedule(tmp_path):
    """2 stages x 2 replicas: four copies of every stage (two pipes x two replicas) average their factors
    and gradients in one group; the one-iteration schedule equals kfac mode and all four stay identical."""
    from pipefisher.runtime.pipeline.checks import single_iteration_schedule
    from pipefisher.schedule.file import save_schedule

    from _schedules import tiny

    cfg = tiny(pipeline={"order": "chimera", "timeout_s": 30.0})
    path = str(tmp_path / "dp.pickle")
    save_schedule(path, single_iteration_schedule(cfg, replicas=2))
    results = spawn_local(train_copies_every_step, 4, cfg, [("kfac", None), ("scheduled", path)], 3, timeout_s=180)
    from test_runtime_executor import _close

    copies: dict[int, list] = {}
    for res in results:
        index, history, _ = res["dp.pickle"]
        for p in (0, 1):
            _close(history[-1][p], res["kfac"][1][-1][p])
            copies.setdefault(index[p], []).append(history[-1][p])
    for stage, group in copies.items():
        assert len(group) == 4
        for other in group[1:]:
            assert all(torch.equal(group[0][n], other[n]) for n in other), f"stage {stage}"


# ----------------------------------------------------------------------------------------------------
# kfac.update: soap on every layout with stage copies


def _soap_worker(cfgs: list, folder: str) -> list:
    """Per config (one process group for all: the same layout kind), three K-FAC-mode runs with
    ``kfac.update: soap``: 3 steps straight; 2 steps checkpointed; resumed to 3. Per config: the losses and
    every copy's parameters of the straight and the resumed run, and the K-FAC weights over every copy
    against those the eigenbasis optimizer stepped in its bases."""
    ctx = init_from_env(cfgs[0].pipeline.stages, cfgs[0].pipeline.timeout_s,
                        chimera=cfgs[0].pipeline.order == "chimera")
    out = []
    try:
        for cfg in cfgs:
            ck = os.path.join(folder, cfg.pipeline.order)

            def run(steps: int, resume: str | None, checkpoint: str | None) -> tuple:
                torch.manual_seed(0)
                trainer = Trainer(cfg, ctx, TrainOptions.of(mode="kfac", steps=steps, progress=False, log_every=10**9,
                                                            checkpoint_dir=checkpoint, resume=resume))
                losses = trainer.run().losses
                params = {f"{j}.{n}": t.detach().clone()
                          for j, c in trainer.worker.copies.items() for n, t in c.named_parameters()}
                opt = trainer.updater.kfac_optimizer
                weights = {id(st.module.weight) for st in trainer.kfac.layer_states()}
                stepped = {id(p) for p, s in opt.state.items() if s.get("basis_a") is not None}
                return losses, params, len(weights), len(weights & stepped)

            straight = run(3, None, None)
            run(2, None, ck)
            out.append((cfg.pipeline.order, straight, run(3, ck, ck)))
    finally:
        shutdown(ctx)
    return out


BLOCKS = {"basis_block": 20, "rotation_dtype": "bfloat16"}  # tiny's 33- and 64-wide factors cut in 2-4 blocks


@pytest.mark.parametrize("orders, extra", [(("interleaved", "zb-v", "dualpipev"), {}), (("chimera",), {}),
                                           (("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev"), BLOCKS),
                                           (("chimera",), BLOCKS)],
                         ids=["one-pipe", "chimera", "blocks-bfloat16", "chimera-blocks-bfloat16"])
def test_the_eigenbasis_update_trains_and_resumes_on_every_layout_with_stage_copies(tmp_path, orders, extra):
    """``kfac.update: soap`` steps the K-FAC layers of every stage copy in their bases (it once read a
    ``layers`` attribute that only one stage's K-FAC has), and a run resumed from its checkpoint (the
    moments and bases of every copy) continues bit for bit; with ``kfac.basis_block`` and bfloat16
    rotations too, on the orders the other cases leave out."""
    from _schedules import tiny

    cfgs = [tiny(pipeline={"order": o, "timeout_s": 30.0}, kfac={"update": "soap", **extra}, optim={"lr": 3e-3})
            for o in orders]
    results = spawn_local(_soap_worker, 2, cfgs, str(tmp_path), timeout_s=180)
    for device in results:
        for order, straight, resumed in device:
            losses, params, weights, stepped = straight
            assert weights > 0 and stepped == weights, order  # every copy's K-FAC layers, in their bases
            assert resumed[2:] == straight[2:]
            for name, t in params.items():
                assert torch.equal(resumed[1][name], t), (order, name)
    for i, order in enumerate(orders):  # the losses, where the last stage is (Chimera: on both devices)
        with_loss = [device[i] for device in results if device[i][1][0]]
        assert with_loss, order
        for _, straight, resumed in with_loss:
            assert len(straight[0]) == 3 and all(math.isfinite(x) for x in straight[0]), order
            assert resumed[0] == straight[0][2:], order
