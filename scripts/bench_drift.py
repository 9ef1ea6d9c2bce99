#!/usr/bin/env python
"""The closed loop's drift rule, checked against measured staleness curves.

AdamW, the default policy's static schedule and the adaptive run whose cycle k follows the run's own
curvature drift, in one run, same seeds.

Everything else is the convergence benchmark's (``scripts/bench_convergence.py``): the model, data and
seeds, two stages on one core each, the AdamW sweep chosen on training loss only, the target (the median
over seeds of the chosen AdamW's final held-out loss). The same two worker processes run:

1. a profile of a few ``kfac`` steps, packed with the default policy and no staleness curve
   (``static``: that schedule for the whole run);
2. the AdamW sweep (seed 0);
3. per seed: AdamW, ``static`` and ``adaptive`` (``--adapt --adapt-drift`` from the same schedule and profile, no curve:
   :class:`pipefisher.loop.drift.DriftRule` sets k from every refresh's curvature aging), interleaved; seed 0's
   AdamW run is the sweep's winning run (evaluated as the others), not trained twice.

Printed: per run the k it settles at (the last schedule's; the adaptive runs' k history and the k most of
their steps ran at too), steps and training time to the target (medians over seeds; evaluations
excluded), the drift and aging measured at each k, and
with ``--staleness FILE|k:r,...`` (a curve ``scripts/bench_staleness.py`` measured, its
``staleness.json``, or ``k:ratio`` pairs) whether the settled k lies where that curve is within 10 % of
its value at k = 1. The last line: ``drift rule: settled k = K (static k = S); time-to-target
adaptive/static: X; ...``. ``--out`` gets ``drift.json`` (every run, its refreshes and k history).

``--calibrate 1,2,4,8`` instead runs ``kfac`` mode with ``kfac.interval`` k (the curvature refreshed every
k steps, nothing else changed) for each k and seed, and prints the drift and the aging of the refreshes
per k and per quarter of the run: the figures the rule's thresholds (:data:`pipefisher.loop.drift.AGING_LOW`,
:data:`~pipefisher.loop.drift.AGING_HIGH`) are read from.

``--replay DRIFT_JSON`` instead replays the rule offline on the refreshes a run of this script recorded
(its ``drift.json``) and prints the k it chooses at each refresh (:func:`replay`). Copies of the script can
run side by side under ``taskset -c 0,1`` / ``taskset -c 2,3``: every worker pins itself to its rank's core
among those its process was given; give each its own ``--out``.

    python scripts/bench_drift.py [--config configs/small.yaml] [--steps 300] [--seeds 3] [--eval-every 10]
        [--lrs 5e-4,1e-3,2e-3] [--warmups 0,30] [--staleness FILE|k:r,...] [--out bench-drift/]
    python scripts/bench_drift.py --calibrate 1,2,4,8 --steps 200 --seeds 1 --set optim.decay_steps=300
    python scripts/bench_drift.py --replay bench-drift/drift.json [--floor K]
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, the convergence benchmark

from pipefisher.errors import InputError  # noqa: E402

from bench_convergence import (ENTRANTS, _median, announcer, baseline_target, bench_config,  # noqa: E402
                               choose_baseline, common_arguments, loss_rank, measured_run, merged_runs,
                               profile_and_pack, race_table, run_record, start_worker, SweptRun, trainer_of)

RUNS = ("baseline", "static", "adaptive")
WITHIN = 0.10
"""The settled k should lie where the measured curve is within this fraction of its k = 1 value."""


def _refreshes(trainer: Any) -> list[list[Any]]:
    """The run's curvature refreshes: [step, drift, aging (None without a refresh two back)]."""
    return [[s, r.drift, r.aging] for s, r in sorted(trainer.refreshes.items())]


def _k_history(trainer: Any) -> list[list[Any]]:
    """[first step, job cycle k, why] of every schedule the run used."""
    return [[sw.step, max(sw.plan.cycles), sw.plan.reason] for sw in trainer.loop.history]


