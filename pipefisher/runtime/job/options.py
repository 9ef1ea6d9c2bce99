"""How a run trains, as opposed to what model it trains (that is the :class:`~pipefisher.runtime.job.config.RunConfig`):
:class:`TrainOptions`, in sections that each check themselves, as torchtitan's per-component configs do.

The sections: what runs (mode, steps, schedule: :class:`TrainOptions` itself), logging
(:class:`LogOptions`), evaluation (:class:`EvalOptions`), checkpoints (:class:`CheckpointOptions`) and the
closed loop (:class:`AdaptOptions`). ``train``'s and ``run``'s flags mirror them, one flag per field
(:data:`FLAGS`, the one table from flag names to fields): :meth:`TrainOptions.of` builds the options from
them, :meth:`TrainOptions.flags` gives them back (the workers' options travel as them, and a checkpoint's
manifest records :data:`RUN_OPTIONS` of them). Plain Python, no torch: the command line checks its
options here, once, before torch loads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipefisher.loop.drift import AGING_HIGH, AGING_LOW
from pipefisher.errors import InputError
from pipefisher.policies import DEFAULT_POLICY

MODES = ("first-order", "kfac", "scheduled")
"""How a worker trains: the pipeline alone, with K-FAC after it, or with K-FAC in its bubbles (a schedule)."""


class OptionError(InputError, ValueError):
    """Options that do not go together, said as the command line's flags say them (one line naming them,
    exit 2); to a library caller, a :class:`ValueError` as well."""


def check_mode(mode: str, schedule: str | None, profile: bool = False, adapt: bool = False) -> None:
    """What runs: ``mode`` one of :data:`MODES`, a ``schedule`` file exactly with mode ``scheduled``,
    profiling (kfac steps) without one, ``adapt`` (re-packing the schedule) with one. The one check of
    them: :class:`TrainOptions`', :func:`~pipefisher.runtime.train.worker.build_worker`'s and the command
    line's, before torch loads."""
    if mode not in MODES:
        raise OptionError(None, f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "scheduled" and schedule is None:
        raise OptionError(None, "--mode scheduled needs --schedule FILE")
    if schedule is not None and mode != "scheduled":
        raise OptionError(None, f"--schedule FILE trains in scheduled mode, not {mode}")
    if profile and schedule is not None:
        raise OptionError(None, "--profile runs kfac steps; it does not take a schedule file")
    if adapt and schedule is None:
        raise OptionError(None, "--adapt re-packs a schedule while training: it needs --schedule FILE")


def check_adapt_drift(drift: bool, adapt: bool, staleness: bool) -> None:
    """The drift rule sets ``--adapt``'s cycle only where there is one for it to set: with ``--adapt``,
    without a staleness curve (``staleness``: whether there is one). One line naming the flag."""
    if drift and not adapt:
        raise OptionError("--adapt-drift", "lets the drift rule set --adapt's cycle, and there is no --adapt; add "
                                           "--adapt, or drop --adapt-drift")
    if drift and staleness:
        raise OptionError("--adapt-drift", "lets the drift rule set --adapt's cycle where there is no staleness "
                                           "curve; with --staleness the curve sets it: drop one of them")


def _check_every(what: str, every: int, least: int = 0) -> None:
    """A section's ``every`` (steps between its events; 0: none, where ``least`` allows it)."""
    if every < least:
        raise ValueError(f"{what}.every must be at least {least} step{'s' if least != 1 else ''}, not {every}")


@dataclass(frozen=True)
class LogOptions:
    """What a run says and writes as it goes: a loss line every ``every`` steps, the progress bar
    (``progress``), the ``out`` folder's files, the ``metrics`` CSV (step, loss, val_loss, lr, step time,
    mode; reporting worker) and ``tensorboard`` logs (reporting worker; see ``runtime.train.tensorboard``)."""

    every: int = 5
    progress: bool = True
    out: str | None = None
    metrics: str | None = None
    tensorboard: str | None = None

    def __post_init__(self) -> None:
        _check_every("log", self.every, 1)


@dataclass(frozen=True)
class EvalOptions:
    """Held-out evaluations every ``every`` steps (0: none; the last step is always one)."""

    every: int = 0

    def __post_init__(self) -> None:
        _check_every("evaluation", self.every)


@dataclass(frozen=True)
class CheckpointOptions:
    """Checkpoints into ``folder`` every ``every`` steps (0: only at the end, if ``folder``); ``resume``:
    the checkpoint folder to continue from."""

    folder: str | None = None
    every: int = 0
    resume: str | None = None

    def __post_init__(self) -> None:
        _check_every("checkpoint", self.every)


@dataclass(frozen=True)
class AdaptOptions:
    """The closed loop of scheduled mode (:mod:`pipefisher.runtime.train.adapt`): measurements always,
    re-packing the schedule with ``enabled`` (by ``policy``, over the last ``window`` steps' ``quantile``;
    ``tie``: the step-time improvement that counts). Without a staleness curve the cycle k stays the
    packing's unless ``drift``: then the drift rule sets it (:mod:`pipefisher.loop.drift`; opt-in until validated
    beyond the job it was fitted on), by its thresholds on the curvature's aging and the longest cycle
    ``max_cycle`` (None: :func:`pipefisher.loop.drift.longest_cycle` of the steps). ``margin``: the room rule's
    for re-packs (default: the schedule's recorded one); ``schedule_timelines``: the profile the schedule
    was packed from (default: its metadata's); ``measure_prefix``: where measurement files go (default:
    ``out/<name>`` with an ``out`` folder); ``staleness``: the job's staleness curve as data (options travel
    to the workers as JSON: :meth:`pipefisher.cost.staleness.StalenessCurve.to_data`); ``overlap``: re-packs may
    let cycles overlap (None: the policy's default, on for ``tight`` and ``target``)."""

    enabled: bool = False
    policy: str = DEFAULT_POLICY
    window: int = 4
    quantile: float = 0.5
    tie: float = 0.04
    drift: bool = False
    aging_low: float = AGING_LOW
    aging_high: float = AGING_HIGH
    max_cycle: int | None = None
    margin: float | None = None
    schedule_timelines: tuple[str, ...] | None = None
    measure_prefix: str | None = None
    staleness: dict[str, Any] | None = None
    overlap: bool | None = None

    def __post_init__(self) -> None:
        if not 0 < self.aging_low < self.aging_high:
            raise ValueError("the drift rule's aging thresholds need 0 < adapt.aging_low < adapt.aging_high")
        if self.margin is not None:
            from pipefisher.schedule.problem import check_margin

            try:
                check_margin(self.margin)
            except ValueError as err:
                raise ValueError(f"adapt.{err}") from None
        check_adapt_drift(self.drift, self.enabled, self.staleness is not None)

    @property
    def staleness_curve(self) -> Any:
        """:attr:`staleness` as a :class:`~pipefisher.cost.staleness.StalenessCurve` (None without one)."""
        from pipefisher.cost.staleness import StalenessCurve

        return None if self.staleness is None else StalenessCurve.from_data(self.staleness, "--staleness")


@dataclass(frozen=True)
class TrainOptions:
    """What to run: ``mode`` (:data:`MODES`; ``profile``: kfac steps, timed), ``steps`` in all, the
    ``schedule`` file of scheduled mode (``allow_schedule_mismatch``: train one whose metadata says it fits
    another job), and the sections: :attr:`log`, :attr:`evaluation`, :attr:`checkpoint`, :attr:`adapt`."""

    mode: str = "first-order"
    steps: int = 10
    profile: bool = False
    schedule: str | None = None
    allow_schedule_mismatch: bool = False
    log: LogOptions = field(default_factory=LogOptions)
    evaluation: EvalOptions = field(default_factory=EvalOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    adapt: AdaptOptions = field(default_factory=AdaptOptions)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"run.steps must be at least 1, not {self.steps}")
        check_mode(self.mode, self.schedule, self.profile, self.adapt.enabled)

    @property
    def effective_mode(self) -> str:
        return "kfac" if self.profile else self.mode

    @classmethod
    def of(cls, **flags: Any) -> TrainOptions:
        """The options from flag-named values (:data:`FLAGS`: ``log_every=10``, ``adapt=True``, ...), the
        rest at their defaults; an unknown name is a :class:`TypeError`, as a dataclass's."""
        unknown = sorted(set(flags) - set(FLAGS))
        if unknown:
            raise TypeError(f"TrainOptions has no option {', '.join(unknown)} (known: {', '.join(FLAGS)})")
        sections: dict[str | None, dict[str, Any]] = {}
        for name, value in flags.items():
            section, key = FLAGS[name]
            sections.setdefault(section, {})[key] = value
        parts = {name: _SECTIONS[name](**values) for name, values in sections.items() if name is not None}
        return cls(**sections.get(None, {}), **parts)

    def flags(self) -> dict[str, Any]:
        """The options by flag name (:data:`FLAGS`), every one: what :meth:`of` takes back."""
        return {name: getattr(self if section is None else getattr(self, section), key)
                for name, (section, key) in FLAGS.items()}


_SECTIONS = {"log": LogOptions, "evaluation": EvalOptions, "checkpoint": CheckpointOptions, "adapt": AdaptOptions}

FLAGS: dict[str, tuple[str | None, str]] = {
    **{f.name: (None, f.name) for f in dataclasses.fields(TrainOptions) if f.name not in _SECTIONS},
    "out": ("log", "out"), "log_every": ("log", "every"), "progress": ("log", "progress"),
    "metrics": ("log", "metrics"), "tensorboard": ("log", "tensorboard"),
    "eval_every": ("evaluation", "every"),
    "checkpoint_dir": ("checkpoint", "folder"), "checkpoint_every": ("checkpoint", "every"),
    "resume": ("checkpoint", "resume"),
    **{("adapt" if f.name == "enabled" else f.name if f.name in ("margin", "schedule_timelines", "measure_prefix",
                                                                 "staleness") else f"adapt_{f.name}"): ("adapt", f.name)
       for f in dataclasses.fields(AdaptOptions)},
}
"""Every option by its flag's name (``--log-every`` is ``log_every``), with its section (None: the options
themselves) and field there. The one table between the flags and the sections."""

def section_class(section: str | None) -> type:
    """The dataclass of a :data:`FLAGS` section (None: :class:`TrainOptions` itself)."""
    return TrainOptions if section is None else _SECTIONS[section]


RUN_OPTIONS = ("adapt", "adapt_policy", "adapt_drift", "adapt_overlap", "margin", "eval_every", "checkpoint_every",
               "log_every", "tensorboard")
"""The options a checkpoint's manifest records (``options``, by flag name): what ``pipefisher run --resume``
runs again."""
