"""``pipefisher train``: train a pipeline locally (workers launched here) or under torchrun.

torch is imported inside the command only, so the other commands never pay for it.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import click

from pipefisher.cli._common import (adapt_drift_option, missing_module, require_runtime,
                                    staleness_option)
from pipefisher.cli._outputs import check_fresh_outputs, check_out_file, check_out_folder, check_profile_folder
from pipefisher.cli._runflags import (checkpoint_every_option, eval_log_options, layout_options, no_progress_option,
                                      past_decay_option, say_loading_torch, set_option, settings_from_config,
                                      tensorboard_option)
from pipefisher.cli.group import main
from pipefisher.errors import InputError
from pipefisher.runtime.job.options import TrainOptions, check_adapt_drift, check_mode


def check_tensorboard(folder: str | None) -> str | None:
    """Refuse ``--tensorboard DIR`` without the tensorboard package, or where DIR cannot be written, before
    torch loads and any worker starts; returns DIR made absolute (the workers may run elsewhere)."""
    if folder is None:
        return None
    from pipefisher.runtime.train.tensorboard import MISSING

    if missing_module("tensorboard"):  # as every missing extra: one input-error line, exit 2
        raise InputError(None, MISSING)
    check_out_folder(folder, "--tensorboard")
    return os.path.abspath(folder)


def workers_log(out_dir: str | None, metrics_path: str | None, name: str) -> str | None:
    """Where a failed local run's worker output and tracebacks go: beside --out or --metrics."""
    from pipefisher.runtime.job.files import RunPaths

    folder = out_dir or (os.path.dirname(os.path.abspath(metrics_path)) if metrics_path else None)
    return None if folder is None else os.path.abspath(RunPaths(folder, name).workers_log)



def prepare_training(cfg: object, config_path: str, nproc: int, schedule_path: str | None,
                     resume: str | None, mode: str, adapt: bool = False,
                     allow_schedule_mismatch: bool = False, progress: bool = True) -> str | None:
    """Refuse, before any worker starts, a schedule or checkpoint that does not belong to this job; build
    (or find in the cache) the corpus the workers will load, saying so in a phase line (``progress``).

    Returns the schedule's digest (None without a schedule). The workers check again on their own.
    """
    from pipefisher.runtime.data.corpus import load_corpus
    from pipefisher.runtime.data.sources import describe_source
    from pipefisher.runtime.job.progress import phase
    from pipefisher.runtime.models.builders import check_builder
    from pipefisher.runtime.pipeline.checks import MISMATCH_FLAG, check_packed_for, load_checked_schedule
    from pipefisher.runtime.pipeline.torch_api import check_engine
    from pipefisher.runtime.train.checkpoint import check_resumable, check_resume_config
    from pipefisher.runtime.train.optim import check_optimizer
    from pipefisher.schedule.file import schedule_digest

    if resume is not None:  # the real reason first, before the corpus: a config the checkpoint's run did not have
        check_resume_config(resume, cfg)
    check_builder(cfg, config_path)  # type: ignore[arg-type]  # model.builder imports, its stages fit
    check_optimizer(cfg.optim, config_path)  # type: ignore[attr-defined]  # this torch has optim.name's optimizer
    check_engine(cfg)  # pipeline.engine torch: this torch's pipelining API is the one it uses
    stages = cfg.pipeline.stages  # type: ignore[attr-defined]
    replicas = max(1, nproc // stages)
    if cfg.data.text != "synthetic":  # type: ignore[attr-defined]
        # tokenizer and token ids built (or found in the cache) once, before the workers need them
        say = phase if progress and os.environ.get("RANK", "0") == "0" else (lambda what: None)
        say(f"preparing {describe_source(cfg.data)}")  # type: ignore[attr-defined]
        load_corpus(cfg.data, cfg.model.vocab_size,  # type: ignore[attr-defined]
                    on_build=lambda what: say(f"building its {what} (once: later runs load them from the cache)"))
    digest = None
    if schedule_path is not None:
        digest = schedule_digest(load_checked_schedule(schedule_path, cfg, replicas,  # type: ignore[arg-type]
                                                       allow_schedule_mismatch))
        if allow_schedule_mismatch and (diff := check_packed_for(schedule_path, cfg, True)):  # type: ignore[arg-type]
            click.echo(f"{schedule_path}: packed for another job ({diff}); training it anyway ({MISMATCH_FLAG})")
    if resume is not None:
        man = check_resumable(resume, cfg, mode, digest, stages, replicas)
        cycles = man.get("node_cycles") or []
        if adapt and len(set(cycles)) > 1:
            raise InputError(resume, f"holds a run whose schedule has cycles of different lengths per node "
                                     f"({', '.join(map(str, cycles))}): it ran without --adapt, which can switch "
                                     "only where every node ends its cycle; resume it without --adapt")
    return digest


@main.command("train")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="YAML run config (see configs/)")
@click.option("--mode", type=click.Choice(["first-order", "kfac", "scheduled"]), default=None,
              help="first-order: pipeline + optimizer; kfac: plus naive K-FAC every kfac.interval steps; "
                   "scheduled: K-FAC in the bubbles as --schedule FILE says (implied by it) "
                   "[default: first-order]")
