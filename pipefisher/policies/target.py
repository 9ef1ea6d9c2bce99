"""The ``target`` policy: the packing density a user's time asks for, not merely the densest.

``tight`` packs for the shortest cycle k at the densest packing the room rule allows: the published
tool's goal, and a fine one when the K-FAC work costs exactly its profiled time. It does not: work
packed densely into bubbles runs longer and delays the pipeline, and the end-of-step preconditioning
is paid every step. ``target`` packs ``tight`` at its margin and at sparser ones
(:data:`pipefisher.cost.objective.DENSITIES`), evaluates each schedule's expected step time, and chooses
(:func:`pipefisher.cost.objective.tradeoff`): with the job's staleness curve, the least expected
time-to-target relative to first-order; without one, by a rule that needs no curve
(:func:`pipefisher.cost.objective.choose_without_curve`): the shortest cycle among the packings whose
planned step is within ``tolerance`` of the least (the densest alone where it is that close to the
floor no packing goes below). The tolerance is the price in step time the user accepts for fresher
curvature: without a curve nothing says what staleness costs, so it is an option, not a guess. Every candidate is a ``tight`` schedule, so it is dependency-correct under the margin it was
packed at, which is at least the one asked for.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Iterator, Sequence

from pipefisher.errors import InputError
from pipefisher.schedule.packed import JobSchedule, Policy, gc_paused
from pipefisher.policies.tight import OVERLAP_BY_DEFAULT, TightPolicy
from pipefisher.schedule.problem import DEFAULT_MARGIN
from pipefisher.schedule.timeline import Job


def cycle_bound(job: Job, margin: float, order: Sequence[int], overlap: bool = OVERLAP_BY_DEFAULT) -> Iterator[int]:
    """Per node of ``job``, in ``order``, a proven lower bound on its cycle in every valid schedule at
    ``margin`` (:mod:`pipefisher.policies.bounds`; the first-iteration bound left out, it walks every
    piece): their running maximum bounds the job's cycle k. One at a time, so that a proof needing only
    the first few costs only theirs. ``overlap``: in every valid overlapping schedule (the bounds of the
    problem ``tight`` then solves)."""
    from pipefisher.policies.bounds import model_bounds
    from pipefisher.schedule.problem import node_model

    for i in order:
        yield model_bounds(node_model(job.nodes[i], job.span, margin, overlap), first_iteration=False).tight


class TargetPolicy(Policy):
    """Pack for the user's cost, steps(k) x step_time(k), rather than for the shortest cycle."""

    name = "target"
    summary = ("the packing density with the least expected time-to-target given the job's staleness curve, "
               "else the shortest cycle whose planned step is within a tolerance of the least (tight at several "
               "margins)")
    options = ("staleness", "slowdown", "max_cycle", "overlap", "tolerance")

    def __init__(self, staleness: object = None, slowdown: float | None = None, max_cycle: int | None = None,
                 overlap: bool = OVERLAP_BY_DEFAULT, tolerance: float | None = None) -> None:
        """``staleness``: the job's :class:`~pipefisher.cost.staleness.StalenessCurve` (or its text: a file or
        ``k:ratio,...``), None for none; ``max_cycle``: the run's length in steps, where known (no
        schedule whose cycle the run does not complete is chosen); ``overlap``: ``tight``'s (cycles
        may overlap); ``tolerance``: without a curve, planned steps this close (a fraction, default
        :data:`~pipefisher.cost.objective.NO_CURVE_TOLERANCE`) tie and the shorter cycle wins."""
        from pipefisher.cost.objective import DEFAULT_SLOWDOWN, NO_CURVE_TOLERANCE
        from pipefisher.cost.staleness import StalenessCurve, read_staleness

        if isinstance(staleness, str):
            staleness = read_staleness(staleness)
        if staleness is not None and not isinstance(staleness, StalenessCurve):
            raise TypeError(f"staleness must be a StalenessCurve, its text or None, not {type(staleness).__name__}")
        self.staleness = staleness
        self.slowdown = DEFAULT_SLOWDOWN if slowdown is None else float(slowdown)
        self.max_cycle = None if max_cycle is None else int(max_cycle)
        self.overlap = bool(overlap)
        self.tolerance = NO_CURVE_TOLERANCE if tolerance is None else float(tolerance)
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise InputError(None, f"the 'target' policy's tolerance must be a fraction >= 0, got {tolerance!r}")

    def pack(self, job: Job, margin: float = DEFAULT_MARGIN) -> JobSchedule:
        from pipefisher.cost.objective import tradeoff

        with gc_paused():  # what it allocates never forms cycles; the packed candidates are millions of tuples
            weighed = tradeoff(job, TightPolicy(self.overlap).pack, margin, self.staleness, self.slowdown,
                               self.max_cycle, bound=partial(cycle_bound, overlap=self.overlap), each_node=True,
                               tolerance=self.tolerance)
        return dataclasses.replace(weighed.chosen.schedule, policy=self.name, tradeoff=weighed)