def _worker(config_path: str, overrides: list[str], steps: int, seeds: int, eval_every: int, lrs: list[float],
            warmups: list[int], profile_steps: int, calibrate: list[int], folder: str) -> dict[str, Any]:
    from pipefisher.runtime.job.dist import shutdown

    base, rank, ctx = start_worker(config_path, overrides)
    train = trainer_of(ctx, steps, eval_every)
    announce = announcer(rank, base)
    out: dict[str, Any] = {"rank": rank, "holds_loss": rank == loss_rank(base), "runs": [], "sweep": []}
    try:
        if calibrate:
            for seed in range(seeds):
                for k in calibrate:
                    cfg = base.replace(kfac={"interval": k}, data={"seed": seed})
                    trainer, res = train(cfg, "kfac", evals=0)
                    out["runs"].append(run_record("kfac", seed, res, interval=k, drift=_refreshes(trainer)))
                    announce(f"seed {seed} kfac every {k:2} steps: {len(trainer.refreshes)} refreshes")
            return out
        sched, out["plan"] = profile_and_pack(base, ctx, rank, folder, profile_steps, steps)  # no curve
        swept: list[SweptRun] = []  # the sweep's runs: seed 0's AdamW run is its winner (bench_convergence.swept_run)
        lr, warm, out["sweep"] = choose_baseline(train, base, steps, lrs, warmups, announce, swept, eval_every)
        out["baseline"] = {"lr": lr, "warmup_steps": warm}
        for seed in range(seeds):  # per seed: the three runs, interleaved
            cfg = base.replace(optim={**ENTRANTS["baseline"].optim, "lr": lr, "warmup_steps": warm}, data={"seed": seed})
            for run in RUNS:
                if run == "baseline":
                    res, _, _ = measured_run(train, swept, cfg, "first-order", None, eval_every)
                    out["runs"].append(run_record(run, seed, res))
                else:
                    # the drift rule is opt-in (docs/adapt.md): this benchmark is its validation, so it asks for it
                    trainer, res = train(cfg, "scheduled", schedule=sched, adapt=run == "adaptive",
                                         adapt_drift=run == "adaptive")
                    out["runs"].append(run_record(run, seed, res, k=max(trainer.cycles), ks=_k_history(trainer),
                                                  drift=_refreshes(trainer)))
                if res.val:
                    announce(f"seed {seed} {run:8}: held-out {res.val[-1][1]:.4f} after {steps} steps"
                             + (f", k = {max(trainer.cycles)}" if run != "baseline" else ""))
    finally:
        shutdown(ctx)
    return out


def staleness_curve(text: str) -> Any:
    """``--staleness``: a curve ``scripts/bench_staleness.py`` measured (its ``staleness.json``) or
    ``k:ratio`` pairs (:func:`pipefisher.cost.staleness.read_staleness`). A file whose ratios to AdamW are
    unusable (AdamW never reached its own median target, so they read 0) is read relative to its k = 1,
    which is all the check against k = 1 needs: its ``vs_first`` (format 1) or its median steps (format 2)."""
    from pipefisher.cost.staleness import StalenessCurve, read_staleness
    from pipefisher.safe_io import load_json

    try:
        return read_staleness(text)
    except InputError as err:
        if not os.path.isfile(text):
            raise InputError(text, "no such staleness curve file, nor k:ratio pairs (--staleness)") from None
        data = load_json(text)
        rows = data.get("curve") if isinstance(data, dict) else None
        try:
            old = [(float(r["interval"]), r["vs_first"]) for r in rows]
            points = tuple((k, math.inf if v is None else float(v)) for k, v in old)
        except (KeyError, TypeError, ValueError):
            try:
                med = [(float(r["k"]), r["steps_median"]) for r in rows]
                first = float(med[0][1])
                points = tuple((k, math.inf if v is None else float(v) / first) for k, v in med)
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
                raise err from None
        return StalenessCurve(points, source=f"{text} (relative to its k = 1)")


def within(curve: Any, k: int) -> tuple[bool, str]:
    """Whether ``curve`` at ``k`` is within :data:`WITHIN` of its value at k = 1, and the figures."""
    first, here = curve.at(1), curve.at(k)
    rel = here / first - 1 if first and not math.isinf(here) else math.inf
    return rel <= WITHIN + 1e-12, (f"the curve at k = {k}: {here:.3f} against {first:.3f} at k = 1 "
                                   + ("(never reached)" if math.isinf(rel) else f"({rel:+.1%})"))


def _fmt(x: float, digits: int = 1) -> str:
    return "inf" if math.isinf(x) or math.isnan(x) else f"{x:.{digits}f}"


