#!/usr/bin/env python
"""Step time of ``first-order``, ``kfac`` (refresh every step), ``scheduled`` (K-FAC in the bubbles,
static schedules) and ``adaptive`` (the closed loop: re-packed from the measured steps while training)
on 2 pipeline stages, one CPU core each, for each pipeline order asked for, in one go.

The same two worker processes run everything: per pipeline (``--orders``, default 1F1B and
Chimera), a profile of a few kfac steps, whose median step rank 0 packs with the default policy
(``target``: the density with the least expected time-to-target) and with ``tight`` (or --policy) once
per K-FAC margin (profiled K-FAC times x margin: slack for noisy CPU timings, at the price of a longer
cycle); then first-order, kfac, each static schedule and the adaptive run (``--adapt``, on by default:
it starts from the ``target`` schedule) of every pipeline, interleaved, ``--rounds`` times.
A ``precondition`` run (kfac mode, no refresh after step 0) measures the floor no schedule can go
below: K-FAC's per-step preconditioning and bookkeeping. Per run it prints the mean step time after
the warm-up steps (the median over the rounds), the ratio
to the same pipeline's first-order step (the median over the rounds of each round's ratio, and their
spread), the bubble fraction of the profiled pipeline, the device-to-host reads per step that logs
nothing (most, and mean in brackets, over both workers and the rounds: :mod:`pipefisher.runtime.job.host`;
every run logs only its first and last step), and the K-FAC cycle k per node (for the adaptive run: where
it ended). Then per pipeline: ``target``, static at margin 1, the best static
margin of the sweep, and adaptive; the last line, ``adaptive/first-order: X (k = K)``, is the worst pipeline's median.
With several pipelines it then compares them against the fastest first-order step of all (the baseline
a user would otherwise train with): per pipeline its first-order, kfac and ``target`` steps over that
step, and, given the job's staleness curve (``--staleness``, from ``scripts/bench_staleness.py``), the
``target`` schedule's expected time to a target loss over first-order's at that step, ``steps(k) x step``
(:mod:`pipefisher.cost.objective`); without one, no time to target is predicted.

    python scripts/bench_scheduled.py [--config configs/small.yaml] [--steps 80] [--warmup 3] [--rounds 5] \
        [--kfac-margin 1,1.25,1.5,2] [--micro-batches M] [--orders 1f1b,chimera] [--no-adapt] \
        [--staleness bench-staleness/staleness.json]
    python scripts/bench_scheduled.py --orders 1f1b,zb-h1,zb-v --kfac-margin 1 --no-adapt   # zero bubble
    python scripts/bench_scheduled.py --orders 1f1b,zb-v --engine pipefisher,torch --kfac-margin 1 --no-adapt

``--engine pipefisher,torch`` runs every pipeline on both engines (``pipeline.engine``) in the same
workers, each profiled and packed on its own (rows ``<pipeline>@<engine>``), and ends with each
pipeline's torch/pipefisher step ratios (first-order, ``target`` schedule) and both engines' k.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.cli._common import add_renamed_argument  # noqa: E402


TARGET = "target"
"""The default policy's schedule: the packing density with the least expected time-to-target."""
PRECONDITION = "precondition"
"""The floor of any schedule: kfac mode whose curvature refresh never comes after step 0, so every step
pays K-FAC's preconditioning and bookkeeping but no K-FAC work."""


def _variant(name: str) -> tuple[str, str]:
    """``(pipeline order, engine)`` of a bench row's pipeline: ``1f1b``, or ``1f1b@torch`` with ``--engine``."""
    pipe, _, engine = name.partition("@")
    return pipe, engine or "pipefisher"


def _config(base, name: str):  # noqa: ANN001, ANN202
    pipe, engine = _variant(name)
    return base.replace(pipeline={"order": pipe, "engine": engine})


def _bubble_fraction(job) -> float:
    """Share of the profiled pipeline time the nodes sit idle (mean over nodes)."""
    from pipefisher.schedule.problem import node_model

    models = [node_model(node, job.span) for node in job.nodes]
    return sum(1 - m.pipeline_busy / m.length for m in models) / len(models)


