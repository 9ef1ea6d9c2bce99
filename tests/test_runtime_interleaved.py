"""Interleaved 1F1B in the trainer: v stage copies (chunks) per device, one pipeline, one result.

Chunk j of device d is virtual stage d + j*D of D*v. Each layout runs in real worker processes (gloo,
one thread each): a step's gradients, K-FAC inverses and preconditioned gradients equal the unsplit
model's on the same batch; schedule files train exactly as kfac mode or a one-process replay.
"""
from __future__ import annotations


import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import generate
from pipefisher.runtime.job.dist import init_from_env, shutdown
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.pipeline.engine import device_plan, pipe_micro_batches, pipeline_ops
from pipefisher.runtime.train.trainer import Trainer, TrainOptions

from _schedules import (assert_one_iteration_schedule_trains_as_kfac_mode, assert_schedule_trains_as_its_replay,
                        train_one_and_spread_schedules)

from test_runtime_engine import (BASE, _reference, assert_copies_kfac_equals_reference,
                                 assert_copies_step_equals_reference, copies_step_worker)

INTERLEAVED = BASE.replace(pipeline=dict(order="interleaved", chunks=2), data=dict(num_micro_batches=4))


def test_the_engine_runs_the_simulators_interleaved_order():
    for d in range(4):
        plan = device_plan("interleaved", d, 4, 8, 2)
        sim = generate("interleaved", 4, 8, 2).devices[d]
        assert [(label.startswith("call_forward"), chunk, mb) for label, chunk, mb in plan] == \
            [(op.kind == "F", op.chunk, op.micro_batch) for op in sim]
        assert [label for label, _, _ in plan] == pipeline_ops("interleaved", d, 4, 8, 2)
        for label, chunk, _ in plan:  # chunk 0 keeps the plain keys, chunk j >= 1 gets ':chunk<j>'
            assert label in (("call_forward", "call_backward") if chunk == 0 else
                             (f"call_forward:chunk{chunk}", f"call_backward:chunk{chunk}"))
        assert pipe_micro_batches("interleaved", d, 4, 8, 2) == {0: list(range(8)), 1: list(range(8))}
    assert {c for _, c, _ in device_plan("interleaved", 0, 2, 4, 3)} == {0, 1, 2}


def test_config_checks_the_interleaved_layout():
    with pytest.raises(InputError, match="num_layers >= pipeline.stages x pipeline.chunks"):
        INTERLEAVED.replace(pipeline=dict(stages=4))  # 4 layers, 8 chunks
    with pytest.raises(InputError, match="pipeline.chunks must be an integer >= 2"):
        INTERLEAVED.replace(pipeline=dict(chunks=1))
    with pytest.raises(InputError, match="must split evenly into"):  # as torch's ScheduleInterleaved1F1B
        INTERLEAVED.replace(data=dict(num_micro_batches=5))
    assert INTERLEAVED.replace(data=dict(num_micro_batches=3)).data.num_micro_batches == 3  # torch takes it
    assert INTERLEAVED.pipeline.virtual_stages == 4


