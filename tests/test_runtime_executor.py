"""Schedule files in the runtime: refused before training when they do not fit the job, and run label by
label with the same result as ``kfac`` mode (one-iteration cycle) or a one-process replay (longer cycles).
"""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.launch.local import WorkerFailed, spawn_local
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.checks import check_schedule, single_iteration_schedule
from pipefisher.runtime.pipeline.contracts import EngineDefaults
from pipefisher.runtime.pipeline.executor import ScheduleExecutor, prepost_points
from pipefisher.runtime.pipeline.labels import FORWARD
from pipefisher.runtime.train.trainer import Trainer, TrainOptions
from pipefisher.schedule.file import save_schedule
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START

from _schedules import REAL_TEXT, TINY, packed_schedule, replay, spread_schedule, tiny, train_runs

STEPS = 7


# ----------------------------------------------------------------------------------------------------
# Refusals (pure checks, then the CLI and the workers)


def _refused(data, cfg=None, replicas=1) -> str:
    with pytest.raises(InputError) as err:
        check_schedule(data, cfg or tiny(), replicas, "s.pickle")
    return str(err.value)


def test_good_schedules_pass_the_check():
    cfg = tiny()
    for data in (single_iteration_schedule(cfg), spread_schedule(cfg), packed_schedule(cfg)):
        check_schedule(data, cfg)
    check_schedule(single_iteration_schedule(cfg, replicas=2), cfg, replicas=2)


def test_other_node_count_is_refused():
    data = single_iteration_schedule(tiny())
    assert "has 3 node schedule(s) but this run has 2 pipeline stage(s)" in _refused(data + data[:1])
    assert "has 1 node schedule(s)" in _refused(data[:1])


def test_unknown_module_is_refused():
    data = single_iteration_schedule(tiny())
    data[0][0][-5] = "inv_kron_A:encoder.layer.9.output.dense"
    assert "node 0 iteration 0: 'inv_kron_A:encoder.layer.9.output.dense': this stage has no K-FAC module" \
        in _refused(data)
    data = single_iteration_schedule(tiny())
    data[1][0][-5] = "inv_kron_A:encoder.layer.0.output.dense"  # a module of the other stage
    assert "node 1 iteration 0" in _refused(data) and "no K-FAC module named" in _refused(data)


@pytest.mark.parametrize("label,message", [
    ("frobnicate", "'frobnicate': unknown label"),
    ("cov_kron_C:encoder.layer.0.output.dense", "unknown label"),
    ("call_forward:up_pipe", "second (up) pipeline, but this run's pipeline has one pipe"),
    ("cov_kron_A:encoder.layer.0.output.dense:up_pipe", "pipeline.order: chimera has two"),
    ("-- end --:up_pipe", "second (up) pipeline"),
    ("cov_kron_A", "no module name"),
])
def test_unknown_labels_are_refused(label, message):
    data = single_iteration_schedule(tiny())
    data[0][0].insert(1, label)
    assert message in _refused(data)


def test_pipeline_order_and_count_must_match_the_engine():
    cfg = tiny()
    gpipe = single_iteration_schedule(cfg.replace(pipeline={"order": "gpipe"}))
    assert "another order than this run's pipeline" in _refused(gpipe, cfg)
    assert "'-- end --'" not in _refused(gpipe, cfg)
    fewer = single_iteration_schedule(cfg.replace(data={"num_micro_batches": 3}))
    assert ("has 3 call_backward, 3 call_forward, but this run's pipeline step has 4 call_backward, "
            "4 call_forward") in _refused(fewer, cfg)


