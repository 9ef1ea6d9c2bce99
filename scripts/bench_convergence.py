#!/usr/bin/env python
"""Time to a target held-out loss: K-FAC against the best first-order optimizer (AdamW, Muon), on real text.

Two pipeline stages, one CPU core each, the config's corpus (default: the Python standard library's
own source files, tokenized by a BPE tokenizer trained on the training files), fixed seeds. The same
two worker processes run everything, so every mode sees the same machine:

1. a profile of a few ``kfac`` steps, whose median step rank 0 packs with the default policy
   (``target``: the density with the least expected time-to-target) into a schedule file;
2. one sweep per optimizer and mode, all of the same size (its peak learning rates x the warm-ups), on
   seed 0, each run as long as the benchmark's runs: ``baseline`` (AdamW), ``muon`` (torch's Muon on
   the hidden matrices, AdamW on the rest), ``kfac`` (curvature every step, the preconditioned gradient
   fed to the config's optimizer, AdamW) and ``scheduled`` (the packed schedule, K-FAC inside the
   pipeline bubbles; ``--scheduled-lrs kfac`` takes ``kfac``'s choice instead of its own sweep); in
   each, the setting with the lowest mean TRAINING loss over the last 10 % of steps wins (the held-out
   text is never used to choose anything);
3. for each seed, every mode with its chosen setting, interleaved, each evaluated on the held-out text
   every ``--eval-every`` steps. The sweep's runs are evaluated so too (never to choose), and seed 0's
   run of a mode is its sweep's winning run, not trained again (a run is a pure function of its config).

The target is the best first-order optimizer's final held-out loss (median over seeds; the best: the
lower median). Steps to target: the first evaluation at or below it; time to target: the training
seconds until then (evaluations excluded). Printed: a table with a row per mode (medians over seeds);
the packing report with its trade-off; the plan against the run (the objective's planned step,
:mod:`pipefisher.objective`, against the measured mean step, for the scheduled and the AdamW runs);
``scheduled step / first-order step: X`` (AdamW's step), ``muon step / adamw step: Y``; the last line
``kfac steps-to-target / baseline: A; scheduled time-to-target / baseline: B; best first-order: NAME;
scheduled time-to-target / best first-order: C`` (the baseline is AdamW; ``inf`` where the median seed
never reached the target, ``n/a`` where the one it is divided by never did); then the total elapsed
time. ``--out`` gets the chart (held-out loss against steps and against seconds, a line per run) and
the raw results as JSON.

    python scripts/bench_convergence.py [--config configs/small.yaml] [--steps 300] [--seeds 3]
        [--eval-every 10] [--lrs 5e-4,1e-3,2e-3] [--muon-lrs 2e-3,4e-3,8e-3] [--kfac-lrs 1e-3,2e-3,4e-3]
        [--scheduled-lrs 7e-4,1.4e-3,2.8e-3|kfac] [--warmups 0,30] [--modes baseline,muon,kfac,scheduled]
        [--out bench-convergence/]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Entrant:
    """One optimizer or mode of the race: how it trains and where its learning-rate sweep is centred."""

    key: str  # its runs' "mode" in the results
    label: str
    mode: str  # the trainer's mode
    lrs: str  # the default peak learning rates of its sweep
    first_order: bool  # a candidate for the target: the best first-order optimizer's final held-out loss
    optim: dict[str, Any] = field(default_factory=dict)  # config changes besides lr and warm-up


RACE = (Entrant("baseline", "AdamW", "first-order", "5e-4,1e-3,2e-3", True, {"name": "adamw"}),
        Entrant("muon", "Muon", "first-order", "2e-3,4e-3,8e-3", True, {"name": "muon"}),
        Entrant("kfac", "K-FAC every step", "kfac", "1e-3,2e-3,4e-3", False),
        Entrant("scheduled", "K-FAC in the bubbles", "scheduled", "7e-4,1.4e-3,2.8e-3", False))
"""The race, in its table's order. The sweeps are centred on where each one was best on this benchmark's
model (AdamW 1e-3, Muon 4e-3, K-FAC every step 2e-3, K-FAC in the bubbles 1.4e-3: with its curvature
3-5 steps old it chose the lowest point of 1e-3/2e-3/4e-3, and refreshed every 4 steps it did best at
1.4e-3 of 5e-4..2e-3, docs/benchmarks.md) and all have the same number of points. The K-FAC modes feed
the preconditioned gradient to the config's optimizer (``configs/small.yaml``: AdamW)."""
MODES = tuple(e.key for e in RACE)
ENTRANTS = {e.key: e for e in RACE}
SHARE = "kfac"
"""``--scheduled-lrs kfac``: K-FAC in the bubbles takes K-FAC every step's choice instead of a sweep."""


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


