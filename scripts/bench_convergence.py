#!/usr/bin/env python
"""Time to a target held-out loss: the best first-order baseline (AdamW) against K-FAC, on real text.

Two pipeline stages, one CPU core each, the config's corpus (default: the Python standard library's
own source files, tokenized by a BPE tokenizer trained on the training files), fixed seeds. The same
two worker processes run everything, so every mode sees the same machine:

1. a profile of a few ``kfac`` steps, whose median step rank 0 packs with the default policy
   (``target``: the density with the least expected time-to-target) into a schedule file;
2. a small AdamW sweep (peak learning rate x warm-up) on seed 0, each run as long as the benchmark's
   runs; the setting with the lowest mean TRAINING loss over the last 10 % of steps wins (the held-out
   text is never used to choose anything);
3. for each seed: the chosen baseline, ``kfac`` (curvature every step, the preconditioned gradient fed
   to the same AdamW) and ``scheduled`` (the packed schedule, K-FAC inside the pipeline bubbles),
   interleaved, each evaluated on the held-out text every ``--eval-every`` steps.

The target is the median over seeds of the baseline's final held-out loss. Steps to target: the first
evaluation at or below it; time to target: the training seconds until then (evaluations excluded).
Printed: a table per mode (medians over seeds); the packing report with its trade-off; the plan against
the run (the objective's planned step, :mod:`pipefisher.objective`, against the measured mean step, for
the scheduled and the first-order runs); ``scheduled step / first-order step: X``; and the last line
``kfac steps-to-target / baseline: X; scheduled time-to-target / baseline: Y`` (``inf`` where the median
seed never reached it). ``--out`` gets the chart (held-out loss against steps and against seconds) and
the raw results as JSON.

    python scripts/bench_convergence.py [--config configs/small.yaml] [--steps 300] [--seeds 3]
        [--eval-every 10] [--lrs 5e-4,1e-3,2e-3] [--warmups 0,30] [--out bench-convergence/]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("baseline", "kfac", "scheduled")


def bench_config(config_path: str, overrides: list[str]) -> Any:
    """The run config with the benchmark's ``--set`` overrides, on 2 stages."""
    from pipefisher.runtime.job.config import apply_overrides, load_config

    return apply_overrides(load_config(config_path), overrides, config_path).replace(pipeline={"stages": 2})


def start_worker(config_path: str, overrides: list[str]) -> tuple[Any, int, Any]:
    """(the config on 2 stages, this worker's rank, its process group): one core per stage."""
    from pipefisher.runtime.job.dist import init_from_env
    from pipefisher.runtime.launch.local import pin_to_one_core

    base = bench_config(config_path, overrides)
    rank = pin_to_one_core()  # one core per stage
    return base, rank, init_from_env(2, base.pipeline.timeout_s)


def trainer_of(ctx: Any, steps: int, eval_every: int) -> Callable[..., tuple[Any, Any]]:
    """``train(cfg, mode, schedule=None, evals=eval_every, **options) -> (trainer, result)``, quietly, in these
    workers (``options``: more :class:`TrainOptions`, such as ``adapt=True``)."""
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    def train(cfg: Any, mode: str, schedule: str | None = None, evals: int = eval_every,
              **options: Any) -> tuple[Any, Any]:
        opts = TrainOptions(mode=mode, steps=steps, schedule=schedule, eval_every=evals, progress=False,
                            log_every=10**9, **options)
        trainer = Trainer(cfg, ctx, opts)
        return trainer, trainer.run()

    return train


def loss_rank(cfg: Any) -> int:
    """The worker holding the losses (2 stages, one replica): the device of the last stage, 1, except
    in ZB-V's V, which ends on device 0."""
    from pipefisher.runtime.pipeline.layout import loss_device

    return loss_device(cfg)


def announcer(rank: int, cfg: Any) -> Callable[[str], None]:
    """Print on the worker that holds the losses."""
    return lambda msg: print(msg, flush=True) if rank == loss_rank(cfg) else None


