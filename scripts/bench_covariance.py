#!/usr/bin/env python
"""Covariance that costs what it must: convergence and covariance time with fewer token rows or micro-batches.

``kfac.cov_stride`` s feeds the covariance factors every s-th token row of a micro-batch;
``kfac.cov_micro_batches`` M only the first M micro-batches of a refresh's iteration. Both cut covariance
work and saved memory; what they cost is noisier curvature. This measures it at the SAME curvature age:
``kfac`` mode with a fixed ``kfac.interval`` k (the refresh every k steps a packed cycle of k gives, and
k = 1), so that what moves the loss is the covariance alone, not a shorter cycle. Everything else is the
convergence benchmark's (``scripts/bench_convergence.py``, whose workers, trainer and records this
imports): two stages on one core each, the config's model and data, held-out loss every ``--eval-every``
steps. K-FAC's learning rate and warm-up are fixed (``--lr``, ``--warmup``; default: K-FAC every step's
choice in the race, 2e-3 and 0), not swept per setting: the settings change the curvature's noise, not
the optimizer.

Per setting (stride, micro-batches, k) and seed: the final held-out loss; per setting the median over
its seeds, and its covariance time per refresh: a profiled ``kfac`` run of ``--profile-steps`` steps
(k = 1), the sum of the ``cov_kron`` intervals of both nodes' median step (the work a packer places in
bubbles). The runs go one at a time. ``--out`` gets the raw results as JSON.

    python scripts/bench_covariance.py [--config configs/small.yaml] [--steps 300] [--intervals 4,1]
        [--strides 1,2,4] [--micro-batches all,2,1] [--only S:M:K,...] [--seeds 1] [--first-seed 0]
        [--extra-seeds S:M:K,...] [--profile-steps 8]
        [--lr 2e-3] [--warmup 0] [--out bench-covariance/]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, the convergence benchmark

from bench_convergence import (_median, announcer, bench_config, loss_rank, merged_runs,  # noqa: E402
                               run_main, run_record, start_worker, trainer_of)

Setting = tuple[int, str, int]  # (cov_stride, cov_micro_batches, kfac.interval)


def _cov_config(base: Any, stride: int, micro: str, interval: int, lr: float, warmup: int, seed: int) -> Any:
    if micro != "all" and not micro.isdigit():  # the config's own check says the rest, in one line
        from pipefisher.errors import InputError

        raise InputError(None, f"setting micro-batches {micro!r} is not a count or all")
    return base.replace(kfac={"cov_stride": stride, "cov_micro_batches": micro if micro == "all" else int(micro),
                              "interval": interval},
                        optim={"lr": lr, "warmup_steps": warmup}, data={"seed": seed})


def _cov_seconds(timeline: str) -> float:
    """The covariance work of one refresh on one node: the sum of its profiled ``cov_kron`` intervals."""
    from pipefisher.safe_io import load_pickle

    raw = load_pickle(timeline)
    return sum((e - s) / 1e9 for key, v in raw.items() if key.startswith("cov_kron_") for s, e in v)


def _worker(config_path: str, overrides: list[str], steps: int, eval_every: int, plan: list[tuple[Setting, int]],
            profiled: list[tuple[int, str]], profile_steps: int, lr: float, warmup: int) -> dict[str, Any]:
    """Per (stride, micro-batches) of ``profiled`` a short profiled run, then every (setting, seed) of ``plan``."""
    from pipefisher.runtime.job.dist import shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "runs": [], "cov": []}
    try:
        for stride, micro in profiled:
            cfg = _cov_config(base, stride, micro, 1, lr, warmup, 0)
            with tempfile.TemporaryDirectory() as folder:
                opts = TrainOptions.of(mode="kfac", steps=profile_steps, profile=True, out=folder, progress=False,
                                       log_every=10**9)
                res = Trainer(cfg, ctx, opts).run()
                out["cov"].append({"cov_stride": stride, "cov_micro_batches": micro,
                                   "cov_seconds": _cov_seconds(res.timeline_path), "peak_saved": res.peak_saved_bytes})
        for (stride, micro, k), seed in plan:
            t0 = time.perf_counter()
            _, res = train(_cov_config(base, stride, micro, k, lr, warmup, seed), "kfac")
            out["runs"].append(run_record("kfac", seed, res, cov_stride=stride, cov_micro_batches=micro, interval=k,
                                          wall=time.perf_counter() - t0))
            if res.val:
                announce(f"stride {stride}, micro-batches {micro}, k = {k}, seed {seed}: held-out "
                         f"{res.val[-1][1]:.4f} after {steps} steps ({time.perf_counter() - t0:.0f} s)")
    finally:
        shutdown(ctx)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--steps", type=int, default=300, help="steps of every run")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    ap.add_argument("--intervals", default="4,1", help="curvature refresh intervals k (kfac.interval)")
    ap.add_argument("--strides", default="1,2,4", help="kfac.cov_stride values")
    ap.add_argument("--micro-batches", default="all,2,1", help="kfac.cov_micro_batches values")
    ap.add_argument("--only", default="", help="settings to run instead of the grid: STRIDE:MICRO:K,...")
    ap.add_argument("--seeds", type=int, default=1, help="seeds of every setting")
    ap.add_argument("--first-seed", type=int, default=0, help="the first of those seeds")
    ap.add_argument("--extra-seeds", default="", help="settings STRIDE:MICRO:K that get one more seed")
    ap.add_argument("--lr", type=float, default=2e-3, help="K-FAC's peak learning rate (every setting)")
    ap.add_argument("--warmup", type=int, default=0, help="K-FAC's warm-up steps (every setting)")
    ap.add_argument("--profile-steps", type=int, default=8, help="steps of each profiled run (0: none)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, as pipefisher train --set does; repeatable")
    ap.add_argument("--out", default="bench-covariance", help="folder for the raw results")
    a = ap.parse_args()

    def setting(text: str) -> Setting:
        s, m, k = text.split(":")
        return int(s), m, int(k)

    try:
        if a.only:
            grid = [setting(x) for x in a.only.split(",")]
        else:
            grid = [(int(s), m, int(k)) for k in a.intervals.split(",") for s in a.strides.split(",")
                    for m in a.micro_batches.split(",")]
        extra = [setting(x) for x in a.extra_seeds.split(",") if x]
    except ValueError as err:
        ap.error(f"settings are STRIDE:MICRO:K with whole numbers (MICRO: a number or all): {err}")
    seeds = range(a.first_seed, a.first_seed + a.seeds)
    plan = [(g, seed) for seed in seeds for g in grid] + [(g, seeds.stop) for g in extra]
    profiled = list(dict.fromkeys((s, m) for (s, m, _), _ in plan)) if a.profile_steps else []

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local
    from pipefisher.safe_io import dump_json_atomic

    cfg = bench_config(a.config, a.overrides)
    for (s, m, k), _ in plan:  # a bad setting: one line, before any worker starts
        _cov_config(cfg, s, m, k, a.lr, a.warmup, 0)
    os.makedirs(a.out, exist_ok=True)
    if cfg.data.text != "synthetic":
        load_corpus(cfg.data, cfg.model.vocab_size)
    t0 = time.perf_counter()
    results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.eval_every, plan, profiled,
                          a.profile_steps, a.lr, a.warmup, timeout_s=6 * 3600)
    wall = time.perf_counter() - t0
    runs, first, _ = merged_runs(results)
    second = next(r for r in results if r is not first)
    cov = {(c["cov_stride"], c["cov_micro_batches"]): (c["cov_seconds"] + o["cov_seconds"], max(c["peak_saved"], o["peak_saved"]))
           for c, o in zip(first["cov"], second["cov"])}
    print()
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, kfac mode, lr {a.lr:g}, warm-up {a.warmup}, "
          f"{a.steps} steps; covariance per refresh: both nodes' cov_kron work in a {a.profile_steps}-step profile")
    print("| cov_stride | cov_micro_batches | k | final held-out loss (per seed) | median | covariance per refresh (ms) | "
          "saved (MiB) | step (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for g in dict.fromkeys(g for g, _ in plan):
        mine = [r for r in runs if (r["cov_stride"], r["cov_micro_batches"], r["interval"]) == g]
        finals = [r["val"][-1][1] for r in mine if r["val"]]
        c, saved = cov.get(g[:2], (math.nan, math.nan))
        step = _median([_median(r["step_seconds"][1:]) * 1e3 for r in mine])
        print(f"| {g[0]} | {g[1]} | {g[2]} | {' / '.join(f'{x:.4f}' for x in finals)} | {_median(finals):.4f} | "
              f"{c * 1e3:.1f} | {saved / 2**20:.1f} | {step:.1f} |")
    dump_json_atomic(os.path.join(a.out, "covariance.json"), {"args": vars(a), "runs": runs,
                                                            "cov": [{"setting": list(k), "seconds": v[0], "saved": v[1]}
                                                                    for k, v in cov.items()]})
    print(f"wrote {os.path.join(a.out, 'covariance.json')}; {wall / 60:.1f} minutes")


if __name__ == "__main__":
    run_main(main)
