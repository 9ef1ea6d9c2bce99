"""``pipefisher run``: profile, pack, report and train with the schedule, in one command; ``--resume``
continues such a run where its checkpoint stopped.

torch and matplotlib are imported inside the command only, after the config, options and outputs
are checked.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import click

from pipefisher.cli._common import (OLD_NAME_SUFFIX, adapt_drift_option,
                                    margin_option, overlap_option, require_runtime, staleness_for, staleness_option)
from pipefisher.cli.group import main
from pipefisher.cli.schedule import _policy_help
from pipefisher.cli._runflags import (checkpoint_every_option, eval_log_options, layout_options, no_progress_option,
                                      past_decay_option, say_loading_torch, set_option, settings_from_config,
                                      tensorboard_option)
from pipefisher.cli.train import check_tensorboard
from pipefisher.errors import InputError
from pipefisher.runtime.job.options import check_adapt_drift

SET_UP = ("config_path", "out_dir", "profile_steps", "policy", "kfac_margin", "margin", "staleness", "overlap",
          "adapt", "adapt_drift", "allow_invalid",
          "nproc", "stages", "order", "order" + OLD_NAME_SUFFIX, "chunks")
"""What sets a run up: ``--resume`` continues the run as it was set up, so these are refused with it."""


@main.command("run")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False),
              help="YAML run config (see configs/); required unless --resume")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="folder for this run's files (all named <run>_...; several runs sit side by side); required "
                   "unless --resume")
@click.option("--resume", "resume_dir", default=None, type=click.Path(), metavar="RUN_DIR",
              help="continue the run in RUN_DIR (its --out folder; --name picks one of several) where its checkpoint "
                   "stopped, with its config, schedule, workers and options, up to --steps steps in all")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="training steps with the schedule (with --resume: in all, those done included)")
@past_decay_option()
@click.option("--profile-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="kfac steps to profile (their median step is packed)")
@click.option("--policy", default=None, help=_policy_help())
@click.option("--kfac-margin", type=click.FloatRange(min=1.0), default=1.0, show_default=True,
              help="pack as if every profiled K-FAC piece took this many times as long (slack for noisy "
                   "CPU timings; a longer cycle k)")
@margin_option()
@staleness_option()
@overlap_option()
@click.option("--adapt", is_flag=True,
              help="measure every training step and re-pack the schedule from the measurements while training "
                   "(same policy; switches at cycle boundaries, on every worker at the same step)")
@adapt_drift_option()
@click.option("--name", default=None,
              help="run name (default: <config>-<policy>-<timestamp>); with --resume, the run to continue")
@click.option("--allow-invalid", is_flag=True,
              help="train a schedule that pipefisher validate rejects, where the runtime can still run it (a "
                   "schedule it cannot run is refused anyway; a refused one stays in --out for inspection)")
@tensorboard_option()
@checkpoint_every_option("steps between checkpoints in <run>_checkpoints/ (0: only at the end)", resumable=True)
@layout_options()
@set_option()
@eval_log_options(resumable=True)
@no_progress_option()
@click.pass_context
@settings_from_config("run", refused=("resume",))
def run_command(ctx: click.Context, config_path: str | None, out_dir: str | None, resume_dir: str | None, steps: int,
                past_decay: bool, profile_steps: int, policy: str | None, kfac_margin: float, margin: float,
                staleness: str | None, overlap: bool | None, adapt: bool, adapt_drift: bool, name: str | None,
                allow_invalid: bool,
                tensorboard_dir: str | None,
                checkpoint_every: int | None, nproc: int | None, stages: int | None, order: str | None,
                chunks: int | None, timeout_s: float | None, overrides: tuple[str, ...], eval_every: int | None,
                log_every: int | None, no_progress: bool) -> None:
    """Profile a few K-FAC steps, pack them into the pipeline bubbles, print the usage report, and
    train with the schedule; timelines, schedule, report, chart, metrics and config go to --out.
    With --resume RUN_DIR, continue such a run from its checkpoint instead."""
    require_runtime("run")
    from pipefisher.cli._outputs import check_fresh_outputs, check_out_folder
    from pipefisher.cli._runconfig import read_run_config
    from pipefisher.runtime.job.process import torchrun_env  # no torch: refuse a bad launch at once

    if torchrun_env() is not None:
        raise InputError(None, "pipefisher run launches its own workers (--nproc-per-node); under torchrun, "
                               "profile, pack and train in steps: pipefisher train --profile, pipefisher "
                               "schedule, pipefisher train --schedule")
    if resume_dir is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if p.name in SET_UP and ctx.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT]
        if given:
            raise InputError(", ".join(given), f"set{'s' if len(given) == 1 else ''} a run up, which --resume "
                                               f"continues as it was set up: drop {'it' if len(given) == 1 else 'them'}")
        _resume(resume_dir, name, steps, overrides, past_decay, timeout_s, no_progress,
                {"tensorboard": tensorboard_dir, "checkpoint_every": checkpoint_every, "eval_every": eval_every,
                 "log_every": log_every})
        return
    if past_decay:
        raise InputError("--past-decay", "is for --resume (training past the decay of the run it continues)")
    if config_path is None or out_dir is None:
        raise click.UsageError(f"{'--config FILE' if config_path is None else '--out DIR'} is required "
                               "(or --resume RUN_DIR)")
    # Up to "loading torch" nothing imports it: a bad config, option or output path costs no start-up.
    cfg = read_run_config(config_path, overrides, "run", {"stages": stages, "order": order,
                                                         "timeout_s": timeout_s, "chunks": chunks})
    check_out_folder(out_dir, "--out")
    tensorboard_dir = check_tensorboard(tensorboard_dir)
    curve = staleness_for(staleness, policy)  # a bad file: one line, before torch loads
    check_adapt_drift(adapt_drift, adapt, staleness is not None)  # the options' own check, before torch
    from pipefisher.policies import check_overlap

    check_overlap(overlap, policy)
    check_fresh_outputs(tensorboard=tensorboard_dir)  # each run's files have their own names; TensorBoard's not
    say_loading_torch(no_progress)
    from pipefisher.runtime.launch.driver import run_job
    from pipefisher.runtime.models.builders import check_builder
    from pipefisher.runtime.pipeline.torch_api import check_engine
    from pipefisher.runtime.train.optim import check_optimizer

    check_builder(cfg, config_path)  # model.builder imports and its stages fit, before any work
    check_optimizer(cfg.optim, config_path)  # this torch has optim.name's optimizer
    check_engine(cfg)  # pipeline.engine torch: this torch's pipelining API is the one it uses
    with _one_line_failures(out_dir, steps):
        run_job(cfg, out_dir, steps=steps, profile_steps=profile_steps, policy=policy, nproc=nproc, name=name,
                allow_invalid=allow_invalid, checkpoint_every=checkpoint_every or 0, log_every=log_every or 5,
                progress=not no_progress, kfac_margin=kfac_margin, eval_every=eval_every or 0, margin=margin,
                adapt=adapt, adapt_drift=adapt_drift, tensorboard=tensorboard_dir, staleness=curve, overlap=overlap)


@contextmanager
def _one_line_failures(run_dir: str, steps: int, paths: Any = None) -> Iterator[None]:
    """A worker's failure, a lost peer or a bad factor as one ``Error:`` line (their messages say it all);
    Ctrl-C or SIGTERM as one line saying what was stopped and how to go on (:func:`_interrupted`)."""
    from pipefisher.kfac.factors import BadFactorError
    from pipefisher.runtime.job.process import StopRequest
    from pipefisher.runtime.launch.local import INTERRUPTED_EXIT, WorkerFailed
    from pipefisher.runtime.train.trainer import PeerLost

    try:
        with StopRequest(defer=False):  # SIGTERM as Ctrl-C (the launcher and the workers defer it to a step end)
            yield
    except (WorkerFailed, PeerLost, BadFactorError) as err:
        raise click.ClickException(str(err)) from None
    except KeyboardInterrupt as err:  # during profiling, packing or training: not click's bare "Aborted!"
        click.echo(_interrupted(err, run_dir, steps, paths), err=True)
        sys.exit(INTERRUPTED_EXIT)


def _interrupted(err: KeyboardInterrupt, run_dir: str, steps: int, paths: Any = None) -> str:
    """The line after Ctrl-C or SIGTERM in ``pipefisher run``: as ``train``'s, about this run (``paths``, the
    one being resumed, or the new one the driver names in its ``Interrupted``), with this command line
    as ``run --resume RUN_DIR`` (:func:`~pipefisher.cli.train.resume_command`: the options that set the run
    up left out, ``--name`` where the folder holds several runs' checkpoints)."""
    from pipefisher.cli.train import interrupted_message, resume_command
    from pipefisher.runtime.job.process import Interrupted
    from pipefisher.runtime.train.consolidate import run_checkpoint_folders

    stop = err if isinstance(err, Interrupted) else Interrupted.of(err, "starting")
    paths = stop.paths if stop.paths is not None else paths
    if paths is None:
        return interrupted_message(stop, steps, None, sys.argv, nothing="nothing to resume: the run had not begun")
    several = len(run_checkpoint_folders(run_dir)) > 1 if os.path.isdir(run_dir) else False
    argv = sys.argv if "run" in sys.argv[1:] else ["pipefisher", "run", "--steps", str(steps)]  # a library call
    drop = {o: not getattr(p, "is_flag", False) for p in run_command.params  # option -> takes a value
            if p.name in (*SET_UP, "name", "resume_dir") for o in p.opts + p.secondary_opts}
    extra = ("--name", paths.name) if several else ()
    if not any(a == "--steps" or a.startswith("--steps=") for a in argv):  # from the config file's run.steps,
        extra += ("--steps", str(steps))  # which a resume (its config left out) would not read
    resume = resume_command(argv, run_dir, "run", drop, extra)
    return interrupted_message(stop, steps, paths.checkpoints, argv, resume=resume,
                               nothing=f"nothing to resume: run {paths.name} stopped before its first checkpoint, "
                                       "and its files are removed")


def _resume(run_dir: str, name: str | None, steps: int, overrides: tuple[str, ...], past_decay: bool,
            timeout_s: float | None, no_progress: bool, given: dict[str, Any]) -> None:
    """``run --resume``: the run's config (``<run>_config.yaml`` with ``--set``, which may change only the
    learning-rate schedule), its schedule, worker count and recorded options (``given`` ones replace
    theirs), checked as ``train --resume`` checks, then trained on from its checkpoint."""
    from pipefisher.cli._runconfig import read_run_config
    from pipefisher.cli.train import prepare_training
    from pipefisher.runtime.launch.driver import find_run
    from pipefisher.runtime.job.options import RUN_OPTIONS
    from pipefisher.runtime.train.checkpoint import check_resume_config, nothing_left, read_manifest, resume_note

    paths = find_run(run_dir, name)
    man = read_manifest(paths.checkpoints)
    if not os.path.isfile(paths.config) or not os.path.isfile(paths.schedule):
        missing = paths.config if not os.path.isfile(paths.config) else paths.schedule
        raise InputError(missing, "is missing: --resume needs the run's config and schedule where the run wrote them")
    cfg = read_run_config(paths.config, overrides, "run", {"timeout_s": timeout_s})
    options = {k: v for k, v in (man.get("options") or {}).items() if k in RUN_OPTIONS}
    options.update({k: v for k, v in given.items() if v is not None})
    if given.get("tensorboard") is not None:
        options["tensorboard"] = check_tensorboard(given["tensorboard"])
    nproc = int(man.get("stages") or 1) * int(man.get("replicas") or 1)
    check_resume_config(paths.checkpoints, cfg)  # what --set may change, before torch loads
    if done := nothing_left(paths.checkpoints, steps):  # before torch and the corpus load: at once
        click.echo(done)
        return
    say_loading_torch(no_progress)
    from pipefisher.runtime.launch.driver import resume_job

    prepare_training(cfg, paths.config, nproc, paths.schedule, paths.checkpoints, "scheduled",
                     bool(options.get("adapt")), progress=not no_progress)
    if note := resume_note(paths.checkpoints, cfg, steps, past_decay):
        click.echo(note)
    with _one_line_failures(run_dir, steps, paths):
        resume_job(cfg, paths, steps=steps, nproc=nproc, options={**options, "progress": not no_progress})
