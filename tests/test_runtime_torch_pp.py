"""The library entry point for a torch pipelining loop of one's own (:mod:`pipefisher.runtime.torch_pp`),
through the documented example script on 2 gloo ranks: profile, pack, validate, train."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.pipeline import torch_api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


EXAMPLE = os.path.join(ROOT, "scripts", "example_torch_pipelining.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def test_the_example_script_packs_kfac_into_its_torch_schedules_bubbles_and_trains(tmp_path):
    """Run with plain python, as a new user runs it: it starts its 2 ranks under torch's launcher (and
    says how, a command that works as printed: it is the one it runs)."""
    out = tmp_path / "pf"
    res = subprocess.run([sys.executable, EXAMPLE, "--order", "interleaved", "--steps", "16", "--profile-steps",
                          "2", "--out", str(out)], capture_output=True, text=True, timeout=240, env=ENV, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    launched = res.stdout.splitlines()[0]
    assert launched == "starting 2 ranks: " + shlex.join(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         os.path.relpath(EXAMPLE, tmp_path), "--order", "interleaved", "--steps", "16", "--profile-steps", "2",
         "--out", str(out)]), launched
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 4 and losses[-1] < losses[0]
    k = re.search(r"K-FAC cycle k=(\d+)", res.stdout)
    assert k and int(k.group(1)) >= 1
    timelines = sorted(str(p) for p in out.glob("torch_pp_node*_timeline.pickle"))
    assert len(timelines) == 2
    check = CliRunner().invoke(main, ["validate", "--schedule", str(out / "torch_pp_schedule.pickle"), *timelines])
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize("out, says", [
    ("/proc/pf", "/proc/pf: cannot be created (--out): /proc is not writable"),
    ("EARLIER", "EARLIER/torch_pp_schedule.pickle: exists: an earlier run packed this schedule, and this run "
                "would replace it; choose another --out, or --overwrite to replace it"),
])
def test_the_example_refuses_an_out_it_cannot_write_or_would_overwrite_in_one_line(tmp_path, out, says):
    """Before any rank starts (one line, not a traceback per rank); a second run into the same --out
    does not replace the first one's schedule."""
    earlier = tmp_path / "pf"
    earlier.mkdir()
    (earlier / "torch_pp_schedule.pickle").write_bytes(b"the first run's")
    out, says = out.replace("EARLIER", str(earlier)), says.replace("EARLIER", str(earlier))
    res = subprocess.run([sys.executable, EXAMPLE, "--out", out], capture_output=True, text=True, timeout=120,
                         env=ENV)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"error: {says}\n")
    assert (earlier / "torch_pp_schedule.pickle").read_bytes() == b"the first run's"


def test_a_schedule_without_an_action_list_is_refused_in_one_line():
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    class OwnLoop(PipelineScheduleSingle):
        """A schedule class of one's own: its loop is its order, which pipefisher cannot know."""

        def _step_microbatches(self, *args, **kwargs):
            raise AssertionError("not run")

    with pytest.raises(InputError, match="OwnLoop has no per-rank action list") as err:
        torch_api.schedule_actions(object.__new__(OwnLoop))
    assert "\n" not in str(err.value)


def test_schedulegpipe_gives_the_order_its_loop_runs_all_forwards_then_all_backwards():
    from torch.distributed.pipelining import ScheduleGPipe

    from pipefisher.pipeline_orders import BACKWARD, FORWARD

    fake = object.__new__(ScheduleGPipe)
    fake.__dict__.update(_num_stages=2, _n_microbatches=3)
    got = torch_api.actions_order(torch_api.schedule_actions(fake))
    assert got == {r: [torch_api.Compute(kind, r, i) for kind in (FORWARD, BACKWARD) for i in range(3)]
                   for r in range(2)}


def test_schedule1f1b_gives_the_order_its_loop_runs():
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B

    fake = object.__new__(Schedule1F1B)
    fake.__dict__.update(SimpleNamespace(_num_stages=2, _n_microbatches=3).__dict__)
    got = torch_api.actions_order(torch_api.schedule_actions(fake))
    assert got == torch_api.compute_orders("1f1b", 2, 3)