@click.option("--schedule", "schedule_path", default=None, metavar="FILE",
              help="schedule file (pipefisher schedule --save-path): train in scheduled mode")
@click.option("--allow-schedule-mismatch", is_flag=True,
              help="train a --schedule whose metadata (FILE.meta.json) says it was packed for another job "
                   "(model shape, stages, micro-batches, pipeline, K-FAC modules)")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="total training steps (with --resume: including those already done)")
@click.option("--profile", is_flag=True,
              help="run kfac steps and write one timeline pickle per pipeline node into --out")
@click.option("--out", "out_dir", type=click.Path(),
              help="folder for timelines (--profile), <name>_losses.json, <name>_config.yaml and "
                   "<name>_tokenizer.json (a folder that holds a run of the same name is refused)")
@click.option("--metrics", "metrics_path", type=click.Path(), default=None,
              help="write a CSV of step, loss, step time, mode here (a new file, or the resumed run's)")
@tensorboard_option()
@click.option("--checkpoint-dir", type=click.Path(), default=None,
              help="write checkpoints here (at the end, and every --checkpoint-every steps; checkpoint.keep "
                   "of them are kept); and the run's tokenizer, for pipefisher export")
@checkpoint_every_option("steps between checkpoints (0: only at the end)")
@click.option("--resume", "resume_dir", type=click.Path(), default=None,
              help="continue from the checkpoint in this folder (same config, mode and schedule)")
@past_decay_option()
@click.option("--adapt", is_flag=True,
              help="with --schedule and --out: measure every step and re-pack the schedule from the measurements "
                   "while training (switching at cycle boundaries, on every worker at the same step); the "
                   "schedules used and the measurements go to --out")
@click.option("--adapt-policy", default=None,
              help="packing policy of --adapt's re-packs, only with --adapt [default: pipefisher schedule's]")
