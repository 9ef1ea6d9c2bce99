"""The torch engine (``pipeline.engine: torch``) computes what pipefisher's own engine computes.

In real worker processes (gloo, one thread each) one kfac-mode step of each supported order runs on
both engines in the same processes: gradients, K-FAC inverses and preconditioned gradients equal the
own engine's and the whole model's in one process, and in bf16 and fp16 the own engine's step in
them. Schedules with K-FAC work between the pipeline calls run at their places among torch's actions
and train as their one-process replay; a resumed run continues bit for bit; ``pipefisher run``
profiles, packs and trains on it, in bf16.
"""
from __future__ import annotations

import csv
import json
import os

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.job.dist import init_from_env, shutdown
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.pipeline.torch_engine import after_whole_actions

from _schedules import (TINY, assert_one_iteration_schedule_trains_as_kfac_mode, assert_schedule_trains_as_its_replay,
                        tiny, train_one_and_spread_schedules)
from test_runtime_engine import (BASE, _assert_close, _reference, assert_copies_kfac_equals_reference,
                                 assert_copies_step_equals_reference, copies_step)
from test_runtime_zero_bubble import test_a_resumed_zero_bubble_run_continues_bit_for_bit as _resumes_bit_for_bit

ENGINES = ("pipefisher", "torch")
PRECISIONS = ("fp32", "bf16", "fp16")
"""``train.precision`` values every equality launch runs on both engines (fp32 first)."""
HALF_TOLERANCE = {"bf16": 1e-5, "fp16": 1e-5}
"""How far (relative, in norm) a half-precision torch-engine run's gradients, inverses and preconditioned
gradients may be from the own engine's run in the same precision. Both run the same ops in the same
dtypes (on CPU they agree bit for bit), so far below bf16's and fp16's rounding (2**-8, 2**-11) and at
least 10 times below the largest gap between that run and fp32, checked too, so the tolerance cannot
hide a run in fp32 (measured, per device: bf16 2.7e-4 to 1e-2, fp16 3.8e-5 to 1e-3)."""


def both_engines_step_worker(cfg) -> dict:
    """One kfac-mode step on each engine in every precision of :data:`PRECISIONS`, in the same worker
    processes, from the same weights (each :func:`copies_step`, the own engine's test's step): per
    precision and engine, every copy's gradients, K-FAC inverses, preconditioned gradients, the loss
    and a held-out loss; and how many steps of torch's runtime it ran."""
    from pipefisher.runtime.pipeline import torch_api

    steps: list[int] = []
    step = torch_api.Runtime.step

    def counted(self, *args):  # noqa: ANN001, ANN202
        steps.append(1)
        return step(self, *args)

    torch_api.Runtime.step = counted  # this worker process only
    out: dict = {}
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        for precision in PRECISIONS:
            for engine in ENGINES:
                before = len(steps)
                run = copies_step(cfg.replace(pipeline={"engine": engine}, train={"precision": precision}), ctx)
                out.setdefault(precision, {})[engine] = {**run, "torch_steps": len(steps) - before}
    finally:
        shutdown(ctx)
    return out


LAYOUTS = {"1f1b, 2 stages x 2 replicas": ("1f1b", 2, 2, 3), "interleaved": ("interleaved", 2, 1, 4),
           "zb-v": ("zb-v", 2, 1, 3), "dualpipev": ("dualpipev", 2, 1, 4)}
"""zb-h1 runs the same handlers as zb-v (B and W passes, the first stage's whole backward in its B slot)
with one stage per rank; its order is checked against ours in tests/test_runtime_torch_api.py."""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def both_engines(request):
    kind, stages, replicas, m = LAYOUTS[request.param]
    cfg = BASE.replace(pipeline=dict(order=kind, stages=stages, engine="torch"), data=dict(num_micro_batches=m))
    results = spawn_local(both_engines_step_worker, stages * replicas, cfg, timeout_s=180)
    return cfg, replicas, results, _reference(cfg, replicas)


def test_the_torch_engine_runs_torchs_runtime_and_the_own_engine_does_not(both_engines):
    _, _, results, _ = both_engines
    for precision in PRECISIONS:
        assert [res[precision]["torch"]["torch_steps"] for res in results] == [1] * len(results)
        assert [res[precision]["pipefisher"]["torch_steps"] for res in results] == [0] * len(results)