def test_k_fac_work_that_cannot_run_is_refused():
    cfg = tiny()
    data = single_iteration_schedule(cfg)
    it = data[0][0]
    it.insert(1, it.pop(it.index("cov_kron_A:encoder.layer.0.attention.self.query")))  # before forward 0
    assert ("node 0 iteration 0: 'cov_kron_A:encoder.layer.0.attention.self.query': piece 0 needs forward 0 "
            "of the first iteration, which has not run yet (cov-before-forward)") in _refused(data)
    data = single_iteration_schedule(cfg)
    data[1][0].remove(SAVE_ON)
    assert "the last iteration must end by turning saving back on (save-on)" in _refused(data)
    data = single_iteration_schedule(cfg)
    data[1][0].remove("cov_kron_B:encoder.layer.3.output.dense")
    assert "'inv_kron_B:encoder.layer.3.output.dense': only 3 of 4 covariance pieces done (inv-before-cov)" \
        in _refused(data)
    data = single_iteration_schedule(cfg)
    data[0][0].remove("inv_kron_A:encoder.layer.1.output.dense")
    assert ("node 0 cycle: 'inv_kron_A:encoder.layer.1.output.dense': appears 0 times in the cycle, this run's "
            "step needs 1 (work-count)") in _refused(data)
    assert "not been all-reduced yet (inv-before-sync); this run has 2 replicas of the stage" \
        in _refused(single_iteration_schedule(cfg), cfg, 2)
    data = single_iteration_schedule(cfg)
    data[0][0].append(FORWARD)
    assert "5 call_forward" in _refused(data)


def test_the_runtime_checks_a_cycle_with_the_rules_own_dependency_rules():
    """One implementation: the runtime hands its step, as a timeline, to the rules' dependency check, and
    refuses with the rules' first violation (every rule of the spec, on every node)."""
    from pipefisher.rules.dependencies import dependency_violations
    from pipefisher.runtime.pipeline import checks
    from pipefisher.runtime.pipeline.engine import pipeline_ops
    from pipefisher.runtime.pipeline.layout import node_kfac_names

    assert checks.dependency_violations is dependency_violations
    cfg = tiny()
    good = spread_schedule(cfg)
    for node, names in enumerate(node_kfac_names(cfg)):
        ops = pipeline_ops(cfg.pipeline.order, node, cfg.pipeline.stages, cfg.data.num_micro_batches)
        step = checks.step_timeline(ops, names, interleaved=False)
        assert dependency_violations(node, step, good[node]) == []
        bad = copy.deepcopy(good[node])
        first_inverse = next(lb for lb in bad[0] if lb.startswith("inv_kron_"))
        bad[0].remove(first_inverse)
        bad[2].insert(1, first_inverse)  # still in the cycle, so every count holds
        bad[0].insert(1, first_inverse.replace("inv_kron_", "cov_kron_"))  # a piece before any forward
        (violation, *_) = dependency_violations(node, step, bad)
        data = copy.deepcopy(good)
        data[node] = bad
        assert f"node {node} iteration 0: '{violation.label}': {violation.detail} ({violation.rule})" in _refused(data)


def test_what_only_the_runtime_needs_of_a_cycle_is_refused():
    """Beyond the rules: no third saving marker (the workers would save micro-batches no covariance
    piece of the cycle uses), and no pipeline call after '-- end --' (the optimizer has stepped)."""
    cfg = tiny()
    data = spread_schedule(cfg)
    data[0][1].insert(1, SAVE_ON)
    assert "node 0 iteration 1: 'turn_on_save_inputs_outgrads' here: a cycle has it once, in iteration 2" \
        in _refused(data)
    data = single_iteration_schedule(cfg)
    data[1][0].append(SAVE_OFF)
    assert "node 1 iteration 0: 'turn_off_save_inputs_outgrads' again" in _refused(data)
    data = single_iteration_schedule(cfg)
    it = data[0][0]
    it.remove(END)
    it.insert(max(i for i, lb in enumerate(it) if lb.startswith("call_")), END)  # before the last backward
    assert "node 0 iteration 0: 'call_backward' after '-- end --'" in _refused(data)


def test_cli_refuses_a_wrong_schedule_before_training(tmp_path):
    data = single_iteration_schedule(tiny())
    data[1][0].insert(3, "cov_kron_A:encoder.layer.7.nope")
    bad = str(tmp_path / "bad.pickle")
    save_schedule(bad, data)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--schedule", bad, "--nproc-per-node", "2",
                                    "--steps", "3", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert f"error: {bad}: node 1 iteration 0: 'cov_kron_A:encoder.layer.7.nope'" in res.output
    assert "pipefisher train: mode" not in res.output  # no worker started
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--mode", "scheduled"])
    assert res.exit_code == 2 and "--mode scheduled needs --schedule FILE" in res.output


