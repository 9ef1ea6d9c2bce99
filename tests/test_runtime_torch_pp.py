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
    dist.init_process_group("gloo")
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