def test_torch_engine_gradients_equal_the_own_engines_and_one_process(both_engines):
    cfg, replicas, results, ref = both_engines
    assert_copies_step_equals_reference(cfg, replicas, [res["fp32"]["torch"] for res in results], ref)
    for res in results:
        mine, own = res["fp32"]["torch"], res["fp32"]["pipefisher"]
        for j in own["grads"]:
            for name, grad in own["grads"][j].items():
                _assert_close(mine["grads"][j][name], grad, f"copy {j} {name}", 1e-6)
        if own["loss"] is not None:
            assert float(mine["loss"]) == pytest.approx(float(own["loss"]), rel=1e-6)
            assert mine["val"] == pytest.approx(own["val"], rel=1e-6)


def test_torch_engine_kfac_inverses_and_update_equal_the_own_engines_and_one_process(both_engines):
    _, _, results, ref = both_engines
    assert_copies_kfac_equals_reference([res["fp32"]["torch"] for res in results], ref)
    for res in results:
        _assert_kfac_close(res["fp32"]["torch"], res["fp32"]["pipefisher"], 1e-4)


def _assert_kfac_close(mine: dict, own: dict, tol: float) -> None:
    for j in own["inverses"]:
        for key, inv in own["inverses"][j].items():
            _assert_close(mine["inverses"][j][key], inv, f"inverse {key}", tol)
        for name, grad in own["precond"][j].items():
            _assert_close(mine["precond"][j][name], grad, f"preconditioned {name}", tol)


@pytest.mark.parametrize("precision", list(HALF_TOLERANCE))
def test_half_precision_on_the_torch_engine_equals_the_own_engines(both_engines, precision):
    """``train.precision`` bf16 or fp16 on torch's stages computes what the own engine computes in it:
    the same autocast, activations and gradients crossing stages in the same wire dtype, and in fp16
    the backward starting from the same loss scale (the gradients are that many times too large until
    the update divides them back; K-FAC divides its saved output gradients by it)."""
    cfg, _, results, _ = both_engines
    tol = HALF_TOLERANCE[precision]
    scale = cfg.train.loss_scale if precision == "fp16" else 1.0
    gap = max(_relative_gap(res[precision]["pipefisher"]["grads"][j][n] / scale, grad)
              for res in results for j, grads in res["fp32"]["pipefisher"]["grads"].items() for n, grad in grads.items())
    assert gap > 10 * tol, f"{precision} gradients are within {gap:.2g} of fp32's: did it compute in {precision}?"
    for res in results:
        mine, own = res[precision]["torch"], res[precision]["pipefisher"]
        for j in own["grads"]:
            for name, grad in own["grads"][j].items():
                _assert_close(mine["grads"][j][name], grad, f"{precision} copy {j} {name}", tol)
        _assert_kfac_close(mine, own, tol)
        if own["loss"] is not None:
            assert float(mine["loss"]) == pytest.approx(float(own["loss"]), rel=tol)
            assert mine["val"] == pytest.approx(own["val"], rel=tol)


def _relative_gap(got, want) -> float:  # noqa: ANN001
    return float((got.double() - want.double()).norm()) / max(1.0, float(want.double().norm()))


# ----------------------------------------------------------------------------------------------------
# Schedules: K-FAC labels in the bubbles among torch's actions


STEPS = 4  # step 0, a full 2-iteration cycle of the spread schedule, and the next one begun


@pytest.fixture(scope="module", params=["zb-v", "dualpipev"])  # 1f1b's packed schedule: the CLI test
def scheduled_runs(request, tmp_path_factory):
    cfg = tiny(pipeline={"order": request.param, "timeout_s": 30.0, "engine": "torch"})
    folder = tmp_path_factory.mktemp(request.param)
    results, files = train_one_and_spread_schedules(cfg, folder, STEPS)
    return cfg, results, files