@adapt_drift_option()
@staleness_option()
@layout_options()
@click.option("--interval", type=click.IntRange(min=1), default=None, help="override kfac.interval")
@set_option()
@eval_log_options()
@no_progress_option()
@settings_from_config("train")
def train_command(config_path: str, mode: str | None, schedule_path: str | None, allow_schedule_mismatch: bool,
                  steps: int, profile: bool, out_dir: str | None, metrics_path: str | None, tensorboard_dir: str | None,
                  checkpoint_dir: str | None, checkpoint_every: int, resume_dir: str | None, past_decay: bool,
                  adapt: bool, adapt_policy: str | None, adapt_drift: bool, staleness: str | None,
                  nproc: int | None, stages: int | None, order: str | None, chunks: int | None,
                  timeout_s: float | None, interval: int | None, overrides: tuple[str, ...], eval_every: int,
                  log_every: int, no_progress: bool) -> None:
    """Train a model with pipeline parallelism (the built-in BERT-style masked-language model, a Hugging
    Face BERT, GPT-2 or Llama, or your own builder's; see configs/): first-order, K-FAC, or K-FAC packed
    into the pipeline bubbles by a schedule file.

    Locally, --nproc-per-node N starts N workers on this machine (gloo on CPU, NCCL on GPUs). Under
    torchrun (torchrun --nproc-per-node N --no-python pipefisher train ...; RANK and WORLD_SIZE set),
    this process is one worker and torchrun's options say how many there are.
    """
    from pipefisher.runtime.job.process import torchrun_env  # no torch: refuse a bad launch at once

    job = torchrun_env()  # under torchrun this process is one worker; torchrun started the others
    _refuse_nproc_under_torchrun(job, nproc)
    require_runtime("train")
    # Up to "loading torch" nothing imports it: a bad config, option or output path costs no start-up.
    mode = _checked_mode(mode, schedule_path, profile, adapt, out_dir, adapt_policy, staleness, adapt_drift)
    from pipefisher.cli._runconfig import read_run_config
    from pipefisher.policies import DEFAULT_POLICY, get_policy
    from pipefisher.cost.staleness import curve_for_job, read_staleness, staleness_data

    read_staleness(staleness)  # a bad file: one line, before the config loads
    adapt_policy = adapt_policy or DEFAULT_POLICY
    if adapt:
        get_policy(adapt_policy)  # an unknown name: one line, before any worker starts
    cfg = read_run_config(config_path, overrides, "train", {"stages": stages, "order": order,
                                                           "timeout_s": timeout_s, "chunks": chunks}, interval)
    reports = job is None or job.rank == 0  # the worker that says what the run does and wrote
    curve = curve_for_job(staleness, cfg.fingerprint(layout=False), config_path,
                          click.echo if reports else (lambda _: None))
    checkpoint_dir, tensorboard_dir = _checked_outputs(cfg.name, profile, out_dir, metrics_path, tensorboard_dir,
                                                       checkpoint_dir, checkpoint_every, resume_dir, job)
    n = _worker_count(job, nproc, cfg.pipeline.stages, config_path)
    opts = TrainOptions.of(mode=mode, steps=steps, profile=profile, schedule=_abs(schedule_path),
                           allow_schedule_mismatch=allow_schedule_mismatch, out=out_dir, log_every=log_every,
                           progress=not no_progress, metrics=_abs(metrics_path), tensorboard=tensorboard_dir,
                           eval_every=eval_every, checkpoint_dir=_abs(checkpoint_dir),
                           checkpoint_every=checkpoint_every, resume=_abs(resume_dir), adapt=adapt,
                           adapt_policy=adapt_policy, adapt_drift=adapt_drift, staleness=staleness_data(curve))
    if resume_dir:
        from pipefisher.runtime.train.checkpoint import nothing_left

        if done := nothing_left(resume_dir, steps):  # resuming to the steps already done: say so before torch loads
            click.echo(done)
            return
    say_loading_torch(no_progress)
    prepare_training(cfg, config_path, n, schedule_path, resume_dir, mode, adapt, allow_schedule_mismatch,
                     progress=not no_progress)
    _record_run(cfg, out_dir, resume_dir, steps, past_decay, reports)
    _train_workers(cfg, opts, job, n, workers_log(out_dir, metrics_path, cfg.name), checkpoint_dir, reports)
    _say_written(cfg, out_dir, bool(schedule_path) and reports, profile)


def _refuse_nproc_under_torchrun(job: Any, nproc: int | None) -> None:
    """Under torchrun (``job``) the worker count is torchrun's: ``--nproc-per-node`` is refused, by the first
    worker of each machine (the others leave quietly)."""
    if job is None or nproc is None:
        return
    if job.local_rank != 0:  # one line per machine, not one per worker
        raise SystemExit(2)
    raise InputError("--nproc-per-node", f"this process already is worker {job.rank} of {job.world_size} "
                                         "started by torchrun; give the worker count to torchrun "
                                         "(torchrun --nproc-per-node N --no-python pipefisher train ...) "
                                         "and drop pipefisher's --nproc-per-node")


def _checked_mode(mode: str | None, schedule_path: str | None, profile: bool, adapt: bool, out_dir: str | None,
                  adapt_policy: str | None, staleness: str | None, adapt_drift: bool) -> str:
    """The training mode (``scheduled`` with a schedule file, else ``first-order`` unless given), the
    combinations of mode, schedule, profiling and ``--adapt``'s options refused in one line."""
    if mode is None:
        mode = "scheduled" if schedule_path else "first-order"
    check_mode(mode, schedule_path, profile, adapt)  # the options' own check, before torch
    if adapt and not out_dir:
        raise InputError("--adapt", "writes the schedules it re-packs and the measurements they come from into "
                                    "--out DIR, and there is no --out: add --out DIR")
    if adapt_policy is not None and not adapt:
        raise InputError("--adapt-policy", "sets the packing policy of --adapt's re-packs, and there is no --adapt; "
                                           "add --adapt, or drop --adapt-policy")
    if staleness is not None and not adapt:
        raise InputError("--staleness", "weighs the trials of --adapt (step time x the curve at k), and there is "
                                        "no --adapt; add --adapt, or drop --staleness")
    check_adapt_drift(adapt_drift, adapt, staleness is not None)  # the options' own check, before torch
    return mode


