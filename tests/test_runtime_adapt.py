"""The closed loop in the runtime: measured steps, an adaptive re-pack, a switch on every worker at the
same step, and resumption after a switch, on a fake clock (deterministic durations injected)."""
from __future__ import annotations

import json
import os
from itertools import accumulate

import pytest
import torch

from pipefisher.runtime.launch.local import spawn_local
from pipefisher.schedule.timeline import job_from_dicts, split_evenly

from _fake_clock import FakeRecorder, slowed_job, true_models
from _schedules import fake_timelines, replay, tiny

STEPS = 14
SCALE = 100_000  # fake_timelines' units (10 per forward) to nanoseconds: a 1 ms forward
KFAC_SCALE = 0.15  # lighter K-FAC work than fake_timelines' (a cycle of 3 instead of 23)


def _cfg():
    """configs/tiny.yaml on real text, its learning rate decaying over STEPS (whatever a run's --steps:
    a run stopped early and resumed must train as the whole run does)."""
    return tiny().replace(optim={"decay_steps": STEPS})


def _timelines(cfg, pieces: int = 1) -> list[dict]:
    """``pieces`` > 1: every inverse as its refresh's pieces (``kfac.refresh_pieces``), as a profile of
    such a run records them; equal ones, as the fake clock runs a key's pieces in different steps alike."""
    def scaled(key: str, s: int, e: int) -> list[tuple[int, int]]:
        s, d = s * SCALE, int((e - s) * SCALE * (KFAC_SCALE if "kron" in key else 1))
        if pieces == 1 or not key.startswith("inv_kron"):
            return [(s, s + d)]
        cuts = list(accumulate(split_evenly(d, pieces), initial=s))
        return list(zip(cuts[:-1], cuts[1:]))

    return [{k: [iv for s, e in v for iv in scaled(k, s, e)] for k, v in raw.items()} for raw in fake_timelines(cfg)]


def _job_files(folder, cfg, pieces: int = 1, overlap: bool | None = None) -> tuple[str, list[str], tuple[int, str]]:
    """The profile (one pickle per node; inverses in ``pieces``), its tight schedule (metadata naming the
    profile), and a K-FAC key that, twice as slow as profiled, no longer fits where the schedule put it
    (and a re-pack fits the schedule's cycle: the closed loop repairs within its k). ``overlap``: the
    tight policy's option (False: as ``run --adapt`` packs, and as the loop's re-packs are)."""
    from pipefisher.policies import get_policy
    from pipefisher.rules import validate
    from pipefisher.safe_io import dump_pickle_atomic
    from pipefisher.schedule.file import save_schedule

    raws = _timelines(cfg, pieces)
    paths = [str(folder / f"tiny_node{n}_timeline.pickle") for n in range(len(raws))]
    for p, raw in zip(paths, raws):
        dump_pickle_atomic(p, raw)
    job = job_from_dicts(raws, paths)
    tight = get_policy("tight", overlap=overlap)
    packed = tight.pack(job)
    sched = str(folder / "schedule.pickle")
    save_schedule(sched, packed, timelines=paths)
    data = packed.to_file_data()
    k = max(len(node) for node in data)
    for n, node in enumerate(job.nodes):
        for key in node.entries:
            slowed = slowed_job(job, {(n, key): 2.0})
            if "kron" in key and validate(data, slowed) and max(map(len, tight.pack(slowed).to_file_data())) <= k:
                return sched, paths, (n, key)
    raise AssertionError("no K-FAC key overruns its bubble at twice its time and re-packs within the cycle")


