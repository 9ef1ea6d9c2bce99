#!/usr/bin/env python
"""Staleness, measured: steps to a target held-out loss when K-FAC's curvature is refreshed every k steps.

A K-FAC cycle of k pipeline iterations refreshes the curvature once every k steps. ``kfac`` mode with
``kfac.interval`` k does exactly that and nothing else (factors and inverses recomputed every k-th step,
the preconditioner reused in between), so it isolates what a longer cycle costs in convergence, apart
from any scheduling. Everything else is the convergence benchmark's race (``scripts/bench_convergence.py``,
whose sweep, target and table code this imports): the same model, data, seeds, two stages on one core
each, and the same tuning budget for every entrant. AdamW (``baseline``), Muon (``muon``) and K-FAC
(``kfac``, the preconditioned gradient fed to the config's optimizer) each get their own sweep of the
same size (peak lr x warm-up, seed 0, judged on training loss only: the held-out text chooses nothing).

K-FAC is swept once, at k = 1, and every k runs with that choice: the learning rate and warm-up are a
property of the optimizer (the preconditioned step and its scale), the interval only of how often its
curvature is refreshed, so a per-k sweep would mix the cost of staleness with a retuning that no packed
schedule does (the packer picks k after the lr is set), and would cost one sweep per k. ``--kfac-lrs``
gives K-FAC's list, as in the convergence benchmark.

The target is the best first-order optimizer's final held-out loss (median over seeds; the best: the
lower median), and the curve's ratios are K-FAC's steps to it over that optimizer's (medians over
seeds). Printed: a row per first-order optimizer (its sweep's choice, steps to target, final held-out
loss, step), ``muon step / adamw step`` (the objective multiplies the ratio by planned step over
first-order step: that stands for the best first-order optimizer's step only while their steps cost
alike), K-FAC's choice, then per k the median steps to target over the best first-order optimizer's,
over every other first-order optimizer's and over k = 1's, and the final held-out loss; the last line
``staleness (kfac steps-to-target / best first-order, NAME) at k = 1, 2, ...: ...``. ``--out`` gets
``staleness.png`` (steps to target against k) and ``staleness.json``: the job's staleness curve
(``pipefisher-staleness/2``, docs/formats.md) with its provenance (the config's digest, name and path,
model, data, horizon, target, seeds, the per-k spread of the steps over seeds, and ``relative_to``: the
best first-order optimizer, its lr and warm-up) and the sweeps, choices and raw runs beside it; every
command that packs takes it as ``--staleness FILE``. A run that never reaches the target counts as ``inf``.
Per other first-order optimizer the same table is printed against that optimizer's own final held-out
loss, written as ``staleness-<optim.name>.json`` (its ``relative_to`` says it is not the best) and drawn
beside the main curve: where no k reaches the best optimizer's target, the main curve is all ``inf`` and
decides nothing, and this one still says what each longer cycle costs; the chart's right panel gives K-FAC's final held-out loss per k beside every first-order
optimizer's.

    python scripts/bench_staleness.py [--config configs/small.yaml] [--steps 300] [--seeds 3]
        [--intervals 1,2,4,8,16] [--eval-every 10] [--lrs 5e-4,1e-3,2e-3] [--muon-lrs 2e-3,4e-3,8e-3]
        [--kfac-lrs 1e-3,2e-3,4e-3] [--warmups 0,30] [--modes baseline,muon,kfac] [--out bench-staleness/]
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, the convergence benchmark

from bench_convergence import (COLOURS, ENTRANTS, _median, _ratio, announcer, bench_config,  # noqa: E402
                               best_first_order, common_arguments, final_loss, loss_rank, merged_runs, race_arguments,
                               measured_run, race_config, race_sweeps, race_table, run_record, save_png,
                               start_worker, steps_and_time_to, sweep_race, SweptRun, trainer_of)

KEYS = ("baseline", "muon", "kfac")
"""The entrants of this race (the convergence benchmark's, but K-FAC in the bubbles: here k is set, not packed)."""


def _worker(config_path: str, overrides: list[str], steps: int, seeds: int, eval_every: int,
            sweeps: dict[str, list[float]], warmups: list[int], intervals: list[int]) -> dict[str, Any]:
    """Every entrant's sweep (K-FAC's at k = 1), then per seed every first-order optimizer and K-FAC at every k."""
    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "runs": []}
    try:
        swept: list[SweptRun] = []  # the sweeps' runs: seed 0's measured runs are their winners (bench_convergence)
        out["choices"], out["sweeps"] = sweep_race(train, base, steps, sweeps, warmups, announce,
                                                   bases={"kfac": base.replace(kfac={"interval": 1})},
                                                   swept=swept, evals=eval_every)
        for seed in range(seeds):  # per seed: the first-order optimizers, then every interval, interleaved
            for key in sweeps:
                choice = out["choices"][key]
                cfg = race_config(base, key, choice, seed)
                for k in intervals if key == "kfac" else [None]:
                    res, _, _ = measured_run(train, swept, cfg if k is None else cfg.replace(kfac={"interval": k}),
                                          ENTRANTS[key].mode, None, eval_every)
                    out["runs"].append(run_record(key, seed, res, **choice, **({} if k is None else {"interval": k})))
                    if res.val:
                        what = ENTRANTS[key].label if k is None else f"kfac every {k:2} steps"
                        announce(f"seed {seed} {what}: held-out {res.val[-1][1]:.4f} after {steps} steps")
    finally:
        shutdown(ctx)
    return out


