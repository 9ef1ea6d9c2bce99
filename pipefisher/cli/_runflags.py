"""The flags ``pipefisher train`` and ``pipefisher run`` share, written once, grouped by what they set: the
pipeline's layout (config shortcuts), the run's logging, evaluation and checkpoints, the config itself.

``run --resume`` takes a run's recorded options unless given again, so its defaults of the step counts
are None (``resumable``); ``train``'s are the values themselves. Nothing here imports torch.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping

import click

from pipefisher.cli._common import chunks_option, order_option
from pipefisher.errors import InputError

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _apply(f: Callable[..., Any], options: list[Decorator]) -> Callable[..., Any]:
    """``options`` on ``f`` in the order they are listed (as stacked decorators read top to bottom)."""
    for option in reversed(options):
        f = option(f)
    return f


def layout_options() -> Decorator:
    """``--nproc-per-node``, ``--stages``, ``--order`` (``--pipeline``), ``--chunks``, ``--timeout``: the
    workers and the ``pipeline.*`` shortcuts (:data:`pipefisher.cli._runconfig.PIPELINE_OPTIONS`)."""
    return lambda f: _apply(f, [
        click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
                     help="workers to launch here = pipeline stages x data-parallel replicas (default: stages)"),
        click.option("--stages", type=click.IntRange(min=1), default=None, help="override pipeline.stages"),
        order_option("--pipeline", lead="override pipeline.order: "),
        chunks_option(),
        click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="override pipeline.timeout_s (seconds a worker waits on a peer before failing)"),
    ])


def _every(flag: str, help: str, default: int, resumable: bool, low: int = 0) -> Decorator:
    """A ``--<what>-every N`` flag: ``default`` (shown), or None with ``resumable`` (the resumed run's)."""
    if resumable:
        return click.option(flag, type=click.IntRange(min=low), default=None,
                            help=f"{help} [default: {default}; with --resume, the run's]")
    return click.option(flag, type=click.IntRange(min=low), default=default, show_default=True, help=help)


def checkpoint_every_option(help: str, resumable: bool = False) -> Decorator:
    """``--checkpoint-every N``: steps between checkpoints (0: only at the end)."""
    return _every("--checkpoint-every", help, 0, resumable)


def eval_log_options(resumable: bool = False) -> Decorator:
    """``--eval-every N`` (held-out evaluations, 0: none) and ``--log-every N`` (loss lines)."""
    return lambda f: _apply(f, [
        _every("--eval-every", "steps between held-out evaluations (loss on data.val_batches of held-out text; "
                               "0: none)", 0, resumable),
        _every("--log-every", "steps between loss lines", 5, resumable, low=1),
    ])


def set_option() -> Any:
    """``--set SECTION.KEY=VALUE``: any config value from the command line (``train`` and ``run``)."""
    return click.option(
        "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set optim.lr=0.01 --set data.seed=3 (VALUE is read as "
             "YAML; repeatable, later ones win; checked like the file and recorded in the config the run "
             "writes)")


def tensorboard_option() -> Any:
    """``--tensorboard DIR``: TensorBoard logs of the training (``train`` and ``run``)."""
    return click.option(
        "--tensorboard", "tensorboard_dir", type=click.Path(), default=None, metavar="DIR",
        help="also write TensorBoard logs of the training here: loss, held-out loss, learning rate, step time, "
             "K-FAC cycle k and overrun (scheduled mode), peak memory; a folder that holds another run's logs "
             "is refused, a resumed run appends. Needs the tensorboard extra; look with: tensorboard --logdir DIR")


def past_decay_option() -> Any:
    """``--past-decay``: resume past the end of the learning-rate decay (``train`` and ``run``)."""
    return click.option(
        "--past-decay", is_flag=True,
        help="with --resume and more --steps than the checkpoint's run decayed its learning rate over: train "
             "the extra steps at its final rate (refused without it; --set optim.decay_steps=N decays over all N)")


def no_progress_option() -> Any:
    """``--no-progress`` (``train`` and ``run``); ``--progress`` turns them back on where the config file's
    ``log.progress`` is false."""
    return click.option("--no-progress/--progress", "no_progress", default=False,
                        help="no start-up phase lines and no progress bar (--progress: them, whatever log.progress "
                             "says)")


def say_loading_torch(no_progress: bool) -> None:
    """The phase line before torch loads (seconds on a cold start, before anything else can be said), on
    the first worker only and not with ``--no-progress``."""
    if not no_progress and os.environ.get("RANK", "0") == "0":
        from pipefisher.runtime.job.progress import phase

        phase("loading torch")


SETTING_PARAMS = {"schedule": "schedule_path", "out": "out_dir", "metrics": "metrics_path",
                  "tensorboard": "tensorboard_dir", "resume": "resume_dir", "progress": "no_progress"}
"""The command parameters of the run settings whose flag is named apart from its option (``--out`` is
``out_dir``; ``--no-progress`` says ``progress`` negated); every other one is its option's name."""


def settings_from_config(command: str, refused: tuple[str, ...] = ()) -> Decorator:
    """A command's parameters with the run settings its ``--config`` file holds (``run:``, ``log:``,
    ``evaluation:``, ``checkpoint:``, ``adapt:``) where no flag was given: a flag overrides the file. A
    setting the command has no flag for (or, ``refused``, one it means otherwise) is one line naming the
    file and the key. The merged values then go through the command's one check, as flags."""
    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(run)
        def with_settings(*args: Any, **params: Any) -> Any:
            path = params.get("config_path")
            if path is not None:
                from pipefisher.runtime.job.config import load_settings

                params.update(_given_settings(params, load_settings(path), path, command, refused))
            return run(*args, **params)
        return with_settings
    return wrap


def _given_settings(params: Mapping[str, Any], settings: Mapping[str, Any], path: str, command: str,
                    refused: tuple[str, ...]) -> dict[str, Any]:
    """The parameters ``settings`` (by option name) set: those no flag on the command line gave."""
    from click.core import ParameterSource

    from pipefisher.runtime.job.config import setting_key

    ctx = click.get_current_context()
    out: dict[str, Any] = {}
    for option, value in settings.items():
        param = SETTING_PARAMS.get(option, option)
        if param not in params or option in refused:
            raise InputError(path, f"{setting_key(option)}: pipefisher {command} does not take this setting")
        if ctx.get_parameter_source(param) in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None):
            out[param] = (not value) if param == "no_progress" else value
    return out