def _run(sched: str, paths: list[str], slow: tuple[int, str], steps: int, prefix: str, adapt: bool,
         checkpoint_dir: str | None = None, resume: str | None = None, pieces: int = 1) -> dict:
    """One worker: a scheduled run whose recorder is the fake clock of the slowed job (K-FAC refreshing
    in ``pieces``)."""
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions
    from pipefisher.schedule.timeline import load_job

    cfg = _cfg().replace(pipeline={"timeout_s": 60.0}, kfac={"refresh_pieces": pieces})
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    g = ctx.grid
    try:
        job = slowed_job(load_job(paths), {slow: 2.0})
        models = true_models(job, 0.05)
        period = max(m.base for m in models)
        recorder = FakeRecorder(g.stage, g.replica, models[g.stage], period, lambda: trainer.executor.iterations)
        torch.manual_seed(0)
        opts = TrainOptions.of(mode="scheduled", schedule=sched, steps=steps, progress=False, log_every=10**9,
                               adapt=adapt, measure_prefix=prefix, checkpoint_dir=checkpoint_dir, resume=resume)
        trainer = Trainer(cfg, ctx, opts, recorder=recorder)
        res = trainer.run()
        loop = trainer.loop
        return {"stage": g.stage, "losses": res.losses,
                "params": {n: p.detach().clone() for n, p in trainer.stage.named_parameters()},
                "history": [(s.step, s.plan.digest, s.plan.cycles) for s in loop.history],
                "overruns": dict(loop.overruns), "active": loop.plan.data,
                "refreshes": {s: (r.drift, r.aging) for s, r in trainer.refreshes.items()}}
    finally:
        shutdown(ctx)


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapt")
    sched, paths, slow = _job_files(folder, _cfg())
    out = {}
    for name, adapt in (("static", False), ("adaptive", True)):
        prefix = str(folder / name)
        results = spawn_local(_run, 2, sched, paths, slow, STEPS, prefix, adapt, timeout_s=180)
        out[name] = ({r["stage"]: r for r in results}, prefix)
    return out, sched, paths, slow, folder


def _labels_run(prefix: str) -> dict[tuple[int, int], list[str]]:
    from pipefisher.cost.measure import read_csv

    return {(r.step, r.node): [lt.label for lt in r.labels] for r in read_csv(prefix + "_measurements.csv")
            if r.replica == 0}


def test_a_slower_item_is_repacked_within_two_cycles_on_every_worker_at_once(adaptive):
    from pipefisher.schedule.file import load_schedule

    out, sched, _, slow, _ = adaptive
    by_stage, prefix = out["adaptive"]
    first = load_schedule(sched)
    history = by_stage[0]["history"]
    assert history == by_stage[1]["history"]  # every worker switched at the same steps, to the same schedule
    assert len(history) >= 2, history
    cycle = max(len(n) for n in first)  # --adapt runs every node on the longest node's cycle
    assert history[1][0] <= 1 + 2 * cycle  # decided after at most two cycles of the first schedule
    # the first schedule overran where the slowed item sat; the schedule that ends the run does not
    overruns = by_stage[0]["overruns"]
    assert max(overruns[s] for s in range(1, history[1][0])) > 0
    repaired = range(history[1][0], history[2][0] if len(history) > 2 else STEPS)
    assert len(repaired) >= cycle and max(overruns[s] for s in repaired) == 0.0
    # the files a run writes: every schedule used, and when it took over
    saved = json.load(open(prefix + "_schedules/history.json"))["switches"]
    assert [(r["step"], r["digest"]) for r in saved] == [(s, d) for s, d, _ in history]
    # every complete cycle's curvature refresh: in the cycles file, as every worker learned it
    lines = [json.loads(x) for x in open(prefix + "_cycles.jsonl")]
    logged = {r["step"]: (r["drift"], r["aging"]) for line in lines for r in line["drift"]}
    assert logged and logged == by_stage[0]["refreshes"] == by_stage[1]["refreshes"]
    assert load_schedule(os.path.join(prefix + "_schedules", saved[-1]["file"])) == by_stage[0]["active"]


