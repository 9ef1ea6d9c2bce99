#!/usr/bin/env python
"""Step time of ``first-order``, ``kfac`` (refresh every step) and ``scheduled`` (K-FAC in the bubbles)
on 2 pipeline stages, one CPU core each, in one go.

The same two worker processes run everything: a profile of a few kfac steps, which rank 0 packs with
the default policy (or --policy) once per K-FAC margin (profiled K-FAC times x margin: slack for noisy
CPU timings, at the price of a longer cycle), then first-order, kfac and each schedule, interleaved,
``--rounds`` times. Per mode it prints the mean step time after the warm-up steps (the median over the
rounds), the ratio to first-order, and for the scheduled runs the K-FAC cycle length k per node (the
curvature refresh interval).

    python scripts/bench_scheduled.py [--config configs/small.yaml] [--steps 30] [--warmup 3] [--rounds 3] \
        [--kfac-margin 1,1.5,2] [--micro-batches M] [--pipeline gpipe|1f1b]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(config_path: str, overrides: dict, steps: int, warmup: int, profile_steps: int, policy: str | None,
           folder: str, rounds: int, margins: list[float]) -> dict:
    import torch.distributed as dist

    from pipefisher.runtime.config import load_config
    from pipefisher.runtime.dist import init_from_env, shutdown
    from pipefisher.runtime.trainer import Trainer, TrainOptions

    cfg = load_config(config_path).replace(**overrides)
    rank = int(os.environ["RANK"])
    if hasattr(os, "sched_setaffinity") and os.cpu_count():
        os.sched_setaffinity(0, {rank % os.cpu_count()})  # one core per stage
    ctx = init_from_env(2, cfg.pipeline.timeout_s)
    quiet = dict(progress=False, log_every=10**9)
    variants = [f"scheduled x{g:g}" for g in margins]
    out: dict = {"rank": rank, "times": {m: [] for m in ["first-order", "kfac", *variants]}, "usage": {},
                 "cycles": {}, "violations": {}}
    try:
        # profile, then rank 0 packs (once per K-FAC margin) while the other waits
        Trainer(cfg, ctx, TrainOptions(mode="kfac", profile=True, steps=profile_steps, out=folder, **quiet)).run()
        dist.barrier()
        files = {v: os.path.join(folder, f"schedule-{i}.pickle") for i, v in enumerate(variants)}
        if rank == 0:
            from pipefisher.policies import DEFAULT_POLICY, get_policy
            from pipefisher.report import usage_lines
            from pipefisher.runtime.driver import inflate_kfac
            from pipefisher.runtime.profiler import timeline_filename
            from pipefisher.schedule import save_schedule, validate
            from pipefisher.timeline import load_job

            job = load_job([os.path.join(folder, timeline_filename(cfg.name, i)) for i in range(2)])
            for v, g in zip(variants, margins):
                packed = get_policy(policy or DEFAULT_POLICY).pack(inflate_kfac(job, g))
                out["usage"][v] = usage_lines(packed)
                out["violations"][v] = len(validate(packed.to_file_data(), job))
                out["policy"] = packed.policy
                save_schedule(files[v], packed)
        dist.barrier()
        for _ in range(rounds):
            for mode in ["first-order", "kfac", *variants]:
                sched = files.get(mode)
                opts = TrainOptions(mode="scheduled" if sched else mode, steps=steps, schedule=sched, **quiet)
                trainer = Trainer(cfg, ctx, opts)
                res = trainer.run()
                # the mean, not the median: a cycle's steps carry different K-FAC loads, the cost is their sum
                out["times"][mode].append(statistics.mean(res.step_seconds[warmup:]))
                if sched:
                    out["cycles"][mode] = trainer.cycles
        out["pipeline"] = (cfg.pipeline.schedule, cfg.data.num_micro_batches)
    finally:
        shutdown(ctx)
    return out


def main() -> None:
    from pipefisher.runtime.launch import spawn_local

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--micro-batches", type=int, default=None, help="override data.num_micro_batches")
    ap.add_argument("--pipeline", choices=["gpipe", "1f1b"], default=None, help="override pipeline.schedule")
    ap.add_argument("--kfac-margin", default="1.0",
                    help="comma-separated K-FAC time factors to pack with, one scheduled run each (e.g. 1,1.5)")
    a = ap.parse_args()
    margins = [float(x) for x in a.kfac_margin.split(",")]
    overrides: dict = {"pipeline": {"stages": 2}}
    if a.pipeline:
        overrides["pipeline"]["schedule"] = a.pipeline
    if a.micro_batches:
        overrides["data"] = {"num_micro_batches": a.micro_batches}
    with tempfile.TemporaryDirectory(prefix="pipefisher-bench-") as folder:
        results = spawn_local(_bench, 2, a.config, overrides, a.steps, a.warmup, a.profile_steps, a.policy, folder,
                              a.rounds, margins, timeout_s=3600)
    r0 = next(r for r in results if r["rank"] == 0)
    modes = list(r0["times"])
    # Both stages finish a step together (the pipeline couples them); report the slower one anyway.
    med = {m: statistics.median(max(r["times"][m][i] for r in results) for i in range(a.rounds)) for m in modes}
    kind, m = r0["pipeline"]
    fo = med["first-order"]
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {kind}, {m} micro-batches, {a.steps} steps "
          f"(mean after {a.warmup} warm-up), median of {a.rounds} round(s); schedules by policy {r0['policy']}")
    print(f"first-order step:      {fo * 1e3:8.1f} ms")
    print(f"kfac step:             {med['kfac'] * 1e3:8.1f} ms   ratio kfac / first-order: {med['kfac'] / fo:.3f}"
          "   (curvature refreshed every step)")
    for v in modes[2:]:
        cyc = r0["cycles"][v]
        bad = f"  {r0['violations'][v]} DEPENDENCY VIOLATIONS" if r0["violations"][v] else ""
        print(f"{v + ' step:':22} {med[v] * 1e3:8.1f} ms   ratio scheduled / first-order: {med[v] / fo:.3f}"
              f"   (K-FAC cycle k = {max(cyc)}; per node {', '.join(map(str, cyc))}){bad}")
        for line in r0["usage"][v]:
            print(f"    {line}")


if __name__ == "__main__":
    main()