def test_a_schedule_packed_for_another_model_is_refused_unless_allowed(tmp_path):
    """Its metadata records the job it was packed for; another model shape is one line naming what
    differs, in the CLI before any worker starts and in every worker, unless the run says it means it."""
    from pipefisher.runtime.job.dist import single_process
    from pipefisher.runtime.pipeline.checks import load_checked_schedule, packed_for

    from _schedules import packed_job_schedule

    cfg = tiny(pipeline={"stages": 1})
    path = str(tmp_path / "s.pickle")
    save_schedule(path, packed_job_schedule(cfg), packed_for=packed_for(cfg))
    load_checked_schedule(path, cfg)  # its own job: fine
    wider = cfg.replace(model={"hidden_size": 64})
    with pytest.raises(InputError, match=r"was packed for another job: model.hidden_size 32 \(this run: 64\);"
                                         r".*--allow-schedule-mismatch"):
        load_checked_schedule(path, wider)
    load_checked_schedule(path, wider, allow_mismatch=True)
    deeper = cfg.replace(model={"num_layers": 6})  # more layers: more K-FAC modules on the stage too
    with pytest.raises(InputError, match=r"model.num_layers 4 \(this run: 6\), node 0's K-FAC modules: 12 in "
                                         r"this run not in it \(e.g. 'encoder.layer.4."):
        load_checked_schedule(path, deeper)
    # the workers check it too (torchrun runs no CLI pre-check), and take the override from the options
    opts = TrainOptions.of(mode="scheduled", schedule=path, steps=1, progress=False)
    with pytest.raises(InputError, match="model.hidden_size 32"):
        Trainer(wider, single_process(), opts)
    assert Trainer(wider, single_process(), TrainOptions.of(**{**opts.flags(), "allow_schedule_mismatch": True})).cycle

    # the CLI, before any worker starts; with the flag it goes on (to the next check, here the resume one)
    flags = ["train", "--config", TINY, "--stages", "1", "--schedule", path, "--no-progress"]
    res = CliRunner().invoke(main, [*flags, "--set", "model.hidden_size=64"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.output.count("\n") == 1 and "model.hidden_size 32 (this run: 64)" in res.output
    from pipefisher.cli.train import prepare_training

    with CliRunner().isolation() as (out, *_):  # the CLI's pre-check with the flag: said, and it goes on
        assert prepare_training(wider, TINY, 1, path, None, "scheduled", allow_schedule_mismatch=True)
        said = out.getvalue().decode()
    assert "packed for another job (model.hidden_size 32 (this run: 64)); training it anyway" in said
    # a schedule without the record (a published file) is checked as before, by its labels alone
    save_schedule(path, packed_job_schedule(cfg).to_file_data())
    load_checked_schedule(path, wider)


def test_a_schedule_packed_from_timelines_records_what_they_say(tmp_path):
    """`pipefisher schedule` knows no config: it records the job's stages, micro-batches, layout and K-FAC
    modules, which the runtime compares with its own (the model's shape stays unchecked there)."""
    import glob

    from pipefisher.runtime.pipeline.checks import load_checked_schedule
    from pipefisher.schedule.file import schedule_packed_for

    profile = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "profiles", "chimera_tiny_2", "*.pickle")))
    path = str(tmp_path / "s.pickle")
    assert CliRunner().invoke(main, ["schedule", *profile, "--save-path", path]).exit_code == 0
    recorded = schedule_packed_for(path)
    assert set(recorded) == {"pipeline.stages", "data.num_micro_batches", "layout", "modules"}
    assert recorded["layout"] == [1, True, False]  # Chimera: one chunk per device, two pipes, whole backwards
    cfg = tiny(pipeline={"order": "chimera"})
    load_checked_schedule(path, cfg)
    load_checked_schedule(path, cfg.replace(model={"hidden_size": 64}))  # not recorded, not compared
    with pytest.raises(InputError, match=r"data.num_micro_batches 4 \(this run: 8\)"):
        load_checked_schedule(path, cfg.replace(data={"num_micro_batches": 8}))