def _checked_outputs(name: str, profile: bool, out_dir: str | None, metrics_path: str | None,
                     tensorboard_dir: str | None, checkpoint_dir: str | None, checkpoint_every: int,
                     resume_dir: str | None, job: Any) -> tuple[str | None, str | None]:
    """Every output checked before torch loads, not only when written after the last step, and the
    folders made; returns the checkpoint folder (the ``--resume`` one unless given: checkpointing goes
    on where the run resumed) and ``--tensorboard`` made absolute."""
    if profile and not out_dir:
        raise click.UsageError("--profile needs --out DIR for the timeline files")
    if profile:
        check_profile_folder(out_dir, name)  # type: ignore[arg-type]  # never overwrite a profile silently
    if resume_dir:  # before the folders below are made: a mistyped --resume DIR must not become an empty one
        from pipefisher.runtime.train.checkpoint import check_exists

        check_exists(resume_dir)
    if resume_dir and not checkpoint_dir:
        checkpoint_dir = resume_dir  # keep checkpointing where we resumed from
    if checkpoint_every and not checkpoint_dir:
        raise click.UsageError("--checkpoint-every needs --checkpoint-dir DIR")
    ck_option = "--checkpoint-dir" if checkpoint_dir != resume_dir else "--resume"
    for folder, option in ((out_dir, "--out"), (checkpoint_dir, ck_option)):
        if folder:
            check_out_folder(folder, option)
    check_out_file(metrics_path, "--metrics")
    tensorboard_dir = check_tensorboard(tensorboard_dir)
    # A new run never writes over an earlier one's outputs; a resumed one continues its own. Under torchrun
    # rank 0 (which writes them) checks, before any worker writes: a later-starting worker would see them.
    if not resume_dir and (job is None or job.rank == 0):
        check_fresh_outputs(out=out_dir, name=name, metrics=metrics_path, tensorboard=tensorboard_dir,
                            checkpoints=checkpoint_dir)
    for folder in (out_dir, checkpoint_dir):
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as err:
                raise InputError(folder, f"cannot be created ({err.strerror or err})") from None
    return checkpoint_dir, tensorboard_dir


def _worker_count(job: Any, nproc: int | None, stages: int, config_path: str) -> int:
    """The workers of the run: ``--nproc-per-node`` (default: the stages) here, torchrun's ``WORLD_SIZE``
    under it; a count the pipeline stages do not divide is refused in one line."""
    if job is None:
        n = nproc or stages
        if n % stages:
            raise InputError(config_path, f"--nproc-per-node {n} is not a multiple of the {stages} pipeline stages")
        return n
    n = job.world_size
    if n % stages:
        if job.local_rank != 0:  # one line per machine, not one per worker
            raise SystemExit(2)
        raise InputError(config_path, f"torchrun started {n} workers (WORLD_SIZE), not a multiple of the "
                                      f"{stages} pipeline stages; start stages x replicas "
                                      "workers (torchrun --nnodes x --nproc-per-node)")
    return n


def _record_run(cfg: Any, out_dir: str | None, resume_dir: str | None, steps: int, past_decay: bool,
                reports: bool) -> None:
    """Before training: a resumed run's learning-rate schedule note (changed on purpose, or kept past its
    end), and the config this run uses, ``--set`` included, in ``--out``; by the reporting worker."""
    if resume_dir:
        from pipefisher.runtime.train.checkpoint import resume_note

        if (note := resume_note(resume_dir, cfg, steps, past_decay)) and reports:
            click.echo(note)
    if out_dir and reports:
        from pipefisher.runtime.job.files import RunPaths
        from pipefisher.runtime.launch.driver import config_yaml
        from pipefisher.safe_io import write_atomic

        write_atomic(RunPaths(out_dir, cfg.name).config, config_yaml(cfg))


def _train_workers(cfg: Any, opts: Any, job: Any, n: int, log_path: str | None, checkpoint_dir: str | None,
                   reports: bool) -> None:
    """Train: this process as the one worker (under torchrun, or alone), else ``n`` local workers. A
    worker's failure is one ``Error:`` line; Ctrl-C one line saying how far it got and how to go on from
    ``checkpoint_dir`` (as the command line gave it)."""
    from pipefisher.kfac.factors import BadFactorError
    from pipefisher.runtime.job.process import Interrupted
    from pipefisher.runtime.launch.local import INTERRUPTED_EXIT, WorkerFailed, launch_local, run_worker
    from pipefisher.runtime.train.trainer import PeerLost

    try:
        if job is not None or n == 1:
            run_worker(cfg, opts)
        else:
            launch_local(cfg, opts, n, log_path=log_path)
    except (WorkerFailed, PeerLost, BadFactorError) as err:
        raise click.ClickException(str(err)) from None
    except KeyboardInterrupt as err:  # Ctrl-C: how far it got and how to go on, not just "Aborted!"
        if reports:
            stop = Interrupted.of(err, "profiling" if opts.profile else "training", opts.steps)
            click.echo(interrupted_message(stop, opts.steps, checkpoint_dir, sys.argv), err=True)
        sys.exit(INTERRUPTED_EXIT)