def _steps_to(runs: list[dict[str, Any]], target: float) -> list[float]:
    """Each run's steps to ``target`` (``inf`` where it never got there)."""
    return [steps_and_time_to(r["val"], target)[0] for r in runs]


def first_order_steps(runs: list[dict[str, Any]], key: str, target: float) -> float:
    """The median steps to ``target`` of ``key``'s runs."""
    return _median(_steps_to([r for r in runs if r["mode"] == key], target))


def curve(runs: list[dict[str, Any]], target: float, intervals: list[int],
          relative_to: str | None = "baseline") -> list[dict[str, float]]:
    """Per interval k: the median steps to target of the kfac runs (and their least and most over the
    seeds); ``ratio``, that over ``relative_to``'s (the best first-order optimizer's; ``inf`` where
    either median seed never reached the target); ``vs_k1``, over k = 1's."""
    reference = first_order_steps(runs, relative_to, target) if relative_to else math.nan
    rows = []
    for k in intervals:
        mine = [r for r in runs if r["mode"] == "kfac" and r.get("interval") == k]
        each = _steps_to(mine, target)
        rows.append({"interval": k, "steps": _median(each), "steps_min": min(each, default=math.nan),
                     "steps_max": max(each, default=math.nan), "final": _median([r["val"][-1][1] for r in mine]),
                     "reached": sum(1 for x in each if not math.isinf(x))})
    first = rows[0]["steps"] if rows else math.nan
    for row in rows:
        row["ratio"] = row["steps"] / reference if math.isfinite(reference) and reference and math.isfinite(row["steps"]) \
            else math.inf
        row["vs_k1"] = row["steps"] / first if math.isfinite(first) and first and math.isfinite(row["steps"]) else math.inf
    return rows


def staleness_race(runs: list[dict[str, Any]], intervals: list[int]) -> tuple[str | None, float, list[dict[str, float]]]:
    """(the best first-order optimizer, the target: its median final held-out loss, :func:`curve`'s rows
    relative to it): the convergence benchmark's target, one definition."""
    best = best_first_order(runs)
    target = final_loss(runs, best) if best else math.nan
    return best, target, curve(runs, target, intervals, best)


def own_target_curves(runs: list[dict[str, Any]], intervals: list[int],
                      others: list[str]) -> dict[str, tuple[float, list[dict[str, float]]]]:
    """Per first-order optimizer that is not the best: (its own median final held-out loss, :func:`curve`'s
    rows against that target and its steps). Where no k reaches the best one's target, every ratio of the
    main curve is ``inf`` and tells the packer nothing; against a target K-FAC does reach, the curve still
    says what each longer cycle costs."""
    out = {}
    for key in others:
        target = final_loss(runs, key)
        out[key] = (target, curve(runs, target, intervals, key))
    return out