def _train_bad(cfg_path: str, schedule: str) -> None:
    from pipefisher.runtime.launch.local import run_worker

    cfg = load_config(cfg_path).replace(pipeline={"timeout_s": 20.0})
    run_worker(cfg, TrainOptions.of(mode="scheduled", schedule=schedule, steps=3, progress=False))


def test_every_worker_refuses_a_wrong_schedule_on_its_own(tmp_path):
    """The check in the worker (torchrun, no CLI pre-check): all ranks fail at once, none hangs."""
    data = single_iteration_schedule(tiny())
    bad = str(tmp_path / "bad.pickle")
    save_schedule(bad, [data[0], data[0]])  # node 1 runs node 0's modules
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as err:
        spawn_local(_train_bad, 2, TINY, bad, timeout_s=60)
    assert time.monotonic() - t0 < 30  # not by waiting out a peer: tiny's collective timeout is 60 s (16 s seen under load)
    text = str(err.value)
    assert "rank 0:" in text and "rank 1:" in text
    assert text.count("node 1 iteration 0") >= 2 and "no K-FAC module named" in text


# ----------------------------------------------------------------------------------------------------
# Equality with kfac mode and with a one-process replay


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.stage.named_parameters()}


NOT_POSTED = "packed, receives not posted ahead"


def _train_runs_posting(cfg_path: str, runs: list[tuple[str, str | None]], steps: int, overrides: dict) -> dict:
    """:func:`train_runs`, also recording how many receives each run posted ahead of its calls, and a
    last run of the final schedule with posting ahead off (:data:`NOT_POSTED`)."""
    from pipefisher.runtime.job.dist import init_from_env, shutdown

    cfg = load_config(cfg_path).replace(**overrides).replace(pipeline={"timeout_s": 30.0})
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    out: dict = {"stage": ctx.grid.stage, "replica": ctx.grid.replica, "posted": {}}
    try:
        for mode, schedule, name in [(m, s, m if s is None else os.path.basename(s)) for m, s in runs] \
                + [("scheduled", runs[-1][1], NOT_POSTED)]:
            torch.manual_seed(0)
            trainer = Trainer(cfg, ctx, TrainOptions.of(mode=mode, schedule=schedule, steps=steps, progress=False,
                                                        log_every=10**9))
            if name == NOT_POSTED:
                trainer.executor.prepost = False
                trainer.executor.switch(trainer.executor.iterations, trainer.executor.first_step)
            res = trainer.run()
            out[name] = ({n: p.detach().clone() for n, p in trainer.stage.named_parameters()}, res.losses)
            out["posted"][name] = trainer.engine.posted_ahead
    finally:
        shutdown(ctx)
    return out


@pytest.fixture(scope="module")
def two_stage_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("schedules")
    cfg = tiny()
    files = {}
    for name, data in (("one", single_iteration_schedule(cfg)), ("spread", spread_schedule(cfg)),
                       ("packed", packed_schedule(cfg))):
        files[name] = str(folder / f"{name}.pickle")
        save_schedule(files[name], data)
    runs = [("kfac", None)] + [("scheduled", files[n]) for n in ("one", "spread", "packed")]
    results = spawn_local(_train_runs_posting, 2, TINY, runs, STEPS, REAL_TEXT, timeout_s=120)
    return {r["stage"]: r for r in results}, files


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in a)
    assert worst < tol, worst
    return worst


def test_one_iteration_schedule_equals_kfac_every_step(two_stage_runs):
    by_stage, _ = two_stage_runs
    for stage, res in by_stage.items():
        _close(res["one.pickle"][0], res["kfac"][0])
    assert by_stage[1]["one.pickle"][1] == pytest.approx(by_stage[1]["kfac"][1], rel=1e-6)
    moved = max(float((by_stage[0]["kfac"][0][k] - PipelineStage(tiny().model, 0, 2).state_dict()[k]).abs().max())
                for k in by_stage[0]["kfac"][0])
    assert moved > 1e-3  # the runs trained


