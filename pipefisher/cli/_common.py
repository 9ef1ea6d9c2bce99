"""What every command shares: bad input becomes one line on stderr and exit code 2."""
from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click

from pipefisher.errors import InputError, install_hint, renamed_notice

EXIT_BAD_INPUT = 2


RUNTIME_INSTALL = install_hint("runtime")


def missing_module(module: str) -> bool:
    """Whether ``module`` is not installed, checked without importing it (nor torch): for every extra."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return True


def require_runtime(command: str, modules: tuple[str, ...] = ("torch",)) -> None:
    """One line saying how to install the runtime extra, instead of a ModuleNotFoundError traceback from
    deep inside the runtime; checked without importing torch (the scheduling path must never import it).
    An input error (exit 2), as every missing extra is."""
    missing = [m for m in modules if missing_module(m)]
    if missing:
        raise InputError(None, f"pipefisher {command} needs {' and '.join(missing)} (the runtime extra), "
                               f"not installed here: {RUNTIME_INSTALL}")


class PipefisherGroup(click.Group):
    """A click group that turns :class:`InputError` into ``error: <file>: <problem>`` and exit 2, and shows
    what the runtime logs while a command runs (:class:`pipefisher.cli._progress.CliLines`)."""

    def invoke(self, ctx: click.Context) -> Any:
        from pipefisher.cli._progress import CliLines
        from pipefisher.runtime.job.progress import showing

        try:
            with showing(CliLines()):
                return super().invoke(ctx)
        except InputError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_BAD_INPUT)


def margin_option(recorded: bool = False) -> Any:
    """``--margin``: the room rule's margin (:mod:`pipefisher.schedule.problem`), one option for every command.

    ``recorded``: for commands that read a schedule, whose metadata may record the margin it was packed
    under; the option then defaults to None (use the record)."""
    from pipefisher.schedule.problem import DEFAULT_MARGIN

    default = "the one recorded in FILE.meta.json beside the --schedule FILE, else " + f"{DEFAULT_MARGIN:g}" if recorded else None
    return click.option(
        "--margin", type=click.FloatRange(0, 10, max_open=True), default=None if recorded else DEFAULT_MARGIN,
        show_default=not recorded,
        help="room each K-FAC item needs beyond its own length, as a fraction of it: an item fits where "
             "start + (1 + margin) x length < the bubble's end" + (f" (default: {default})" if default else
                                                                    "; the least one: policy target packs at "
                                                                    "larger ones too and may choose one (its report "
                                                                    "and the schedule's .meta.json say which)"))


def staleness_option() -> Any:
    """``--staleness FILE|K:RATIO,...``: the job's staleness curve, one option for every command that packs
    with the default policy (:func:`pipefisher.cost.staleness.read_staleness` reads it)."""
    from pipefisher.cost.staleness import STALENESS_HELP

    return click.option("--staleness", default=None, metavar="FILE|K:RATIO,...", help=STALENESS_HELP)


def staleness_for(text: str | None, policy: str | None) -> Any:
    """The curve ``--staleness`` gives (None without one), refused for a policy that does not weigh one."""
    from pipefisher.cost.staleness import read_staleness
    from pipefisher.policies import DEFAULT_POLICY

    if text is not None and (policy or DEFAULT_POLICY) != "target":
        raise InputError(None, f"--staleness applies to the 'target' policy only, not to '{policy}'")
    return read_staleness(text)


def adapt_drift_option() -> Any:
    """``--adapt-drift``: the drift rule sets ``--adapt``'s cycle k, one option for ``train`` and ``run``;
    opt-in, since the rule is validated on no job but the one it was fitted on (docs/adapt.md)."""
    return click.option(
        "--adapt-drift", is_flag=True,
        help="with --adapt and no --staleness: let the curvature's drift set the K-FAC cycle k (the drift rule, "
             "pipefisher.loop.drift; fitted on configs/small.yaml with one seed and not yet validated on other jobs: "
             "docs/adapt.md); without it --adapt keeps the packing's cycle")


OLD_NAME_SUFFIX = "_by_old_name"
"""What the parameter of an option's old name (:func:`old_name`) is called: its new one's and this."""


def old_name(old: str, new: str, dest: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A hidden option ``old``, the former name of option ``new`` (parameter ``dest``): it sets ``dest``
    as ``new`` does, with a one-line notice of the new name on stderr; both at once are refused in one
    line. ``kwargs``: the option's type and such, as ``new``'s."""
    hidden = dest + OLD_NAME_SUFFIX

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def command(*args: Any, **params: Any) -> Any:
            value = params.pop(hidden)
            if value is not None:
                if params.get(dest) is not None:
                    raise InputError(old, f"is the old name of {new}: give {new} only")
                renamed_notice(old, new)
                params[dest] = value
            return f(*args, **params)

        return click.option(old, hidden, hidden=True, default=None, help=f"the old name of {new}", **kwargs)(command)

    return decorate