def test_a_refresh_in_pieces_is_measured_repacked_and_switched_to_in_its_pieces(tmp_path):
    """kfac.refresh_pieces 2: the measured window keeps each inverse's 2 pieces, so the re-pack holds the
    2 labels per factor and cycle the runtime runs, and the run switches to it and goes on (it stopped at
    the switch, refused, when the measured timeline had one interval per inverse)."""
    from pipefisher.runtime.pipeline.executor import inverse_counts
    from pipefisher.schedule.file import load_schedule

    sched, paths, slow = _job_files(tmp_path, _cfg(), pieces=2, overlap=False)
    assert {len(v) for v in inverse_counts(load_schedule(sched)[0]).values()} == {2}
    prefix = str(tmp_path / "pieces")
    results = spawn_local(_run, 2, sched, paths, slow, STEPS, prefix, True, None, None, 2, timeout_s=180)
    by_stage = {r["stage"]: r for r in results}
    history = by_stage[0]["history"]
    assert len(history) >= 2 and history == by_stage[1]["history"], history
    assert len(by_stage[1]["losses"]) == STEPS  # the last stage's loss of every step: the run went on
    for node in by_stage[0]["active"]:
        assert {len(v) for v in inverse_counts(node).values()} == {2}


def test_parameters_equal_a_one_process_replay_of_the_labels_run(adaptive):
    out, *_ = adaptive
    by_stage, prefix = out["adaptive"]
    run = _labels_run(prefix)
    assert len({tuple(v) for (s, n), v in run.items() if n == 0}) > 2  # several schedules' iterations ran
    ref = replay(_cfg(), None, STEPS, labels_at=lambda step, node: run[step, node])
    for stage, res in by_stage.items():
        for name, t in res["params"].items():
            assert torch.allclose(t, ref[stage][name], rtol=1e-5, atol=1e-7), name


def test_the_static_scheduler_runs_the_file_as_before(adaptive):
    from pipefisher.schedule.file import load_schedule

    out, sched, *_ = adaptive
    by_stage, prefix = out["static"]
    assert [h[0] for h in by_stage[0]["history"]] == [1]  # measured, never switched
    assert max(by_stage[0]["overruns"].values()) > 0  # ... though it overran
    ref = replay(_cfg(), load_schedule(sched), STEPS)
    for stage, res in by_stage.items():
        for name, t in res["params"].items():
            assert torch.allclose(t, ref[stage][name], rtol=1e-5, atol=1e-7), name


def test_resuming_after_a_switch_reproduces_the_uninterrupted_run_bit_for_bit(adaptive):
    out, sched, paths, slow, folder = adaptive
    by_stage, _ = out["adaptive"]
    switch = by_stage[0]["history"][1][0]
    stop = switch + 1  # after the switch, in the middle of the new schedule's first cycle
    assert stop < STEPS
    ckpt = str(folder / "ckpt")
    prefix = str(folder / "resumed")
    spawn_local(_run, 2, sched, paths, slow, stop, prefix, True, ckpt, None, timeout_s=180)
    resumed = {r["stage"]: r for r in spawn_local(_run, 2, sched, paths, slow, STEPS, prefix, True, ckpt, ckpt,
                                                  timeout_s=180)}
    for stage, res in resumed.items():
        whole = by_stage[stage]
        assert res["history"] == whole["history"]
        for name, t in res["params"].items():
            assert torch.equal(t, whole["params"][name]), name
        # the curvature drift too, including the refresh of the cycle the checkpoint cut in two
        assert res["refreshes"] and res["refreshes"] == {s: whole["refreshes"][s] for s in res["refreshes"]}
    assert resumed[1]["losses"] == by_stage[1]["losses"][stop:]


