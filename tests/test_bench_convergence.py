"""The convergence benchmark reads the losses from the worker that holds them (rank 1, or rank 0 under ZB-V),
and races K-FAC against the best first-order optimizer."""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_convergence import bench_config, loss_rank, merged_runs  # noqa: E402

from _schedules import TINY  # noqa: E402


def _result(rank: int, holds_loss: bool, seconds: float) -> dict:
    run = {"mode": "baseline", "val": [(10, 5.0, 1.0)] if holds_loss else [], "peak_memory": 10 * (rank + 1),
           "peak_saved": 0, "step_seconds": [seconds, seconds]}
    return {"rank": rank, "holds_loss": holds_loss, "runs": [run]}


def test_the_losses_come_from_the_worker_holding_the_last_stage():
    assert loss_rank(bench_config(TINY, [])) == 1
    assert loss_rank(bench_config(TINY, ["pipeline.order=zb-v"])) == 0  # the V ends where it began
    runs, first, last = merged_runs([_result(0, True, 0.2), _result(1, False, 0.3)])
    assert last["rank"] == 0 and first["rank"] == 0
    assert runs[0]["val"] == [(10, 5.0, 1.0)]
    assert runs[0]["step_seconds"] == [0.3, 0.3] and runs[0]["peak_memory"] == 20  # the slower, the larger


def _race_run(mode: str, seed: int, losses: list[float], step_s: float = 0.1, lr: float = 1e-3) -> dict:
    # held-out evaluations every 10 steps, (step, loss, training seconds); a step of step_s seconds
    return {"mode": mode, "seed": seed, "lr": lr, "warmup_steps": 0, "peak_memory": 2**20, "peak_saved": 0,
            "val": [(10 * (i + 1), loss, 10 * (i + 1) * step_s) for i, loss in enumerate(losses)],
            "step_seconds": [1.0] + [step_s] * 30}


def test_the_target_is_the_best_first_order_optimizers_final_loss_and_the_last_line_races_it():
    from bench_convergence import best_first_order, final_loss, last_line, race_table

    runs = [_race_run("baseline", s, [6.3, 6.1, f]) for s, f in enumerate([6.0, 5.9, 6.1])]  # median 6.0
    runs += [_race_run("muon", s, [6.0, f, f - 0.1], lr=4e-3) for s, f in enumerate([5.8, 5.7, 5.9])]  # 5.7
    runs += [_race_run("kfac", s, [6.0, 5.6, 5.5], step_s=0.2) for s in range(3)]  # reaches 5.7 at 20
    runs += [_race_run("scheduled", s, [6.1, 5.8, 5.6], step_s=0.11) for s in range(3)]  # at 30
    best = best_first_order(runs)
    assert best == "muon" and final_loss(runs, best) == 5.7
    table = race_table(runs, 5.7)
    assert list(table) == ["baseline", "muon", "kfac", "scheduled"]
    assert table["baseline"]["steps"] == math.inf and table["baseline"]["reached"] == 0  # AdamW never gets there
    assert table["muon"]["steps"] == 30 and table["muon"]["seconds"] == 3.0 and table["muon"]["lr"] == 4e-3
    assert table["kfac"]["steps"] == 20 and table["kfac"]["seconds"] == 4.0
    assert table["scheduled"]["seconds"] == 3.3 and table["scheduled"]["mean_step_ms"] == 110.0
    assert last_line(table, best) == ("kfac steps-to-target / baseline: n/a; scheduled time-to-target / baseline: n/a; "
                                      "best first-order: muon; scheduled time-to-target / best first-order: 1.100")
    # AdamW the best (6.0; it reaches that at step 30 on the median seed, K-FAC at 10, in the bubbles at 20)
    table = race_table([r for r in runs if r["mode"] != "muon"], 6.0)
    assert best_first_order([r for r in runs if r["mode"] != "muon"]) == "baseline"
    assert last_line(table, "baseline") == ("kfac steps-to-target / baseline: 0.333; scheduled time-to-target / "
                                            "baseline: 0.733; best first-order: adamw; scheduled time-to-target / "
                                            "best first-order: 0.733")


def test_ratios_say_inf_when_never_reached_and_n_a_when_there_is_nothing_to_divide_by():
    from bench_convergence import _ratio

    assert _ratio(1.0, 4.0) == "0.250"
    assert _ratio(math.inf, 4.0) == "inf"  # the median seed never reached the target
    assert _ratio(3.0, math.inf) == _ratio(math.inf, math.inf) == "n/a"  # the reference never did
    assert _ratio(math.nan, 4.0) == _ratio(3.0, math.nan) == "n/a"  # a mode not in the race


