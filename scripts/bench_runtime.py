#!/usr/bin/env python
"""Step time of ``first-order`` vs ``kfac`` training on 2 pipeline stages, one CPU core each.

Both modes run in the same two worker processes, one after the other, so they see the same machine.
Prints the median step time of each (first steps skipped as warm-up) and their ratio.

    python scripts/bench_runtime.py [--config configs/small.yaml] [--steps 12] [--warmup 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(config_path: str, steps: int, warmup: int) -> dict[str, float]:
    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.launch.local import pin_to_one_core
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    cfg = load_config(config_path).replace(pipeline={"stages": 2})
    pin_to_one_core()  # one core per stage
    ctx = init_from_env(2, cfg.pipeline.timeout_s)
    out = {}
    try:
        for mode in ("first-order", "kfac"):
            opts = TrainOptions.of(mode=mode, steps=steps, progress=False, log_every=10**9)
            res = Trainer(cfg, ctx, opts).run()
            out[mode] = statistics.median(res.step_seconds[warmup:])
    finally:
        shutdown(ctx)
    return out


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--steps", type=int, default=12, help="training steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    a = ap.parse_args()

    from pipefisher.runtime.launch.local import spawn_local  # torch: only once the arguments are good

    results = spawn_local(_bench, 2, a.config, a.steps, a.warmup, timeout_s=600)
    # A step ends on stage 0 (its last backward is the pipeline's last); report the slower stage anyway.
    fo = max(r["first-order"] for r in results)
    kf = max(r["kfac"] for r in results)
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {a.steps} steps (median after {a.warmup})")
    print(f"first-order step: {fo * 1e3:9.1f} ms")
    print(f"kfac step:        {kf * 1e3:9.1f} ms")
    print(f"ratio kfac / first-order: {kf / fo:.2f}")


if __name__ == "__main__":
    main()