@pytest.mark.parametrize("name", ["spread", "packed"])
def test_multi_iteration_schedule_equals_a_one_process_replay(two_stage_runs, name):
    from pipefisher.schedule.file import load_schedule

    by_stage, files = two_stage_runs
    schedule = load_schedule(files[name])
    assert min(len(node) for node in schedule) >= 2
    ref = replay(tiny(), schedule, STEPS)
    for stage, res in by_stage.items():
        _close(res[f"{name}.pickle"][0], ref[stage])
    # ... and the curvature of a longer cycle really differs from refreshing every step
    with pytest.raises(AssertionError):
        _close(by_stage[0][f"{name}.pickle"][0], by_stage[0]["kfac"][0], tol=1e-6)


def test_scheduled_runs_post_receives_ahead_and_train_as_without(two_stage_runs):
    """Schedules with K-FAC work in bubbles post the next call's receives ahead of it on both stages
    (the replay equalities above ran so), and a run with that off trains bit for bit the same."""
    by_stage, _ = two_stage_runs
    for stage, res in by_stage.items():
        assert res["posted"]["kfac"] == 0 and res["posted"][NOT_POSTED] == 0
        assert res["posted"]["spread.pickle"] > 0 and res["posted"]["packed.pickle"] > 0, (stage, res["posted"])
        params, losses = res[NOT_POSTED]
        want, want_losses = res["packed.pickle"]
        assert all(torch.equal(params[k], want[k]) for k in want)
        assert losses == want_losses


def test_replay_of_the_one_iteration_schedule_equals_kfac(two_stage_runs):
    """The reference itself: replaying the one-iteration schedule gives kfac mode's parameters."""
    by_stage, _ = two_stage_runs
    ref = replay(tiny(), single_iteration_schedule(tiny()), STEPS)
    for stage, res in by_stage.items():
        _close(ref[stage], res["kfac"][0])


def test_data_parallel_replicas_run_the_same_labels(tmp_path):
    """2 stages x 2 replicas: sync labels line up; the one-iteration schedule equals kfac mode, and the
    replicas of each stage hold the same parameters."""
    cfg = tiny()
    path = str(tmp_path / "dp.pickle")
    save_schedule(path, single_iteration_schedule(cfg, replicas=2))
    results = spawn_local(train_runs, 4, TINY, [("kfac", None), ("scheduled", path)], 3, REAL_TEXT,
                          timeout_s=120)
    for r in results:
        _close(r["dp.pickle"][0], r["kfac"][0])
    for s in range(2):
        a, b = [r["dp.pickle"][0] for r in results if r["stage"] == s]
        _close(a, b, tol=1e-6)


def test_one_stage_run_in_one_process_uses_the_executor():
    cfg = tiny(pipeline={"stages": 1})
    data = copy.deepcopy(spread_schedule(cfg))
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.pickle")
        save_schedule(path, data)
        from pipefisher.runtime.job.dist import single_process

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            trainer = Trainer(cfg, single_process(), TrainOptions.of(mode="scheduled", schedule=path, steps=STEPS,
                                                                     progress=False))
            assert trainer.cycle == 3
            trainer.run()
        finally:
            torch.set_num_threads(threads)
    _close(_params(trainer), replay(cfg, data, STEPS)[0])