def test_every_benchmark_that_races_names_and_reads_its_sweeps_alike():
    """The staleness benchmark races AdamW, Muon and K-FAC with the convergence benchmark's options: the
    same --KEY-lrs, --warmups and --modes, K-FAC required there, K-FAC in the bubbles not offered."""
    import pytest

    from bench_convergence import common_arguments, race_arguments, race_sweeps

    keys, required = ("baseline", "muon", "kfac"), ("kfac",)
    ap = common_arguments("staleness", packs=False)
    race_arguments(ap, keys, required)
    a = ap.parse_args(["--muon-lrs", "1e-3,2e-3", "--kfac-lrs", "3e-3", "--warmups", "0,10"])
    assert not hasattr(a, "scheduled_lrs")
    assert race_sweeps(ap, a, keys, required) == (
        {"baseline": [5e-4, 1e-3, 2e-3], "muon": [1e-3, 2e-3], "kfac": [3e-3]}, [0, 10])
    sweeps, _ = race_sweeps(ap, ap.parse_args(["--modes", "kfac,muon"]), keys, required)
    assert list(sweeps) == ["muon", "kfac"]  # in the race's order
    for bad in (["--modes", "baseline,muon"], ["--modes", "kfac"], ["--modes", "kfac,baseline,scheduled"],
                ["--kfac-lrs", "0"], ["--warmups", "a"]):
        with pytest.raises(SystemExit):
            race_sweeps(ap, ap.parse_args(bad), keys, required)


def test_a_mode_runs_with_its_own_optimizer_and_its_chosen_setting():
    from bench_convergence import race_config

    base = bench_config(TINY, [])
    muon = race_config(base, "muon", {"lr": 4e-3, "warmup_steps": 30}, seed=2)
    assert (muon.optim.name, muon.optim.lr, muon.optim.warmup_steps, muon.data.seed) == ("muon", 4e-3, 30, 2)
    kfac = race_config(base, "kfac", {"lr": 2e-3, "warmup_steps": 0}, seed=1)
    assert (kfac.optim.name, kfac.optim.lr, kfac.data.seed) == (base.optim.name, 2e-3, 1)  # the config's optimizer


def _three_modes_trained_twice(folder: str) -> dict:
    """In each worker: per mode, a run, a run of another learning rate, and the first run again."""
    from bench_convergence import profile_and_pack, start_worker, trainer_of

    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(TINY, ["model.dropout=0.1"])  # dropout: the runs draw random numbers
    train = trainer_of(ctx, steps=6, eval_every=2)
    out: dict = {}
    try:
        sched, _ = profile_and_pack(base, ctx, rank, folder, profile_steps=3, steps=6)
        for mode in ("first-order", "kfac", "scheduled"):
            schedule = sched if mode == "scheduled" else None
            again = []
            for lr in (base.optim.lr, 2 * base.optim.lr, base.optim.lr):
                _, res = train(base.replace(optim={"lr": lr}), mode, schedule=schedule)
                again.append(([float(x) for x in res.losses], [(s, float(v)) for s, v, _ in res.val]))
            out[mode] = again
    finally:
        shutdown(ctx)
    return out


def test_a_run_is_a_pure_function_of_its_config_so_seed_0_can_take_over_the_sweeps_run(tmp_path):
    # bench_convergence.swept_run hands seed 0's measured run the sweep's run of the same config instead of
    # training it again: that is only honest if the same workers train the same config to the same numbers
    from pipefisher.runtime.launch.local import spawn_local

    results = spawn_local(_three_modes_trained_twice, 2, str(tmp_path), timeout_s=180)
    holder = next(r for r in results if any(v[0][1] for v in r.values()))  # the worker with the held-out losses
    for mode, (first, other, again) in holder.items():
        assert first[0] and first[1], mode
        assert again == first, mode
        assert other[0] != first[0], mode  # a test that could tell runs apart


