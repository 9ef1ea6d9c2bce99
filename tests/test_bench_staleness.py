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