def _say_written(cfg: Any, out_dir: str | None, measured: bool, profile: bool) -> None:
    """The files a run wrote beside its losses: the measurements of a scheduled run in ``--out``
    (``measured``: by the reporting worker), the timelines of a profiling one."""
    if measured and out_dir:
        from pipefisher.runtime.job.files import RunPaths

        for path in RunPaths(out_dir, cfg.name).measured_files():
            if os.path.exists(path):
                click.echo(f"wrote {os.path.normpath(path)}")
    if profile:
        from pipefisher.runtime.train.profiler import timeline_filename

        for node in range(cfg.pipeline.stages):
            click.echo(f"wrote {os.path.normpath(os.path.join(out_dir or '.', timeline_filename(cfg.name, node)))}")


def interrupted_message(stop: Any, steps: int, checkpoint_dir: str | None, argv: list[str],
                        resume: str | None = None, nothing: str | None = None) -> str:
    """The line after Ctrl-C or SIGTERM: what was stopped (:func:`stopped_what`), the command that resumes
    from the last checkpoint (or that there is none), and where the worker log is when one was kept.
    ``stop``: the run's ``Interrupted``; ``resume``: the command that resumes (default: ``argv`` with
    ``--resume checkpoint_dir``, :func:`resume_command`); ``nothing``: what to say without a checkpoint
    (default: how to have them)."""
    from pipefisher.runtime.train.checkpoint import MANIFEST, read_manifest

    done = stopped_what(stop, steps)
    if checkpoint_dir is None:
        then = nothing or ("no checkpoint to resume from (--checkpoint-dir DIR writes them, at the end, every "
                           "--checkpoint-every N steps and on Ctrl-C or SIGTERM)")
    elif not os.path.exists(os.path.join(checkpoint_dir, MANIFEST)):
        then = nothing or f"no checkpoint to resume from: none was written in {os.path.normpath(checkpoint_dir)} yet"
    else:
        try:
            held = int(read_manifest(checkpoint_dir).get("steps_done") or 0)
        except InputError as err:  # another pipefisher's checkpoint there: still one line, saying so
            then = f"the checkpoint there cannot be resumed: {err}"
        else:
            then = (f"the checkpoint in {os.path.normpath(checkpoint_dir)} has {held} steps done; resume with: "
                    f"{resume or resume_command(argv, checkpoint_dir)}")
    log = f"; worker output in {stop.log}" if stop.log else ""
    return f"interrupted {done}; {then}{log}"


def stopped_what(stop: Any, steps: int) -> str:
    """What a Ctrl-C or SIGTERM stopped, from its ``Interrupted``: ``after 45 of 200 training steps``, ``while
    profiling, after 3 of 10 profiling steps``, ``while packing the schedule``, ``while starting``."""
    n = stop.steps_done
    if stop.phase == "training":
        return "before its first training step ended" if n is None else \
            f"after {n} of {stop.total or steps} training steps"
    if stop.phase == "profiling":
        return "while profiling, " + ("before its first profiling step ended" if n is None else
                                      f"after {n} of {stop.total} profiling steps")
    return "while packing the schedule" if stop.phase == "packing" else "while starting"


def resume_command(argv: list[str], resume_dir: str, command: str = "train", drop: dict[str, bool] | None = None,
                   extra: tuple[str, ...] = ()) -> str:
    """This very command line (``sys.argv``) as the one that resumes its run: ``--resume DIR`` added where it
    is missing, the options in ``drop`` left out (option -> whether a value follows it) and ``extra`` added;
    everything else as given (its ``--steps`` too), so that it trains what the stopped one was to train."""
    import shlex

    if command not in argv[1:]:  # not started from a command line (a library call, a test runner)
        return f"this command with --resume {shlex.quote(resume_dir)}"
    args: list[str] = []
    skip = False  # the value of an option left out
    for a in argv[argv.index(command, 1):]:
        name, eq, _ = a.partition("=")
        if skip or name in (drop or {}):
            skip = not skip and (drop or {})[name] and not eq
            continue
        args.append(a)
    if not any(a == "--resume" or a.startswith("--resume=") for a in args):
        args += ["--resume", resume_dir]
    return "pipefisher " + shlex.join(args + list(extra))


def _abs(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)
