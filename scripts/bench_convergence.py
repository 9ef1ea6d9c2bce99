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
   pipeline bubbles, its cycles overlapping, its refresh in ``--refresh-pieces`` pieces: by default 1, 2
   and 4 are each profiled and packed and kept as ``pipefisher run`` keeps one; its curvature update, K-FAC
   feeding AdamW or ``soap``, Adam in K-FAC's eigenbasis, chosen by its sweep: each update has its own
   lrs and the updates split the warm-ups, 3 lrs x 1 warm-up each, the size of every other sweep;
   ``--scheduled-lrs kfac`` takes ``kfac``'s choice, K-FAC feeding AdamW, instead of its own sweep); in
   each, the setting with the lowest mean TRAINING loss over the last 10 % of steps wins (the held-out
   text is never used to choose anything);
3. for each seed, every mode with its chosen setting, interleaved, each evaluated on the held-out text
   every ``--eval-every`` steps. The sweep's runs are evaluated so too (never to choose), and seed 0's
   run of a mode is its sweep's winning run, not trained again (a run is a pure function of its config).

The target is the best first-order optimizer's final held-out loss (median over seeds; the best: the
lower median). Steps to target: the first evaluation at or below it; time to target: the training
seconds until then (evaluations excluded). Printed: a table with a row per mode (medians over seeds);
the packing report with its trade-off; the plan against the run (the objective's planned step,
:mod:`pipefisher.cost.objective`, against the measured mean step, for the scheduled and the AdamW runs);
``scheduled step / first-order step: X`` (AdamW's step; again against the best first-order optimizer's
where that is Muon), ``muon step / adamw step: Y``; the last line
``kfac steps-to-target / baseline: A; scheduled time-to-target / baseline: B; best first-order: NAME;
scheduled time-to-target / best first-order: C`` (the baseline is AdamW; ``inf`` where the median seed
never reached the target, ``n/a`` where the one it is divided by never did); then the total elapsed
time. ``--out`` gets the chart (held-out loss against steps and against seconds, a line per run) and
the raw results as JSON.

    python scripts/bench_convergence.py [--config configs/small.yaml] [--steps 300] [--seeds 3]
        [--eval-every 10] [--lrs 5e-4,1e-3,2e-3] [--muon-lrs 2e-3,4e-3,8e-3] [--kfac-lrs 1e-3,2e-3,4e-3]
        [--scheduled-lrs 7e-4,1.4e-3,2.8e-3|kfac] [--soap-lrs 2e-3,4e-3,8e-3] [--scheduled-updates base,soap]
        [--refresh-pieces best|auto|N] [--warmups 0,30] [--modes baseline,muon,kfac,scheduled]
        [--basis-block 129] [--factor-decay-per-step 0.8] [--cov-micro-batches 2|all] [--out bench-convergence/]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.cost.objective import PIECE_CHOICES, PiecesPacked, best_pieces  # noqa: E402 (no torch)


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
UPDATES = {"base": "K-FAC feeding AdamW", "soap": "soap: Adam in K-FAC's eigenbasis"}

BASIS_BLOCK = 129
"""``--basis-block``'s default: the soap update's ``kfac.basis_block`` in K-FAC in the bubbles. On
``configs/small.yaml`` (hidden 128) 129 keeps the attention layers' factors whole (128 inputs and the bias
column) and cuts the 512- and 513-wide ones into 4 blocks; one seed of the race at 300 steps, Muon at
5.7919: whole factors 5.9937 (k = 6/7), blocks of 128 5.7937 (k = 3), of 129 5.7848 (k = 3)
(docs/benchmarks.md, "Factors cut into diagonal blocks")."""

ROTATION_DTYPE = "float32"
"""``--rotation-dtype``'s default: the soap update's ``kfac.rotation_dtype`` in K-FAC in the bubbles.
bfloat16 looked better on one seed (5.7766 at 1.040x Muon's step, float32 5.7848 at 1.106x) and lost
more on 3 (time-to-target / Muon 1.119 against float32's 1.085: docs/benchmarks.md, "Factors cut into
diagonal blocks"), so float32 stays."""