def choose_setting(train: Callable[..., tuple[Any, Any]], base: Any, steps: int, lrs: list[float],
                   warmups: list[int], announce: Callable[[str], None], entrant: Entrant = RACE[0],
                   schedule: str | None = None, swept: list[SweptRun] | None = None,
                   evals: int = 0) -> tuple[float, int, list[dict[str, Any]]]:
    """``entrant``'s sweep (peak learning rate x warm-up) on seed 0, judged on TRAINING loss only (the
    mean of the last 10 % of steps): the held-out text never chooses anything, even where ``evals``
    evaluates on it every that many steps (0: never) so that ``swept`` can keep each run for
    :func:`swept_run`. Returns (lr, warm-up, the sweep's rows), the same on every worker."""
    import torch.distributed as dist

    tail = max(1, steps // 10)
    sweep = []
    for lr in lrs:
        for warm in warmups:
            cfg = base.replace(optim={**entrant.optim, "lr": lr, "warmup_steps": warm})
            trainer, res = train(cfg, entrant.mode, schedule=schedule, evals=evals)
            score = statistics.mean(res.losses[-tail:]) if res.losses else math.nan
            sweep.append({"lr": lr, "warmup_steps": warm, "train_loss_tail": score})
            if swept is not None:
                swept.append(SweptRun(cfg, entrant.mode, schedule, evals, res, trainer.cycles))
            announce(f"sweep: {entrant.label} lr {lr:g}, warm-up {warm}: training loss (last {tail} steps) {score:.4f}")
    choice: list[Any] = [None]
    if int(os.environ["RANK"]) == loss_rank(base):  # the last stage knows the losses: everyone takes its choice
        best = min(sweep, key=lambda r: math.inf if math.isnan(r["train_loss_tail"]) else r["train_loss_tail"])
        choice = [(best["lr"], best["warmup_steps"])]
    dist.broadcast_object_list(choice, src=loss_rank(base))
    lr, warm = choice[0]
    announce(f"{entrant.label}: lr {lr:g}, warm-up {warm} steps (the best training loss of its sweep)")
    return lr, warm, sweep


@dataclass(frozen=True)
class SweptRun:
    """One run of a sweep, kept so that a measured run of exactly the same config is not trained twice."""

    cfg: Any
    mode: str
    schedule: str | None
    evals: int
    result: Any  # the trainer's result
    cycles: Any  # the trainer's K-FAC cycle per node (scheduled mode), else None


def swept_run(swept: list[SweptRun], cfg: Any, mode: str, schedule: str | None, evals: int) -> SweptRun | None:
    """The sweep's run of exactly this config, mode, schedule and evaluation interval, or None.

    A run is a pure function of those (its seed is in the config; the same workers train every run from
    freshly seeded weights, data and dropout: ``tests/test_bench_convergence.py`` checks that a config
    trained twice gives the same losses), so seed 0's measured run of a mode is its sweep's winning run,
    taken over rather than trained again: 4 of the default race's 36 runs. Its step times are its own
    (measured in the sweep, not interleaved with the other modes' seed-0 runs)."""
    return next((r for r in swept if (r.cfg, r.mode, r.schedule, r.evals) == (cfg, mode, schedule, evals)), None)


def sweep_race(train: Callable[..., tuple[Any, Any]], base: Any, steps: int, sweeps: Mapping[str, list[float] | str],
               warmups: list[int], announce: Callable[[str], None], schedules: Mapping[str, str] | None = None,
               bases: Mapping[str, Any] | None = None, swept: list[SweptRun] | None = None,
               evals: int = 0) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Every mode of ``sweeps`` (key: its peak learning rates, or :data:`SHARE`: K-FAC every step's choice),
    in that order, each with its own :func:`choose_setting` sweep of the warm-ups x its lrs, on ``base``
    (or ``bases[key]``) and ``schedules[key]`` where given (``swept``, ``evals``: as there). Returns (per
    mode its chosen ``lr`` and ``warmup_steps``, per swept mode its sweep's rows), the same on every worker."""
    choices: dict[str, dict[str, Any]] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    for key, lrs in sweeps.items():
        if lrs == SHARE:
            choices[key] = dict(choices[SHARE])
            announce(f"{ENTRANTS[key].label}: {ENTRANTS[SHARE].label}'s choice, lr {choices[key]['lr']:g}, "
                     f"warm-up {choices[key]['warmup_steps']} (--{key}-lrs {SHARE})")
            continue
        lr, warm, rows[key] = choose_setting(train, (bases or {}).get(key, base), steps, lrs, warmups,  # type: ignore[arg-type]
                                             announce, ENTRANTS[key], (schedules or {}).get(key), swept, evals)
        choices[key] = {"lr": lr, "warmup_steps": warm}
    return choices, rows


def measured_run(train: Callable[..., tuple[Any, Any]], swept: list[SweptRun], cfg: Any, mode: str,
                 schedule: str | None, evals: int) -> tuple[Any, Any, bool]:
    """(the result, the K-FAC cycle per node, whether it is the sweep's) of ``cfg``'s run: the sweep's
    where it ran exactly this (:func:`swept_run`), else trained now."""
    kept = swept_run(swept, cfg, mode, schedule, evals)
    if kept is not None:
        return kept.result, kept.cycles, True
    trainer, res = train(cfg, mode, schedule=schedule, evals=evals)
    return res, trainer.cycles, False


def race_config(base: Any, key: str, choice: Mapping[str, Any], seed: int) -> Any:
    """``base`` as mode ``key`` runs it on ``seed``: its optimizer with its chosen peak lr and warm-up."""
    return base.replace(optim={**ENTRANTS[key].optim, "lr": choice["lr"], "warmup_steps": choice["warmup_steps"]},
                        data={"seed": seed})


def choose_baseline(train: Callable[..., tuple[Any, Any]], base: Any, steps: int, lrs: list[float],
                    warmups: list[int], announce: Callable[[str], None], swept: list[SweptRun] | None = None,
                    evals: int = 0) -> tuple[float, int, list[dict[str, Any]]]:
    """The AdamW sweep (:func:`choose_setting` of the baseline; ``swept``, ``evals``: as there)."""
    return choose_setting(train, base, steps, lrs, warmups, announce, ENTRANTS["baseline"], swept=swept, evals=evals)


def run_record(mode: str, seed: int, res: Any, **extra: Any) -> dict[str, Any]:
    """What a benchmark keeps of one training run."""
    return {"mode": mode, "seed": seed, "val": res.val, "losses": res.losses, "step_seconds": res.step_seconds,
            "peak_memory": res.peak_memory_bytes, "peak_saved": res.peak_saved_bytes, **extra}


def profile_and_pack(base: Any, ctx: Any, rank: int, folder: str, profile_steps: int, steps: int,
                     staleness: str | None = None) -> tuple[str, dict[str, Any] | None]:
    """A profile of ``profile_steps`` kfac steps in these workers, whose median step rank 0 packs with the
    default policy (with the ``staleness`` curve file where given, for a run of ``steps`` steps) into
    ``folder/schedule.pickle`` (its metadata names the profile, which an ``--adapt`` run plans against).
    Returns the schedule's path and, on rank 0, the plan: the policy, the planned and first-order step
    (ms) and the packing report's lines."""
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
        from pipefisher.staleness import read_staleness

        packed = get_policy(DEFAULT_POLICY, staleness=read_staleness(staleness), max_cycle=steps).pack(job)
        assert not validate(packed.to_file_data(), job, margin=packed.margin), "an invalid schedule"
        save_schedule(sched, packed, timelines)
        cost = step_cost(packed.to_file_data(), job)  # the profile is in nanoseconds
        plan = {"policy": packed.policy, "step_ms": cost.step * 1e-6, "first_order_ms": cost.first_order * 1e-6,
                "report": usage_lines(packed)}
    dist.barrier()
    return sched, plan


def _worker(config_path: str, overrides: list[str], steps: int, seeds: int, eval_every: int,
            sweeps: dict[str, list[float] | str], warmups: list[int], profile_steps: int, folder: str,
            staleness: str | None = None) -> dict[str, Any]:
    """Every mode of ``sweeps`` (key: its learning rates, or :data:`SHARE`), swept then run per seed."""
    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "sweeps": {}, "choices": {},
                           "runs": [], "cycles": None, "plan": None}
    try:
        # 1. profile and pack
        sched, out["plan"] = profile_and_pack(base, ctx, rank, folder, profile_steps, steps, staleness)

        # 2. a sweep of the same size per mode, judged on training loss only (evaluated as the measured
        # runs are, so that seed 0's measured run can be its winner's, not trained twice)
        swept: list[SweptRun] = []
        out["choices"], out["sweeps"] = sweep_race(train, base, steps, sweeps, warmups, announce, {"scheduled": sched},
                                                   swept=swept, evals=eval_every)

        # 3. every mode per seed, interleaved
        for seed in range(seeds):
            for key in sweeps:
                choice = out["choices"][key]
                res, cycles, kept = measured_run(train, swept, race_config(base, key, choice, seed), ENTRANTS[key].mode,
                                           sched if key == "scheduled" else None, eval_every)
                if cycles:
                    out["cycles"] = cycles
                out["runs"].append(run_record(key, seed, res, **choice))
                if res.val:
                    announce(f"seed {seed} {key:9}: held-out {res.val[-1][1]:.4f} after {steps} steps, "
                             f"{res.val[-1][2]:.0f} s of training" + (" (its sweep's run)" if kept else ""))
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


def final_loss(runs: list[dict[str, Any]], mode: str) -> float:
    """The median over seeds of ``mode``'s final held-out loss (nan without a run of it); with an even number
    of seeds the higher of the two middle ones, so that as a target at least half of ``mode``'s own seeds
    reach it (the mean of the two would leave one of two seeds short, and its steps-to-target infinite)."""
    finals = [r["val"][-1][1] for r in runs if r["mode"] == mode]
    return statistics.median_high(finals) if finals else math.nan


def baseline_target(runs: list[dict[str, Any]]) -> float:
    """The median over seeds of the baseline's (AdamW's) final held-out loss."""
    return final_loss(runs, "baseline")


def best_first_order(runs: list[dict[str, Any]]) -> str | None:
    """The first-order optimizer of the race with the lower median final held-out loss: its final loss
    is the target. None without a first-order run."""
    keys = [e.key for e in RACE if e.first_order and any(r["mode"] == e.key for r in runs)]
    return min(keys, key=lambda k: final_loss(runs, k)) if keys else None


def race_table(runs: list[dict[str, Any]], target: float, modes: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """Per mode that ran (``modes``, default the race's, in that order): medians over seeds of the steps
    and training seconds to ``target``, the final held-out loss, the step (after step 0), K-FAC's saved
    tensors (MiB; no process peak: see the table in :func:`main`), the seeds reaching the target, and the chosen peak lr and warm-up."""
    table: dict[str, dict[str, float]] = {}
    for key in MODES if modes is None else modes:
        mine = [r for r in runs if r["mode"] == key]
        if not mine:
            continue
        reach = [steps_and_time_to(r["val"], target) for r in mine]
        table[key] = {
            "steps": _median([s for s, _ in reach]), "seconds": _median([t for _, t in reach]),
            "final": _median([r["val"][-1][1] for r in mine]),
            "step_ms": _median([statistics.median(r["step_seconds"][1:] or r["step_seconds"]) * 1e3 for r in mine]),
            "mean_step_ms": _median([statistics.fmean(r["step_seconds"][1:] or r["step_seconds"]) * 1e3 for r in mine]),
            "saved": _median([r["peak_saved"] / 2**20 for r in mine]),
            "reached": sum(1 for s, _ in reach if not math.isinf(s)),
            "lr": mine[0].get("lr", math.nan), "warmup_steps": mine[0].get("warmup_steps", math.nan),
        }
    return table


def last_line(table: dict[str, dict[str, float]], best: str | None) -> str:
    """The benchmark's last line: K-FAC against AdamW (the baseline) and, on the clock, K-FAC in the
    bubbles against the best first-order optimizer (named by its ``optim.name``)."""
    def get(key: str | None, what: str) -> float:
        return table[key][what] if key in table else math.nan

    name = ENTRANTS[best].optim["name"] if best else "n/a"
    return (f"kfac steps-to-target / baseline: {_ratio(get('kfac', 'steps'), get('baseline', 'steps'))}; "
            f"scheduled time-to-target / baseline: {_ratio(get('scheduled', 'seconds'), get('baseline', 'seconds'))}; "
            f"best first-order: {name}; "
            f"scheduled time-to-target / best first-order: {_ratio(get('scheduled', 'seconds'), get(best, 'seconds'))}")


def steps_and_time_to(val: list[tuple[int, float, float]], target: float) -> tuple[float, float]:
    """The first evaluation at or below ``target``: (steps, training seconds); inf if none."""
    for step, loss, seconds in val:
        if loss <= target:
            return float(step), float(seconds)
    return math.inf, math.inf


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _ratio(a: float, b: float) -> str:
    """``a / b`` to 3 decimals; ``inf`` where ``a`` never happened (the median seed never reached the
    target), ``n/a`` where ``a`` was not measured or ``b`` is no measure to divide by (not run, never
    reached, 0)."""
    if math.isnan(a) or math.isnan(b) or b == 0 or math.isinf(b):
        return "n/a"
    if math.isinf(a):
        return "inf"
    return f"{a / b:.3f}"


COLOURS = {"baseline": "#4c72b0", "muon": "#8172b3", "kfac": "#dd8452", "scheduled": "#55a868"}


def chart(runs: list[dict[str, Any]], target: float, path: str, title: str, target_of: str = "") -> None:
    """Held-out loss against steps and against training seconds: a line per run, a colour per mode
    (labelled with its chosen lr), the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, x_index, xlabel in ((axes[0], 0, "training step"), (axes[1], 2, "training seconds (2 CPU cores)")):
        seen = set()
        for run in runs:
            xs = [v[x_index] for v in run["val"]]
            ys = [v[1] for v in run["val"]]
            mode = run["mode"]
            label = f"{ENTRANTS[mode].label} (lr {run['lr']:g})" if "lr" in run else ENTRANTS[mode].label
            ax.plot(xs, ys, color=COLOURS[mode], lw=1.4, alpha=0.85, label=None if mode in seen else label)
            seen.add(mode)
        ax.axhline(target, color="#333333", ls="--", lw=1,
                   label=f"target {target:.3f}" + (f" ({target_of}'s final)" if target_of else ""))
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


def common_arguments(description: str, packs: bool = True) -> argparse.ArgumentParser:
    """The options every convergence-style benchmark shares: the run config, its length and seeds, the
    held-out evaluations and the AdamW sweep (one definition, so they measure the same thing); for one
    that packs (``packs``), the job's staleness curve."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--steps", type=int, default=300, help="steps of every run (the baseline's run length)")
    ap.add_argument("--seeds", type=int, default=3, help="runs per setting, with different data seeds")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    ap.add_argument("--lrs", default="5e-4,1e-3,2e-3", help="AdamW peak learning rates of the sweep")
    ap.add_argument("--warmups", default="0,30", help="warm-up steps of the sweep (of every sweep, in the race)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, as pipefisher train --set does (e.g. --set data.text=DIR: "
                         "any folder or file of text as the corpus); repeatable")
    if packs:
        from pipefisher.staleness import STALENESS_HELP

        ap.add_argument("--staleness", default=None, metavar="FILE|K:RATIO,...", help=STALENESS_HELP)
    return ap


def race_arguments(ap: argparse.ArgumentParser, keys: tuple[str, ...] = MODES, required: tuple[str, ...] = ()) -> None:
    """The race's options (one definition, so every benchmark that races names them alike): ``--KEY-lrs``
    per mode of ``keys`` but the baseline (whose sweep is :func:`common_arguments`' ``--lrs``), and
    ``--modes``, a subset of ``keys`` with every mode of ``required``. :func:`race_sweeps` reads them."""
    for e in (ENTRANTS[k] for k in MODES if k in keys and k != "baseline"):
        extra = f", or {SHARE!r}: {ENTRANTS[SHARE].label}'s choice, no sweep of its own" if e.key == "scheduled" else ""
        ap.add_argument(f"--{e.key}-lrs", default=e.lrs, help=f"{e.label}'s peak learning rates of its sweep{extra}")
    need = f", with {','.join(required)}" if required else ""
    ap.add_argument("--modes", default=",".join(k for k in MODES if k in keys),
                    help=f"the modes to race, a subset of {','.join(k for k in MODES if k in keys)}{need} (at least "
                         "one first-order: baseline or muon); the target is the best first-order one's final held-out loss")


def race_sweeps(ap: argparse.ArgumentParser, a: argparse.Namespace, keys: tuple[str, ...] = MODES,
                required: tuple[str, ...] = ()) -> tuple[dict[str, list[float] | str], list[int]]:
    """(per mode of ``--modes``, in the race's order, its sweep's peak learning rates or :data:`SHARE`; the
    warm-ups of every sweep) from :func:`race_arguments`' options; a bad one is ``ap.error``'s one line."""
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    allowed = [k for k in MODES if k in keys]
    if not modes or set(modes) - set(allowed) or len(set(modes)) != len(modes) or set(required) - set(modes):
        need = f" with {','.join(required)}" if required else ""
        ap.error(f"--modes: a subset of {','.join(allowed)}{need}, each once, not {a.modes!r}")
    if not any(ENTRANTS[m].first_order for m in modes):
        ap.error("--modes: the target is the best first-order optimizer's final held-out loss; add baseline or muon")
    sweeps: dict[str, list[float] | str] = {}
    try:
        warmups = [int(x) for x in a.warmups.split(",")]
        for key in (m for m in MODES if m in modes):
            text = a.lrs if key == "baseline" else getattr(a, f"{key}_lrs")
            sweeps[key] = SHARE if key == "scheduled" and text == SHARE else lr_list(text)
    except ValueError as err:
        ap.error(f"a list of numbers is expected: {err}")
    if sweeps.get("scheduled") == SHARE and SHARE not in sweeps:
        ap.error(f"--scheduled-lrs {SHARE} takes {ENTRANTS[SHARE].label}'s choice: add {SHARE} to --modes")
    return sweeps, warmups


def lr_list(text: str) -> list[float]:
    """A comma-separated list of peak learning rates (ValueError on anything else)."""
    lrs = [float(x) for x in text.split(",")]
    if not lrs or not all(lr > 0 for lr in lrs):
        raise ValueError(f"peak learning rates are positive numbers, not {text!r}")
    return lrs


def main() -> None:
    started = time.monotonic()
    ap = common_arguments(__doc__.splitlines()[0])
    race_arguments(ap)
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="kfac steps profiled before packing (default 10; their median step is packed)")
    ap.add_argument("--out", default="bench-convergence", help="folder for the chart and the raw results")
    a = ap.parse_args()
    sweeps, warmups = race_sweeps(ap, a)

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local

    cfg = bench_config(a.config, a.overrides)
    from pipefisher.staleness import curve_for_job

    curve_for_job(a.staleness, cfg.fingerprint(layout=False), a.config)  # a bad file: one line, before any run
    os.makedirs(a.out, exist_ok=True)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)  # build the cache once, before the workers
    print(f"corpus '{cfg.data.text}': {corpus.files} files, {len(corpus.train)} training and {len(corpus.val)} "
          f"held-out tokens, {cfg.data.tokenizer} vocabulary {cfg.model.vocab_size}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipefisher-conv-") as folder:
        results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.seeds, a.eval_every, sweeps, warmups,
                              a.profile_steps, folder, a.staleness, timeout_s=3 * 3600)
    runs, first, last = merged_runs(results)
    best = best_first_order(runs)
    target = final_loss(runs, best) if best else math.nan
    table = race_table(runs, target)
    choices = last["choices"]
    print()
    sizes = ", ".join(f"{k} {len(v)} lrs x {len(warmups)} warm-ups" if v != SHARE else f"{k}: {SHARE}'s choice"
                      for k, v in sweeps.items())
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {a.steps} steps, {a.seeds} seeds, "
          f"held-out evaluation every {a.eval_every} steps; each mode's peak lr and warm-up chosen by its own sweep "
          f"on training loss ({sizes}); K-FAC's base optimizer {cfg.optim.name}"
          + (f"; scheduled K-FAC cycle k = {max(first['cycles'] or [0])} (per node {first['cycles']})"
             if "scheduled" in sweeps else ""))
    print(f"target held-out loss: {target:.4f} (median of the best first-order optimizer's final held-out loss: "
          f"{ENTRANTS[best].label if best else 'n/a'}; "
          + ", ".join(f"{ENTRANTS[k].label} {table[k]['final']:.4f}" for k in table if ENTRANTS[k].first_order) + ")")
    # no process peak column: the same two workers run every mode, and a CPU worker's resident set keeps
    # what the earlier runs' allocator grew (every mode showed the same 1019 MiB); scripts/bench_compute.py
    # measures memory. K-FAC's saved tensors are counted by K-FAC itself, per run.
    print("| mode | peak lr, warm-up | steps to target | time to target (s) | final held-out loss | step (ms) "
          "| K-FAC saved (MiB) | seeds reaching |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, t in table.items():
        label = ENTRANTS[key].label + (" (baseline)" if key == "baseline" else "")
        print(f"| {label} | {t['lr']:g}, {t['warmup_steps']:g} | {t['steps']:g} | {t['seconds']:.1f} | {t['final']:.4f} "
              f"| {t['step_ms']:.1f} | {t['saved']:.1f} | {t['reached']}/{a.seeds} |")
    png = os.path.join(a.out, "convergence.png")
    chart(runs, target, png, f"{cfg.name}: held-out loss, {a.seeds} seed{'s' if a.seeds != 1 else ''}, 2 pipeline stages on CPU",
          ENTRANTS[best].label if best else "")
    from pipefisher.safe_io import dump_json_atomic

    dump_json_atomic(os.path.join(a.out, "convergence.json"),
                     {"target": target, "best_first_order": best, "table": table, "choices": choices,
                      "sweeps": last["sweeps"], "runs": runs, "cycles": first["cycles"], "plan": first["plan"],
                      "args": vars(a)})
    print(f"wrote {png} and {os.path.join(a.out, 'convergence.json')}")
    plan = first["plan"]
    print(f"packed with '{plan['policy']}' on the profile's median step:")
    for line in plan["report"]:
        print(f"  {line}")
    # means, not medians: a cycle's steps carry different K-FAC loads, and time to target is their sum
    measured = {key: t["mean_step_ms"] for key, t in table.items()}
    if "scheduled" in measured and "baseline" in measured:
        print(f"plan against run (mean step after step 0, median over seeds): scheduled planned {plan['step_ms']:.1f} ms, "
              f"measured {measured['scheduled']:.1f} ms ({_ratio(measured['scheduled'], plan['step_ms'])}); first-order "
              f"planned {plan['first_order_ms']:.1f} ms, measured {measured['baseline']:.1f} ms "
              f"({_ratio(measured['baseline'], plan['first_order_ms'])})")
    how = "(mean step after step 0, median over seeds, measured in this run)"
    print(f"scheduled step / first-order step: {_ratio(measured.get('scheduled', math.nan), measured.get('baseline', math.nan))} {how}")
    print(f"muon step / adamw step: {_ratio(measured.get('muon', math.nan), measured.get('baseline', math.nan))} {how}")
    print(last_line(table, best))
    elapsed = time.monotonic() - started
    print(f"total elapsed: {elapsed / 60:.1f} min ({elapsed:.0f} s)")


if __name__ == "__main__":
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:  # a bad config or --set: one line
        sys.exit(f"error: {err}")