def test_a_schedule_for_m_covariance_micro_batches_runs_only_with_m_and_trains_as_kfac_mode(tmp_path):
    """``kfac.cov_micro_batches`` M: the one-iteration cycle holds M covariance pieces per factor, trains
    exactly as ``kfac`` mode with the same M (the runtime saves only those micro-batches), and a
    schedule made for another M is refused in one line, by its labels and by its metadata."""
    from pipefisher.runtime.job.dist import single_process
    from pipefisher.runtime.pipeline.checks import load_checked_schedule, packed_for

    cfg = tiny(pipeline={"stages": 1})
    two = cfg.replace(kfac={"cov_micro_batches": 2})
    data = single_iteration_schedule(two)
    name = [lb for lb in data[0][0] if lb.startswith("cov_kron_A:")][0]
    assert data[0][0].count(name) == 2 < cfg.data.num_micro_batches
    check_schedule(data, two)
    assert "only 2 of 4 covariance pieces done (inv-before-cov)" in _refused(data, cfg)
    assert "appears 4 pieces in the cycle, this run's step needs 2 (work-count)" in _refused(
        single_iteration_schedule(cfg), two)
    path = str(tmp_path / "s.pickle")
    from _schedules import packed_job_schedule

    save_schedule(path, packed_job_schedule(cfg), packed_for=packed_for(two))
    with pytest.raises(InputError, match=r"packed for another job: kfac.cov_micro_batches 2 \(this run: 'all'\)"):
        load_checked_schedule(path, cfg)
    save_schedule(path, data)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {}
        for mode in ("scheduled", "kfac"):
            torch.manual_seed(0)
            trainer = Trainer(two, single_process(), TrainOptions.of(mode=mode, schedule=path if mode == "scheduled"
                                                                     else None, steps=3, progress=False))
            res = trainer.run()
            runs[mode] = (_params(trainer), res.peak_saved_bytes)
        torch.manual_seed(0)
        every = Trainer(cfg, single_process(), TrainOptions.of(mode="kfac", steps=3, progress=False)).run()
    finally:
        torch.set_num_threads(threads)
    _close(runs["scheduled"][0], runs["kfac"][0])
    assert runs["kfac"][1] * 2 == every.peak_saved_bytes  # 2 of the 4 micro-batches saved


def test_a_profile_with_m_covariance_micro_batches_records_m_and_packs_a_schedule_the_run_takes(tmp_path):
    """The chain: a profiled kfac run with ``kfac.cov_micro_batches`` 1 records it in its timeline, the
    packer places one covariance piece per factor, ``validate`` accepts it, and the runtime's own checks
    accept it for this run and refuse it, in one line, for a run that covers every micro-batch."""
    from pipefisher.policies import get_policy
    from pipefisher.rules import validate
    from pipefisher.runtime.job.dist import single_process
    from pipefisher.runtime.pipeline.checks import load_checked_schedule, packed_for
    from pipefisher.schedule.timeline import load_job

    cfg = tiny(pipeline={"stages": 1})
    one = cfg.replace(kfac={"cov_micro_batches": 1})
    res = Trainer(one, single_process(), TrainOptions.of(mode="kfac", profile=True, out=str(tmp_path), steps=2,
                                                         progress=False)).run()
    job = load_job([res.timeline_path])
    assert job.nodes[0].cov_micro_batches == 1
    packed = get_policy("tight").pack(job)
    data = packed.to_file_data()
    assert validate(data, job) == []
    cov = [lb for it in data[0] for lb in it if lb.startswith("cov_kron_A:")]
    assert len(cov) == len(set(cov))  # one piece per factor
    path = str(tmp_path / "s.pickle")
    save_schedule(path, packed, timelines=[res.timeline_path])
    load_checked_schedule(path, one)
    with pytest.raises(InputError, match=r"only 1 of 4 covariance pieces done|appears 1 pieces"):
        load_checked_schedule(path, cfg)
    save_schedule(path, packed, packed_for=packed_for(one))
    with pytest.raises(InputError, match=r"kfac.cov_micro_batches 1 \(this run: 'all'\)"):
        load_checked_schedule(path, cfg)


# ----------------------------------------------------------------------------------------------------
# Receives posted ahead of bubble work, on a fake engine

_BWD = "call_backward"
_M = "encoder.layer.0.output.dense"