def test_the_sweeps_run_is_taken_over_only_for_exactly_the_same_run():
    from bench_convergence import SweptRun, measured_run, swept_run

    base = bench_config(TINY, [])
    cfg = base.replace(optim={"lr": 0.2})
    kept = SweptRun(cfg, "kfac", None, 10, result="the sweep's result", cycles=None)
    assert swept_run([kept], base.replace(optim={"lr": 0.2}), "kfac", None, 10) is kept
    assert swept_run([kept], cfg.replace(data={"seed": 1}), "kfac", None, 10) is None  # another seed
    assert swept_run([kept], cfg, "first-order", None, 10) is None
    assert swept_run([kept], cfg, "kfac", "s.pickle", 10) is None
    assert swept_run([kept], cfg, "kfac", None, 0) is None  # evaluated otherwise

    trained = []

    class _Trainer:
        cycles = (4, 4)

    def train(c, mode, schedule=None, evals=0):
        trained.append((c, mode, schedule, evals))
        return _Trainer(), "trained now"

    assert measured_run(train, [kept], cfg, "kfac", None, 10) == ("the sweep's result", None, True) and not trained
    assert measured_run(train, [kept], cfg.replace(data={"seed": 1}), "kfac", None, 10) == ("trained now", (4, 4), False)
    assert len(trained) == 1


def test_k_fac_in_the_bubbles_sweeps_its_curvature_update_at_every_other_modes_size():
    """The updates replace the warm-up axis: base at warm-up 0, soap at 30, 3 lrs each = 3 lrs x 2 warm-ups."""
    import pytest

    from bench_convergence import common_arguments, race_arguments, race_sweeps, scheduled_updates, update_warmups

    assert update_warmups(["base", "soap"], [0, 30]) == [[0], [30]]
    assert update_warmups(["base"], [0, 30]) == [[0, 30]]
    ap = common_arguments("convergence")
    race_arguments(ap)
    for opt in (["--scheduled-updates", "base,soap"], ["--soap-lrs", "1e-3"], ["--refresh-pieces", "auto"]):
        ap.add_argument(opt[0], default=None)  # as main() declares them
    a = ap.parse_args(["--scheduled-updates", "base,soap", "--soap-lrs", "2e-3,4e-3,8e-3", "--refresh-pieces", "best"])
    sweeps, warmups = race_sweeps(ap, a)
    updates = scheduled_updates(ap, a, sweeps)
    assert updates == {"base": [7e-4, 1.4e-3, 2.8e-3], "soap": [2e-3, 4e-3, 8e-3]}
    size = sum(len(lrs) * len(w) for lrs, w in zip(updates.values(), update_warmups(list(updates), warmups)))
    assert size == len(sweeps["baseline"]) * len(warmups) == 6
    for bad in (["--scheduled-updates", "base,adam"], ["--refresh-pieces", "0"], ["--refresh-pieces", "two"]):
        with pytest.raises(SystemExit):
            scheduled_updates(ap, ap.parse_args(["--scheduled-updates", "base", "--refresh-pieces", "1", *bad]), sweeps)


def _choose_among_updates(folder: str) -> dict:
    """In each worker: K-FAC in the bubbles' sweep over both updates, each packed with overlap."""
    from bench_convergence import Variant, choose_update, pack_variant, start_worker, trainer_of

    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(TINY, [])
    train = trainer_of(ctx, steps=4, eval_every=0)
    try:
        variants = []
        for update in ("base", "soap"):
            cfg, sched, plan = pack_variant(base, ctx, rank, folder, 2, 4, update, "2")
            variants.append(Variant(update, cfg, sched, [1e-3], [0], plan))
        choice, rows = choose_update(train, 4, variants, lambda msg: None)
    finally:
        shutdown(ctx)
    from pipefisher.schedule.file import meta_path

    import json

    metas = [json.load(open(meta_path(v.schedule))) for v in variants]
    return {"rank": rank, "choice": choice, "rows": rows, "updates": [v.cfg.kfac.update for v in variants],
            "pieces": [v.cfg.kfac.refresh_pieces for v in variants], "plans": [v.plan for v in variants],
            "metas": metas}


def test_the_scheduled_mode_chooses_its_update_by_training_loss_and_packs_with_overlap(tmp_path):
    import math as m

    from pipefisher.runtime.launch.local import spawn_local

    results = spawn_local(_choose_among_updates, 2, str(tmp_path), timeout_s=180)
    assert results[0]["choice"] == results[1]["choice"]  # every worker runs the same choice
    holder = next(r for r in results if not any(m.isnan(row["train_loss_tail"]) for row in r["rows"]))
    assert [row["update"] for row in holder["rows"]] == ["base", "soap"]  # both updates swept
    best = min(holder["rows"], key=lambda row: row["train_loss_tail"])
    assert holder["choice"]["update"] == best["update"] and holder["choice"]["overlap"] is True
    assert holder["updates"] == ["base", "soap"] and holder["pieces"] == [2, 2]
    plans = next(r for r in results if r["rank"] == 0)["plans"]
    assert all("overlap" in p and p["cycles"] for p in plans)  # packed by the overlapping policy
    rank0 = next(r for r in results if r["rank"] == 0)
    assert all(meta.get("overlap", False) == p["overlap"] for meta, p in zip(rank0["metas"], plans))


