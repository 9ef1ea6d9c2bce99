"""What a packing policy is: a loaded job in, one schedule per node plus its figures out.

A policy is a small object with a name and one method, :meth:`Policy.pack`. Everything it returns is
plain data: the label lists the trainer walks (the schedule file), the placements a chart draws, and
the figures a report prints. It lives with the schedule, below the policies, because the costs, the
schedule files and the reports read it too.
"""
from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Sequence

from pipefisher.schedule.format import START, label_category
from pipefisher.schedule.problem import DEFAULT_MARGIN
from pipefisher.schedule.timeline import Job, Time


class Placement(NamedTuple):
    """One label of a schedule, placed in time. ``start``/``end`` are relative to its iteration."""

    label: str
    start: Time
    end: Time
    iteration: int

    @property
    def duration(self) -> Time:
        return self.end - self.start

    @property
    def category(self) -> str:
        return label_category(self.label)


@dataclass(frozen=True)
class NodeFigures:
    """What a report says about one node's schedule."""

    iterations: int
    """Pipeline iterations per K-FAC cycle (the curvature refresh interval)."""
    usage: float
    """Percent of the cycle's time that is busy (pipeline work plus placed K-FAC work)."""
    cycle_time: Time
    """The time the cycle's iterations take (their pipeline time, plus any overflow)."""
    pipeline_busy: Time
    """Forward and backward time over the cycle."""
    kfac_placed: Time
    """K-FAC work placed over the cycle."""
    bubble_left: Time
    """Idle time left in the cycle."""
    overflow: Time = 0
    """Time added to iterations by work that fits in no bubble (0 for policies that never lengthen)."""
    lower_bound: int | None = None
    """A proven lower bound on ``iterations``, where the policy computes one: no schedule that
    ``validate`` accepts under the same margin has fewer (see :mod:`pipefisher.policies.bounds`)."""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def gap(self) -> int | None:
        """Iterations above the lower bound (0: proven optimal); None without a bound."""
        return None if self.lower_bound is None else self.iterations - self.lower_bound

    @property
    def optimal(self) -> bool:
        """Proven optimal: the cycle meets its lower bound."""
        return self.gap == 0


class LazyPlacements(Sequence[Placement]):
    """A node's placements, built on first use: the schedule file, the report and the checks need only the
    labels and figures, and a big job's placements are millions of tuples only a chart or a workload
    listing reads. It compares, iterates and pickles as the tuple it stands for."""

    def __init__(self, build: Callable[[], tuple[Placement, ...]]) -> None:
        self._build: Callable[[], tuple[Placement, ...]] | None = build
        self._items: tuple[Placement, ...] = ()

    def _all(self) -> tuple[Placement, ...]:
        if self._build is not None:
            self._items, self._build = self._build(), None
        return self._items

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[Placement]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LazyPlacements, tuple)):
            return self._all() == tuple(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self) -> tuple[type, tuple[tuple[Placement, ...]]]:
        return (tuple, (self._all(),))


KfacLayout = tuple[tuple[tuple[int, str, int], ...], ...]
"""A cycle's K-FAC labels where every iteration is ``-- start --``, the node's pipeline calls in timeline
order with K-FAC work between them and then its overflow, ``-- end --`` and markers: per iteration, in
order, each run of one K-FAC label (a queue's pieces back to back) as (the number of calls before it,
all of them for overflow; the label; how many times it runs there). It says what the labels say, in a
form whose size is the K-FAC work's, not the pipeline's."""


@dataclass(frozen=True)
class NodeSchedule:
    """One node's cycle: the labels per iteration (the schedule file's entry) and their placement."""

    iterations: tuple[tuple[str, ...], ...]
    placements: Sequence[Placement]
    """In time order per iteration; a tuple, or a :class:`LazyPlacements` that builds it on first use."""
    figures: NodeFigures
    layout: KfacLayout | None = None
    """The labels' :data:`KfacLayout`, where the policy built them so (None: only the labels say it)."""


@dataclass(frozen=True)
class JobSchedule:
    """A whole job's schedule as produced by one policy."""

    policy: str
    span: Time
    nodes: tuple[NodeSchedule, ...]
    margin: float = DEFAULT_MARGIN
    """The room rule's margin it was packed under (:mod:`pipefisher.schedule.problem`)."""
    overlap: bool = False
    """Its cycles overlap: some refresh pieces lie before their factor's completion, as pieces of the
    previous cycle's refresh (:mod:`pipefisher.schedule.problem`); ``validate`` checks it by that rule."""
    tradeoff: Any = None
    """The ``target`` policy's weighing (a :class:`pipefisher.cost.objective.Tradeoff`: the densities it packed
    and evaluated, this schedule one of them); None for the other policies."""

    def to_file_data(self) -> list[list[list[str]]]:
        """The schedule file's content: ``schedules[node][iteration] = [label, ...]``."""
        return [[list(it) for it in node.iterations] for node in self.nodes]


class Policy(ABC):
    """A way to pack a job's K-FAC work into its pipeline bubbles."""

    name: ClassVar[str]
    summary: ClassVar[str]

    @abstractmethod
    def pack(self, job: Job, margin: float = DEFAULT_MARGIN) -> JobSchedule:
        """Pack every node of ``job`` under the room rule with ``margin``. Pure: the job is not changed."""


@contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """Run a packer without the cyclic garbage collector.

    Packing a large job allocates hundreds of thousands of small tuples that never form cycles; the
    collector's passes over them took a third of the packing time and freed nothing. ``freeze``: what
    is alive at the end is frozen (:func:`gc.freeze`) before the collector is back, so no later pass
    walks it (:func:`pipefisher.cli._common.kept_until_exit`).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


def split_iterations(placed: Sequence[Placement | tuple[str, Time, Time]]) -> list[list[str]]:
    """Cut a flat label sequence into iterations at each ``-- start --``.

    Labels before the first ``-- start --`` (the published tool sorts early up-pipe items there) form
    a list of their own, as the published tool writes them.
    """
    out: list[list[str]] = [[]]
    for p in placed:
        label = p.label if isinstance(p, Placement) else p[0]
        if label == START and out[-1]:
            out.append([])
        out[-1].append(label)
    return out
