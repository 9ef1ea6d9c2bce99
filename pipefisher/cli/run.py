"""``pipefisher run``: profile, pack, report and train with the schedule, in one command.

torch and matplotlib are imported inside the command only.
"""
from __future__ import annotations

import os

import click

from pipefisher.cli._common import (chunks_option, margin_option, pipeline_option, require_runtime,
                                    staleness_for, staleness_option)
from pipefisher.cli.group import main
from pipefisher.cli.schedule import _policy_help
from pipefisher.cli.train import check_tensorboard, set_option, tensorboard_option
from pipefisher.errors import InputError


@main.command("run")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="YAML run config (see configs/)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="folder for this run's files (all named <run>_...; several runs sit side by side)")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="training steps with the schedule")
@click.option("--profile-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="kfac steps to profile (their median step is packed)")
@click.option("--policy", default=None, help=_policy_help())
@click.option("--kfac-margin", type=click.FloatRange(min=1.0), default=1.0, show_default=True,
              help="pack as if every profiled K-FAC piece took this many times as long (slack for noisy "
                   "CPU timings; a longer cycle k)")
@margin_option()
@staleness_option()
@click.option("--adapt", is_flag=True,
              help="measure every training step and re-pack the schedule from the measurements while training "
                   "(same policy; switches at cycle boundaries, on every worker at the same step)")
@click.option("--name", default=None, help="run name (default: <config>-<policy>-<timestamp>)")
@click.option("--allow-invalid", is_flag=True,
              help="train a schedule that pipefisher validate rejects, where the runtime can still run it (a "
                   "schedule it cannot run is refused anyway; a refused one stays in --out for inspection)")
@tensorboard_option()
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="steps between checkpoints in <run>_checkpoints/ (0: only at the end)")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
              help="workers to launch here = pipeline stages x data-parallel replicas (default: stages)")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="override pipeline.stages")
@pipeline_option()
@chunks_option()
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="override pipeline.timeout_s")
@set_option()
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="steps between held-out evaluations while training (0: none)")
@click.option("--log-every", type=click.IntRange(min=1), default=5, show_default=True,
              help="steps between loss lines")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def run_command(config_path: str, out_dir: str, steps: int, profile_steps: int, policy: str | None,
                kfac_margin: float, margin: float, staleness: str | None, adapt: bool, name: str | None,
                allow_invalid: bool,
                tensorboard_dir: str | None, checkpoint_every: int, nproc: int | None,
                stages: int | None, pipe_schedule: str | None, chunks: int | None, timeout_s: float | None,
                overrides: tuple[str, ...], eval_every: int, log_every: int, no_progress: bool) -> None:
    """Profile a few K-FAC steps, pack them into the pipeline bubbles, print the usage report, and
    train with the schedule; timelines, schedule, report, chart, metrics and config go to --out."""
    require_runtime("run")
    from pipefisher.runtime.job.process import torchrun_env  # no torch: refuse a bad launch at once

    if torchrun_env() is not None:
        raise InputError(None, "pipefisher run launches its own workers (--nproc-per-node); under torchrun, "
                               "profile, pack and train in steps: pipefisher train --profile, pipefisher "
                               "schedule, pipefisher train --schedule")
    tensorboard_dir = check_tensorboard(tensorboard_dir)
    curve = staleness_for(staleness, policy)  # a bad file: one line, before torch loads
    if not no_progress and os.environ.get("RANK", "0") == "0":
        from pipefisher.runtime.job.progress import phase

        phase("loading torch")  # seconds on a cold start, before anything else can be said
    from pipefisher.kfac.factors import BadFactorError
    from pipefisher.runtime.job.config import apply_overrides, load_config
    from pipefisher.runtime.launch.driver import run_job
    from pipefisher.runtime.launch.local import WorkerFailed
    from pipefisher.runtime.train.trainer import PeerLost

    cfg = apply_overrides(load_config(config_path), overrides, config_path)
    if cfg.data.text != "synthetic":
        require_runtime("run", ("tokenizers",))  # real text is tokenized by the tokenizers package
    pipeline = {k: v for k, v in (("stages", stages), ("schedule", pipe_schedule), ("timeout_s", timeout_s),
                                  ("chunks", chunks)) if v is not None}
    try:
        cfg = cfg.replace(pipeline=pipeline)
    except InputError as err:
        raise InputError(config_path, err.problem) from None
    from pipefisher.runtime.models.builders import check_builder
    from pipefisher.runtime.train.optim import check_optimizer

    check_builder(cfg, config_path)  # model.builder imports and its stages fit, before any work
    check_optimizer(cfg.optim, config_path)  # this torch has optim.name's optimizer
    try:
        run_job(cfg, out_dir, steps=steps, profile_steps=profile_steps, policy=policy, nproc=nproc, name=name,
                allow_invalid=allow_invalid, checkpoint_every=checkpoint_every, log_every=log_every,
                progress=not no_progress, kfac_margin=kfac_margin, eval_every=eval_every, echo=click.echo,
                margin=margin, adapt=adapt, tensorboard=tensorboard_dir, staleness=curve)
    except (WorkerFailed, PeerLost, BadFactorError) as err:
        raise click.ClickException(str(err)) from None