def add_renamed_argument(parser: Any, new: str, old: str, **kwargs: Any) -> None:
    """``new`` on an ``argparse`` parser (the scripts'), and ``old``, its former name, hidden: it sets the
    same value with a one-line notice of the new name on stderr (:func:`old_name` for click commands)."""
    import argparse

    class _OldName(argparse.Action):
        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
            renamed_notice(old, new)
            setattr(namespace, self.dest, values)

    action = parser.add_argument(new, **kwargs)
    parser.add_argument(old, dest=action.dest, action=_OldName, help=argparse.SUPPRESS,
                        **{k: v for k, v in kwargs.items() if k in ("type", "choices")})


ORDER_HELP = ("the forward/backward order (gpipe; 1f1b; chimera: two pipes in opposite directions, every device "
              "holding two stage copies; interleaved: 1F1B over --chunks model chunks per device; zb-h1 and zb-v: "
              "zero bubble, every backward split into an input-gradient and a weight-gradient pass, zb-v with 2 "
              "chunks per device in a V; dualpipev: DualPipe's overlapped forward-backward pairs in zb-v's V, needs "
              "micro-batches >= 2 x stages)")
"""What every command's ``--order`` says the orders are (:func:`order_option`)."""


class OrderChoice(click.Choice):
    """The pipeline orders (:func:`pipefisher.pipeline_orders.order_names`); an alias, in any case
    (:func:`~pipefisher.pipeline_orders.canonical_name`), is taken as the order it names, and an unknown
    name is refused in the project's one line (``error: ...``), not click's usage block."""

    def __init__(self) -> None:
        from pipefisher.pipeline_orders import order_names  # plain Python: no torch

        super().__init__(order_names())

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from pipefisher.pipeline_orders import canonical_name

        if isinstance(value, str):
            value = canonical_name(value)  # an unknown order: the project's one line, naming the orders
        return super().convert(value, param, ctx)


def order_option(old: str, lead: str = "", tail: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--order``: the forward/backward order, one definition for every command that takes one (``train``
    and ``run``: ``pipeline.order``; ``simulate``, ``compare``, ``demo``: the cost model's), its choices
    :class:`OrderChoice`; ``old``, its former name in that command, still works (:func:`old_name`). The
    help is ``lead``, :data:`ORDER_HELP`, ``tail``: what the option overrides and its default."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        f = old_name(old, "--order", "order", type=OrderChoice())(f)
        return click.option("--order", "order", type=OrderChoice(), default=None,
                            help=f"{lead}{ORDER_HELP}{tail}")(f)

    return decorate


def chunks_option() -> Any:
    """``--chunks``: model chunks per device under ``--order interleaved`` (``train`` and ``run``)."""
    return click.option(
        "--chunks", type=click.IntRange(min=2), default=None,
        help="override pipeline.chunks: model chunks per device with --order interleaved "
             "(virtual stage s on device s % stages; zb-v and dualpipev have 2) [config default: 2]")


ENDS_WITH_COMMAND = False
"""True in a process that ends with its one command (the console scripts set it); never in tests, the
library or the trainer, which go on after a command."""


@contextmanager
def kept_until_exit() -> Iterator[None]:
    """Around loading and packing, in a process that ends with its command: what is alive after it (a
    packed job is millions of tuples without cycles) stays alive until exit, so the collector's passes
    over it, the one at exit included, free nothing and only take time (a tenth of a big job's run):
    it is frozen. The collector stays off until then: the packers pause it anyway
    (:func:`~pipefisher.schedule.packed.gc_paused`), and turned back on before the freeze, its first
    pass walks everything they allocated (some 60 ms of the heavy regression job's second)."""
    if not ENDS_WITH_COMMAND:
        yield
        return
    from pipefisher.schedule.packed import gc_paused

    with gc_paused(freeze=True):
        yield


def overlap_option() -> Any:
    """``--overlap/--no-overlap``: cycles that overlap (``schedule`` and ``run``); None where neither is
    given (the policy's default: :data:`pipefisher.policies.tight.OVERLAP_BY_DEFAULT`)."""
    return click.option(
        "--overlap/--no-overlap", default=None,
        help="let a factor's refresh pieces run on into the next cycle's first iterations, so a cycle is as "
             "short as its covariance, sync and total refresh work allow (the 'tight' and 'target' policies; "
             "the metadata records it) [default: on for those policies; --no-overlap: every refresh within "
             "its cycle]")
