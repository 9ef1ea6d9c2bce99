"""The library entry point for a torch pipelining loop of one's own (:mod:`pipefisher.runtime.torch_pp`),
through the documented example script on 2 gloo ranks: profile, pack, validate, train."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.pipeline import torch_api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_example_script_packs_kfac_into_its_torch_schedules_bubbles_and_trains(tmp_path):
    out = tmp_path / "pf"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          os.path.join(ROOT, "scripts", "example_torch_pipelining.py"), "--schedule", "interleaved",
                          "--steps", "16", "--profile-steps", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 4 and losses[-1] < losses[0]
    k = re.search(r"K-FAC cycle k=(\d+)", res.stdout)
    assert k and int(k.group(1)) >= 1
    timelines = sorted(str(p) for p in out.glob("torch_pp_node*_timeline.pickle"))
    assert len(timelines) == 2
    check = CliRunner().invoke(main, ["validate", "--schedule", str(out / "torch_pp_schedule.pickle"), *timelines])
    assert check.exit_code == 0, check.output


def test_a_schedule_without_an_action_list_is_refused_in_one_line():
    from torch.distributed.pipelining import ScheduleGPipe

    with pytest.raises(InputError, match="ScheduleGPipe has no per-rank action list") as err:
        torch_api.schedule_actions(object.__new__(ScheduleGPipe))
    assert "\n" not in str(err.value)


def test_schedule1f1b_gives_the_order_its_loop_runs():
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B

    fake = object.__new__(Schedule1F1B)
    fake.__dict__.update(SimpleNamespace(_num_stages=2, _n_microbatches=3).__dict__)
    got = torch_api.actions_order(torch_api.schedule_actions(fake))
    assert got == torch_api.compute_orders("1f1b", 2, 3)
