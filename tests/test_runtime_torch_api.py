"""The one module that names torch's private pipelining API: the supported range, a loud refusal when a
name moves, and torch's per-rank orders, which must be pipefisher's (:mod:`pipefisher.pipeline_orders`)."""
from __future__ import annotations

import pytest

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import BACKWARD, FORWARD, WEIGHT, generate
from pipefisher.runtime.job.config import TORCH_ENGINE_ORDERS
from pipefisher.runtime.pipeline import torch_api
from pipefisher.runtime.pipeline.engine import device_chunks


def test_every_private_name_the_engine_uses_is_in_the_installed_torch():
    assert torch_api.missing_names() == []
    torch_api.check_torch()  # the installed torch is the supported one


def test_a_name_that_moved_is_named_in_one_line(monkeypatch):
    import torch.distributed.pipelining.schedules as schedules

    monkeypatch.delattr(schedules, "_wait_batch_p2p")
    with pytest.raises(InputError) as err:
        torch_api.check_torch()
    line = str(err.value)
    assert "\n" not in line
    assert "torch.distributed.pipelining.schedules._wait_batch_p2p" in line and torch_api.SUPPORTED_TEXT in line


def test_a_changed_signature_names_the_parameter_that_went(monkeypatch):
    from torch.distributed.pipelining.stage import PipelineStage

    def forward_one_chunk(self, chunk, args, kwargs=None):  # save_forward_output gone, fwd_chunk_id renamed
        raise AssertionError("never called")

    monkeypatch.setattr(PipelineStage, "forward_one_chunk", forward_one_chunk)
    assert torch_api.missing_names() == [
        "torch.distributed.pipelining.stage.PipelineStage.forward_one_chunk(fwd_chunk_id, save_forward_output)"]


def test_a_torch_outside_the_supported_range_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(InputError, match=r"supports torch >=2\.13,<2\.14 .* not torch 2\.14\.0"):
        torch_api.check_torch()
    assert torch_api.torch_version("2.13.0+cpu") == (2, 13)


def test_setup_cfg_states_the_same_range():
    import configparser
    import pathlib

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).parents[1] / "setup.cfg")
    assert f"torch{torch_api.SUPPORTED_TEXT}" in cfg["options.extras_require"]["torch-pipelining"].split()


def test_the_config_offers_the_orders_torch_has_a_schedule_class_for():
    assert set(TORCH_ENGINE_ORDERS) == set(torch_api.SCHEDULE_CLASSES)


def _ours(kind: str, p: int, m: int, v: int) -> tuple[list[list[tuple[str, int, int]]], bool] | None:
    """Our order per device as (kind, stage, micro-batch), and whether it splits backwards; None where
    our generator refuses the shape."""
    try:
        s = generate(kind, p, m, v)
    except InputError:
        return None
    return [[(op.kind, op.stage, op.micro_batch) for op in ops] for ops in s.devices], s.split_backward


@pytest.mark.parametrize("kind", TORCH_ENGINE_ORDERS)
def test_torchs_order_of_every_supported_schedule_is_ours_on_every_rank(kind):
    """Call for call: torch's compute actions of a rank, each as the pipeline calls it stands for
    (DualPipeV's full backwards, also inside its overlapped pairs, as a B and its W pass)."""
    checked = 0
    for p in range(1, 6):
        for m in range(1, 13):
            for v in ((2, 3) if kind == "interleaved" else (device_chunks(kind),)):
                ours = _ours(kind, p, m, v)
                try:
                    theirs = torch_api.compute_orders(kind, p, m, v)
                except ValueError:  # a micro-batch count torch's rounds refuse
                    continue
                if ours is None:
                    continue
                split = torch_api.splits(theirs)
                calls = [[(k, c.stage, c.micro_batch) for c in theirs[r] for k in torch_api.label_kinds(c, split)]
                         for r in range(p)]
                assert (calls, split) == ours, (p, m, v)
                checked += 1
    assert checked >= 25