def choose_baseline(train: Callable[..., tuple[Any, Any]], base: Any, steps: int, lrs: list[float],
                    warmups: list[int], announce: Callable[[str], None]) -> tuple[float, int, list[dict[str, Any]]]:
    """The AdamW sweep on seed 0, judged on TRAINING loss only (the mean of the last 10 % of steps): the
    held-out text never chooses anything. Returns (lr, warm-up, the sweep's rows), the same on every worker."""
    import torch.distributed as dist

    tail = max(1, steps // 10)
    sweep = []
    for lr in lrs:
        for warm in warmups:
            _, res = train(base.replace(optim={"lr": lr, "warmup_steps": warm}), "first-order", evals=0)
            score = statistics.mean(res.losses[-tail:]) if res.losses else math.nan
            sweep.append({"lr": lr, "warmup_steps": warm, "train_loss_tail": score})
            announce(f"sweep: AdamW lr {lr:g}, warm-up {warm}: training loss (last {tail} steps) {score:.4f}")
    choice: list[Any] = [None]
    if int(os.environ["RANK"]) == loss_rank(base):  # the last stage knows the losses: everyone takes its choice
        best = min(sweep, key=lambda r: r["train_loss_tail"])
        choice = [(best["lr"], best["warmup_steps"])]
    dist.broadcast_object_list(choice, src=loss_rank(base))
    lr, warm = choice[0]
    announce(f"baseline: AdamW lr {lr:g}, warm-up {warm} steps (same settings for the K-FAC runs)")
    return lr, warm, sweep


def run_record(mode: str, seed: int, res: Any, **extra: Any) -> dict[str, Any]:
    """What a benchmark keeps of one training run."""
    return {"mode": mode, "seed": seed, "val": res.val, "losses": res.losses, "step_seconds": res.step_seconds,
            "peak_memory": res.peak_memory_bytes, "peak_saved": res.peak_saved_bytes, **extra}


def profile_and_pack(base: Any, ctx: Any, rank: int, folder: str, profile_steps: int) -> tuple[str, dict[str, Any] | None]:
    """A profile of ``profile_steps`` kfac steps in these workers, whose median step rank 0 packs with the
    default policy into ``folder/schedule.pickle`` (its metadata names the profile, which an ``--adapt``
    run plans against). Returns the schedule's path and, on rank 0, the plan: the policy, the planned
    and first-order step (ms) and the packing report's lines."""
    import torch.distributed as dist

    from pipefisher.runtime.train.profiler import timeline_filename
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    Trainer(base, ctx, TrainOptions(mode="kfac", profile=True, steps=profile_steps, out=folder, progress=False,
                                    log_every=10**9)).run()
    dist.barrier()
    sched = os.path.join(folder, "schedule.pickle")
    plan = None
    if rank == 0:
        from pipefisher.objective import step_cost
        from pipefisher.policies import DEFAULT_POLICY, get_policy
        from pipefisher.report import usage_lines
        from pipefisher.rules import validate
        from pipefisher.schedule_file import save_schedule
        from pipefisher.timeline import load_job

        timelines = [os.path.join(folder, timeline_filename(base.name, i)) for i in range(2)]
        job = load_job(timelines)
        packed = get_policy(DEFAULT_POLICY).pack(job)
        assert not validate(packed.to_file_data(), job, margin=packed.margin), "an invalid schedule"
        save_schedule(sched, packed, timelines)
        cost = step_cost(packed.to_file_data(), job)  # the profile is in nanoseconds
        plan = {"policy": packed.policy, "step_ms": cost.step * 1e-6, "first_order_ms": cost.first_order * 1e-6,
                "report": usage_lines(packed)}
    dist.barrier()
    return sched, plan


def _worker(config_path: str, overrides: list[str], steps: int, seeds: int, eval_every: int, lrs: list[float],
            warmups: list[int], profile_steps: int, folder: str) -> dict[str, Any]:
    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "sweep": [], "runs": [], "cycles": None}
    try:
        # 1. profile and pack
        sched, out["plan"] = profile_and_pack(base, ctx, rank, folder, profile_steps)

        # 2. the baseline sweep, judged on training loss only
        lr, warm, out["sweep"] = choose_baseline(train, base, steps, lrs, warmups, announce)
        out["baseline"] = {"lr": lr, "warmup_steps": warm}

        # 3. three modes per seed, interleaved
        for seed in range(seeds):
            for mode in MODES:
                cfg = base.replace(optim={"lr": lr, "warmup_steps": warm}, data={"seed": seed})
                trainer, res = train(cfg, {"baseline": "first-order", "kfac": "kfac"}.get(mode, "scheduled"),
                                     schedule=sched if mode == "scheduled" else None)
                if trainer.cycles:
                    out["cycles"] = trainer.cycles
                out["runs"].append(run_record(mode, seed, res))
                if res.val:
                    announce(f"seed {seed} {mode:9}: held-out {res.val[-1][1]:.4f} after {steps} steps, "
                             f"{res.val[-1][2]:.0f} s of training")
    finally:
        shutdown(ctx)
    return out


