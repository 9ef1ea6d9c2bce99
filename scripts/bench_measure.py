#!/usr/bin/env python
"""What the always-on measurement of scheduled steps costs: the same schedule run with and without the
recorder (:mod:`pipefisher.runtime.train.recorder`), in one process, interleaved rounds.

One pipeline stage in one process (no point-to-point waits: what is left is the recorder's own cost:
two clock reads and an append per label, and turning a step's labels into a record), a schedule of one
iteration with every K-FAC label, so a step runs as many labels as a cycle of a packed schedule has.
Prints the mean step time of each, their ratio, and the overhead per label.

    python scripts/bench_measure.py [--config configs/small.yaml] [--steps 40] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steps(cfg, schedule: str, recorder, steps: int) -> tuple[float, int]:
    """Mean seconds per step after the first (and labels per step) of one run from the same seed."""
    import torch

    from pipefisher.runtime.api import build_worker
    from pipefisher.runtime.job.dist import single_process

    torch.manual_seed(0)
    ctx = single_process()
    worker = build_worker(cfg, ctx, mode="scheduled", total_steps=steps, schedule=schedule, recorder=recorder)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        worker.step(step)  # with a recorder, the step's record is built inside (run_step)
        times.append(time.perf_counter() - t0)
    labels = len(worker.executor.iterations[0]) if worker.executor is not None else 0
    return statistics.mean(times[1:]), labels


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--steps", type=int, default=40, help="steps per run")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    a = ap.parse_args()
    import torch

    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.pipeline.checks import single_iteration_schedule
    from pipefisher.runtime.train.recorder import ClockRecorder
    from pipefisher.schedule.file import save_schedule

    torch.set_num_threads(1)
    cfg = load_config(a.config).replace(pipeline={"stages": 1, "order": "1f1b"})
    with tempfile.TemporaryDirectory(prefix="pipefisher-bench-") as folder:
        path = os.path.join(folder, "one.pickle")
        save_schedule(path, single_iteration_schedule(cfg))
        off, on = [], []
        labels = 0
        for _ in range(a.rounds):
            off.append(_steps(cfg, path, None, a.steps)[0])
            t, labels = _steps(cfg, path, ClockRecorder(0, 0), a.steps)
            on.append(t)
    m_off, m_on = statistics.median(off), statistics.median(on)
    # the wrapper alone, on a call that does nothing: what a label costs the recorder, without the noise
    rec = ClockRecorder(0, 0)
    bare, wrapped = (lambda: None), rec.wrap("cov_kron_A:x", lambda: None)
    n = 200_000
    alone = []
    for call in (bare, wrapped, bare, wrapped, bare, wrapped):
        rec.begin_step(1, 0)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        alone.append((time.perf_counter() - t0) / n)
    per_label = statistics.median(alone[1::2]) - statistics.median(alone[0::2])
    rec.begin_step(1, 0)
    for _ in range(labels):
        wrapped()
    t0 = time.perf_counter()
    rec.end_step()
    record_s = time.perf_counter() - t0
    ratios = [b / x for x, b in zip(off, on)]
    print(f"config {os.path.basename(a.config)}, 1 stage, 1 thread, {labels} labels per step, {a.steps} steps, "
          f"median of {a.rounds} interleaved rounds")
    print(f"without the recorder: {m_off * 1e3:.2f} ms per step")
    print(f"with the recorder:    {m_on * 1e3:.2f} ms per step")
    print(f"overhead per label:   {(m_on - m_off) / labels * 1e6:.2f} us (can read below 0: noise)")
    print(f"the recorder alone:   {per_label * 1e6:.2f} us per label, {record_s * 1e3:.2f} ms to build a step's record "
          f"({labels * per_label / m_off * 100 + record_s / m_off * 100:.3f} % of an unmeasured step)")
    print(f"measured/unmeasured: {statistics.median(ratios):.4f} [{min(ratios):.4f}-{max(ratios):.4f}]")


if __name__ == "__main__":
    main()
