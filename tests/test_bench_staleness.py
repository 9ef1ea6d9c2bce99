"""The staleness benchmark's curve: medians over seeds of the steps to target, against AdamW and k = 1."""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_staleness import curve  # noqa: E402


def _run(mode: str, losses: list[float], interval: int | None = None) -> dict:
    # held-out evaluations every 10 steps: (step, loss, seconds)
    run = {"mode": mode, "val": [(10 * (i + 1), loss, float(i)) for i, loss in enumerate(losses)]}
    if interval is not None:
        run["interval"] = interval
    return run


def test_the_curve_is_the_median_steps_to_target_relative_to_adamw_and_to_every_step() -> None:
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
    assert [r["vs_baseline"] for r in rows] == [20 / 30, 1.0, math.inf]
    assert [r["vs_first"] for r in rows] == [1.0, 1.5, math.inf]
    assert [r["reached"] for r in rows] == [3, 2, 1]
    assert rows[1]["final"] == 5.0


def test_the_benchmark_writes_the_jobs_curve_with_where_it_was_measured(tmp_path) -> None:
    from bench_staleness import measured_curve

    from pipefisher.runtime.job.config import RunConfig
    from pipefisher.safe_io import dump_json_atomic
    from pipefisher.staleness import read_staleness

    runs = [_run("baseline", [6.0, 5.0, 4.9]), _run("kfac", [5.5, 4.9, 4.7], 1), _run("kfac", [5.6, 5.0, 4.8], 1),
            _run("kfac", [6.0, 5.9, 5.8], 4), _run("kfac", [5.9, 5.5, 4.9], 4)]
    rows = curve(runs, target=5.0, intervals=[1, 4])
    assert [(r["steps_min"], r["steps"], r["steps_max"]) for r in rows] == [(20, 20, 20), (30, math.inf, math.inf)]
    cfg = RunConfig(name="tiny")
    path = str(tmp_path / "staleness.json")
    dump_json_atomic(path, measured_curve(rows, cfg, "configs/tiny.yaml", 30, 5.0, 2,
                                          {"lr": 1e-3, "warmup_steps": 0}).to_data(runs=runs))
    loaded = read_staleness(path)
    assert loaded.points == ((1, 20 / 20), (4, math.inf)) and loaded.spread[0] == (20, 20, 20)
    p = loaded.provenance
    assert (p.config_digest, p.config_name, p.config_path) == (cfg.fingerprint(layout=False), "tiny", "configs/tiny.yaml")
    assert (p.horizon, p.target, p.seeds) == (30, 5.0, 2) and p.relative_to.startswith("adamw lr 0.001")
    assert "layers" in p.model and "micro-batches" in p.data
    # a run of the same model on another pipeline layout is the same job; another learning rate is not
    assert loaded.config_warning(cfg.replace(pipeline={"stages": 1, "schedule": "gpipe"}).fingerprint(layout=False), "x") is None
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
    assert rows[0]["steps"] == 20 and rows[0]["vs_baseline"] == 20 / 30