class _FakeKFAC:
    names = [_M]

    def __init__(self, log: list, fail: str | None = None) -> None:
        self.log, self.fail = log, fail
        self.refreshes: list[tuple] = []  # refresh_every and finish_refreshes, in order

    def pieces(self, name: str, factor: str) -> int:
        return 1

    def refresh_every(self, steps: int) -> None:
        self.refreshes.append(("every", steps))

    def plan_refresh(self) -> None:  # whole refreshes: every label does its work, as logged
        return None

    def complete(self, factor: str, name: str) -> None:
        return None

    def finish_refreshes(self) -> None:
        self.refreshes.append(("finish",))

    def set_saving(self, on: bool) -> None:
        self.log.append(("saving", on))

    def _work(self, kind: str, factor: str, name: str) -> None:
        if kind == self.fail:
            raise RuntimeError(f"{kind} failed")
        self.log.append((kind, factor))

    def cov(self, factor: str, name: str) -> None:
        self._work("cov", factor, name)

    def sync(self, factor: str, name: str) -> None:
        self._work("sync", factor, name)

    def inv(self, factor: str, name: str) -> None:
        self._work("inv", factor, name)


class _BareEngine(EngineDefaults):
    """Logs every call (an engine that cannot post receives ahead: the contract's no-op defaults)."""

    def __init__(self, log: list) -> None:
        self.log, self.posted, self.dropped = log, set(), 0

    def begin_step(self, step: int) -> None:
        self.log.append(("begin", step))

    def op(self, label: str):
        def call() -> None:
            self.log.append(("call", label, label in self.posted))
            self.posted.discard(label)
        return call

    def finish_step(self) -> None:
        assert not self.posted
        self.log.append(("finish",))

    def set_wait_log(self, log) -> None:
        pass


class _FakeEngine(_BareEngine):
    """``prepost`` remembers what is posted, the call takes it, as the real engine."""

    def prepost(self, label: str) -> int:
        self.log.append(("prepost", label))
        self.posted.add(label)
        return 1

    def drop_preposted(self) -> int:
        self.dropped += len(self.posted)
        self.posted.clear()
        return self.dropped


_ITERATION = [START, f"cov_kron_A:{_M}", FORWARD, f"cov_kron_A:{_M}", f"cov_kron_A:{_M}", SAVE_ON,
              f"sync_kron_A:{_M}", FORWARD, _BWD, f"cov_kron_B:{_M}", _BWD, f"inv_kron_A:{_M}", END,
              f"inv_kron_B:{_M}"]


def test_the_executor_marks_each_factor_s_completion_where_the_packing_problem_has_it():
    """Issue 46: one definition of a factor's completion (:func:`pipefisher.schedule.problem.completions`):
    its FIRST sync (every covariance piece comes before any sync, so the factor is final there, and the
    rules let its inverse begin there), or without one its last covariance piece; the executor marks that
    label. A cycle that syncs a factor twice validates where the profile ran its sync twice (the inverse
    between the two then takes the synced factor); the runtime's own step has one sync per factor, so it
    refuses such a cycle before any step."""
    from pipefisher.rules import validate
    from pipefisher.rules.dependencies import dependency_violations
    from pipefisher.runtime.pipeline.checks import step_timeline
    from pipefisher.runtime.pipeline.executor import completion_points
    from pipefisher.schedule.problem import completions, pieces_before_completion
    from pipefisher.schedule.timeline import job_from_dicts

    cycle = [[START, FORWARD, _BWD, "cov_kron_A:l", "sync_kron_A:l", "inv_kron_A:l", "sync_kron_A:l",
              "cov_kron_B:l", "inv_kron_B:l", END, SAVE_OFF, SAVE_ON]]
    job = job_from_dicts([{"start_end": [(0, 1000)], FORWARD: [(0, 10)], _BWD: [(10, 20)],
                           "cov_kron_A:l": [(0, 10)], "sync_kron_A:l": [(0, 2), (0, 2)], "inv_kron_A:l": [(0, 10)],
                           "cov_kron_B:l": [(0, 10)], "inv_kron_B:l": [(0, 10)]}])
    assert validate([cycle], job) == []
    assert completion_points(cycle) == {(0, 4): (0, "A", "l"), (0, 7): (0, "B", "l")}
    assert completions([(label, 1) for label in cycle[0]]) == {"A:l": 4, "B:l": 7}
    assert pieces_before_completion(job.nodes[0], cycle) == {"inv_kron_A:l": 0, "inv_kron_B:l": 0}
    (refused,) = dependency_violations(0, step_timeline([FORWARD, _BWD], {0: ["l"]}, False, {"sync_kron_A:l"}), cycle)
    assert (refused.label, refused.rule) == ("sync_kron_A:l", "work-count")


