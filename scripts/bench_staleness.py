#!/usr/bin/env python
"""Staleness, measured: steps to a target held-out loss when K-FAC's curvature is refreshed every k steps.

A K-FAC cycle of k pipeline iterations refreshes the curvature once every k steps. ``kfac`` mode with
``kfac.interval`` k does exactly that and nothing else (factors and inverses recomputed every k-th step,
the preconditioner reused in between), so it isolates what a longer cycle costs in convergence, apart
from any scheduling. Everything else is the convergence benchmark's (``scripts/bench_convergence.py``):
the same model, data, seeds, two stages on one core each, the same AdamW sweep chosen on training loss
only, and the same target (the median over seeds of the chosen AdamW's final held-out loss).

Printed: per k, the median over seeds of the steps to target, relative to AdamW and to k = 1, and the
final held-out loss; the last line ``staleness (kfac steps-to-target / AdamW) at k = 1, 2, ...: ...``.
``--out`` gets ``staleness.png`` (steps to target against k) and ``staleness.json``: the job's staleness
curve (``pipefisher-staleness/2``, docs/formats.md) with its provenance (the config's digest, name and
path, model, data, horizon, target, seeds, the per-k spread of the steps over seeds, the optimizer it
is relative to) and the raw runs beside it; every command that packs takes it as ``--staleness FILE``.
A run that never reaches the target counts as ``inf``.

    python scripts/bench_staleness.py [--config configs/small.yaml] [--steps 300] [--seeds 3]
        [--intervals 1,2,4,8,16] [--eval-every 10] [--lrs 5e-4,1e-3,2e-3] [--warmups 0,30]
        [--out bench-staleness/]
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, the convergence benchmark

from bench_convergence import (_median, announcer, baseline_target, bench_config, choose_baseline,  # noqa: E402
                               common_arguments, loss_rank, merged_runs, run_record, save_png, start_worker,
                               steps_and_time_to, trainer_of)


def _worker(config_path: str, overrides: list[str], steps: int, seeds: int, eval_every: int, lrs: list[float],
            warmups: list[int], intervals: list[int]) -> dict[str, Any]:
    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "runs": []}
    try:
        lr, warm, out["sweep"] = choose_baseline(train, base, steps, lrs, warmups, announce)
        out["baseline"] = {"lr": lr, "warmup_steps": warm}
        for seed in range(seeds):  # per seed: the baseline, then every interval, interleaved
            cfg = base.replace(optim={"lr": lr, "warmup_steps": warm}, data={"seed": seed})
            _, res = train(cfg, "first-order")
            out["runs"].append(run_record("baseline", seed, res))
            for k in intervals:
                _, res = train(cfg.replace(kfac={"interval": k}), "kfac")
                out["runs"].append(run_record("kfac", seed, res, interval=k))
                if res.val:
                    announce(f"seed {seed} kfac every {k:2} steps: held-out {res.val[-1][1]:.4f} after {steps} steps")
    finally:
        shutdown(ctx)
    return out


def curve(runs: list[dict[str, Any]], target: float, intervals: list[int]) -> list[dict[str, float]]:
    """Per interval k: the median steps to target of the kfac runs (and their least and most over the
    seeds), that over AdamW's, and over k = 1's."""
    def steps(mine: list[dict[str, Any]]) -> list[float]:
        return [steps_and_time_to(r["val"], target)[0] for r in mine]

    baseline = _median(steps([r for r in runs if r["mode"] == "baseline"]))
    rows = []
    for k in intervals:
        mine = [r for r in runs if r["mode"] == "kfac" and r.get("interval") == k]
        each = steps(mine)
        rows.append({"interval": k, "steps": _median(each), "steps_min": min(each, default=math.nan),
                     "steps_max": max(each, default=math.nan), "final": _median([r["val"][-1][1] for r in mine]),
                     "reached": sum(1 for x in each if not math.isinf(x))})
    first = rows[0]["steps"] if rows else math.nan
    for row in rows:
        row["vs_baseline"] = row["steps"] / baseline if baseline and not math.isinf(row["steps"]) else math.inf
        row["vs_first"] = row["steps"] / first if first and not math.isinf(row["steps"]) else math.inf
    return rows


def measured_curve(rows: list[dict[str, float]], cfg: Any, config_path: str, steps: int, target: float, seeds: int,
                   baseline: dict[str, Any]) -> Any:
    """The job's :class:`~pipefisher.staleness.StalenessCurve` from :func:`curve`'s rows, with where it was
    measured: the config's digest (:meth:`RunConfig.fingerprint` without the layout), name and path, model,
    data, horizon, target, seeds, the per-k spread over seeds, and the optimizer it is relative to."""
    from pipefisher.staleness import Provenance, StalenessCurve

    m, d = cfg.model, cfg.data
    provenance = Provenance(
        config_digest=cfg.fingerprint(layout=False), config_name=cfg.name, config_path=config_path,
        model=f"{m.builder}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, vocab "
              f"{m.vocab_size}" + (f", from {m.pretrained}" if m.pretrained else ""),
        data=f"{d.text} ({d.tokenizer} tokens, {d.objective}), {d.num_micro_batches} micro-batches of "
             f"{d.micro_batch_size} x {d.seq_len} tokens per step",
        horizon=steps, target=target, seeds=seeds,
        relative_to=f"{cfg.optim.name} lr {baseline['lr']:g}, warm-up {baseline['warmup_steps']} steps (the best "
                    "of the sweep, on training loss)")
    return StalenessCurve(tuple((float(r["interval"]), r["vs_baseline"]) for r in rows), provenance=provenance,
                          spread=tuple((r["steps_min"], r["steps"], r["steps_max"]) for r in rows))


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) or math.isnan(x) else f"{x:.3f}"


def chart(rows: list[dict[str, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ks = [r["interval"] for r in rows if not math.isinf(r["vs_baseline"])]
    ys = [r["vs_baseline"] for r in rows if not math.isinf(r["vs_baseline"])]
    ax.plot(ks, ys, "o-", color="#dd8452", lw=1.6, label="K-FAC, curvature every k steps")
    ax.axhline(1.0, color="#4c72b0", ls="--", lw=1, label="AdamW (best of sweep)")
    for k, y in zip(ks, ys):
        ax.annotate(f"{y:.2f}", (k, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    missed = [r["interval"] for r in rows if math.isinf(r["vs_baseline"])]
    if missed:
        ax.set_xlabel(f"refresh interval k (never reached the target: k = {', '.join(map(str, missed))})")
    else:
        ax.set_xlabel("refresh interval k (steps between curvature refreshes)")
    ax.set_xscale("log", base=2)
    ax.set_xlim(rows[0]["interval"] / 1.5, rows[-1]["interval"] * 1.5)  # also when no k reached the target
    ax.set_xticks([r["interval"] for r in rows], [str(r["interval"]) for r in rows])
    ax.set_ylabel("steps to target / AdamW's")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=10)
    save_png(fig, path)


def main() -> None:
    ap = common_arguments(__doc__.splitlines()[0], packs=False)
    ap.add_argument("--intervals", default="1,2,4,8,16", help="curvature refresh intervals k to measure")
    ap.add_argument("--out", default="bench-staleness", help="folder for the chart and the raw results")
    a = ap.parse_args()
    try:
        intervals = sorted({int(x) for x in a.intervals.split(",")})
        lrs = [float(x) for x in a.lrs.split(",")]
        warmups = [int(x) for x in a.warmups.split(",")]
    except ValueError as err:
        ap.error(f"a list of numbers is expected: {err}")
    if not intervals or intervals[0] < 1:
        ap.error("--intervals: refresh intervals are whole steps, at least 1")

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local

    cfg = bench_config(a.config, a.overrides)
    os.makedirs(a.out, exist_ok=True)
    if cfg.data.text != "synthetic":
        load_corpus(cfg.data, cfg.model.vocab_size)  # build the cache once, before the workers
    results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.seeds, a.eval_every, lrs, warmups, intervals,
                          timeout_s=6 * 3600)
    runs, _, last = merged_runs(results)
    target = baseline_target(runs)
    rows = curve(runs, target, intervals)
    b = last["baseline"]
    print()
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {a.steps} steps, {a.seeds} seeds, held-out "
          f"evaluation every {a.eval_every} steps; baseline AdamW lr {b['lr']:g}, warm-up {b['warmup_steps']} "
          f"(chosen on training loss); target held-out loss {target:.4f}")
    print("| refresh interval k | steps to target | / AdamW | / k = 1 | final held-out loss | seeds reaching |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['interval']} | {r['steps']:g} | {_fmt(r['vs_baseline'])} | {_fmt(r['vs_first'])} | "
              f"{r['final']:.4f} | {r['reached']}/{a.seeds} |")
    png = os.path.join(a.out, "staleness.png")
    chart(rows, png, f"{cfg.name}: steps to AdamW's final held-out loss, {a.steps} steps, {a.seeds} seeds")
    from pipefisher.safe_io import dump_json_atomic

    dump_json_atomic(os.path.join(a.out, "staleness.json"),
                     measured_curve(rows, cfg, a.config, a.steps, target, a.seeds, b).to_data(
                         baseline=b, sweep=last["sweep"], runs=runs, args=vars(a)))
    print(f"wrote {png} and {os.path.join(a.out, 'staleness.json')}")
    ks = ", ".join(str(r["interval"]) for r in rows)
    print(f"staleness (kfac steps-to-target / AdamW) at k = {ks}: "
          + ", ".join(_fmt(r["vs_baseline"]) for r in rows))


if __name__ == "__main__":
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:  # a bad config or --set: one line
        sys.exit(f"error: {err}")