FACTOR_DECAY_PER_STEP = 0.8
"""``--factor-decay-per-step``'s default: the soap update's ``kfac.factor_decay_per_step`` in K-FAC in the
bubbles (the library's default is SOAP's 0.95). On ``configs/small.yaml``, refreshed every step for 300
steps (seed 0; Muon 5.7919), 0.8 ended at 5.7640 against 5.8142 at 0.95 and 5.9214 at 0.5; in the
bubbles at k = 3 for 1000 steps (seeds 0 / 1) 0.5 a refresh (about 0.8 a step) 5.4255 / 5.4021 against
5.4327 / 5.4079 at 0 (docs/benchmarks.md, "Factors averaged across refreshes under soap")."""

NESTEROV = "on"
"""``--nesterov``'s default: the soap update's ``kfac.nesterov`` in K-FAC in the bubbles (the library's
default is off, SOAP's plain Adam). On ``configs/small.yaml`` (3 seeds, Muon 5.4384 / 5.3977 / 5.3677) at
1000 steps it ended 5.4159 / 5.3901 / 5.3766 against 5.4304 / 5.4040 / 5.3777 without it, and the races
with it were won at 300 and 1000 steps (docs/benchmarks.md, "Nesterov's look-ahead in the eigenbasis")."""

COV_MICRO_BATCHES = 2
"""``--cov-micro-batches``' default: the soap update's ``kfac.cov_micro_batches`` in K-FAC in the bubbles
(the library's default is ``all``), a count of this benchmark's 4 micro-batches a step. Half the
covariance work a refresh, on ``configs/small.yaml`` at 300 steps (3 seeds; Muon 5.7919 / 5.7625 /
5.8206): the race at k = 3 ended at 5.7676 / 5.7608 / 5.8069 at 1.026x Muon's step, time-to-target /
Muon 0.935, against 5.7893 / 5.7713 / 5.8200 at 1.056x (1.014) with all 4; at 1000 steps it lost
(0.008 behind at 1.121x). Not compared at the same curvature age (docs/benchmarks.md, "Half the
micro-batches a refresh under soap")."""

