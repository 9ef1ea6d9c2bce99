"""The staleness benchmark's curve: medians over seeds of the steps to target, against the best first-order
optimizer of the race (AdamW or Muon) and k = 1."""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_staleness import curve  # noqa: E402


def _run(mode: str, losses: list[float], interval: int | None = None, lr: float = 1e-3) -> dict:
    # held-out evaluations every 10 steps: (step, loss, seconds); the mode's chosen lr, no warm-up
    run = {"mode": mode, "val": [(10 * (i + 1), loss, float(i)) for i, loss in enumerate(losses)], "lr": lr,
           "warmup_steps": 0, "step_seconds": [1.0, 0.1, 0.1], "peak_memory": 0, "peak_saved": 0}
    if interval is not None:
        run["interval"] = interval
    return run


def test_the_curve_is_the_median_steps_to_target_relative_to_the_first_order_optimizer_and_to_every_step() -> None:
    runs = [
        _run("baseline", [6.0, 5.5, 5.0]), _run("baseline", [6.0, 5.0, 4.9]), _run("baseline", [6.0, 5.8, 5.2]),
        # k = 1: reaches 5.0 at steps 20, 20, 30 -> median 20
        _run("kfac", [5.6, 5.0, 4.8], 1), _run("kfac", [5.5, 4.9, 4.7], 1), _run("kfac", [5.9, 5.1, 4.9], 1),
        # k = 4: 30, 30, never -> median 30
        _run("kfac", [5.9, 5.4, 5.0], 4), _run("kfac", [5.8, 5.2, 4.9], 4), _run("kfac", [5.9, 5.6, 5.3], 4),
        # k = 16: never on two seeds -> median inf
        _run("kfac", [6.0, 5.9, 5.8], 16), _run("kfac", [6.0, 5.9, 5.7], 16), _run("kfac", [5.9, 5.1, 5.0], 16),
    ]
    rows = curve(runs, target=5.0, intervals=[1, 4, 16])
    assert [r["steps"] for r in rows] == [20, 30, math.inf]
    # AdamW reaches 5.0 at 30, 20 and never: median 30
    assert [r["ratio"] for r in rows] == [20 / 30, 1.0, math.inf]
    assert [r["vs_k1"] for r in rows] == [1.0, 1.5, math.inf]
    assert [r["reached"] for r in rows] == [3, 2, 1]
    assert rows[1]["final"] == 5.0


def test_the_benchmark_writes_the_jobs_curve_with_where_it_was_measured(tmp_path) -> None:
    from bench_staleness import measured_curve, relative_to_text

    from pipefisher.cost.staleness import read_staleness
    from pipefisher.runtime.job.config import RunConfig
    from pipefisher.safe_io import dump_json_atomic

    runs = [_run("baseline", [6.0, 5.0, 4.9]), _run("kfac", [5.5, 4.9, 4.7], 1), _run("kfac", [5.6, 5.0, 4.8], 1),
            _run("kfac", [6.0, 5.9, 5.8], 4), _run("kfac", [5.9, 5.5, 4.9], 4)]
    rows = curve(runs, target=5.0, intervals=[1, 4])
    assert [(r["steps_min"], r["steps"], r["steps_max"]) for r in rows] == [(20, 20, 20), (30, math.inf, math.inf)]
    cfg = RunConfig(name="tiny")
    path = str(tmp_path / "staleness.json")
    relative_to = relative_to_text("baseline", {"lr": 1e-3, "warmup_steps": 0}, {"baseline": 4.9})
    dump_json_atomic(path, measured_curve(rows, cfg, "configs/tiny.yaml", 30, 5.0, 2, relative_to).to_data(runs=runs))
    loaded = read_staleness(path)
    assert loaded.points == ((1, 20 / 20), (4, math.inf)) and loaded.spread[0] == (20, 20, 20)
    p = loaded.provenance
    assert (p.config_digest, p.config_name, p.config_path) == (cfg.fingerprint(layout=False), "tiny", "configs/tiny.yaml")
    assert (p.horizon, p.target, p.seeds) == (30, 5.0, 2) and p.relative_to.startswith("adamw lr 0.001")
    assert "layers" in p.model and "micro-batches" in p.data
    # a run of the same model on another pipeline layout is the same job; another learning rate is not
    assert loaded.config_warning(cfg.replace(pipeline={"stages": 1, "order": "gpipe"}).fingerprint(layout=False), "x") is None
    assert loaded.config_warning(cfg.replace(optim={"lr": 0.5}).fingerprint(layout=False), "x") is not None


def test_with_two_seeds_the_target_is_one_both_baseline_seeds_can_be_measured_against() -> None:
    """Two AdamW seeds ending at 6.0496 and 6.0501: the mean of the two (6.04985) is a target the second
    seed never reaches, which made AdamW's median steps infinite and every ratio 0. The higher middle
    final is the target, so the baseline's median steps stay finite."""
    from bench_convergence import baseline_target

    runs = [_run("baseline", [6.2, 6.1, 6.0496]), _run("baseline", [6.2, 6.06, 6.0501]),
            _run("kfac", [6.1, 6.0, 5.9], 1), _run("kfac", [6.2, 6.0, 5.9], 1)]
    target = baseline_target(runs)
    assert target == 6.0501
    rows = curve(runs, target=target, intervals=[1])
    assert rows[0]["steps"] == 20 and rows[0]["ratio"] == 20 / 30