LAYOUTS = {"D=2 v=2": (2, 1, 4, 4), "D=2 v=2 x 2 replicas": (2, 2, 4, 4), "D=4 v=2": (4, 1, 8, 4),
           "D=2 v=2 m=3 (not a multiple of D)": (2, 1, 4, 3)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def interleaved_step(request):
    stages, replicas, layers, micro_batches = LAYOUTS[request.param]
    cfg = INTERLEAVED.replace(pipeline=dict(stages=stages), model=dict(num_layers=layers),
                              data=dict(num_micro_batches=micro_batches))
    results = spawn_local(copies_step_worker, stages * replicas, cfg, timeout_s=180)
    return cfg, replicas, results, _reference(cfg, replicas)


def test_interleaved_gradients_equal_single_process(interleaved_step):
    cfg, _, results, _ = interleaved_step
    assert all(res["index"][j] == res["device"] + j * cfg.pipeline.stages for res in results for j in res["index"])
    assert_copies_step_equals_reference(*interleaved_step)


def test_interleaved_kfac_inverses_and_preconditioned_gradients_equal_single_process(interleaved_step):
    _, _, results, ref = interleaved_step
    assert_copies_kfac_equals_reference(results, ref)


# ----------------------------------------------------------------------------------------------------
# Training: kfac mode, schedule files, a one-process replay




STEPS = 4  # step 0, a full 2-iteration cycle of the spread schedule, and the next one begun


@pytest.fixture(scope="module")
def interleaved_runs(tmp_path_factory):
    from _schedules import tiny

    cfg = tiny(pipeline={"order": "interleaved", "chunks": 2, "timeout_s": 30.0})
    folder = tmp_path_factory.mktemp("interleaved")
    results, files = train_one_and_spread_schedules(cfg, folder, STEPS)
    return cfg, results, files


def test_one_iteration_interleaved_schedule_equals_kfac_mode(interleaved_runs):
    _, results, _ = interleaved_runs
    assert_one_iteration_schedule_trains_as_kfac_mode(results, STEPS)


@pytest.mark.parametrize("name", ["one", "spread"])
def test_interleaved_schedule_equals_single_process_replay(interleaved_runs, name):
    cfg, results, files = interleaved_runs
    assert_schedule_trains_as_its_replay(cfg, results, files[name], STEPS)


def test_trainer_refuses_a_covariance_piece_before_its_own_chunks_forward(tmp_path):
    """The device's first forward is chunk 0's: a chunk-1 A piece right after it has nothing saved yet."""
    from pipefisher.runtime.pipeline.checks import load_checked_schedule, single_iteration_schedule
    from pipefisher.schedule.file import save_schedule

    from _schedules import tiny

    cfg = tiny(pipeline={"order": "interleaved", "chunks": 2})
    data = single_iteration_schedule(cfg)
    labels = data[0][0]
    piece = next(lb for lb in labels if lb.startswith("cov_kron_A:") and lb.endswith(":chunk1"))
    labels.remove(piece)
    labels.insert(labels.index("call_forward") + 1, piece)
    path = tmp_path / "early.pickle"
    save_schedule(str(path), data)
    with pytest.raises(InputError, match=r"needs forward 0 of the first iteration of chunk 1 \('call_forward:chunk1'\).*cov-before-forward"):
        load_checked_schedule(path, cfg)
    ok = single_iteration_schedule(cfg)  # the same piece after chunk 1's first forward is fine
    labels = ok[0][0]
    labels.remove(piece)
    labels.insert(labels.index("call_forward:chunk1") + 1, piece)
    save_schedule(str(path), ok)
    load_checked_schedule(path, cfg)


def test_chunk_labels_are_refused_outside_interleaving(tmp_path):
    from pipefisher.runtime.pipeline.checks import check_schedule, single_iteration_schedule

    from _schedules import tiny

    cfg = tiny()
    data = single_iteration_schedule(cfg)
    data[0][0].insert(1, "call_forward:chunk1")
    with pytest.raises(InputError, match="one model chunk per device"):
        check_schedule(data, cfg)


def _profile_worker(cfg, out: str) -> None:
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        Trainer(cfg, ctx, TrainOptions.of(mode="kfac", profile=True, out=out, steps=1, progress=False)).run()
    finally:
        shutdown(ctx)


def test_profiled_timelines_carry_the_chunk_keys(tmp_path):
    """Chunk 0 keeps the plain keys; chunk 1's pipeline and K-FAC keys get ':chunk1' exactly once."""
    import pickle

    from pipefisher.runtime.pipeline.layout import node_kfac_names

    cfg = INTERLEAVED.replace(pipeline=dict(stages=2))
    spawn_local(_profile_worker, 2, cfg, str(tmp_path), timeout_s=120)
    for node, by_chunk in enumerate(node_kfac_names(cfg)):
        with open(tmp_path / f"{cfg.name}_node{node}_timeline.pickle", "rb") as f:
            timeline = pickle.load(f)
        m = cfg.data.num_micro_batches
        for key in ("call_forward", "call_backward", "call_forward:chunk1", "call_backward:chunk1"):
            assert len(timeline[key]) == m, key
        want = {"call_forward", "call_backward", "call_forward:chunk1", "call_backward:chunk1", "start_end",
                "update", "precondition"}  # end-of-step work: one key per node, whatever its chunks
        for j, names in by_chunk.items():
            want |= {f"{kind}_{f}:{n}{':chunk1' if j else ''}" for n in names for f in "AB"
                     for kind in ("cov_kron", "inv_kron")}
        assert set(timeline) - {k for k in timeline if k.startswith("sync_kron")} == want


def _resume_worker(cfg, folder: str) -> list:
    """Train 2 steps with a checkpoint, resume for a third; and 3 steps straight: the losses."""
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        def run(steps: int, resume: str | None, ck: str | None) -> list:
            torch.manual_seed(0)
            opts = TrainOptions.of(mode="kfac", steps=steps, progress=False, log_every=10**9,
                                   checkpoint_dir=ck, resume=resume)
            return Trainer(cfg, ctx, opts).run().losses

        straight = run(3, None, None)
        run(2, None, folder)
        return [straight, run(3, folder, folder)]
    finally:
        shutdown(ctx)


def test_checkpoints_hold_every_chunks_kfac_state(tmp_path):
    """With 3 chunks a resumed run continues exactly (chunk 2's K-FAC state is saved and loaded)."""
    cfg = INTERLEAVED.replace(pipeline=dict(stages=2, chunks=3), model=dict(num_layers=6))
    results = spawn_local(_resume_worker, 2, cfg, str(tmp_path / "ck"), timeout_s=120)
    straight, resumed = next(r for r in results if r[0])
    assert resumed == straight[2:]