def relative_to_text(best: str, choice: Mapping[str, Any], finals: Mapping[str, float], *, is_best: bool = True) -> str:
    """The curve's ``relative_to``: the first-order optimizer (its ``optim.name``) it is relative to, its lr and
    warm-up, and the median final held-out losses the best was chosen by (``finals``: per first-order key).
    ``is_best=False``: a curve against that optimizer's own final loss, though another did better."""
    names = "; ".join(f"{ENTRANTS[k].optim['name']} {f:.4f}" for k, f in finals.items())
    why = ("the best first-order optimizer by median final held-out loss" if is_best else
           "not the best first-order optimizer: the target is its own median final held-out loss")
    return (f"{ENTRANTS[best].optim['name']} lr {choice['lr']:g}, warm-up {choice['warmup_steps']} steps ({why}"
            + (f": {names}" if names else "") + "; each optimizer the best of its own sweep, on training loss)")


def measured_curve(rows: list[dict[str, float]], cfg: Any, config_path: str, steps: int, target: float, seeds: int,
                   relative_to: str) -> Any:
    """The job's :class:`~pipefisher.cost.staleness.StalenessCurve` from :func:`curve`'s rows, with where it was
    measured: the config's digest (:meth:`RunConfig.fingerprint` without the layout), name and path, model,
    data, horizon, target, seeds, the per-k spread over seeds, and the optimizer it is relative to
    (:func:`relative_to_text`)."""
    from pipefisher.cost.staleness import Provenance, StalenessCurve

    m, d = cfg.model, cfg.data
    provenance = Provenance(
        config_digest=cfg.fingerprint(layout=False), config_name=cfg.name, config_path=config_path,
        model=f"{m.builder}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, vocab "
              f"{m.vocab_size}" + (f", from {m.pretrained}" if m.pretrained else ""),
        data=f"{d.text} ({d.tokenizer} tokens, {d.objective}), {d.num_micro_batches} micro-batches of "
             f"{d.micro_batch_size} x {d.seq_len} tokens per step",
        horizon=steps, target=target, seeds=seeds, relative_to=relative_to)
    return StalenessCurve(tuple((float(r["interval"]), r["ratio"]) for r in rows), provenance=provenance,
                          spread=tuple((r["steps_min"], r["steps"], r["steps_max"]) for r in rows))


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) or math.isnan(x) else f"{x:.3f}"