def _example() -> object:
    """The example script as a module (its model, batches and schedule classes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_torch_pipelining",
                                                  os.path.join(ROOT, "scripts", "example_torch_pipelining.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_step_both_ways(schedule_name: str) -> dict:
    """On 2 ranks, the example's model twice from the same weights: one step of torch's own
    ``schedule.step``, one of ``torch_pp.wrap``'s (step 0: a plain pipeline step); the gradients and losses."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from pipefisher.runtime import torch_pp

    ex = _example()
    from pipefisher.runtime.job.dist import join_process_group

    join_process_group("gloo")  # through the launcher's store (spawn_local)
    rank, world = dist.get_rank(), dist.get_world_size()
    cls, per_rank = ex.schedule_class(schedule_name)
    model = ex.make_model(world * per_rank, 16, 4)
    mine = [rank] if per_rank == 1 else [rank, 2 * world - 1 - rank]
    x, y = ex.batch(0, 16, 16, 4)
    out = {}
    try:
        for way in ("torch", "wrap"):
            stages = [PipelineStage(copy.deepcopy(model[i]), i, world * per_rank, torch.device("cpu")) for i in mine]
            schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=4, loss_fn=torch.nn.CrossEntropyLoss())
            losses: list = []
            if way == "torch":
                schedule.step(x, target=y, losses=losses)
            else:
                torch_pp.wrap(stages, schedule, folder="unused").step(x, target=y, losses=losses)
            out[way] = ({f"{st.stage_index}.{n}": p.grad.clone() for st in stages for n, p in st.submod.named_parameters()},
                        [float(v) for v in losses])
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-v"])
def test_a_wrapped_step_computes_what_the_torch_schedules_own_step_does(schedule):
    """Same gradients (torch's scale_grads division included) and losses: the handlers pipefisher
    registers do what torch's own do."""
    import torch

    from pipefisher.runtime.launch.local import spawn_local

    for res in spawn_local(_first_step_both_ways, 2, schedule, timeout_s=120):
        grads, losses = res["torch"]
        assert set(res["wrap"][0]) == set(grads)
        for name, g in grads.items():
            assert torch.allclose(res["wrap"][0][name], g, rtol=1e-5, atol=1e-7), name
        assert res["wrap"][1] == pytest.approx(losses, rel=1e-6)


SETTINGS = {"kl_clip": 1e-7, "inverse_dtype": "float64", "refresh_pieces": 2, "cov_stride": 2, "damping": 0.03,
            "cov_micro_batches": 2}