def _bench(config_path: str, overrides: dict, pipelines: list[str], steps: int, warmup: int, profile_steps: int,
           policy: str | None, folder: str, rounds: int, margins: list[float], adapt: bool,
           staleness: str | None = None) -> dict:
    import dataclasses

    import torch.distributed as dist

    from pipefisher.runtime.job.config import load_config
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.launch.local import pin_to_one_core
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    base = load_config(config_path).replace(**overrides)
    rank = pin_to_one_core()  # one core per stage
    # One set of process groups serves both layouts: the Chimera pair of 2 stages is the whole job.
    chimera_ctx = init_from_env(2, base.pipeline.timeout_s, chimera=True)
    one_pipe_ctx = dataclasses.replace(chimera_ctx, chimera=False, stage_group=chimera_ctx.dp_group,
                                       stage_group_size=chimera_ctx.grid.replicas)
    from pipefisher.cost.staleness import read_staleness, staleness_data

    quiet = dict(progress=False, log_every=10**9)
    curve_data = staleness_data(read_staleness(staleness))  # the adaptive run's too
    runs = [(p, m) for p in pipelines for m in ["first-order", "kfac", PRECONDITION, TARGET,
                                                *[f"scheduled x{g:g}" for g in margins],
                                                *(["adaptive"] if adapt else [])]]
    out: dict = {"rank": rank, "times": {r: [] for r in runs}, "reads": {r: [] for r in runs}, "usage": {},
                 "cycles": {r: [] for r in runs},
                 "violations": {}, "bubbles": {}, "switches": {r: [] for r in runs}}
    timelines: dict = {}
    files: dict = {}
    try:
        for pipe in pipelines:
            cfg = _config(base, pipe)
            ctx = chimera_ctx if pipe == "chimera" else one_pipe_ctx
            sub = os.path.join(folder, pipe)
            os.makedirs(sub, exist_ok=True)
            # profile, then rank 0 packs (once per K-FAC margin) while the other waits
            Trainer(cfg, ctx, TrainOptions.of(mode="kfac", profile=True, steps=profile_steps, out=sub, **quiet)).run()
            dist.barrier()
            for i, g in enumerate(margins):
                files[pipe, f"scheduled x{g:g}"] = os.path.join(sub, f"schedule-{i}.pickle")
            files[pipe, TARGET] = os.path.join(sub, "schedule-target.pickle")
            files[pipe, "adaptive"] = os.path.join(sub, "schedule-adaptive.pickle")
            from pipefisher.runtime.train.profiler import timeline_filename as _tf

            timelines[pipe] = tuple(os.path.join(sub, _tf(cfg.name, i)) for i in range(2))
            if rank == 0:
                from pipefisher.outputs.report import usage_lines
                from pipefisher.policies import DEFAULT_POLICY, get_policy
                from pipefisher.rules import validate
                from pipefisher.runtime.pipeline.checks import packed_for
                from pipefisher.runtime.train.profiler import timeline_filename
                from pipefisher.schedule.file import save_schedule
                from pipefisher.schedule.timeline import inflate_kfac, load_job

                job = load_job([os.path.join(sub, timeline_filename(cfg.name, i)) for i in range(2)])
                out["bubbles"][pipe] = _bubble_fraction(job)
                for g in margins:
                    v = (pipe, f"scheduled x{g:g}")
                    inflated = inflate_kfac(job, g)  # what it is packed against is what it is checked on
                    packed = get_policy(policy or "tight").pack(inflated)
                    out["usage"][v] = usage_lines(packed)
                    out["violations"][v] = len(validate(packed.to_file_data(), inflated))
                    out["policy"] = packed.policy
                    save_schedule(files[v], packed, kfac_margin=g, packed_for=packed_for(cfg))
                # the density with the least expected time-to-target (with a curve), else the least step
                chosen = get_policy(DEFAULT_POLICY, staleness=read_staleness(staleness), max_cycle=steps).pack(job)
                v = (pipe, TARGET)
                out["usage"][v] = usage_lines(chosen)
                out["violations"][v] = len(validate(chosen.to_file_data(), job, margin=chosen.margin))
                save_schedule(files[v], chosen, packed_for=packed_for(cfg))
                if adapt:  # the closed loop starts from the default policy's schedule
                    save_schedule(files[pipe, "adaptive"], chosen, packed_for=packed_for(cfg))
            dist.barrier()
        for _ in range(rounds):
            for pipe, mode in runs:
                cfg = _config(base, pipe)
                if mode == PRECONDITION:  # K-FAC's update with a refresh never due: no K-FAC work after step 0
                    cfg = cfg.replace(kfac={"interval": 10**9})
                ctx = chimera_ctx if pipe == "chimera" else one_pipe_ctx
                sched = files.get((pipe, mode))
                opts = TrainOptions.of(mode="scheduled" if sched else "kfac" if mode == PRECONDITION else mode,
                                       steps=steps, schedule=sched,
                                       adapt=mode == "adaptive", schedule_timelines=timelines[pipe],
                                       staleness=curve_data if mode == "adaptive" else None, **quiet)
                trainer = Trainer(cfg, ctx, opts)
                res = trainer.run()
                # the mean, not the median: a cycle's steps carry different K-FAC loads, the cost is their sum
                out["times"][pipe, mode].append(statistics.mean(res.step_seconds[warmup:]))
                out["reads"][pipe, mode].extend(res.host_reads[1:-1])  # steps that log nothing (not 0, not the last)
                if sched:
                    out["cycles"][pipe, mode].append(list(trainer.cycles))
                    out["switches"][pipe, mode].append(len(trainer.loop.history) - 1)
        out["micro_batches"] = base.data.num_micro_batches
    finally:
        shutdown(chimera_ctx)
    return out


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--steps", type=int, default=80,
                    help="training steps per run (the adaptive run spends its first cycles measuring)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the mean")
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="kfac steps profiled before packing (default 10; their median step is packed)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every run (median reported)")
    ap.add_argument("--policy", default=None, help="packing policy of the margin sweep (default: tight)")
    ap.add_argument("--micro-batches", type=int, default=None, help="override data.num_micro_batches")
    add_renamed_argument(ap, "--orders", "--pipelines", default="1f1b,chimera",
                         help="comma-separated pipeline orders to compare (gpipe, 1f1b, chimera, interleaved, zb-h1, zb-v, "
                         "dualpipev)")
    ap.add_argument("--engine", default="pipefisher",
                    help="comma-separated pipeline engines to run every pipeline on (pipefisher, torch)")
    ap.add_argument("--kfac-margin", default="1,1.25,1.5,2",
                    help="comma-separated K-FAC time factors to pack with, one static scheduled run each")
    ap.add_argument("--no-adapt", dest="adapt", action="store_false",
                    help="leave out the adaptive run (the closed loop starting from the margin-1 schedule)")
    from pipefisher.cost.staleness import STALENESS_HELP

    ap.add_argument("--staleness", default=None, metavar="FILE|K:RATIO,...", help=STALENESS_HELP)
    a = ap.parse_args()
    from pipefisher.cost.staleness import curve_for_job
    from pipefisher.runtime.job.config import load_config

    margins = [float(x) for x in a.kfac_margin.split(",")]
    engines = [e.strip() for e in a.engine.split(",") if e.strip()]
    pipelines = [p.strip() for p in a.orders.split(",") if p.strip()]
    if engines != ["pipefisher"]:
        pipelines = [f"{p}@{e}" for p in pipelines for e in engines]
    overrides: dict = {"pipeline": {"stages": 2}}
    if a.micro_batches:
        overrides["data"] = {"num_micro_batches": a.micro_batches}
    cfg = load_config(a.config).replace(**overrides)
    for name in pipelines:  # an engine that cannot run a pipeline: one line, before any worker starts
        _config(cfg, name)
    curve = curve_for_job(a.staleness, cfg.fingerprint(layout=False), a.config)  # a bad file: one line, now
    from pipefisher.runtime.launch.local import spawn_local  # torch: only once the arguments are good

    with tempfile.TemporaryDirectory(prefix="pipefisher-bench-") as folder:
        results = spawn_local(_bench, 2, a.config, overrides, pipelines, a.steps, a.warmup, a.profile_steps,
                              a.policy, folder, a.rounds, margins, a.adapt, a.staleness, timeout_s=3600)
    r0 = next(r for r in results if r["rank"] == 0)
    runs = list(r0["times"])
    # Both stages finish a step together (the pipeline couples them); report the slower one anyway.
    per_round = {r: [max(res["times"][r][i] for res in results) for i in range(a.rounds)] for r in runs}
    med = {r: statistics.median(v) for r, v in per_round.items()}
    ratios = {(pipe, mode): [t / fo for t, fo in zip(per_round[pipe, mode], per_round[pipe, "first-order"])]
              for pipe, mode in runs}
    ratio = {r: statistics.median(v) for r, v in ratios.items()}

    def reads_of(run: tuple) -> str:  # device-to-host reads per step that logs nothing: most, and mean
        reads = [n for res in results for n in res["reads"][run]]
        return f"{max(reads)} ({statistics.mean(reads):.2f})" if reads else "-"

    def k_of(run: tuple) -> int | None:  # the median over rounds of the job's k (the longest node's)
        cyc = r0["cycles"].get(run)
        return int(statistics.median(max(c) for c in cyc)) if cyc else None

    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {r0['micro_batches']} micro-batches, "
          f"{a.steps} steps (mean after {a.warmup} warm-up), {a.rounds} interleaved round(s) (median; ratios: the "
          f"median of each round's ratio, min-max in brackets); schedules by policy {r0['policy']}")
    width = max(9, *(len(p) for p, _ in runs))
    print(f"{'pipeline':{width}} {'run':14} {'step':>9} {'/ first-order':>22} {'bubbles':>8} {'reads':>11}  "
          "K-FAC cycle k (per node)")
    for pipe, mode in runs:
        run = (pipe, mode)
        cyc = r0["cycles"].get(run)
        extra = f"  {max(cyc[-1])} ({', '.join(map(str, cyc[-1]))})" if cyc else ""
        if mode == "adaptive":
            extra += f", {statistics.median(r0['switches'][run]):g} switch(es)"
        if r0["violations"].get(run):
            extra += f"  {r0['violations'][run]} VIOLATIONS"
        spread = f"[{min(ratios[run]):.3f}-{max(ratios[run]):.3f}]"
        print(f"{pipe:{width}} {mode:14} {med[run] * 1e3:7.1f} ms {ratio[run]:8.3f} {spread:>13} "
              f"{r0['bubbles'][pipe] * 100:7.1f}% {reads_of(run):>11}{extra}")
    for (pipe, mode), lines in r0["usage"].items():
        print(f"{pipe} {mode}:")
        for line in lines:
            print(f"    {line}")
    worst = None
    for pipe in dict.fromkeys(p for p, _ in runs):
        statics = [(ratio[p, m], m) for p, m in runs if p == pipe and m.startswith("scheduled")]
        one = next(((r, m) for r, m in statics if m == "scheduled x1"), statics[0])
        best = min(statics)
        line = (f"{pipe}: floor (preconditioning alone) {ratio[pipe, PRECONDITION]:.3f}; "
                f"target {ratio[pipe, TARGET]:.3f} (k = {k_of((pipe, TARGET))}); "
                f"static x1 {one[0]:.3f} (k = {k_of((pipe, one[1]))}); best static "
                f"{best[1].split()[-1]} {best[0]:.3f} (k = {k_of((pipe, best[1]))})")
        if (pipe, "adaptive") in ratio:
            ad = (pipe, "adaptive")
            line += (f"; adaptive {ratio[ad]:.3f} [{min(ratios[ad]):.3f}-{max(ratios[ad]):.3f}] "
                     f"(k = {k_of(ad)})")
            if worst is None or ratio[ad] > worst[0]:
                worst = (ratio[ad], k_of(ad))
        print(line)
    if worst is not None:
        print(f"adaptive/first-order: {worst[0]:.3f} (k = {worst[1]})")
    pipes = list(dict.fromkeys(p for p, _ in runs))
    if len(engines) > 1:
        for line in across_engines(pipes, per_round, a.rounds, k_of, r0["bubbles"]):
            print(line)
    if len(pipes) > 1:
        for line in across_pipelines(pipes, per_round, a.rounds, k_of, curve):
            print(line)