SOAP_LRS = "2e-3,4e-3,8e-3"
"""K-FAC in the bubbles' curvature updates (``kfac.update``), chosen by its sweep: its default lrs of each
(``--scheduled-lrs`` for ``base``, centred on 1.4e-3; ``--soap-lrs`` for ``soap``, centred on 4e-3, where
the eigenbasis in the bubbles did best, docs/benchmarks.md)."""
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
        opts = TrainOptions.of(mode=mode, steps=steps, schedule=schedule, eval_every=evals, progress=False,
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
    best = lowest_training_loss(sweep, base)
    lr, warm = best["lr"], best["warmup_steps"]
    announce(f"{entrant.label}: lr {lr:g}, warm-up {warm} steps (the best training loss of its sweep)")
    return lr, warm, sweep


def lowest_training_loss(rows: list[dict[str, Any]], base: Any) -> dict[str, Any]:
    """The sweep row with the lowest ``train_loss_tail`` as the worker holding the losses saw it (the other
    worker's are nan), the same on every worker."""
    import torch.distributed as dist

    choice: list[Any] = [None]
    if int(os.environ["RANK"]) == loss_rank(base):  # the last stage knows the losses: everyone takes its choice
        choice = [min(rows, key=lambda r: math.inf if math.isnan(r["train_loss_tail"]) else r["train_loss_tail"])]
    dist.broadcast_object_list(choice, src=loss_rank(base))
    return choice[0]


@dataclass(frozen=True)
class Variant:
    """One curvature update of K-FAC in the bubbles' sweep: its config (``kfac.update`` and the refresh
    pieces it was profiled with), its schedule, its part of the sweep and, on rank 0, its plan."""

    update: str
    cfg: Any
    schedule: str
    lrs: list[float]
    warmups: list[int]
    plan: dict[str, Any] | None


def choose_update(train: Callable[..., tuple[Any, Any]], steps: int, variants: list[Variant],
                  announce: Callable[[str], None], swept: list[SweptRun] | None = None,
                  evals: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """K-FAC in the bubbles' sweep over its curvature updates: each variant's own :func:`choose_setting`
    sweep (its lrs x its warm-ups, on its config and schedule), the winner over all their runs by the
    same rule (the lowest mean training loss over the last 10 % of steps). Returns (the choice: ``lr``,
    ``warmup_steps``, ``update``, ``refresh_pieces``, ``overlap``; every row), the same on every worker."""
    entrant, rows = ENTRANTS["scheduled"], []
    for v in variants:
        label = replace(entrant, label=f"{entrant.label} ({UPDATES[v.update]})")
        _, _, sub = choose_setting(train, v.cfg, steps, v.lrs, v.warmups, announce, label, v.schedule, swept, evals)
        rows += [{**r, "update": v.update} for r in sub]
    best = lowest_training_loss(rows, variants[0].cfg)
    cfg = next(v.cfg for v in variants if v.update == best["update"])
    choice = {"lr": best["lr"], "warmup_steps": best["warmup_steps"], "update": best["update"],
              "refresh_pieces": cfg.kfac.refresh_pieces, "overlap": True, "basis_block": cfg.kfac.basis_block,
              "rotation_dtype": cfg.kfac.rotation_dtype, "nesterov": cfg.kfac.nesterov,
              "factor_decay_per_step": cfg.kfac.factor_decay_per_step,
              "cov_micro_batches": cfg.kfac.cov_micro_batches}
    announce(f"{entrant.label}: {UPDATES[best['update']]}, lr {best['lr']:g}, warm-up {best['warmup_steps']} steps "
             "(the best training loss of its sweep over the updates)")
    return choice, rows


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
                     staleness: str | None = None, overlap: bool | None = None) -> tuple[str, dict[str, Any] | None]:
    """A profile of ``profile_steps`` kfac steps in these workers, whose median step rank 0 packs with the
    default policy (with the ``staleness`` curve file where given, for a run of ``steps`` steps) into
    ``folder/schedule.pickle`` (its metadata names the profile, which an ``--adapt`` run plans against),
    its cycles overlapping where ``overlap`` lets them (the policy's option, None: its default, on; an
    ``--adapt`` run takes either).
    Returns the schedule's path and, on rank 0, the plan: the policy, the planned and first-order step
    (ms), the cycle per node, whether the cycles overlap, and the packing report's lines."""
    import torch.distributed as dist

    from pipefisher.runtime.train.profiler import timeline_filename
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    Trainer(base, ctx, TrainOptions.of(mode="kfac", profile=True, steps=profile_steps, out=folder, progress=False,
                                       log_every=10**9)).run()
    dist.barrier()
    sched = os.path.join(folder, "schedule.pickle")
    plan = None
    if rank == 0:
        from pipefisher.cost.objective import step_cost
        from pipefisher.outputs.report import usage_lines
        from pipefisher.policies import DEFAULT_POLICY, get_policy
        from pipefisher.rules import validate
        from pipefisher.schedule.file import save_schedule
        from pipefisher.schedule.timeline import load_job

        timelines = [os.path.join(folder, timeline_filename(base.name, i)) for i in range(2)]
        job = load_job(timelines)
        from pipefisher.cost.staleness import read_staleness

        packed = get_policy(DEFAULT_POLICY, staleness=read_staleness(staleness), max_cycle=steps,
                            overlap=overlap).pack(job)
        assert not validate(packed.to_file_data(), job, margin=packed.margin, overlap=packed.overlap), "an invalid schedule"
        save_schedule(sched, packed, timelines)
        cost = step_cost(packed.to_file_data(), job)  # the profile is in nanoseconds
        plan = {"policy": packed.policy, "step_ms": cost.step * 1e-6, "first_order_ms": cost.first_order * 1e-6,
                "cycles": [node.figures.iterations for node in packed.nodes], "overlap": packed.overlap,
                "report": usage_lines(packed)}
    dist.barrier()
    return sched, plan


def pack_variant(base: Any, ctx: Any, rank: int, folder: str, profile_steps: int, steps: int, update: str,
                 pieces: str, staleness: str | None = None,
                 soap: Mapping[str, Any] | None = None) -> tuple[Any, str, dict[str, Any] | None]:
    """(the config, the schedule, on rank 0 the plan) of K-FAC in the bubbles with curvature ``update``:
    profiled with the refresh in ``pieces`` pieces (``kfac.refresh_pieces``: a number or ``auto``; ``best``:
    each of :data:`~pipefisher.cost.objective.PIECE_CHOICES` profiled and packed, the count kept as ``pipefisher
    run`` keeps it, :func:`~pipefisher.cost.objective.best_pieces`) and packed with overlapping cycles;
    ``soap``: the soap update's own ``kfac`` settings (:func:`soap_settings`), for that update only."""
    import torch.distributed as dist

    packs = []
    for p in PIECE_CHOICES if pieces == "best" else (pieces if pieces == "auto" else int(pieces),):
        cfg = base.replace(kfac={"update": update, "refresh_pieces": p, **((soap or {}) if update == "soap" else {})})
        where = os.path.join(folder, f"{update}-pieces-{p}")
        os.makedirs(where, exist_ok=True)
        sched, plan = profile_and_pack(cfg, ctx, rank, where, profile_steps, steps, staleness, overlap=True)
        packs.append((cfg, sched, plan))
    pick = [0]
    if rank == 0:  # the plans are rank 0's; the rule is pipefisher run's (best_pieces)
        tried = [PiecesPacked(c.kfac.refresh_pieces, plan["step_ms"], max(plan["cycles"])) for c, _, plan in packs]
        pick = [tried.index(best_pieces(tried))]
        packs[pick[0]][2]["pieces_tried"] = {str(t.pieces): {"step_ms": t.step_ms, "cycle": t.cycle} for t in tried}
    dist.broadcast_object_list(pick, src=0)
    return packs[pick[0]]


def _worker(config_path: str, overrides: list[str], steps: int, seeds: int, eval_every: int,
            sweeps: dict[str, list[float] | str], warmups: list[int], profile_steps: int, folder: str,
            staleness: str | None = None, updates: dict[str, list[float]] | None = None,
            pieces: str = "best", soap: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every mode of ``sweeps`` (key: its learning rates, or :data:`SHARE`), swept then run per seed; K-FAC
    in the bubbles (unless it shares) over ``updates`` (per curvature update its lrs; :func:`update_warmups`
    splits the warm-ups among them), each profiled with ``pieces`` and packed (:func:`pack_variant`)."""
    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "sweeps": {}, "choices": {},
                           "runs": [], "cycles": None, "plan": None, "plans": {}}
    own = sweeps.get("scheduled") not in (None, SHARE)
    updates = updates if own and updates else {"base": []}
    try:
        # 1. per curvature update: profile (in refresh pieces) and pack (cycles overlapping)
        variants = []
        for (update, lrs), warms in zip(updates.items(), update_warmups(list(updates), warmups)):
            cfg, sched, plan = pack_variant(base, ctx, rank, folder, profile_steps, steps, update, pieces, staleness,
                                            soap)
            variants.append(Variant(update, cfg, sched, lrs, warms, plan))
            out["plans"][update] = plan

        # 2. a sweep of the same size per mode, judged on training loss only (evaluated as the measured
        # runs are, so that seed 0's measured run can be its winner's, not trained twice)
        swept: list[SweptRun] = []
        others = {k: v for k, v in sweeps.items() if not (own and k == "scheduled")}
        out["choices"], out["sweeps"] = sweep_race(train, base, steps, others, warmups, announce,
                                                   {"scheduled": variants[0].schedule}, {"scheduled": variants[0].cfg},
                                                   swept=swept, evals=eval_every)
        if own:
            out["choices"]["scheduled"], out["sweeps"]["scheduled"] = choose_update(train, steps, variants, announce,
                                                                                    swept, eval_every)
        elif "scheduled" in sweeps:
            out["choices"]["scheduled"].update(update="base", refresh_pieces=variants[0].cfg.kfac.refresh_pieces,
                                               overlap=True)
        chosen = next(v for v in variants if v.update == out["choices"].get("scheduled", {}).get("update", "base"))
        out["plan"] = chosen.plan

        # 3. every mode per seed, interleaved
        for seed in range(seeds):
            for key in sweeps:
                choice = out["choices"][key]
                on = chosen.cfg if key == "scheduled" else base
                res, cycles, kept = measured_run(train, swept, race_config(on, key, choice, seed), ENTRANTS[key].mode,
                                                 chosen.schedule if key == "scheduled" else None, eval_every)
                if cycles:
                    out["cycles"] = cycles
                out["runs"].append(run_record(key, seed, res, **choice))
                if res.val:
                    announce(f"seed {seed} {key:9}: held-out {res.val[-1][1]:.4f} after {steps} steps, "
                             f"{res.val[-1][2]:.0f} s of training" + (" (its sweep's run)" if kept else ""))
    finally:
        shutdown(ctx)
    return out


def update_warmups(updates: list[str], warmups: list[int]) -> list[list[int]]:
    """Each curvature update's warm-ups in K-FAC in the bubbles' sweep: the update replaces the warm-up
    axis (update i takes every n-th warm-up from the i-th, n updates), so that its sweep has as many runs
    as every other mode's (2 updates x 3 lrs = 3 lrs x 2 warm-ups); with fewer warm-ups than updates,
    each takes them all (a larger sweep: said in the printed sizes)."""
    n = len(updates)
    return [warmups[i::n] if len(warmups) >= n else list(warmups) for i in range(n)]


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
        from pipefisher.cost.staleness import STALENESS_HELP

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


def scheduled_updates(ap: argparse.ArgumentParser, a: argparse.Namespace,
                      sweeps: Mapping[str, list[float] | str]) -> dict[str, list[float]]:
    """Per curvature update of ``--scheduled-updates`` its lrs (``--scheduled-lrs`` or ``--soap-lrs``),
    after ``--refresh-pieces`` is checked; a bad one is ``ap.error``'s one line. Empty where K-FAC in the
    bubbles does not sweep (not raced, or ``--scheduled-lrs kfac``)."""
    if a.refresh_pieces not in ("best", "auto") and not (a.refresh_pieces.isdigit() and int(a.refresh_pieces) >= 1):
        ap.error(f"--refresh-pieces: an integer >= 1, auto or best, not {a.refresh_pieces!r}")
    names = [u.strip() for u in a.scheduled_updates.split(",") if u.strip()]
    if not names or set(names) - set(UPDATES) or len(set(names)) != len(names):
        ap.error(f"--scheduled-updates: a subset of {','.join(UPDATES)}, each once, not {a.scheduled_updates!r}")
    if sweeps.get("scheduled") in (None, SHARE):
        return {}
    try:
        return {u: lr_list(a.scheduled_lrs if u == "base" else a.soap_lrs) for u in names}
    except ValueError as err:
        ap.error(f"a list of numbers is expected: {err}")
        raise


def soap_settings(a: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """The soap update's own ``kfac`` settings from the flags, for ``cfg``: a ``kfac.factor_decay`` set (per
    refresh) stands, so the weight per step is left out beside it; a ``kfac.cov_micro_batches`` set stands
    too, and a count of at least the config's micro-batches is all of them."""
    out: dict[str, Any] = {"basis_block": a.basis_block, "rotation_dtype": a.rotation_dtype,
                           "nesterov": a.nesterov == "on"}
    if cfg.kfac.factor_decay is None:
        out["factor_decay_per_step"] = a.factor_decay_per_step
    if cfg.kfac.cov_micro_batches == "all":
        m = a.cov_micro_batches
        out["cov_micro_batches"] = "all" if m == "all" or m >= cfg.data.num_micro_batches else m
    return out


def scheduled_label(run: Mapping[str, Any]) -> str:
    """K-FAC in the bubbles as it ran: its curvature update, refresh pieces and whether its cycles overlap."""
    if "update" not in run:
        return ENTRANTS["scheduled"].label
    block = f", factors in diagonal blocks of at most {run['basis_block']}" if run.get("basis_block") else ""
    if run.get("rotation_dtype", "float32") != "float32":
        block += f", rotations in {run['rotation_dtype']}"
    if run.get("nesterov"):
        block += ", Nesterov's look-ahead"
    if run.get("factor_decay_per_step") is not None:
        block += f", factors averaged {run['factor_decay_per_step']:g} a step"
    if run.get("cov_micro_batches", "all") != "all":
        block += f", covariance of the first {run['cov_micro_batches']} micro-batches a refresh"
    return (f"{ENTRANTS['scheduled'].label} ({UPDATES[run['update']]}{block}, refresh in {run['refresh_pieces']} "
            f"piece{'s' if run['refresh_pieces'] != 1 else ''}{', overlapping cycles allowed' if run['overlap'] else ''})")


def main() -> None:
    started = time.monotonic()
    ap = common_arguments(__doc__.splitlines()[0])
    race_arguments(ap)
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="kfac steps profiled before packing (default 10; their median step is packed)")
    ap.add_argument("--out", default="bench-convergence", help="folder for the chart and the raw results")
    ap.add_argument("--scheduled-updates", default="base,soap",
                    help="K-FAC in the bubbles' curvature updates, chosen by its sweep: base (K-FAC feeding AdamW; "
                         "its lrs: --scheduled-lrs) and/or soap (Adam in K-FAC's eigenbasis; its lrs: --soap-lrs); "
                         "the updates split the warm-ups, so the sweep keeps every mode's size")
    ap.add_argument("--soap-lrs", default=SOAP_LRS, help="soap's peak learning rates in K-FAC in the bubbles' sweep")
    ap.add_argument("--refresh-pieces", default="best", metavar="N|auto|best",
                    help="kfac.refresh_pieces of K-FAC in the bubbles' profile and runs; best (default): "
                         f"{'/'.join(map(str, PIECE_CHOICES))} each profiled and packed, the count kept as pipefisher run "
                         "keeps it (among planned steps within 2 %% of the least, the shorter cycle, then fewer pieces)")
    ap.add_argument("--basis-block", type=int, default=BASIS_BLOCK, metavar="N",
                    help="kfac.basis_block of the soap update in K-FAC in the bubbles: factors wider than N columns "
                         f"cut into diagonal blocks (0: whole factors; default {BASIS_BLOCK})")
    ap.add_argument("--rotation-dtype", default=ROTATION_DTYPE, choices=("float32", "bfloat16"),
                    help=f"kfac.rotation_dtype of the soap update in K-FAC in the bubbles (default {ROTATION_DTYPE})")
    ap.add_argument("--nesterov", default=NESTEROV, choices=("on", "off"),
                    help="kfac.nesterov of the soap update in K-FAC in the bubbles: Adam's first moment looks one "
                         f"step ahead (default {NESTEROV}, this benchmark's; the library's is off)")
    ap.add_argument("--factor-decay-per-step", type=float, default=FACTOR_DECAY_PER_STEP, metavar="W",
                    help="kfac.factor_decay_per_step of the soap update in K-FAC in the bubbles: the old factor's "
                         f"weight a step (default {FACTOR_DECAY_PER_STEP}, this benchmark's; unused where --set "
                         "kfac.factor_decay gives a weight per refresh)")
    ap.add_argument("--cov-micro-batches", default=str(COV_MICRO_BATCHES), metavar="M|all",
                    help="kfac.cov_micro_batches of the soap update in K-FAC in the bubbles: the first M micro-batches "
                         f"of a refresh feed its factors (default {COV_MICRO_BATCHES}, this benchmark's; all: every one; "
                         "unused where --set kfac.cov_micro_batches gives a count)")
    a = ap.parse_args()
    if a.cov_micro_batches != "all":
        if not a.cov_micro_batches.isdigit() or int(a.cov_micro_batches) < 1:
            ap.error(f"--cov-micro-batches: a count >= 1 or all, not {a.cov_micro_batches}")
        a.cov_micro_batches = int(a.cov_micro_batches)
    if a.basis_block < 0:
        ap.error(f"--basis-block: an integer >= 0, not {a.basis_block}")
    if not 0.0 <= a.factor_decay_per_step < 1.0:
        ap.error(f"--factor-decay-per-step: a weight in [0, 1), not {a.factor_decay_per_step}")
    sweeps, warmups = race_sweeps(ap, a)
    updates = scheduled_updates(ap, a, sweeps)

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local

    cfg = bench_config(a.config, a.overrides)
    from pipefisher.cost.staleness import curve_for_job

    curve_for_job(a.staleness, cfg.fingerprint(layout=False), a.config)  # a bad file: one line, before any run
    os.makedirs(a.out, exist_ok=True)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)  # build the cache once, before the workers
    print(f"corpus '{cfg.data.text}': {corpus.files} files, {len(corpus.train)} training and {len(corpus.val)} "
          f"held-out tokens, {cfg.data.tokenizer} vocabulary {cfg.model.vocab_size}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipefisher-conv-") as folder:
        results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.seeds, a.eval_every, sweeps, warmups,
                              a.profile_steps, folder, a.staleness, updates, a.refresh_pieces,
                              soap_settings(a, cfg),
                              timeout_s=3 * 3600)
    runs, first, last = merged_runs(results)
    best = best_first_order(runs)
    target = final_loss(runs, best) if best else math.nan
    table = race_table(runs, target)
    choices = last["choices"]
    print()
    split = zip(updates, update_warmups(list(updates), warmups))
    sizes = ", ".join(f"{k}: {SHARE}'s choice" if v == SHARE else
                      " + ".join(f"{k} {u} {len(updates[u])} lrs x {len(w)} warm-up{'s' if len(w) != 1 else ''}"
                                 for u, w in split) if k == "scheduled" and updates else
                      f"{k} {len(v)} lrs x {len(warmups)} warm-ups" for k, v in sweeps.items())
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
        if key == "scheduled":
            label = scheduled_label(next(r for r in runs if r["mode"] == key))
        print(f"| {label} | {t['lr']:g}, {t['warmup_steps']:g} | {t['steps']:g} | {t['seconds']:.1f} | {t['final']:.4f} "
              f"| {t['step_ms']:.1f} | {t['saved']:.1f} | {t['reached']}/{a.seeds} |")
    png = os.path.join(a.out, "convergence.png")
    chart(runs, target, png, f"{cfg.name}: held-out loss, {a.seeds} seed{'s' if a.seeds != 1 else ''}, 2 pipeline stages on CPU",
          ENTRANTS[best].label if best else "")
    from pipefisher.safe_io import dump_json_atomic

    dump_json_atomic(os.path.join(a.out, "convergence.json"),
                     {"target": target, "best_first_order": best, "table": table, "choices": choices,
                      "sweeps": last["sweeps"], "runs": runs, "cycles": first["cycles"], "plan": first["plan"],
                      "plans": first["plans"], "scheduled": scheduled_label(choices.get("scheduled", {})),
                      "args": vars(a)})
    print(f"wrote {png} and {os.path.join(a.out, 'convergence.json')}")
    plan = first["plan"]
    tried = ", ".join(f"{p}: {t['step_ms']:.1f} ms (k = {t['cycle']})" for p, t in plan.get("pieces_tried", {}).items())
    print(f"packed with '{plan['policy']}' on the profile's median step, cycles overlapping "
          f"({'they do' if plan['overlap'] else 'none did'}); planned step per refresh piece count: {tried}:")
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
    if best and best != "baseline":  # against the best first-order optimizer's step too
        print(f"scheduled step / first-order step ({ENTRANTS[best].label}, the best first-order): "
              f"{_ratio(measured.get('scheduled', math.nan), measured.get(best, math.nan))} {how}")
    print(f"muon step / adamw step: {_ratio(measured.get('muon', math.nan), measured.get('baseline', math.nan))} {how}")
    print(last_line(table, best))
    elapsed = time.monotonic() - started
    print(f"total elapsed: {elapsed / 60:.1f} min ({elapsed:.0f} s)")


def run_main(main: Any) -> None:
    """Run a benchmark's ``main``: a bad config or ``--set`` is one line and exit status 1, no traceback."""
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    run_main(main)