def test_full_and_input_only_backwards_are_told_apart():
    kinds = {c.kind for c in torch_api.compute_orders("1f1b", 2, 3)[0]}
    assert kinds == {FORWARD, BACKWARD}
    kinds = {c.kind for c in torch_api.compute_orders("zb-v", 2, 3)[0]}
    assert kinds == {FORWARD, torch_api.INPUT, WEIGHT}
    dualpipev = torch_api.compute_orders("dualpipev", 2, 4)[0]  # full backwards among B and W passes
    assert {c.kind for c in dualpipev} == {FORWARD, BACKWARD, torch_api.INPUT, WEIGHT}
    full = next(c for c in dualpipev if c.kind == BACKWARD)
    assert torch_api.label_kinds(full, split=True) == [BACKWARD, WEIGHT]
    assert torch_api.label_kinds(full, split=False) == [BACKWARD]


def test_the_calls_that_continue_one_of_torchs_actions_are_named():
    """DualPipeV's overlapped pairs and full backwards are one torch action each: every call but the
    first of such an action continues it (torch sends the action's outputs once all of it ran)."""
    actions = torch_api.torch_actions("dualpipev", 2, 4)[0]
    split = torch_api.splits(torch_api.actions_order(torch_api.torch_actions("dualpipev", 2, 4)))
    calls = [k for c in torch_api.actions_order({0: actions})[0] for k in torch_api.label_kinds(c, split)]
    inside = torch_api.inside_calls(actions, split)
    overlap = torch_api._schedules()._ComputationType.OVERLAP_F_B
    pairs = sum(1 for a in actions if a is not None and a.computation_type == overlap)
    full = sum(1 for c in torch_api.actions_order({0: actions})[0] if c.kind == BACKWARD)
    assert pairs > 0 and full > 0
    assert len(inside) == pairs + full  # a pair's B and W (its backward is full), a lone full backward's W
    assert 0 not in inside and all(calls[k] in (BACKWARD, WEIGHT) for k in inside)
    assert all(calls[k] == WEIGHT for k in inside if calls[k - 1] == BACKWARD)
    assert torch_api.inside_calls(torch_api.torch_actions("zb-v", 2, 4)[0], True) == set()  # one call each


def test_schedule1f1b_order_is_the_one_its_loop_runs():
    """Its loop's order, recorded: the last rank starts with micro-batch 0 (torch 2.13's
    ``_get_pipeline_order``, drawn from another code path, starts it at 1)."""
    last = torch_api.compute_orders("1f1b", 3, 4)[2]
    assert [(c.kind, c.micro_batch) for c in last[:3]] == [(FORWARD, 0), (BACKWARD, 0), (FORWARD, 1)]


def test_an_unknown_order_or_a_refused_micro_batch_count_says_why():
    with pytest.raises(ValueError, match="no schedule class for the pipeline order 'chimera'"):
        torch_api.torch_actions("chimera", 2, 4)
    with pytest.raises(ValueError, match="multiple of its 2 rounds"):
        torch_api.torch_actions("zb-h1", 2, 5)


@pytest.mark.parametrize("kind,p,m", [("1f1b", 3, 4), ("interleaved", 2, 4), ("zb-v", 3, 5), ("zb-h1", 3, 3)])
def test_torchs_lowering_posts_each_send_right_after_its_compute(kind, p, m):
    """What the engine relies on to run K-FAC work in a bubble: the calls packed between X and Y run in
    Y's handler, which torch reaches after X's send is posted (every send follows its compute at once)."""
    import re

    lists = torch_api.lowered(kind, p, m)
    virtual = 1 + max(int(re.match(r"(\d+)", a).group(1)) for acts in lists.values() for a in acts)
    sends = 0
    for acts in lists.values():
        for i, action in enumerate(acts):
            stage, what, mb = re.fullmatch(r"(\d+)([A-Z_]+?)(\d*)", action).groups()
            stage = int(stage)
            sends_forward = what == "F" and stage < virtual - 1 and f"{stage + 1}F{mb}" not in acts
            sends_back = what in ("B", "I") and stage > 0 and f"{stage - 1}F{mb}" not in acts
            if sends_forward or sends_back:
                assert acts[i + 1] == f"{stage}SEND_{'F' if what == 'F' else 'B'}{mb}", (action, acts[i + 1])
                sends += 1
    assert sends > 0