def test_kfac_work_packed_inside_one_of_torchs_actions_runs_when_it_has_ended():
    # calls 2 and 3 continue the action that call 1 starts (an overlapped pair: F, then B and W)
    segments = [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert after_whole_actions(segments, {2, 3}, ["end"]) == ([["a"], ["b"], [], [], ["c", "d", "e"]], ["end"])
    assert after_whole_actions(segments, {4}, ["end"]) == ([["a"], ["b"], ["c"], ["d"], []], ["e", "end"])
    assert after_whole_actions(segments, set(), []) == (segments, [])


def test_a_one_iteration_schedule_on_torch_trains_as_kfac_mode(scheduled_runs):
    _, results, _ = scheduled_runs
    assert_one_iteration_schedule_trains_as_kfac_mode(results, STEPS)


def test_kfac_work_between_torchs_actions_trains_as_the_single_process_replay(scheduled_runs):
    cfg, results, files = scheduled_runs
    assert_schedule_trains_as_its_replay(cfg, results, files["spread"], STEPS)


def test_a_resumed_torch_engine_run_continues_bit_for_bit(tmp_path):
    _resumes_bit_for_bit(tmp_path, BASE.replace(pipeline=dict(order="zb-v", engine="torch"),
                                                data=dict(num_micro_batches=4)))


def _profile_both_engines(cfg, folder: str) -> None:  # noqa: ANN001
    """A profiled kfac step on each engine, in the same workers: timelines in ``folder/<engine>``."""
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        for engine in ENGINES:
            Trainer(cfg.replace(pipeline={"engine": engine}), ctx,
                    TrainOptions.of(mode="kfac", profile=True, out=os.path.join(folder, engine), steps=2,
                                    progress=False)).run()
    finally:
        shutdown(ctx)


def test_the_profiler_records_the_same_keys_per_action_on_both_engines(tmp_path):
    """The packer reads either engine's profile alike: the same keys, each as many times (interleaved:
    both chunks' keys)."""
    from pipefisher.safe_io import load_pickle

    cfg = BASE.replace(pipeline=dict(order="interleaved"), data=dict(num_micro_batches=4))
    for engine in ENGINES:
        (tmp_path / engine).mkdir()
    spawn_local(_profile_both_engines, 2, cfg, str(tmp_path), timeout_s=120)
    for node in range(2):
        own, mine = (load_pickle(str(tmp_path / e / f"{cfg.name}_node{node}_timeline.pickle")) for e in ENGINES)
        assert {k: len(v) for k, v in mine.items()} == {k: len(v) for k, v in own.items()}
        assert len(mine["call_forward:chunk1"]) == 4 and any(k.endswith(":chunk1") and "kron" in k for k in mine)


def _silent_peer(cfg) -> tuple[float, str] | None:  # noqa: ANN001
    """Stage 0 stays alive and sends nothing, past the process group's timeout; stage 1 runs a step on
    the torch engine: its wait (torch's first exchange with its neighbour) must end there."""
    import time

    from pipefisher.runtime.train.worker import build_worker

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    if ctx.grid.stage == 0:
        time.sleep(cfg.pipeline.timeout_s + 3)
        return None
    worker = build_worker(cfg, ctx, total_steps=1)
    t0 = time.monotonic()
    try:
        worker.step(0)
    except RuntimeError as err:
        return time.monotonic() - t0, str(err)
    return time.monotonic() - t0, "no error"


def test_a_silent_peer_ends_a_torch_engine_step_within_the_timeout():
    cfg = BASE.replace(pipeline=dict(timeout_s=2.0, engine="torch"), data=dict(text="synthetic"))
    _, (waited, err) = spawn_local(_silent_peer, 2, cfg, timeout_s=60)
    assert 1.5 < waited < 10, waited
    assert "timed out" in err.lower() or "timeout" in err.lower(), err


def _fp16_overflow_worker(cfg) -> dict:  # noqa: ANN001
    """Two kfac steps on the torch engine whose fp16 gradients all overflow: the weights after, and
    the loss scale's state."""
    import torch

    from pipefisher.runtime.train.worker import build_worker

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        worker = build_worker(cfg, ctx, mode="kfac", total_steps=2)
        before = {n: p.detach().clone() for n, p in worker.stage.named_parameters()}
        for s in range(2):
            worker.step(s)
        return {"engine": type(worker.engine).__name__, "scaler": worker.updater.scaler.state_dict(),
                "unchanged": all(torch.equal(p, before[n]) for n, p in worker.stage.named_parameters())}
    finally:
        shutdown(ctx)


def test_fp16_overflow_on_the_torch_engine_skips_every_stages_update():
    """The loss scale reaches torch's backwards (a scale of 1e30 overflows float16 gradients), and
    the trainer's one overflow flag per step skips the update on every stage and halves the scale."""
    cfg = BASE.replace(pipeline=dict(engine="torch"), train=dict(precision="fp16", loss_scale=1e30))
    results = spawn_local(_fp16_overflow_worker, 2, cfg, timeout_s=120)
    for res in results:
        assert res["engine"] == "TorchEngine" and res["unchanged"]
        assert res["scaler"] == {"scale": 1e30 / 4, "good_steps": 0, "skipped": 2}


# ----------------------------------------------------------------------------------------------------
# Refusals, and the order check


@pytest.mark.parametrize("sections,message", [
    ({"pipeline": {"order": "chimera"}}, "pipeline.engine torch runs pipeline.order 1f1b, interleaved, zb-v, zb-h1, "
                                            "dualpipev, not chimera"),
    ({"pipeline": {"order": "gpipe"}}, "not gpipe"),
    ({"kfac": {"fisher": "true"}}, "needs kfac.fisher empirical"),
    ({"pipeline": {"stages": 1}}, "needs pipeline.stages >= 2"),
    ({"pipeline": {"order": "zb-h1"}, "data": {"num_micro_batches": 5}}, "multiple of max"),
])
def test_what_the_torch_engine_cannot_run_is_refused_in_one_line(sections, message):
    pipeline = {"engine": "torch", **sections.get("pipeline", {})}
    with pytest.raises(InputError, match=message) as err:
        BASE.replace(**{**sections, "pipeline": pipeline})
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="pipeline.engine must be one of pipefisher, torch"):
        BASE.replace(pipeline={"engine": "deepspeed"})


