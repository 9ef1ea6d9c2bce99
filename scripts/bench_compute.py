#!/usr/bin/env python
"""Step time and peak memory with bf16 and with activation recomputation, on 2 pipeline stages.

Every variant (``train.precision`` fp32 / bf16 x ``train.recompute`` none / layer) trains in the same
two worker processes, one after the other, so all see the same machine, after an unmeasured pass of
two steps over every variant (so no variant pays a process's first use of its kernels); ratios are
against the fp32, no-recomputation run of the same invocation. Per variant: the median step time (first steps skipped as
warm-up) of the slower stage, and per stage the peak memory of the steps above what the built model
held as they began (activations, gradients, optimizer and K-FAC state;
``WorkerResult.peak_above_base_bytes``, never negative). On CPU the peak is the resident set's high-water mark with glibc's mmap threshold
fixed (freed tensors leave the resident set); on CUDA, the allocator's peak. Peaks are counted in pages:
no ratio is printed against a reference peak under 1 MiB (a tiny model's), which is noise.

    python scripts/bench_compute.py [--config configs/small.yaml] [--mode kfac] [--steps 12] [--warmup 2]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = (("fp32", "none"), ("bf16", "none"), ("fp32", "layer"), ("bf16", "layer"))
LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # see tests/test_runtime_compute.py: RSS follows live tensors


RATIO_FLOOR = 2**20
"""Peaks are measured in pages: a ratio against a reference peak below 1 MiB is page-level noise, not shown."""


def ratio(value: float, reference: float, floor: float = 0.0) -> str:
    """``value / reference`` as a table cell, or ``-`` where the reference is at most ``floor``."""
    return f"{value / reference:>6.2f}" if reference > floor else f"{'-':>6}"


def _bench(config_path: str, mode: str, steps: int, warmup: int, stages: int) -> dict[str, tuple[float, int]]:
    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.launch.local import pin_to_one_core
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    base = load_config(config_path).replace(pipeline={"stages": stages})
    pin_to_one_core()  # one core per stage
    ctx = init_from_env(stages, base.pipeline.timeout_s)
    out = {}
    try:
        # A first, unmeasured pass over every variant: what a process pays once for a kind of kernel
        # (bf16 primitives, checkpointing's code, allocator arenas) is then paid by none of the measured runs.
        for measured in (False, True):
            for precision, recompute in VARIANTS:
                cfg = base.replace(train={"precision": precision, "recompute": recompute})
                gc.collect()  # the previous variant's trainer is gone before this one's baseline
                opts = TrainOptions.of(mode=mode, steps=steps if measured else 2, progress=False, log_every=10**9)
                trainer = Trainer(cfg, ctx, opts)
                res = trainer.run()
                if measured:  # the peak above what the process held as the steps began
                    out[f"{precision}/{recompute}"] = (statistics.median(res.step_seconds[warmup:]),
                                                       res.peak_above_base_bytes)
                del trainer, res
    finally:
        shutdown(ctx)
    return out


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--mode", default="kfac", choices=("first-order", "kfac"), help="training mode of every variant")
    ap.add_argument("--steps", type=int, default=12, help="training steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (one process and core each)")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")

    os.environ.update(LIVE_RSS)  # the workers' glibc reads it at start
    from pipefisher.runtime.launch.local import spawn_local  # torch: only once the arguments are good

    results = spawn_local(_bench, a.stages, a.config, a.mode, a.steps, a.warmup, a.stages, timeout_s=1200)
    print(f"config {os.path.basename(a.config)}, mode {a.mode}, {a.stages} stages x 1 core, {a.steps} steps "
          f"(median after {a.warmup}); ratios against fp32/none of this run (none against a peak under 1 MiB)")
    print(f"{'precision/recompute':<20} {'step ms':>9} {'ratio':>6}   "
          + "   ".join(f"{'stage %d peak MiB' % s:>17} {'ratio':>6}" for s in range(a.stages)))
    ref = max(r["fp32/none"][0] for r in results)
    ref_mem = [r["fp32/none"][1] for r in results]
    for precision, recompute in VARIANTS:
        key = f"{precision}/{recompute}"
        step = max(r[key][0] for r in results)  # the step ends when the slower stage's part does
        mems = "   ".join(f"{r[key][1] / 2**20:>17.1f} {ratio(r[key][1], m, RATIO_FLOOR)}" for r, m in zip(results, ref_mem))
        print(f"{key:<20} {step * 1e3:>9.1f} {ratio(step, ref)}   {mems}")


if __name__ == "__main__":
    main()