def across_engines(pipes: list[str], per_round: dict, rounds: int, k_of, bubbles: dict) -> list[str]:  # noqa: ANN001
    """Per pipeline order, every other engine's steps over pipefisher's own (medians of each round's ratio)."""
    out = []
    for pipe in pipes:
        order, engine = _variant(pipe)
        own = f"{order}@pipefisher"
        if engine == "pipefisher" or own not in {p for p in pipes}:
            continue

        def over(mode: str) -> float:
            return statistics.median(per_round[pipe, mode][i] / per_round[own, mode][i] for i in range(rounds))

        out.append(f"{order}: {engine}/pipefisher step: first-order {over('first-order'):.3f}, target schedule "
                   f"{over(TARGET):.3f}; bubbles {bubbles[own] * 100:.1f}% / {bubbles[pipe] * 100:.1f}%; "
                   f"k {k_of((own, TARGET))} / {k_of((pipe, TARGET))}")
    return out


def across_pipelines(pipes: list[str], per_round: dict, rounds: int, k_of, curve=None) -> list[str]:  # noqa: ANN001
    """Every pipeline against the fastest first-order step of them all, round by round (medians); with the
    job's staleness ``curve``, the ``target`` schedule's expected time to the target too."""
    def over_best(mode: str, pipe: str) -> float:
        return statistics.median(per_round[pipe, mode][i] / min(per_round[q, "first-order"][i] for q in pipes)
                                 for i in range(rounds))

    best = min(pipes, key=lambda q: statistics.median(per_round[q, "first-order"]))
    w = max(9, *(len(q) for q in pipes))
    out = [f"against the fastest first-order step ({best}, "
           f"{statistics.median(per_round[best, 'first-order']) * 1e3:.1f} ms; medians of each round's ratio):",
           f"{'pipeline':{w}} {'first-order':>12} {'kfac':>8} {'target':>8} {'k':>4}"
           + (f" {'time to target (expected)':>27}" if curve is not None else "")]
    for pipe in pipes:
        k = k_of((pipe, TARGET))
        line = (f"{pipe:{w}} {over_best('first-order', pipe):12.3f} {over_best('kfac', pipe):8.3f} "
                f"{over_best(TARGET, pipe):8.3f} {k:>4}")
        if curve is not None:
            steps = curve.at(k) if k else float("nan")
            line += f" {steps * over_best(TARGET, pipe):27.3f}"
        out.append(line)
    if curve is None:
        out.append("(no staleness curve given, --staleness FILE: no time to target is predicted)")
    return out


if __name__ == "__main__":
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:  # a bad config or --staleness: one line
        sys.exit(f"error: {err}")