def chart(rows: list[dict[str, float]], path: str, title: str, best: str, others: Mapping[str, float],
          finals: Mapping[str, float], own: Mapping[str, list[dict[str, float]]] | None = None) -> None:
    """Left: steps to target over the best first-order optimizer's against k; a dashed line per first-order
    optimizer at its own steps over the best's (``others``: per other first-order key, where finite); per
    other optimizer in ``own`` (:func:`own_target_curves`' rows), K-FAC's steps to that optimizer's own final
    loss over its steps, a thinner line. Right: K-FAC's final held-out loss against k, a line per
    first-order optimizer at its own (``finals``), which still shows the race where no k reaches the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(11.5, 4.2))
    right.plot([r["interval"] for r in rows], [r["final"] for r in rows], "o-", color=COLOURS["kfac"], lw=1.6,
               label="K-FAC, curvature every k steps")
    for key, y in finals.items():
        right.axhline(y, color=COLOURS[key], ls="--" if key == best else ":", lw=1, label=ENTRANTS[key].label)
    right.set_xscale("log", base=2)
    right.set_xticks([r["interval"] for r in rows], [str(r["interval"]) for r in rows])
    right.set_xlabel("refresh interval k")
    right.set_ylabel("final held-out loss, median over seeds")
    right.grid(alpha=0.3)
    right.legend(loc="best")
    ks = [r["interval"] for r in rows if not math.isinf(r["ratio"])]
    ys = [r["ratio"] for r in rows if not math.isinf(r["ratio"])]
    ax.plot(ks, ys, "o-", color=COLOURS["kfac"], lw=1.6, label="K-FAC, curvature every k steps")
    ax.axhline(1.0, color=COLOURS[best], ls="--", lw=1, label=f"{ENTRANTS[best].label} (best first-order)")
    for key, y in others.items():
        ax.axhline(y, color=COLOURS[key], ls=":", lw=1, label=ENTRANTS[key].label)
    for key, own_rows in (own or {}).items():
        reached = [(r["interval"], r["ratio"]) for r in own_rows if not math.isinf(r["ratio"])]
        ax.plot([k for k, _ in reached], [y for _, y in reached], "s:", color=COLOURS["kfac"], lw=1, alpha=0.7,
                label=f"K-FAC to {ENTRANTS[key].label}'s own final loss / {ENTRANTS[key].label}'s steps")
        for k, y in reached:
            ax.annotate(f"{y:.2f}", (k, y), textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)
    for k, y in zip(ks, ys):
        ax.annotate(f"{y:.2f}", (k, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    missed = [r["interval"] for r in rows if math.isinf(r["ratio"])]
    if missed:
        ax.set_xlabel(f"refresh interval k (never reached the target: k = {', '.join(map(str, missed))})")
    else:
        ax.set_xlabel("refresh interval k (steps between curvature refreshes)")
    ax.set_xscale("log", base=2)
    ax.set_xlim(rows[0]["interval"] / 1.5, rows[-1]["interval"] * 1.5)  # also when no k reached the target
    ax.set_xticks([r["interval"] for r in rows], [str(r["interval"]) for r in rows])
    ax.set_ylabel(f"steps to target / {ENTRANTS[best].label}'s" if not own else "steps to target / the optimizer's")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)


def main() -> None:
    ap = common_arguments(__doc__.splitlines()[0], packs=False)
    race_arguments(ap, KEYS, required=("kfac",))
    ap.add_argument("--intervals", default="1,2,4,8,16", help="curvature refresh intervals k to measure")
    ap.add_argument("--out", default="bench-staleness", help="folder for the chart and the raw results")
    a = ap.parse_args()
    sweeps, warmups = race_sweeps(ap, a, KEYS, required=("kfac",))
    try:
        intervals = sorted({int(x) for x in a.intervals.split(",")})
    except ValueError as err:
        ap.error(f"--intervals: a list of whole numbers is expected: {err}")
    if not intervals or intervals[0] < 1:
        ap.error("--intervals: refresh intervals are whole steps, at least 1")

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local

    cfg = bench_config(a.config, a.overrides)
    os.makedirs(a.out, exist_ok=True)
    if cfg.data.text != "synthetic":
        load_corpus(cfg.data, cfg.model.vocab_size)  # build the cache once, before the workers
    results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.seeds, a.eval_every, sweeps, warmups, intervals,
                          timeout_s=6 * 3600)
    runs, _, last = merged_runs(results)
    best, target, rows = staleness_race(runs, intervals)
    assert best is not None, "race_sweeps keeps a first-order optimizer in the race"
    first_order = race_table(runs, target, tuple(k for k in sweeps if ENTRANTS[k].first_order))
    choices = last["choices"]
    sizes = ", ".join(f"{k} {len(v)} lrs x {len(warmups)} warm-ups" for k, v in sweeps.items())
    print()
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {a.steps} steps, {a.seeds} seeds, held-out "
          f"evaluation every {a.eval_every} steps; each optimizer's peak lr and warm-up chosen by its own sweep on "
          f"training loss ({sizes}; K-FAC's at k = 1, kept for every k); K-FAC's base optimizer {cfg.optim.name}")
    print(f"target held-out loss: {target:.4f} (median of the best first-order optimizer's final held-out loss: "
          f"{ENTRANTS[best].label}; " + ", ".join(f"{ENTRANTS[k].label} {t['final']:.4f}" for k, t in first_order.items())
          + ")")
    print("| first-order optimizer | peak lr, warm-up | steps to target | final held-out loss | step (ms) | seeds reaching |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key, t in first_order.items():
        print(f"| {ENTRANTS[key].label}{' (best)' if key == best else ''} | {t['lr']:g}, {t['warmup_steps']:g} | "
              f"{t['steps']:g} | {t['final']:.4f} | {t['step_ms']:.1f} | {t['reached']}/{a.seeds} |")
    steps_of = {key: t["mean_step_ms"] for key, t in first_order.items()}
    print(f"muon step / adamw step: {_ratio(steps_of.get('muon', math.nan), steps_of.get('baseline', math.nan))} "
          "(mean step after step 0, median over seeds, measured in this run; the objective's first-order step "
          "stands for the best first-order optimizer's while this is near 1)")
    kfac = choices["kfac"]
    print(f"K-FAC: lr {kfac['lr']:g}, warm-up {kfac['warmup_steps']} (the best training loss of its own sweep, at "
          "k = 1; every k runs with it)")
    others = [k for k in first_order if k != best]
    print(f"| refresh interval k | steps to target | / {ENTRANTS[best].label} (best first-order) | "
          + "".join(f"/ {ENTRANTS[k].label} | " for k in others) + "/ k = 1 | final held-out loss | seeds reaching |")
    print("| --- " * (6 + len(others)) + "|")
    for r in rows:
        print(f"| {r['interval']} | {r['steps']:g} | {_fmt(r['ratio'])} | "
              + "".join(f"{_ratio(r['steps'], first_order[k]['steps'])} | " for k in others)
              + f"{_fmt(r['vs_k1'])} | {r['final']:.4f} | {r['reached']}/{a.seeds} |")
    png = os.path.join(a.out, "staleness.png")
    best_steps = first_order[best]["steps"]
    lines = {k: first_order[k]["steps"] / best_steps for k in others
             if math.isfinite(first_order[k]["steps"]) and math.isfinite(best_steps) and best_steps}
    finals = {k: t["final"] for k, t in first_order.items()}
    own_curves = own_target_curves(runs, intervals, others)
    chart(rows, png, f"{cfg.name}: steps to {ENTRANTS[best].label}'s final held-out loss, {a.steps} steps, "
                     f"{a.seeds} seeds", best, lines, finals, {k: r for k, (_, r) in own_curves.items()})
    from pipefisher.safe_io import dump_json_atomic

    relative_to = relative_to_text(best, choices[best], finals)
    written = [os.path.join(a.out, "staleness.json")]
    dump_json_atomic(written[0], measured_curve(rows, cfg, a.config, a.steps, target, a.seeds, relative_to).to_data(
        best_first_order=best, choices=choices, sweeps=last["sweeps"], first_order=first_order, runs=runs,
        args=vars(a)))
    for key, (own, own_rows) in own_curves.items():
        name = ENTRANTS[key].optim["name"]
        print(f"against {ENTRANTS[key].label}'s own target, its final held-out loss {own:.4f} (steps to it: "
              f"{first_order_steps(runs, key, own):g}):")
        print("| refresh interval k | steps to it | / " + ENTRANTS[key].label + " | / k = 1 | seeds reaching |")
        print("| --- | --- | --- | --- | --- |")
        for r in own_rows:
            print(f"| {r['interval']} | {r['steps']:g} | {_fmt(r['ratio'])} | {_fmt(r['vs_k1'])} | {r['reached']}/{a.seeds} |")
        written.append(os.path.join(a.out, f"staleness-{name}.json"))
        dump_json_atomic(written[-1], measured_curve(own_rows, cfg, a.config, a.steps, own, a.seeds, relative_to_text(
            key, choices[key], finals, is_best=False)).to_data(best_first_order=best, choices=choices, args=vars(a)))
    print(f"wrote {png} and {' and '.join(written)}")
    ks = ", ".join(str(r["interval"]) for r in rows)
    print(f"staleness (kfac steps-to-target / best first-order, {ENTRANTS[best].optim['name']}) at k = {ks}: "
          + ", ".join(_fmt(r["ratio"]) for r in rows))


if __name__ == "__main__":
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:  # a bad config or --set: one line
        sys.exit(f"error: {err}")