def test_prepost_points_are_the_starts_of_bubbles_before_a_call():
    # the head bubble (after the start), the first of a run of K-FAC labels, each call once, nothing
    # for work after the end; a bubble split by a marker posts its call once
    assert prepost_points(_ITERATION) == {1: FORWARD, 3: FORWARD, 9: _BWD}
    assert prepost_points([START, FORWARD, _BWD, END]) == {}
    assert prepost_points([START, FORWARD, f"inv_kron_A:{_M}", END, f"inv_kron_B:{_M}"]) == {}


def test_the_executor_posts_the_next_calls_receives_before_bubble_work():
    log: list = []
    engine = _FakeEngine(log)
    ex = ScheduleExecutor([_ITERATION], engine, {0: _FakeKFAC(log)}, lambda: log.append(("end",)))
    ex.run_step(1)
    assert log == [("begin", 1), ("prepost", FORWARD), ("cov", "A"), ("call", FORWARD, True),
                   ("prepost", FORWARD), ("cov", "A"), ("cov", "A"), ("saving", True), ("sync", "A"),
                   ("call", FORWARD, True), ("call", _BWD, False), ("prepost", _BWD), ("cov", "B"),
                   ("call", _BWD, True), ("inv", "A"), ("finish",), ("end",), ("inv", "B")]
    # off (or an engine without prepost): the labels' calls alone, in the same order
    plain = [x[:2] + (False,) if x[0] == "call" else x for x in log if x[0] != "prepost"]
    for other, on in ((_FakeEngine([]), False), (_BareEngine([]), True)):
        ScheduleExecutor([_ITERATION], other, {0: _FakeKFAC(other.log)}, lambda e=other: e.log.append(("end",)),
                         prepost=on).run_step(1)
        assert other.log == plain


def test_a_failed_step_drops_what_it_posted_ahead():
    log: list = []
    engine = _FakeEngine(log)
    ex = ScheduleExecutor([_ITERATION], engine, {0: _FakeKFAC(log, fail="sync")}, lambda: None)
    with pytest.raises(RuntimeError, match="sync failed"):
        ex.run_step(1)
    assert log[-4:] == [("prepost", FORWARD), ("cov", "A"), ("cov", "A"), ("saving", True)]
    assert engine.dropped == 1 and not engine.posted


def test_posting_ahead_is_no_label_of_the_record():
    """The recorder times the labels alone; a call's receive wait stays in its own label."""
    from pipefisher.runtime.train.recorder import ClockRecorder

    log: list = []
    rec = ClockRecorder(0, 0)
    ex = ScheduleExecutor([_ITERATION], _FakeEngine(log), {0: _FakeKFAC(log)}, lambda: None, recorder=rec)
    ex.run_step(1)
    assert [t.label for t in ex.last_record.labels] == _ITERATION


def test_every_schedule_the_executor_installs_tells_kfac_its_cycle():
    """The cycle is how often each factor refreshes: K-FAC weighs its running average per step by it
    (:meth:`pipefisher.kfac.KFAC.refresh_every`), at the first schedule and at every switch, after the
    refreshes the old schedule left under way have ended."""
    kfac = _FakeKFAC([])
    plain = [START, FORWARD, FORWARD, _BWD, _BWD, END]  # no K-FAC work: the cycle's other iterations
    ex = ScheduleExecutor([_ITERATION, plain, plain], _FakeEngine([]), {0: kfac}, lambda: None)
    assert kfac.refreshes == [("every", 3)]
    for step in (1, 2, 3):
        ex.run_step(step)
    ex.switch([_ITERATION, plain], 4)  # the old cycle's refreshes end at its own weight, then the new one's
    assert kfac.refreshes == [("every", 3), ("finish",), ("every", 2)]