def test_the_target_and_the_ratios_follow_the_better_first_order_optimizer_and_the_file_names_it(tmp_path) -> None:
    """Muon ends lower than AdamW (median 5.7 against 6.0): Muon's final is the target, K-FAC's steps are
    counted over Muon's, and the curve file says it is relative to Muon, with Muon's lr and warm-up."""
    from bench_convergence import race_table
    from bench_staleness import measured_curve, relative_to_text, staleness_race

    from pipefisher.cost.staleness import read_staleness
    from pipefisher.runtime.job.config import RunConfig
    from pipefisher.safe_io import dump_json_atomic

    runs = [_run("baseline", [6.3, 6.1, f]) for f in (6.0, 5.9, 6.1)]  # median 6.0: never reaches 5.7
    runs += [_run("muon", [6.0, f, f - 0.1], lr=4e-3) for f in (5.8, 5.7, 5.9)]  # 5.7 at 30, 20, never: median 30
    runs += [_run("kfac", [5.9, 5.7, 5.5], 1) for _ in range(3)]  # at 20
    runs += [_run("kfac", [6.0, 5.9, 5.6], 4) for _ in range(3)]  # at 30
    best, target, rows = staleness_race(runs, [1, 4])
    assert (best, target) == ("muon", 5.7)
    assert [r["ratio"] for r in rows] == [20 / 30, 1.0]  # over Muon's 30 steps, not AdamW's (never)
    # AdamW alone in the race: the target is its final, the ratios over its steps
    best, target, rows = staleness_race([r for r in runs if r["mode"] != "muon"], [1, 4])
    assert (best, target) == ("baseline", 6.0) and [r["steps"] for r in rows] == [10, 10]
    assert [r["ratio"] for r in rows] == [10 / 30, 10 / 30]  # AdamW reaches 6.0 at 30 on the median seed

    best, target, rows = staleness_race(runs, [1, 4])
    finals = {k: t["final"] for k, t in race_table(runs, target, ("baseline", "muon")).items()}
    relative_to = relative_to_text(best, {"lr": 4e-3, "warmup_steps": 30}, finals)
    path = str(tmp_path / "staleness.json")
    dump_json_atomic(path, measured_curve(rows, RunConfig(name="tiny"), "configs/tiny.yaml", 30, target, 3,
                                          relative_to).to_data(best_first_order=best, runs=runs))
    loaded = read_staleness(path)
    assert loaded.points == ((1, 20 / 30), (4, 1.0)) and loaded.provenance.target == 5.7
    assert loaded.provenance.relative_to.startswith("muon lr 0.004, warm-up 30 steps (the best first-order")
    assert "adamw 6.0000; muon 5.7000" in loaded.provenance.relative_to
    assert "relative to muon lr 0.004" in loaded.describe()


def test_where_no_k_reaches_the_best_target_the_other_optimizers_own_target_still_gives_a_curve(tmp_path) -> None:
    """Muon ends at 5.5, below every K-FAC run: against it the curve is all inf. Against AdamW's own final
    (6.0, reached at 30 on the median seed) K-FAC's cycles still differ: k = 1 at 10, k = 4 at 20."""
    import matplotlib.image

    from bench_staleness import chart, own_target_curves, relative_to_text, staleness_race

    runs = [_run("baseline", [6.3, 6.1, f]) for f in (6.0, 5.9, 6.1)]
    runs += [_run("muon", [6.0, 5.7, 5.5], lr=4e-3) for _ in range(3)]
    runs += [_run("kfac", [5.9, 5.8, 5.7], 1) for _ in range(3)]
    runs += [_run("kfac", [6.2, 6.0, 5.9], 4) for _ in range(3)]
    best, target, rows = staleness_race(runs, [1, 4])
    assert (best, target) == ("muon", 5.5) and all(math.isinf(r["ratio"]) for r in rows)
    own = own_target_curves(runs, [1, 4], ["baseline"])
    adamw_target, adamw_rows = own["baseline"]
    assert adamw_target == 6.0
    assert [r["steps"] for r in adamw_rows] == [10, 20]
    assert [r["ratio"] for r in adamw_rows] == [10 / 30, 20 / 30] and [r["vs_k1"] for r in adamw_rows] == [1.0, 2.0]
    text = relative_to_text("baseline", {"lr": 1e-3, "warmup_steps": 0}, {"baseline": 6.0, "muon": 5.5}, is_best=False)
    assert text.startswith("adamw lr 0.001, warm-up 0 steps (not the best first-order optimizer")
    png = str(tmp_path / "staleness.png")
    chart(rows, png, "no k reaches Muon's target", best, {}, {"baseline": 6.0, "muon": 5.5}, {"baseline": adamw_rows})
    assert matplotlib.image.imread(png).shape[1] > matplotlib.image.imread(png).shape[0]  # two panels side by side