def test_the_cli_refuses_a_torch_whose_pipelining_api_moved_in_one_line(tmp_path, monkeypatch):
    import torch.distributed.pipelining.schedules as schedules

    monkeypatch.delattr(schedules._PipelineScheduleRuntime, "register_custom_function")
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--set", "pipeline.engine=torch", "--steps", "1",
                                    "--nproc-per-node", "2", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "_PipelineScheduleRuntime.register_custom_function" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_a_half_precision_stage_gives_torch_its_output_in_the_wire_dtype():
    """What torch sends (and the static shapes it was given) is in the dtype the own engine sends; the
    loss stays float32, and fp32 is untouched."""
    import torch

    from pipefisher.runtime.models.bert import PipelineStage
    from pipefisher.runtime.pipeline.torch_engine import LossStage

    first, last = (PipelineStage(BASE.model, i, 2, seed=0) for i in range(2))
    ids = torch.randint(5, BASE.model.vocab_size, (2, 8))
    hidden = LossStage(first, "bf16")(ids)
    assert hidden.dtype == torch.bfloat16 and hidden.requires_grad
    loss = LossStage(last, "bf16")(hidden.detach().requires_grad_(), ids)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert LossStage(first)(ids).dtype == torch.float32


def test_pipeline_calls_out_of_torchs_order_are_refused_before_the_step():
    from pipefisher.runtime.pipeline.torch_engine import TorchEngine

    engine = object.__new__(TorchEngine)
    engine.labels = ["call_forward", "call_forward", "call_backward", "call_backward"]
    engine.rank = 0
    engine.check_plan(["call_forward", "call_forward", "call_backward", "call_backward"])
    with pytest.raises(ValueError, match=r"differs from torch's order at call 1: \['call_backward'"):
        engine.check_plan(["call_forward", "call_backward", "call_forward", "call_backward"])
    with pytest.raises(ValueError, match=r"at call 3: \[\] where torch runs \['call_backward'\] \(3 calls against torch's 4\)"):
        engine.fold_iteration(["-- start --", "call_forward", "call_forward", "cov_kron_A:x", "call_backward",
                               "-- end --"], [lambda: None] * 6)


# ----------------------------------------------------------------------------------------------------
# The CLI: profile, pack, validate and train in one command


def test_pipefisher_run_on_the_torch_engine_profiles_packs_and_trains_in_bf16(tmp_path):
    """A torchtitan-style user's run: torch's pipeline, bf16. (fp32 training on the torch engine: the
    schedule and resume tests above.)"""
    from pipefisher.schedule.timeline import load_job

    out = tmp_path / "runs"
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--set", "pipeline.engine=torch",
                                    "--set", "train.precision=bf16", "--order", "1f1b",
                                    "--out", str(out), "--steps", "24", "--profile-steps", "2", "--nproc-per-node", "2",
                                    "--name", "t", "--no-progress"])  # longer than a busy machine's cycle
    assert res.exit_code == 0, res.output
    timelines = sorted(str(p) for p in (out / "t_timelines").iterdir())
    job = load_job(timelines)
    assert all(len(node.forwards()) == len(node.backwards()) == 4 for node in job.nodes)
    report = json.loads((out / "t_report.json").read_text())
    assert report["valid"] and report["training"]["steps"] == 24
    assert "precision: bf16" in (out / "t_config.yaml").read_text()
    with open(out / "t_metrics.csv", newline="") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 24 and sum(losses[-3:]) < sum(losses[:3])
