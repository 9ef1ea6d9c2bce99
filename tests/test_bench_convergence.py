"""The convergence benchmark reads the losses from the worker that holds them: rank 1, or rank 0 under ZB-V."""
from __future__ import annotations

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
    assert loss_rank(bench_config(TINY, ["pipeline.schedule=zb-v"])) == 0  # the V ends where it began
    runs, first, last = merged_runs([_result(0, True, 0.2), _result(1, False, 0.3)])
    assert last["rank"] == 0 and first["rank"] == 0
    assert runs[0]["val"] == [(10, 5.0, 1.0)]
    assert runs[0]["step_seconds"] == [0.3, 0.3] and runs[0]["peak_memory"] == 20  # the slower, the larger