def test_a_loop_restored_in_the_middle_of_a_cycle_goes_on_as_the_uninterrupted_one(tmp_path):
    """The loop alone (no torch, no workers): its state in a checkpoint holds the open cycle's records,
    the window and the active schedule, so a restored loop ends in the very state of one never stopped."""
    import copy

    from pipefisher.loop.closed_loop import AdaptiveScheduler, Plan, equal_cycles
    from pipefisher.runtime.train.adapt import ScheduleLoop
    from pipefisher.schedule.timeline import load_job

    from _fake_clock import fake_records

    sched, paths, slow = _job_files(tmp_path, _cfg())
    from pipefisher.schedule.file import load_schedule
    from pipefisher.schedule.timeline import read_node_file

    models = true_models(slowed_job(load_job(paths), {slow: 2.0}), 0.05)
    raws = [read_node_file(p) for p in paths]

    def new_loop() -> ScheduleLoop:
        plan = Plan(equal_cycles(load_schedule(sched)), timelines=raws)
        loop: ScheduleLoop

        def gather(mine):  # node 0's records, and the other nodes' of the same steps (no drift measured)
            records, drift = mine
            steps = {r.step for r in records}
            every = fake_records(loop.plan.data, models, loop.first_step, max(steps) - loop.first_step + 1)
            return [mine, ([r for r in every if r.step in steps and r.node != 0], [])]
        loop = ScheduleLoop(plan, node=0, rank=0, nodes=2, scheduler=AdaptiveScheduler(plan, 2), adapt=True,
                            collective=(gather, lambda x: x, lambda: None))
        return loop

    def run(loop: ScheduleLoop, steps: range) -> None:
        for s in steps:
            mine = [r for r in fake_records(loop.plan.data, models, loop.first_step, s - loop.first_step + 1)
                    if r.step == s and r.node == 0]
            loop.after_step(s, mine[0])

    whole = new_loop()
    run(whole, range(1, 16))
    switch = whole.history[1].step
    stop = switch + 1
    first = new_loop()
    run(first, range(1, stop))
    assert first.pending  # stopped in the middle of a cycle
    resumed = new_loop()
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    run(resumed, range(stop, 16))

    def deciding(loop: ScheduleLoop) -> dict:  # what decides; how long deciding took (wall clock) does not
        out = loop.state_dict()
        for h in out["history"]:
            h.pop("decide_seconds")
        return out
    assert deciding(resumed) == deciding(whole)
    # ... and one restored without the open cycle's records would not be
    without = copy.deepcopy(first.state_dict())
    without["pending"] = []
    lossy = new_loop()
    lossy.load_state_dict(without)
    run(lossy, range(stop, 16))
    assert deciding(lossy) != deciding(whole)


def test_a_switch_to_another_cycle_says_the_factors_new_weight_a_refresh(tmp_path, switch_through, caplog):
    """Under soap the old factor weighs 0.8 a step, so a refresh's weight follows the cycle: a switch from
    a cycle of 1 to one of 2 says the new weight (0.64) where the start lines said 0.8; a switch that
    keeps the cycle says nothing more."""
    import logging

    from pipefisher.loop.closed_loop import Plan
    from pipefisher.runtime.job.dist import single_process
    from pipefisher.runtime.pipeline.checks import single_iteration_schedule
    from pipefisher.runtime.pipeline.labels import parse_label
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions
    from pipefisher.schedule.file import save_schedule
    from pipefisher.schedule.format import SAVE_OFF, SAVE_ON

    cfg = tiny(pipeline={"stages": 1}, kfac={"update": "soap", "factor_decay_per_step": 0.8})
    labels = single_iteration_schedule(cfg)[0][0]
    # a cycle of 2: the K-FAC work and turning saving off in its first step, saving back on in its last
    first = [lb for lb in labels if lb != SAVE_ON]
    last = [lb for lb in labels if lb not in (SAVE_ON, SAVE_OFF) and not parse_label(lb).kind.endswith("_kron")]
    invs = [lb for lb in first if parse_label(lb).kind == "inv_kron"]
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, [[labels]])
    later = [Plan([[first, last + [SAVE_ON]]], "a cycle of 2"),  # then the inverses in its second step
             Plan([[[lb for lb in first if lb not in invs], [last[0], *invs, *last[1:], SAVE_ON]]], "2 again")]

    switch_through(later)
    with caplog.at_level(logging.INFO, logger="pipefisher"):
        t = Trainer(cfg, single_process(), TrainOptions.of(mode="scheduled", schedule=sched, steps=6, adapt=True,
                                                             progress=False, log_every=10**9))
        t.run()
    assert [(s.step, len(s.plan.data[0])) for s in t.loop.history] == [(1, 1), (2, 2), (4, 2)]
    said = [r.getMessage() for r in caplog.records if "factors averaged" in r.getMessage()]
    assert said == [
        "stage 0: factors averaged across refreshes: the old factor weighs 0.8 a refresh (0.8 a step, a refresh "
        "every 1 step)",
        "step 2: stage 0: factors averaged across refreshes: the old factor weighs 0.64 a refresh (0.8 a step, a "
        "refresh every 2 steps)"]
