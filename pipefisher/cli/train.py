"""``pipefisher train``: run the BERT-style pipeline locally (workers launched here) or under torchrun.

torch is imported inside the command only, so the other commands never pay for it.
"""
from __future__ import annotations

import os

import click

from pipefisher.cli import main
from pipefisher.errors import InputError


@main.command("train")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="YAML run config (see configs/)")
@click.option("--mode", type=click.Choice(["first-order", "kfac"]), default="first-order", show_default=True,
              help="first-order: pipeline + optimizer; kfac: plus naive K-FAC every kfac.interval steps")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--profile", is_flag=True,
              help="run kfac steps and write one timeline pickle per pipeline node into --out")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="folder for timelines (--profile) and <name>_losses.json")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
              help="workers to launch here = pipeline stages x data-parallel replicas (default: stages)")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="override pipeline.stages")
@click.option("--schedule", "pipe_schedule", type=click.Choice(["gpipe", "1f1b"]), default=None,
              help="override pipeline.schedule")
@click.option("--interval", type=click.IntRange(min=1), default=None, help="override kfac.interval")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="override pipeline.timeout_s (seconds a worker waits on a peer before failing)")
@click.option("--log-every", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--no-progress", is_flag=True, help="no progress bar")
def train_command(config_path: str, mode: str, steps: int, profile: bool, out_dir: str | None,
                  nproc: int | None, stages: int | None, pipe_schedule: str | None, interval: int | None,
                  timeout_s: float | None, log_every: int, no_progress: bool) -> None:
    """Train the masked-language model with pipeline parallelism, optionally with K-FAC or profiling.

    Locally, --nproc-per-node N starts N workers on this machine (gloo on CPU, NCCL on GPUs). Under
    torchrun (RANK and WORLD_SIZE set), this process is one worker.
    """
    from pipefisher.runtime.config import load_config
    from pipefisher.runtime.launch import WorkerFailed, launch_local, run_worker
    from pipefisher.runtime.trainer import PeerLost, TrainOptions

    cfg = load_config(config_path)
    pipeline = {k: v for k, v in (("stages", stages), ("schedule", pipe_schedule), ("timeout_s", timeout_s))
                if v is not None}
    try:
        cfg = cfg.replace(pipeline=pipeline, kfac={"interval": interval} if interval else {})
    except InputError as err:
        raise InputError(config_path, err.problem) from None
    if profile and not out_dir:
        raise click.UsageError("--profile needs --out DIR for the timeline files")
    if out_dir:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as err:
            raise InputError(out_dir, f"cannot be created ({err.strerror or err})") from None
    opts = TrainOptions(mode=mode, steps=steps, profile=profile, out=out_dir, log_every=log_every,
                        progress=not no_progress)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and nproc is None
    n = nproc or cfg.pipeline.stages
    if not under_torchrun and n % cfg.pipeline.stages:
        raise InputError(config_path, f"--nproc-per-node {n} is not a multiple of the "
                                      f"{cfg.pipeline.stages} pipeline stages")
    try:
        if under_torchrun or n == 1:
            run_worker(cfg, opts)
        else:
            launch_local(cfg, opts, n, echo=click.echo)
    except (WorkerFailed, PeerLost) as err:
        raise click.ClickException(str(err)) from None
    if profile:
        from pipefisher.runtime.profiler import timeline_filename

        for node in range(cfg.pipeline.stages):
            click.echo(f"wrote {os.path.join(out_dir or '.', timeline_filename(cfg.name, node))}")