def _summary(values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return "- | -"
    return (f"{statistics.median(values):.3f} | {values[len(values) // 10]:.3f}-"
            f"{values[min(len(values) - 1, len(values) * 9 // 10)]:.3f}")


def calibration_report(runs: list[dict[str, Any]], steps: int) -> list[str]:
    """Per k: the refreshes' drift and aging, their medians (p10-p90) over the run and per quarter of it."""
    lines = ["| refresh interval k | refreshes | drift median | p10-p90 | aging median | p10-p90 | drift by quarter "
             "| aging by quarter |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k in sorted({r["interval"] for r in runs}):
        pts = [x for r in runs if r["interval"] == k for x in r["drift"]]

        def quarters(i: int) -> str:
            cut = [[x[i] for x in pts if q * steps / 4 <= x[0] < (q + 1) * steps / 4 and x[i] is not None]
                   for q in range(4)]
            return ", ".join(f"{statistics.median(v):.3f}" if v else "-" for v in cut)
        lines.append(f"| {k} | {len(pts)} | {_summary([x[1] for x in pts])} | "
                     f"{_summary([x[2] for x in pts if x[2] is not None])} | {quarters(1)} | {quarters(2)} |")
    return lines


def _k_at(ks: list[list[Any]], step: int) -> int:
    """The k of the schedule that ran ``step`` (``ks``: [first step, k, why] of every schedule used)."""
    return next(k for s, k, _ in reversed(ks) if s <= step)


def _most_steps(ks: list[list[Any]], steps: int) -> int:
    """The k the most steps of the run (from step 1) ran at."""
    count: dict[int, int] = {}
    for s in range(1, steps):
        count[_k_at(ks, s)] = count.get(_k_at(ks, s), 0) + 1
    return max(count, key=lambda k: (count[k], -k))


def replay(drift: list[list[Any]], ks: list[list[Any]], rule: Any) -> list[tuple[int, float | None, bool, int]]:
    """The drift rule replayed on a run's recorded refreshes (``drift``: [step, drift, aging]; ``ks``: the
    k history, [first step, k, why]): per refresh at the rule's k, (step, aging, whether it counted, the k
    the rule runs after it). A refresh counts as the scheduler counts it: where the run had run its
    schedule for the two cycles before it (after any switch, a repair at the same k too, the refreshes
    one and two back were not k and 2k steps before). The replay ends where the run's k and the rule's
    part: what followed was measured at a k the rule would not have run."""
    rows: list[tuple[int, float | None, bool, int]] = []
    for step, _, aging in drift:
        k = _k_at(ks, step)
        if k != rule.cycle:
            break
        counts = aging is not None and step >= max(s for s, _, _ in ks if s <= step) + 2 * k
        if counts:
            rule.observe(aging)
            proposal = rule.proposal()
            if proposal is not None:
                rule.moved(proposal[0])
        rows.append((step, aging, counts, rule.cycle))
    return rows


def replay_report(data: dict[str, Any], floor: int | None) -> list[str]:
    """``--replay``: the rule on every scheduled run of a ``drift.json`` this script wrote, from the run's
    first k, never below ``floor`` (default: the static schedule's k, the densest packing in the runs so
    far) nor beyond the longest cycle of the run's length."""
    from pipefisher.loop.drift import DriftRule, longest_cycle

    steps = int(data["args"]["steps"])
    runs = [r for r in data["runs"] if r.get("ks")]
    static = [r["k"] for r in runs if r["mode"] == "static"]
    floor = floor or (min(static) if static else 1)
    lines = [f"the drift rule replayed on {len(runs)} recorded run(s) of {steps} steps, never below k = {floor} "
             f"nor beyond k = {longest_cycle(steps)}; per refresh step:aging (in brackets: not counted, its "
             "refreshes before ran another schedule), -> the k the rule chose where it changed"]
    for r in runs:
        first = r["ks"][0][1]
        rule = DriftRule(first, max_cycle=longest_cycle(steps), floor=floor)
        rows = replay(r["drift"], r["ks"], rule)
        end = rows[-1][0] if rows else 0
        moves = [(s, k) for (s, _, _, k), before in zip(rows, [first] + [x[3] for x in rows]) if k != before]
        chose = ", ".join(f"k = {k} after step {s}" for s, k in moves) if moves else f"held k = {first}"
        parted = next((f"; the run measured on at k = {_k_at(r['ks'], s)} (from step "
                       f"{max(b for b, _, _ in r['ks'] if b <= s)}), the rule would have run k = {rule.cycle}"
                       for s, _, _ in r["drift"] if s > end), "")
        lines.append(f"  {r['mode']} seed {r['seed']}: {chose} through step {end} ({rule.evidence}){parted}")
        shown = [(f"{s}:{a:.2f}" if counted else f"({s}:{a:.2f})") + (f"->{k}" if (s, k) in moves else "")
                 for s, a, counted, k in rows if a is not None]
        lines += ["    " + " ".join(shown[i:i + 12]) for i in range(0, len(shown), 12)]
    return lines


def main() -> None:
    ap = common_arguments(__doc__.splitlines()[0], packs=False)  # the static schedule is packed without a curve
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="kfac steps profiled before packing (default 10; their median step is packed)")
    ap.add_argument("--staleness", default=None, metavar="FILE|k:r,...",
                    help="a measured staleness curve to check the settled k against (staleness.json of "
                         "scripts/bench_staleness.py, or k:ratio pairs such as 1:0.718,2:0.718,4:0.769)")
    ap.add_argument("--calibrate", default="", metavar="K,K,...",
                    help="instead: kfac runs with the curvature refreshed every k steps, and their drift per k")
    ap.add_argument("--out", default="bench-drift", help="folder for the raw results (drift.json)")
    ap.add_argument("--replay", default=None, metavar="DRIFT_JSON",
                    help="instead: replay the drift rule on the refreshes a run of this script recorded (its "
                         "drift.json), and print the k it would have chosen at each refresh; no training")
    ap.add_argument("--floor", type=int, default=None,
                    help="--replay: the densest packing's cycle, below which the rule never goes (default: "
                         "the recorded static schedule's k)")
    a = ap.parse_args()
    if a.replay:
        from pipefisher.safe_io import load_json

        if a.floor is not None and a.floor < 1:
            ap.error("--floor: a cycle of at least 1 step")

        if not os.path.isfile(a.replay):
            raise InputError(a.replay, "no such file (--replay: a drift.json of scripts/bench_drift.py)")
        try:
            lines = replay_report(load_json(a.replay), a.floor)
        except (KeyError, TypeError, ValueError, IndexError, StopIteration):
            raise InputError(a.replay, "not a drift.json of scripts/bench_drift.py (--replay)") from None
        print("\n".join(lines))
        return
    try:
        lrs = [float(x) for x in a.lrs.split(",")]
        warmups = [int(x) for x in a.warmups.split(",")]
        calibrate = sorted({int(x) for x in a.calibrate.split(",")}) if a.calibrate else []
    except ValueError as err:
        ap.error(f"a list of numbers is expected: {err}")
    if calibrate and calibrate[0] < 1:
        ap.error("--calibrate: refresh intervals are whole steps, at least 1")
    curve = staleness_curve(a.staleness) if a.staleness else None  # a bad curve: one line, before any work

    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.launch.local import spawn_local
    from pipefisher.safe_io import dump_json_atomic

    cfg = bench_config(a.config, a.overrides)
    os.makedirs(a.out, exist_ok=True)
    if cfg.data.text != "synthetic":
        load_corpus(cfg.data, cfg.model.vocab_size)  # build the cache once, before the workers
    with tempfile.TemporaryDirectory(prefix="pipefisher-drift-") as folder:
        results = spawn_local(_worker, 2, a.config, a.overrides, a.steps, a.seeds, a.eval_every, lrs, warmups,
                              a.profile_steps, calibrate, folder, timeout_s=6 * 3600)
    last = next(r for r in results if r["holds_loss"])
    print()
    if calibrate:
        runs = next(r for r in results if r["rank"] == 0)["runs"]  # every worker gathers the same refreshes
        print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, kfac with the curvature refreshed every k "
              f"steps, {a.steps} steps, {a.seeds} seed(s); drift of each refresh (relative change of the "
              "preconditioned gradient)")
        for line in calibration_report(runs, a.steps):
            print(line)
        dump_json_atomic(os.path.join(a.out, "calibration.json"), {"runs": runs, "args": vars(a)})
        print(f"wrote {os.path.join(a.out, 'calibration.json')}")
        return
    runs, first, _ = merged_runs(results)
    target = baseline_target(runs)
    table: dict[str, dict[str, Any]] = race_table(runs, target, RUNS)
    for run, t in table.items():
        mine = [r for r in runs if r["mode"] == run]
        t.update(k=[r.get("k") for r in mine], k_most=[_most_steps(r["ks"], a.steps) for r in mine if "ks" in r])
    b = last["baseline"]
    print(f"config {os.path.basename(a.config)}, 2 stages x 1 core, {a.steps} steps, {a.seeds} seed(s), held-out "
          f"evaluation every {a.eval_every} steps; AdamW lr {b['lr']:g}, warm-up {b['warmup_steps']} (chosen on "
          f"training loss, for every run); static: policy '{first['plan']['policy']}', no staleness curve")
    print(f"target held-out loss: {target:.4f} (median of AdamW's final held-out loss)")
    print("| run | k settled (most steps), per seed | steps to target | time to target (s) | / AdamW time | "
          "final held-out loss | mean step (ms) | seeds reaching |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in RUNS:
        t = table[run]
        ks = "-" if run == "baseline" else ", ".join(f"{k} ({m})" for k, m in zip(t["k"], t["k_most"]))
        ratio = t["seconds"] / table["baseline"]["seconds"] if table["baseline"]["seconds"] else math.inf
        print(f"| {run} | {ks} | {_fmt(t['steps'], 0)} | {_fmt(t['seconds'])} | {_fmt(ratio, 3)} | {t['final']:.4f} "
              f"| {t['mean_step_ms']:.1f} | {t['reached']}/{a.seeds} |")
    print("k history of the adaptive runs (first step: k), and why each schedule took over:")
    for r in runs:
        if r["mode"] == "adaptive":
            print(f"  seed {r['seed']}: " + ", ".join(f"{s}: {k}" for s, k, _ in r["ks"]))
            for s, k, why in r["ks"][1:]:
                print(f"    step {s}, k = {k}: {why}")
    print("per refresh, median drift / aging by the k it was measured at (refreshes):")
    for run in ("static", "adaptive"):
        by_k: dict[int, list[list[Any]]] = {}
        for r in (x for x in runs if x["mode"] == run):
            for x in r["drift"]:
                by_k.setdefault(_k_at(r["ks"], x[0]), []).append(x)
        print(f"  {run}: " + ", ".join(
            f"k = {k}: {statistics.median(x[1] for x in v):.3f} / "
            + (f"{statistics.median(x[2] for x in v if x[2] is not None):.3f}" if any(x[2] is not None for x in v)
               else "-") + f" ({len(v)})" for k, v in sorted(by_k.items())))
    settled = int(_median([float(k) for k in table["adaptive"]["k"]]))
    most = int(_median([float(k) for k in table["adaptive"]["k_most"]]))
    static_k = int(_median([float(k) for k in table["static"]["k"]]))
    verdict = ""
    if curve is not None:
        print(f"against the staleness curve {curve.source}:")
        for run in ("static", "adaptive"):
            for seed, (k, m) in enumerate(zip(table[run]["k"], table[run]["k_most"])):
                for what, kk in (("settled", k), ("most steps", m)) if run == "adaptive" else (("k", k),):
                    ok, text = within(curve, kk)
                    print(f"  {run} seed {seed} {what}: {text}: within {WITHIN:.0%} of k = 1: {'yes' if ok else 'no'}")
        ok, text = within(curve, settled)
        ok_most, _ = within(curve, most)
        verdict = (f"; {text}: within {WITHIN:.0%} of k = 1: {'yes' if ok else 'no'} (k = {most}, most steps: "
                   f"{'yes' if ok_most else 'no'})")
    dump_json_atomic(os.path.join(a.out, "drift.json"),
                     {"target": target, "table": table, "baseline": b, "sweep": last["sweep"], "runs": runs,
                      "plan": first["plan"], "args": vars(a)})
    print(f"wrote {os.path.join(a.out, 'drift.json')}")
    t_ad, t_st = table["adaptive"]["seconds"], table["static"]["seconds"]
    ratio = _fmt(t_ad / t_st, 3) if t_st and not math.isinf(t_st) else "inf"
    print(f"drift rule: settled k = {settled}, most steps at k = {most} (static k = {static_k}); time-to-target "
          f"adaptive/static: {ratio}{verdict}")


if __name__ == "__main__":
    from pipefisher.errors import InputError

    try:
        main()
    except InputError as err:  # a bad config, --set or --staleness: one line
        sys.exit(f"error: {err}")