def _wrapped_with_settings(folder: str) -> dict:
    """On 2 ranks (1F1B, the example's model): the same weights wrapped twice, with :data:`SETTINGS` and
    with them but ``kl_clip``; both train to their first profiled step (K-FAC refreshed, gradients
    preconditioned), then the first trains on to its packed schedule. What its K-FAC was built with, both
    steps' gradients of K-FAC's layers and the labels of the schedule it runs."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipefisher.runtime import torch_pp

    ex = _example()
    from pipefisher.runtime.job.dist import join_process_group

    join_process_group("gloo")  # through the launcher's store (spawn_local)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ex.make_model(world, 16, 4)
    out: dict = {}
    try:
        pfs = {}
        for way, kfac in (("clipped", SETTINGS), ("unclipped", {**SETTINGS, "kl_clip": 0.0})):
            stage = PipelineStage(copy.deepcopy(model[rank]), rank, world, torch.device("cpu"))
            optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.5)
            schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.CrossEntropyLoss())
            pfs[way] = pf = torch_pp.wrap([stage], schedule, folder=os.path.join(folder, way), kfac=kfac,
                                          optimizer=optimizer, profile_steps=2)
            for step in range(2):
                pf.step(*ex.batch(step, 16, 16, 4)[:1], target=ex.batch(step, 16, 16, 4)[1])
                if step == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            out[way] = [p.grad.clone() for p in pf.kfacs[0].parameters()]
        pf = pfs["clipped"]
        kfac = pf.kfacs[0]
        out["built"] = {"kl_clip": pf.settings.kl_clip, "inverse_dtype": kfac.refresher.dtype,
                        "cov_stride": kfac.stats.cov_stride, "damping": kfac.refresher.damping,
                        "pieces": {kfac.pieces(n, f) for n in kfac.names for f in "AB"}}
        for step in (2, 3):  # step 2 packs; step 3 runs the packed schedule
            x, y = ex.batch(step, 16, 16, 4)
            pf.step(x, target=y)
        out["cycle"] = pf.cycle
        out["labels"] = [label for it in pf.executor.iterations for label in it]
    finally:
        dist.destroy_process_group()
    return out


def test_a_torch_pp_run_honours_the_kfac_settings_and_writes_runs_metadata(tmp_path):
    """K-FAC built from the config as ``pipefisher train`` builds it (kl_clip, inverse_dtype, refresh_pieces,
    cov_stride, damping all taken), the KL-clip scaling the preconditioned step, the refresh pieces in the
    packed schedule, and the schedule saved with ``run``'s metadata: the same file ``pipefisher schedule``
    writes from the same timelines."""
    import json

    import torch

    from pipefisher.runtime.launch.local import spawn_local
    from pipefisher.schedule.file import meta_path

    results = spawn_local(_wrapped_with_settings, 2, str(tmp_path), timeout_s=180)
    for res in results:
        assert res["built"] == {"kl_clip": 1e-7, "inverse_dtype": torch.float64, "cov_stride": 2, "damping": 0.03,
                                "pieces": {2}}
        ratios = [float(c.norm() / u.norm()) for c, u in zip(res["clipped"], res["unclipped"])]
        assert max(ratios) < 0.5 and max(ratios) == pytest.approx(min(ratios), rel=1e-6), ratios  # one factor
        for c, u in zip(res["clipped"], res["unclipped"]):
            assert torch.allclose(c, u * ratios[0], rtol=1e-5, atol=1e-9)
        invs = [label for label in res["labels"] if label.startswith("inv_kron")]
        assert invs and all(invs.count(label) == 2 for label in invs), invs  # each refresh in 2 pieces
    folder = tmp_path / "clipped"
    meta = json.loads(open(meta_path(str(folder / "torch_pp_schedule.pickle"))).read())
    assert set(meta) - {"overlap"} == {"format", "policy", "margin", "kfac_margin", "pipeline_time", "nodes",
                                       "timelines", "packed_for"}  # what `run` writes ("overlap" where cycles do)
    assert meta["packed_for"]["pipeline.stages"] == 2 and meta["packed_for"]["data.num_micro_batches"] == 4
    assert {"layout", "modules"} <= set(meta["packed_for"])
    assert meta["packed_for"]["kfac.cov_micro_batches"] == 2  # the profile recorded the cap it ran with
    again = str(tmp_path / "again.pickle")
    res = CliRunner().invoke(main, ["schedule", *meta["timelines"], "--save-path", again])
    assert res.exit_code == 0, res.output
    assert json.loads(open(meta_path(again)).read()) == meta
    assert open(again, "rb").read() == (folder / "torch_pp_schedule.pickle").read_bytes()


def test_the_covariance_cap_is_checked_against_the_torch_schedules_micro_batches():
    """``kfac.cov_micro_batches`` is checked against the schedule's micro-batches, not a config default's."""
    from pipefisher.runtime.torch_pp import kfac_settings

    assert kfac_settings({"cov_micro_batches": 6}, micro_batches=8).cov_micro_batches == 6
    with pytest.raises(InputError, match="kfac.cov_micro_batches 3 is more than the step's 2 micro-batches"):
        kfac_settings({"cov_micro_batches": 3}, micro_batches=2)


def test_wrap_refuses_kfac_settings_a_loop_of_its_own_cannot_honour_in_one_line(tmp_path):
    """Before anything is built or written: an update rule that needs pipefisher's optimizer, the true
    Fisher, a KL-clip without the optimizer's learning rate, an unknown key; never silently dropped."""
    from pipefisher.runtime import torch_pp

    for kfac, says in (({"update": "soap"}, "kfac.update soap steps K-FAC's layers at your optimizer's learning rate: "
                                            "give wrap your optimizer (optimizer=...)"),
                       ({"update": "momentum"}, "kfac.update momentum steps K-FAC's layers at your optimizer's"),
                       ({"fisher": "true"}, "kfac.fisher true needs a second backward of sampled labels sent from "
                                            "stage to stage, which torch's pipeline schedules do not run"),
                       ({"kl_clip": 0.01}, "kfac.kl_clip 0.01 bounds the step at your optimizer's learning rate"),
                       ({"clip": 0.01}, "unknown key(s) in 'kfac': clip")):
        with pytest.raises(InputError, match=re.escape(says)) as err:
            torch_pp.wrap([object()], object(), folder=str(tmp_path / "pf"), kfac=kfac)
        assert "\n" not in str(err.value) and str(err.value).startswith("torch_pp.wrap kfac: ")
    assert not (tmp_path / "pf").exists()


def test_wrap_refuses_soap_with_an_optimizer_without_adams_betas_in_one_line(tmp_path):
    """soap runs Adam in K-FAC's eigenbases with your optimizer's betas and eps: SGD has none to give."""
    import torch

    from pipefisher.runtime import torch_pp

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(InputError, match=re.escape("kfac.update soap runs Adam with your optimizer's betas and eps, "
                                                   "and SGD has none")) as err:
        torch_pp.wrap([object()], object(), folder=str(tmp_path / "pf"), kfac={"update": "soap"}, optimizer=sgd)
    assert "\n" not in str(err.value)


OWN_UPDATE_STEPS = 8


