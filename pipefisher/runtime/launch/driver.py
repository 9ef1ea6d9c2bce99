"""The whole loop in one call, like a job driver: profile, pack, report, check, train with the schedule.

Everything a run makes goes into one folder, every name prefixed by the run's name so that several
runs sit side by side; :mod:`pipefisher.runtime.job.files` decides every name (:class:`RunPaths`).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import statistics
import time
from typing import Any, Callable

from pipefisher.errors import InputError
from pipefisher.runtime.job.config import BEST_PIECES, RunConfig
from pipefisher.runtime.job.files import RUN_CHECKPOINTS, RunPaths
from pipefisher.safe_io import load_json

logger = logging.getLogger(__name__)

_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def run_paths(folder: str, cfg: RunConfig, policy: str, name: str | None = None,
              now: Callable[[], float] = time.time) -> RunPaths:
    """Where a run's files go. An explicit ``name`` must be new in ``folder``; the default name
    ``{config}-{policy}-{YYYYmmdd-HHMMSS}`` gets a ``-2``, ``-3``, ... suffix if that one is taken."""
    folder = os.path.normpath(folder)  # the paths it prints read cleanly ('runs/x', not 'runs//x')
    if name is not None:
        if not _NAME_OK.match(name):
            raise InputError(None, f"run name '{name}' must be letters, digits, '.', '_' or '-'")
        paths = RunPaths(folder, name)
        if paths.taken():
            raise InputError(folder, f"already holds a run named '{name}'; choose another --name")
        return paths
    base = f"{cfg.name}-{policy}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now()))}"
    paths, n = RunPaths(folder, base), 1
    while paths.taken():
        n += 1
        paths = RunPaths(folder, f"{base}-{n}")
    return paths


def config_yaml(cfg: RunConfig) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(cfg.to_dict(), default=list)), sort_keys=False)


def keep_only_timelines(paths: RunPaths, name: str) -> None:
    """The profiling trainer writes its ``<name>_losses.json`` (and tokenizer, and every node's raw
    ``<name>_node<i>_steps.pickle``) into its output folder, the timelines': move them out, so that the
    folder holds node files only and ``pipefisher schedule <run>_timelines/*`` reads one job. The
    tokenizer is the run's own already; the raw steps go to ``<run>_profile_steps/``."""
    profiled = RunPaths(paths.timelines, name)  # the profiling trainer's --out
    steps = re.compile(re.escape(name) + r"_node\d+_steps\.pickle")
    for entry in sorted(os.listdir(paths.timelines)) if os.path.isdir(paths.timelines) else []:
        if steps.fullmatch(entry):
            os.makedirs(paths.profile_steps_dir, exist_ok=True)
            os.replace(os.path.join(paths.timelines, entry), os.path.join(paths.profile_steps_dir, entry))

    losses = profiled.losses
    if os.path.exists(losses):
        os.replace(losses, paths.profile_losses)
    tokenizer = profiled.tokenizer
    if os.path.exists(tokenizer):
        os.replace(tokenizer, paths.tokenizer)  # the same corpus's tokenizer: one copy, where the run keeps it


def runtime_refusal(schedule_path: str, cfg: RunConfig, replicas: int) -> str | None:
    """Why the runtime would refuse this schedule file (the check every worker makes), or None.

    ``--allow-invalid`` lets a run train a schedule that ``validate`` rejects, but never one the runtime
    cannot execute (a covariance piece before its micro-batch is saved, say): that would stop every worker.
    """
    from pipefisher.runtime.pipeline.checks import load_checked_schedule

    try:
        load_checked_schedule(schedule_path, cfg, replicas)
    except InputError as err:
        return err.problem if err.path == schedule_path else str(err)
    return None


def pack_and_check(job: Any, packer: Any, cfg: RunConfig, paths: RunPaths, replicas: int, *, margin: float,
                   allow_invalid: bool, kfac_margin: float = 1.0, steps: int | None = None,
                   echo: Callable[[str], None] | None = None) -> tuple[Any, dict[str, Any]]:
    """Pack ``job`` with its K-FAC times x ``kfac_margin``, say the usage report (to ``echo``; default:
    logged), write the schedule (its metadata records both margins and the job it is for, so ``pipefisher
    validate`` checks the same rule on the same job, and a run of another job refuses it) and its chart,
    and decide whether to train it.

    Refuses (:class:`InputError`, after writing the report too) a schedule that ``validate`` rejects unless
    ``allow_invalid``, one the runtime cannot run always, and one whose K-FAC cycle (sync groups aligned)
    is longer than the run's ``steps``: such a run never refreshes some layers' curvature. A refused
    schedule stays in the run folder with its chart and report, for inspection. Returns the packed
    schedule and the report (not yet written), which holds the schedule's planned overhead per step.
    """
    from pipefisher.cost.measure import seconds_per_unit
    from pipefisher.cost.objective import aligned_from, step_cost
    from pipefisher.outputs.plot import chart_from_schedule, render
    from pipefisher.policies.packing import pack_job
    from pipefisher.outputs.report import report_data, usage_lines
    from pipefisher.runtime.pipeline.checks import packed_for
    from pipefisher.safe_io import dump_json_atomic

    echo = echo or logger.info
    packing = pack_job(job, packer, margin, kfac_margin=kfac_margin)
    job, packed, violations = packing.job, packing.schedule, packing.violations
    for line in usage_lines(packed, job):
        echo(line)
    report = report_data(packed, job)
    # what the run trains, as the report prints it: the cycle (after aligning sync groups) and the
    # planned overhead per step (target's own figure for what it chose; the same function for the others)
    cost = packed.tradeoff.chosen.cost if packed.tradeoff is not None else \
        step_cost([n.iterations for n in packed.nodes], job)
    cycle = max(n.figures.iterations for n in packed.nodes)
    too_long = steps is not None and cycle > steps
    report.update(run=paths.name, valid=not violations, violations=[str(v) for v in violations[:50]],
                  kfac_margin=kfac_margin, cycle=cycle, planned_overhead=round(cost.overhead, 6),
                  planned_step_ms=round(cost.step * seconds_per_unit(job.span) * 1e3, 3),
                  steps=steps, within_run=not too_long)
    packing.save(paths.schedule, packed_for(cfg))
    render(chart_from_schedule(packed, job, violations=violations), paths.chart)
    refusal = runtime_refusal(paths.schedule, cfg, replicas)  # what every worker checks, before they start
    report.update(runnable=refusal is None, runtime_refusal=refusal)
    if packing.problem is not None:
        echo(packing.problem)
    if refusal is not None or too_long or (violations and not allow_invalid):
        dump_json_atomic(paths.report, report)
        where = f" (report: {paths.report})"
        if refusal is not None:
            raise InputError(paths.schedule, f"policy '{packer.name}' gave a schedule the runtime cannot run "
                                             f"({refusal}); not training it, not even with --allow-invalid{where}")
        if too_long:
            before = aligned_from(packed)
            stretched = "" if before is None else f", {before} before aligning Chimera's stage pairs"
            raise InputError(paths.schedule, f"policy '{packer.name}' packs no K-FAC cycle within the run's {steps} "
                                             f"steps (its shortest: k = {cycle}{stretched}); not training it, since a "
                                             "run shorter than its cycle never refreshes some layers' curvature: "
                                             f"give --steps {cycle} or more{where}")
        raise InputError(paths.schedule, f"policy '{packer.name}' gave a schedule that breaks {len(violations)} "
                                         f"rule(s) of pipefisher validate; not training it (--allow-invalid trains "
                                         f"it anyway: the runtime can run it){where}")
    if violations:
        echo("training it anyway (--allow-invalid): the runtime can run it; its iterations may take longer "
             "than the report says")
    return packed, report


def run_job(cfg: RunConfig, out: str, *, steps: int, profile_steps: int = 10, policy: str | None = None,
            nproc: int | None = None, name: str | None = None, allow_invalid: bool = False,
            checkpoint_every: int = 0, log_every: int = 5, progress: bool = True, kfac_margin: float = 1.0,
            eval_every: int = 0, echo: Callable[[str], None] | None = None, margin: float | None = None,
            adapt: bool = False, tensorboard: str | None = None, staleness: Any = None,
            adapt_drift: bool = False, overlap: bool | None = None) -> RunPaths:
    """Profile ``profile_steps`` kfac steps (their median step, :func:`pipefisher.schedule.timeline.median_step`),
    pack them with ``policy`` (K-FAC times x ``kfac_margin``,
    room rule with ``margin``, :mod:`pipefisher.schedule.problem`),
    say the usage report (to ``echo``, as every line of the run; default: logged); with
    ``kfac.refresh_pieces: best``, profile and pack each piece count first and keep one
    (:func:`profile_each_piece_count`), the run's config then holding that count; refuse a schedule
    that ``validate`` rejects (unless ``allow_invalid``) or that the runtime cannot run (always; both
    leave the schedule, chart and report in the run folder),
    then train ``steps`` steps with it (with ``adapt``, re-packing it from the measured steps while it
    trains, :mod:`pipefisher.runtime.train.adapt`; without a curve at the packing's cycle, unless
    ``adapt_drift`` lets the drift rule set it; with ``tensorboard``, TensorBoard logs of the training
    in that folder); returns the paths. ``staleness``: the job's
    :class:`~pipefisher.cost.staleness.StalenessCurve` (None: none), for the ``target`` policy, which also
    chooses among the cycles the run's ``steps`` complete, and for ``adapt``. Where no packing's cycle
    (sync groups aligned) fits the run, it stops before training and says how many steps it needs.
    ``overlap``: the policy may let a refresh's pieces run on into the next cycle (:mod:`pipefisher.schedule.problem`;
    None: the policy's default); with ``adapt`` its re-packs too."""
    from pipefisher.policies import DEFAULT_POLICY, check_overlap, get_policy
    from pipefisher.schedule.problem import DEFAULT_MARGIN
    from pipefisher.runtime.train.profiler import timeline_filename
    from pipefisher.safe_io import dump_json_atomic, write_atomic
    from pipefisher.cost.staleness import staleness_data
    from pipefisher.schedule.timeline import load_job

    warn, echo = echo or logger.warning, echo or logger.info
    policy = policy or DEFAULT_POLICY
    if staleness is not None and policy != "target":
        raise InputError(None, f"--staleness applies to the 'target' policy only, not to '{policy}'")
    check_overlap(overlap, policy)
    packer = get_policy(policy, overlap=overlap,
                        **({"staleness": staleness, "max_cycle": steps} if policy == "target" else {}))
    margin = DEFAULT_MARGIN if margin is None else margin
    stages = cfg.pipeline.stages
    n = nproc or stages
    if kfac_margin < 1.0:
        raise InputError(None, f"--kfac-margin must be at least 1, not {kfac_margin:g}")
    if n % stages:
        raise InputError(None, f"--nproc-per-node {n} is not a multiple of the {stages} pipeline stages")
    replicas = n // stages
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise InputError(out, f"cannot be created ({err.strerror or err})") from None
    paths = run_paths(out, cfg, packer.name, name)
    phase: list[Any] = ["starting", None]  # what a Ctrl-C or SIGTERM stops: phase, its steps
    try:
        os.makedirs(paths.timelines, exist_ok=True)
        write_atomic(paths.config, config_yaml(cfg))
        if cfg.data.text != "synthetic":
            from pipefisher.runtime.data.corpus import load_corpus, save_tokenizer

            save_tokenizer(load_corpus(cfg.data, cfg.model.vocab_size), paths.tokenizer)
        echo(f"run {paths.name}: {cfg.name}, {stages} stage(s) x {replicas} replica(s), policy {packer.name}, "
             f"files in {paths.folder}")
        if staleness is not None and (warning := staleness.config_warning(cfg.fingerprint(layout=False), cfg.name)):
            warn(warning)

        pack = functools.partial(pack_and_check, packer=packer, replicas=replicas, margin=margin,
                                 allow_invalid=allow_invalid, kfac_margin=kfac_margin, steps=steps)
        t0 = time.perf_counter()
        tried = None
        if cfg.kfac.refresh_pieces == BEST_PIECES:  # 1. and 2. for each count; the kept one's files are the run's
            cfg, tried = profile_each_piece_count(cfg, n, paths, profile_steps, pack, phase, echo)
            write_atomic(paths.config, config_yaml(cfg))  # the count chosen: what --resume and the fingerprint see
        launch = launcher(cfg, n, paths, echo)

        # 1. profile
        if tried is None:
            echo(f"[1/3] profiling {profile_steps} kfac step(s)")
            phase[:] = ["profiling", profile_steps]
            profile_into(launch, cfg, paths, profile_steps)
        timelines = [os.path.join(paths.timelines, timeline_filename(cfg.name, i)) for i in range(stages)]
        for line in unsteady_profile_lines(paths, cfg.name, stages):
            echo(line)
        profile_s = time.perf_counter() - t0

        # 2. pack, report, check
        phase[:] = ["packing", None]
        echo(f"[2/3] packing with policy {packer.name}"
             + (f", K-FAC times x {kfac_margin:g}" if kfac_margin != 1.0 else "")
             + (f" (refresh in {pieces_said(cfg.kfac.refresh_pieces)}, kept)" if tried is not None else ""))
        packed, report = pack(load_job(timelines), cfg=cfg, paths=paths, echo=echo)
        if tried is not None:
            report["pieces_tried"] = [t.to_dict() for t in tried]
        cycles = [node.figures.iterations for node in packed.nodes]
        dump_json_atomic(paths.report, report)  # the packing's report, also if the training is cut short

        # 3. train
        echo(f"[3/3] training {steps} step(s) with the schedule (K-FAC cycle k={max(cycles)}, planned "
             f"{100 * report['planned_overhead']:.1f} % over first-order per step)")
        phase[:] = ["training", steps]
        t0 = time.perf_counter()
        figures = launch(scheduled_options(paths, steps, checkpoint_every=checkpoint_every, log_every=log_every,
                                           progress=progress, eval_every=eval_every, adapt=adapt,
                                           adapt_policy=packer.name, adapt_drift=adapt_drift, adapt_overlap=overlap,
                                           margin=margin,
                                           tensorboard=tensorboard,
                                           staleness=staleness_data(staleness) if adapt else None))
        report["training"] = training_summary(paths, figures, steps, cycles, adapt, profile_s,
                                              time.perf_counter() - t0, echo)
        dump_json_atomic(paths.report, report)
        measured = paths.measured_files()
        for p in (paths.config, *([paths.tokenizer] if os.path.exists(paths.tokenizer) else []), paths.timelines,
                  *([paths.profile_losses] if os.path.exists(paths.profile_losses) else []),
                  *([paths.profile_steps_dir] if os.path.exists(paths.profile_steps_dir) else []),
                  paths.schedule, paths.report, paths.chart, paths.metrics,
                  *[m for m in measured if os.path.exists(m)], paths.checkpoints,
                  *([tensorboard] if tensorboard else [])):
            echo(f"wrote {p}")
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: this run, in its phase
        raise interrupted_run(err, paths, *phase) from None
    return paths


def profile_into(launch: Callable[[Any], Any], cfg: RunConfig, paths: RunPaths, profile_steps: int) -> None:
    """Profile ``profile_steps`` kfac steps of ``cfg`` into ``paths.timelines`` (its node files alone there:
    :func:`keep_only_timelines`)."""
    from pipefisher.runtime.job.options import TrainOptions

    launch(TrainOptions.of(mode="kfac", steps=profile_steps, profile=True, out=paths.timelines, progress=False,
                           log_every=10**9))
    keep_only_timelines(paths, cfg.name)


def unsteady_profile_lines(paths: RunPaths, name: str, stages: int) -> list[str]:
    """A line per node whose profile was taken on a busy machine (:func:`slowed_profile`), so that a user
    who sees a longer cycle than usual, or another one next time, knows why."""
    from pipefisher.safe_io import load_pickle
    from pipefisher.schedule.timeline import STEADY, slowed_profile
    from pipefisher.runtime.train.profiler import steps_filename

    lines = []
    for node in range(stages):
        path = os.path.join(paths.profile_steps_dir, steps_filename(name, node))
        slowed = slowed_profile(load_pickle(path)) if os.path.exists(path) else None
        if slowed is None:
            continue
        left_out, used, fastest, slowest = slowed
        lines.append(f"profile: node {node}: {left_out} of its {used} steps ran more than {100 * STEADY:.0f} % "
                     f"slower than its fastest ({fastest / 1e6:.1f} ms; up to {slowest / 1e6:.1f} ms: another "
                     f"process on the machine?) and are left out of its timeline, the median of the other "
                     f"{used - left_out}")
    return lines


def pieces_said(p: int) -> str:
    """``1 piece``, ``2 pieces``: a refresh's piece count in a run's lines."""
    return f"{p} piece{'s' if p != 1 else ''}"


def profile_each_piece_count(cfg: RunConfig, n: int, paths: RunPaths, profile_steps: int,
                             pack: Callable[..., tuple[Any, dict[str, Any]]], phase: list[Any],
                             echo: Callable[[str], None]) -> tuple[RunConfig, list[Any]]:
    """``kfac.refresh_pieces: best``: profile ``cfg`` with each of
    :data:`~pipefisher.cost.objective.PIECE_CHOICES` pieces, each into its own ``<run>_pieces/<p>/`` folder,
    and ``pack`` each (:func:`pack_and_check` with the run's policy, its lines not said); keep the count
    :func:`~pipefisher.cost.objective.best_pieces` chooses, say every count's planned step in one line, move
    the kept count's profile (timelines, profile losses and raw steps) to the run's own places and remove
    the rest, so that the run folder is a normal run's. Returns the config with that count and every count
    packed. A count whose packing is refused takes no part; where every one is, the first refusal stands."""
    import shutil

    from pipefisher.cost.objective import PIECE_CHOICES, PiecesPacked, best_pieces, pieces_line
    from pipefisher.schedule.timeline import load_job
    from pipefisher.runtime.train.profiler import timeline_filename

    root = f"{paths.prefix}_pieces"  # <run>_*: a Ctrl-C's clean-up (discard_run) removes it with the run
    variants: dict[int, tuple[RunConfig, RunPaths]] = {}
    tried: list[PiecesPacked] = []
    refusals: list[InputError] = []
    for i, p in enumerate(PIECE_CHOICES, 1):
        vcfg = cfg.replace(kfac={"refresh_pieces": p})
        vpaths = RunPaths(os.path.join(root, str(p)), paths.name)
        os.makedirs(vpaths.timelines, exist_ok=True)
        echo(f"[1/3] profiling {profile_steps} kfac step(s) (refresh in {pieces_said(p)}; {i} of "
             f"{len(PIECE_CHOICES)} counts)")
        phase[:] = ["profiling", profile_steps]
        profile_into(launcher(vcfg, n, paths, echo), vcfg, vpaths, profile_steps)
        phase[:] = ["packing", None]
        timelines = [os.path.join(vpaths.timelines, timeline_filename(vcfg.name, j))
                     for j in range(vcfg.pipeline.stages)]
        try:
            _, report = pack(load_job(timelines), cfg=vcfg, paths=vpaths, echo=lambda line: None)
        except InputError as err:
            echo(f"refresh in {pieces_said(p)}: {err.problem}")
            refusals.append(err)
            continue
        variants[p] = (vcfg, vpaths)
        tried.append(PiecesPacked(p, report["planned_step_ms"], report["cycle"]))
    if not tried:
        raise refusals[0]
    kept = best_pieces(tried)
    echo(pieces_line(tried, kept))
    vcfg, vpaths = variants[kept.pieces]
    for entry in os.listdir(vpaths.timelines):
        os.replace(os.path.join(vpaths.timelines, entry), os.path.join(paths.timelines, entry))
    for src, dst in ((vpaths.profile_losses, paths.profile_losses), (vpaths.profile_steps_dir, paths.profile_steps_dir)):
        if os.path.exists(src):
            os.replace(src, dst)
    shutil.rmtree(root)
    return vcfg, tried


def interrupted_run(err: KeyboardInterrupt, paths: RunPaths, phase: str, total: int | None) -> Any:
    """A Ctrl-C or SIGTERM of the run at ``paths`` in ``phase`` (of ``total`` steps), as the
    :class:`~pipefisher.runtime.job.process.Interrupted` the CLI words. A run that stopped before its
    first checkpoint cannot be resumed: its files are removed (all but the workers' log, which the line
    after the stop names), so that the folder holds runs that are whole or resumable only."""
    from pipefisher.runtime.job.process import Interrupted
    from pipefisher.runtime.train.checkpoint import MANIFEST

    if not os.path.exists(os.path.join(paths.checkpoints, MANIFEST)):
        discard_run(paths, keep=(paths.workers_log,))
    return Interrupted.of(err, phase, total, paths)


def discard_run(paths: RunPaths, keep: tuple[str, ...] = ()) -> None:
    """Remove the run's files (``<name>_*`` in its folder), but those in ``keep``."""
    import shutil

    prefix = f"{paths.name}_"
    for entry in os.listdir(paths.folder) if os.path.isdir(paths.folder) else []:
        path = os.path.join(paths.folder, entry)
        if entry.startswith(prefix) and path not in keep:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def launcher(cfg: RunConfig, n: int, paths: RunPaths,
             echo: Callable[[str], None]) -> Callable[[Any], dict[str, list[float]] | None]:
    """How a run launches its ``n`` workers for one phase (here, for one; else local processes, their
    output in ``<run>_workers.log`` after a failure); a launch returns the trainer's run figures
    (:meth:`pipefisher.runtime.train.metrics.Metrics.figures`)."""
    from pipefisher.runtime.launch.local import launch_local, run_worker

    def launch(opts: Any) -> dict[str, list[float]] | None:
        if n == 1:
            return run_worker(cfg, opts).figures
        return launch_local(cfg, opts, n, echo=echo, log_path=os.path.abspath(paths.workers_log))

    return launch


def scheduled_options(paths: RunPaths, steps: int, **options: Any) -> Any:
    """The ``TrainOptions`` of a run's training phase: scheduled mode with the run's schedule, its metrics,
    checkpoints and measurement files in the run folder, and ``options`` (how it trains)."""
    from pipefisher.runtime.job.options import TrainOptions

    return TrainOptions.of(mode="scheduled", steps=steps, schedule=os.path.abspath(paths.schedule),
                           metrics=os.path.abspath(paths.metrics), checkpoint_dir=os.path.abspath(paths.checkpoints),
                           measure_prefix=os.path.abspath(paths.prefix), **options)


def training_summary(paths: RunPaths, figures: dict[str, list[float]] | None, steps: int, cycles: list[int],
                     adapt: bool, profile_s: float | None, train_s: float, echo: Callable[[str], None]) -> dict[str, Any]:
    """The report's ``training`` section, from the trainer's run figures (every step, a resumed run's earlier
    ones included: :meth:`pipefisher.runtime.train.metrics.Metrics.figures`) and the schedule history;
    says the line ``done: ...``."""
    fig = figures or {}
    seconds = fig.get("step_seconds", [])
    times = seconds[1:] or seconds
    losses, overruns, drifts = fig.get("losses", []), fig.get("overruns", []), fig.get("drifts", [])
    history = paths.history
    switches = load_json(history).get("switches", []) if os.path.exists(history) else []
    summary = {
        "steps": steps, "cycle": max(cycles), "cycles": cycles, "adapt": adapt,
        "final_cycle": switches[-1]["cycle"] if switches else max(cycles),
        "switches": [{k: sw[k] for k in ("step", "cycle", "node_cycles", "reason")} for sw in switches[1:]],
        "median_overrun_seconds": statistics.median(overruns) if overruns else None,
        "refreshes": len(drifts), "median_drift": statistics.median(drifts) if drifts else None,
        "median_step_seconds": statistics.median(times) if times else None,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "profile_seconds": None if profile_s is None else round(profile_s, 3), "train_seconds": round(train_s, 3),
    }
    if times:
        echo(f"done: {steps} steps, median step {summary['median_step_seconds'] * 1e3:.1f} ms, "
             f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
             + (f", {len(summary['switches'])} schedule switch(es), final K-FAC cycle k={summary['final_cycle']}"
                if adapt else ""))
    return summary


def find_run(folder: str, name: str | None = None) -> RunPaths:
    """The run in the run folder ``folder`` (``pipefisher run --out``) that ``--resume`` continues: the
    one named ``name``, else the only one there with checkpoints; one line says what is missing."""
    from pipefisher.runtime.train.consolidate import run_checkpoint_folders

    if not os.path.isdir(folder):
        raise InputError(folder, "is not a run folder (no such folder); --resume takes the --out folder of a run")
    if name is not None:
        paths = RunPaths(os.path.normpath(folder), name)
        if not os.path.isdir(paths.checkpoints):
            raise InputError(folder, f"holds no checkpoints of a run named '{name}' ({os.path.basename(paths.checkpoints)})")
        return paths
    runs = [e[: -len(RUN_CHECKPOINTS)] for e in run_checkpoint_folders(folder)]
    if len(runs) != 1:
        what = f"the checkpoints of {len(runs)} runs ({', '.join(runs)}): pick one with --name" if runs else \
            f"no run's checkpoints (<run>{RUN_CHECKPOINTS}); --resume takes the --out folder of a pipefisher run"
        raise InputError(folder, f"holds {what}")
    return RunPaths(os.path.normpath(folder), runs[0])


def resume_job(cfg: RunConfig, paths: RunPaths, *, steps: int, nproc: int, options: dict[str, Any],
               echo: Callable[[str], None] | None = None) -> RunPaths:
    """Continue the run at ``paths`` from its checkpoint up to ``steps`` steps in all, with its schedule
    (and with the closed loop's state the checkpoint holds), ``nproc`` workers as it had and the
    training ``options`` it recorded (:data:`pipefisher.runtime.job.options.RUN_OPTIONS`, some
    given anew); the metrics and report go on where they were. The caller has checked the checkpoint.
    Its lines go to ``echo`` (default: logged)."""
    from pipefisher.safe_io import dump_json_atomic
    from pipefisher.schedule.file import read_schedule_meta

    echo = echo or logger.info
    meta = read_schedule_meta(paths.schedule) or {}
    cycles = [int(n["iterations"]) for n in meta.get("nodes", [])] or [1]
    report = load_json(paths.report) if os.path.exists(paths.report) else {"run": paths.name}
    echo(f"run {paths.name}: resuming from {paths.checkpoints}, training up to {steps} step(s) with its schedule "
         f"(K-FAC cycle k={max(cycles)})")
    t0 = time.perf_counter()
    try:
        figures = launcher(cfg, nproc, paths, echo)(scheduled_options(paths, steps,
                                                                      resume=os.path.abspath(paths.checkpoints),
                                                                      **options))
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: this run, while training
        raise interrupted_run(err, paths, "training", steps) from None
    previous = report.get("training") or {}
    report["training"] = training_summary(paths, figures, steps, cycles, bool(options.get("adapt")),
                                          previous.get("profile_seconds"), time.perf_counter() - t0, echo)
    dump_json_atomic(paths.report, report)
    for p in (paths.report, paths.metrics, paths.checkpoints):
        echo(f"wrote {p}")
    return paths