def test_the_scheduled_mode_packs_with_overlap_and_takes_the_refresh_pieces_best_pieces_keeps(
        monkeypatch, tmp_path):
    import bench_convergence
    import torch.distributed as dist

    calls = []

    def fake_pack(cfg, ctx, rank, folder, profile_steps, steps, staleness=None, overlap=False):
        calls.append((cfg.kfac.update, cfg.kfac.refresh_pieces, overlap))
        ms = {1: 30.0, 2: 20.0, 4: 25.0, "auto": 22.0}[cfg.kfac.refresh_pieces]
        return os.path.join(folder, "s.pickle"), {"step_ms": ms, "cycles": [3, 4], "overlap": overlap}

    monkeypatch.setattr(bench_convergence, "profile_and_pack", fake_pack)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src: None)
    cfg, _, plan = bench_convergence.pack_variant(bench_config(TINY, []), None, 0, str(tmp_path), 2, 8, "soap", "best")
    assert calls == [("soap", 1, True), ("soap", 2, True), ("soap", 4, True)]  # every count, cycles overlapping
    assert cfg.kfac.refresh_pieces == 2 and cfg.kfac.update == "soap" and plan["pieces_tried"]["2"] == {"step_ms": 20.0, "cycle": 4}
    calls.clear()
    cfg, _, _ = bench_convergence.pack_variant(bench_config(TINY, []), None, 0, str(tmp_path), 2, 8, "base", "auto")
    assert calls == [("base", "auto", True)] and cfg.kfac.refresh_pieces == "auto"


def test_soap_in_the_bubbles_takes_this_benchmarks_weight_per_step_unless_a_weight_per_refresh_is_set():
    """The library's default weight is SOAP's; the race's is its own (``FACTOR_DECAY_PER_STEP``), a flag,
    said in the mode's label; a ``kfac.factor_decay`` set with ``--set`` stands alone."""
    import argparse

    from bench_convergence import COV_MICRO_BATCHES, FACTOR_DECAY_PER_STEP, NESTEROV, scheduled_label, soap_settings

    a = argparse.Namespace(basis_block=129, rotation_dtype="float32", factor_decay_per_step=FACTOR_DECAY_PER_STEP,
                           cov_micro_batches=COV_MICRO_BATCHES, nesterov=NESTEROV)
    soap = soap_settings(a, bench_config(TINY, []))
    assert soap == {"basis_block": 129, "rotation_dtype": "float32", "factor_decay_per_step": 0.8, "cov_micro_batches": 2,
                    "nesterov": True}
    assert "factor_decay_per_step" not in soap_settings(a, bench_config(TINY, ["kfac.factor_decay=0.5"]))
    cfg = bench_config(TINY, []).replace(kfac={"update": "soap", **soap})  # what pack_variant builds
    assert cfg.kfac.factor_decay_per_step == 0.8 and cfg.kfac.cov_micro_batches == 2
    label = scheduled_label({"update": "soap", "refresh_pieces": 2, "overlap": True, **soap})
    assert ("factors in diagonal blocks of at most 129, Nesterov's look-ahead, factors averaged 0.8 a step, "
            "covariance of the first 2 "
            "micro-batches a refresh, refresh in 2 pieces") in label
    every = scheduled_label({"update": "soap", "refresh_pieces": 2, "overlap": True, **soap, "cov_micro_batches": "all"})
    assert "covariance" not in every and ", Nesterov's look-ahead" in every
    assert bench_config(TINY, []).replace(kfac={"update": "soap", **soap}).kfac.nesterov is True  # the race's
    plain = soap_settings(argparse.Namespace(**{**vars(a), "nesterov": "off"}), bench_config(TINY, []))
    assert plain["nesterov"] is False
    assert bench_config(TINY, []).replace(kfac={"update": "soap", **plain}).kfac.nesterov is False
    assert "Nesterov" not in scheduled_label({"update": "soap", "refresh_pieces": 1, "overlap": True, **plain})
    # a count set with --set stands; a count of every micro-batch (or more) is all of them
    one = bench_config(TINY, ["kfac.cov_micro_batches=1"])
    assert "cov_micro_batches" not in soap_settings(a, one)
    assert one.replace(kfac={"update": "soap", **soap_settings(a, one)}).kfac.cov_micro_batches == 1
    few = bench_config(TINY, ["data.num_micro_batches=2"])
    assert soap_settings(a, few)["cov_micro_batches"] == "all"