def _own_update_against_the_updater(folder: str, update: str) -> dict:
    """On 2 ranks (1F1B, the example's model), a loop of one's own with AdamW, a warm-up scheduler and
    ``kfac.update`` ``update`` (KL-clip on with momentum): every step, the K-FAC layers' step ``pf.step``
    took, against ``pipefisher train``'s :class:`Updater` from the same weights, gradients and optimizer
    state (through the profiled steps and the packed schedule's); the loop's losses, and what the user's
    AdamW holds state for."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipefisher.runtime import torch_pp
    from pipefisher.runtime.job.config import config_from_dict
    from pipefisher.runtime.train.update import Updater

    ex = _example()
    from pipefisher.runtime.job.dist import join_process_group

    join_process_group("gloo")  # through the launcher's store (spawn_local)
    rank, world = dist.get_rank(), dist.get_world_size()
    # the config check refuses kl_clip with soap (Adam's step, not a preconditioned one); each stage's
    # first layer is left to AdamW alone; the learning rate warms up (a torch scheduler in the loop)
    kfac = {"update": update, "kl_clip": 1e-2 if update == "momentum" else 0.0, "damping": 0.03, "lr": 0.05,
            "momentum": 0.9, "ignore": ["0"]}
    optim = {"name": "adamw", "lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01,
             "warmup_steps": 4}
    out: dict = {"losses": [], "gaps": [], "moved": []}
    try:
        stage = PipelineStage(ex.make_model(world, 16, 4)[rank], rank, world, torch.device("cpu"))
        module = stage.submod
        optimizer = torch.optim.AdamW(module.parameters(), lr=optim["lr"], betas=tuple(optim["betas"]),
                                      eps=optim["eps"], weight_decay=optim["weight_decay"])
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.CrossEntropyLoss())
        pf = torch_pp.wrap([stage], schedule, folder=folder, kfac=kfac, optimizer=optimizer, profile_steps=2)
        updater = Updater(config_from_dict({"optim": optim, "kfac": kfac}, "test"), module, pf.kfac,
                          total_steps=OWN_UPDATE_STEPS, pipe_group=dist.group.WORLD)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, updater.schedule.factor)  # train's warm-up
        params, own = list(module.parameters()), {id(p) for p in pf.kfac.parameters()}
        before: dict = {}
        precondition = pf.kfac.precondition_all

        def recorded() -> int:  # what the update starts from: weights, raw gradients, K-FAC's optimizer state
            before.update(weights=[p.detach().clone() for p in params], grads=[p.grad.clone() for p in params],
                          state=copy.deepcopy(pf.kfac_optimizer.state_dict()))
            return precondition()

        for step in range(OWN_UPDATE_STEPS):
            x, y = ex.batch(step, 16, 16, 4)
            losses: list = []
            pf.kfac.precondition_all = recorded
            pf.step(x, target=y, losses=losses)
            pf.kfac.precondition_all = precondition
            taken = [p.detach().clone() for p in params]
            assert all(p.grad is None for p in params if id(p) in own)  # the user's AdamW skips them
            rest = [p.grad for p in params]
            with torch.no_grad():  # the Updater's step from the same point
                for p, w, g in zip(params, before["weights"], before["grads"]):
                    p.copy_(w)
                    p.grad = g.clone()
            updater.kfac_optimizer.load_state_dict(before["state"])
            updater.set_step(step)
            updater.step(module)
            out["gaps"].append(max(float((p.detach() - t).abs().max()) for p, t in zip(params, taken) if id(p) in own))
            out["moved"].append(min(float((t - w).abs().max()) for t, w, p in zip(taken, before["weights"], params)
                                    if id(p) in own))
            with torch.no_grad():
                for p, t, g in zip(params, taken, rest):
                    p.copy_(t)
                    p.grad = g
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            out["losses"].append(sum(float(v) for v in losses) / max(len(losses), 1))
        out["adamw_state"] = sorted(id(p) in own for p in optimizer.state)  # False: a parameter K-FAC leaves
        out["cycle"] = pf.cycle
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("update", ["soap", "momentum"])
def test_a_torch_pp_run_with_kfacs_own_update_steps_its_layers_as_the_updater_does(tmp_path, update):
    """``kfac.update`` soap and momentum: ``pf.step`` steps K-FAC's layers exactly as ``pipefisher train``'s
    Updater does on the same gradients (the learning rate following the loop's warm-up, momentum's KL-clip
    at its learning rate included), in the profiled
    steps and under the packed schedule; the user's AdamW steps only the other parameters; the loss falls."""
    from pipefisher.runtime.launch.local import spawn_local

    for rank, res in enumerate(spawn_local(_own_update_against_the_updater, 2, str(tmp_path), update, timeout_s=180)):
        assert res["cycle"] is not None
        assert max(res["gaps"]) < 1e-6, res["gaps"]
        assert min(res["moved"]) > 1e-5, res["moved"]
        assert res["adamw_state"] == [False, False], res["adamw_state"]  # the first layer's weight and bias
        if rank == 1:  # the last stage's losses
            assert sum(res["losses"][-2:]) < sum(res["losses"][:2]), res["losses"]