def merged_runs(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(the runs as the last stage saw them, with both workers' memory and step times; rank 0's result;
    the result of the worker holding the losses: rank 1, rank 0 under ZB-V)."""
    last = next(r for r in results if r["holds_loss"])
    first = next(r for r in results if r["rank"] == 0)
    runs = last["runs"]
    other_result = next(r for r in results if r is not last)
    for run, other in zip(runs, other_result["runs"]):  # memory: the larger of the two workers
        run["peak_memory"] = max(run["peak_memory"], other["peak_memory"])
        run["peak_saved"] = max(run["peak_saved"], other["peak_saved"])
        # a step ends when both stages are done: the slower stage's time
        run["step_seconds"] = [max(x, y) for x, y in zip(run["step_seconds"], other["step_seconds"])]
    return runs, first, last


def baseline_target(runs: list[dict[str, Any]]) -> float:
    """The target held-out loss: the median over seeds of the baseline's final held-out loss."""
    return _median([r["val"][-1][1] for r in runs if r["mode"] == "baseline"])


def steps_and_time_to(val: list[tuple[int, float, float]], target: float) -> tuple[float, float]:
    """The first evaluation at or below ``target``: (steps, training seconds); inf if none."""
    for step, loss, seconds in val:
        if loss <= target:
            return float(step), float(seconds)
    return math.inf, math.inf


def reach_row(mine: list[dict[str, Any]], target: float) -> dict[str, float]:
    """Runs of one mode against the target: median steps and training seconds to it, median final held-out
    loss, and how many runs reached it."""
    reach = [steps_and_time_to(r["val"], target) for r in mine]
    return {"steps": _median([s for s, _ in reach]), "seconds": _median([t for _, t in reach]),
            "final": _median([r["val"][-1][1] for r in mine]), "reached": sum(1 for s, _ in reach if not math.isinf(s))}


def header_lines(a: argparse.Namespace, baseline: dict[str, Any], target: float, extra: str = "") -> list[str]:
    """The run's setting and its target, as the convergence-style benchmarks print them first."""
    return [f"config {os.path.basename(a.config)}, 2 stages x 1 core, {a.steps} steps, {a.seeds} seed(s), held-out "
            f"evaluation every {a.eval_every} steps; baseline AdamW lr {baseline['lr']:g}, warm-up "
            f"{baseline['warmup_steps']} (chosen on training loss){extra}",
            f"target held-out loss: {target:.4f} (median of the baseline's final held-out loss)"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _ratio(a: float, b: float) -> str:
    if math.isinf(a) or math.isnan(a) or b in (0, math.inf) or math.isnan(b):
        return "inf"
    return f"{a / b:.3f}"


def chart(runs: list[dict[str, Any]], target: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"baseline": "#4c72b0", "kfac": "#dd8452", "scheduled": "#55a868"}
    labels = {"baseline": "AdamW (best of sweep)", "kfac": "K-FAC every step", "scheduled": "K-FAC in the bubbles"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, x_index, xlabel in ((axes[0], 0, "training step"), (axes[1], 2, "training seconds (2 CPU cores)")):
        seen = set()
        for run in runs:
            xs = [v[x_index] for v in run["val"]]
            ys = [v[1] for v in run["val"]]
            mode = run["mode"]
            ax.plot(xs, ys, color=colours[mode], lw=1.4, alpha=0.85,
                    label=None if mode in seen else labels[mode])
            seen.add(mode)
        ax.axhline(target, color="#333333", ls="--", lw=1, label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out masked-LM loss")
    axes[0].legend(loc="upper right")
    lo = min(v[1] for r in runs for v in r["val"])
    axes[0].set_ylim(lo - 0.1, min(max(v[1] for r in runs for v in r["val"]), target + 1.0))
    fig.suptitle(title)
    save_png(fig, path)


def save_png(fig: Any, path: str) -> None:
    """Write a benchmark's chart atomically, and let it go."""
    import matplotlib.pyplot as plt

    from pipefisher.safe_io import atomic_path

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def common_arguments(description: str) -> argparse.ArgumentParser:
    """The options every convergence-style benchmark shares: the run config, its length and seeds, the
    held-out evaluations and the AdamW sweep (one definition, so they measure the same thing)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--steps", type=int, default=300, help="steps of every run (the baseline's run length)")
    ap.add_argument("--seeds", type=int, default=3, help="runs per setting, with different data seeds")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    ap.add_argument("--lrs", default="5e-4,1e-3,2e-3", help="AdamW peak learning rates of the sweep")
    ap.add_argument("--warmups", default="0,30", help="AdamW warm-up steps of the sweep")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, as pipefisher train --set does (e.g. --set data.text=DIR: "
                         "any folder or file of text as the corpus); repeatable")
    return ap


def main() -> None:
    ap = common_arguments(__doc__.splitlines()[0])
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="kfac steps profiled before packing (default 10; their median step is packed)")
    ap.add_argument("--out", default="bench-convergence", help="folder for the chart and the raw results")
    a = ap.parse_args()
    lrs = [float(x) for x in a.lrs.split(",")]
    warmups = [int(x) for x in a.warmups.split(",")]

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local

    cfg = bench_config(a.config, a.overrides)
    os.makedirs(a.out, exist_ok=True)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)  # build the cache once, before the workers
    print(f"corpus '{cfg.data.text}': {corpus.files} files, {len(corpus.train)} training and {len(corpus.val)} "
          f"held-out tokens, {cfg.data.tokenizer} vocabulary {cfg.model.vocab_size}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipefisher-conv-") as folder:
        results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.seeds, a.eval_every, lrs, warmups,
                              a.profile_steps, folder, timeout_s=3 * 3600)
    runs, first, last = merged_runs(results)
    target = baseline_target(runs)
    table: dict[str, dict[str, float]] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        table[mode] = {
            **reach_row(mine, target),
            "step_ms": _median([statistics.median(r["step_seconds"][1:]) * 1e3 for r in mine]),
            "memory": _median([r["peak_memory"] / 2**20 for r in mine]),
            "saved": _median([r["peak_saved"] / 2**20 for r in mine]),
        }
    b = last["baseline"]
    print()
    for line in header_lines(a, b, target, f"; scheduled K-FAC cycle k = {max(first['cycles'] or [0])} "
                                           f"(per node {first['cycles']})"):
        print(line)
    print("| mode | steps to target | time to target (s) | final held-out loss | step (ms) | peak memory (MiB) "
          "| K-FAC saved (MiB) | seeds reaching |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        t = table[mode]
        print(f"| {mode} | {t['steps']:g} | {t['seconds']:.1f} | {t['final']:.4f} | {t['step_ms']:.1f} | "
              f"{t['memory']:.0f} | {t['saved']:.1f} | {t['reached']}/{a.seeds} |")
    png = os.path.join(a.out, "convergence.png")
    chart(runs, target, png, f"{cfg.name}: held-out loss, {a.seeds} seeds, 2 pipeline stages on CPU")
    from pipefisher.safe_io import dump_json_atomic

    dump_json_atomic(os.path.join(a.out, "convergence.json"),
                     {"target": target, "table": table, "baseline": b, "sweep": last["sweep"], "runs": runs,
                      "cycles": first["cycles"], "plan": first["plan"], "args": vars(a)})
    print(f"wrote {png} and {os.path.join(a.out, 'convergence.json')}")
    plan = first["plan"]
    print(f"packed with '{plan['policy']}' on the profile's median step:")
    for line in plan["report"]:
        print(f"  {line}")
    measured = {m: _median([statistics.fmean(r["step_seconds"][1:]) * 1e3 for r in runs if r["mode"] == m])
                for m in ("baseline", "scheduled")}
    print(f"plan against run (mean step after step 0, median over seeds): scheduled planned {plan['step_ms']:.1f} ms, "
          f"measured {measured['scheduled']:.1f} ms ({_ratio(measured['scheduled'], plan['step_ms'])}); first-order "
          f"planned {plan['first_order_ms']:.1f} ms, measured {measured['baseline']:.1f} ms "
          f"({_ratio(measured['baseline'], plan['first_order_ms'])})")
    # means, not medians: a cycle's steps carry different K-FAC loads, and time to target is their sum
    print(f"scheduled step / first-order step: {_ratio(measured['scheduled'], measured['baseline'])} "
          f"(mean step after step 0, median over seeds, measured in this run)")
    print(f"kfac steps-to-target / baseline: {_ratio(table['kfac']['steps'], table['baseline']['steps'])}; "
          f"scheduled time-to-target / baseline: {_ratio(table['scheduled']['seconds'], table['baseline']['seconds'])}")


if __name__ == "__main__":
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:  # a bad config or --set: one line
        sys.exit(f"error: {err}")
