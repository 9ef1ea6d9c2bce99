"""The ``target`` policy: the schedule with the least expected time to a target loss.

``tight`` packs for the shortest cycle k at the densest packing the room rule allows: the published
tool's goal, and a fine one when the K-FAC work costs exactly its profiled time. It does not: work
packed densely into bubbles runs longer and delays the pipeline, and the end-of-step preconditioning
is paid every step. ``target`` packs ``tight`` at its margin and at sparser ones
(:data:`pipefisher.objective.DENSITIES`), evaluates each schedule's expected step time and its
curvature's staleness (:mod:`pipefisher.objective`), and keeps the one with the least expected
time-to-target relative to first-order. Every candidate is a ``tight`` schedule, so it is
dependency-correct under the margin it was packed at, which is at least the one asked for.
"""
from __future__ import annotations

import dataclasses

from pipefisher.policies.base import JobSchedule, Policy
from pipefisher.policies.tight import TightPolicy
from pipefisher.problem import DEFAULT_MARGIN
from pipefisher.timeline import Job


class TargetPolicy(Policy):
    """Pack for the user's cost, steps(k) x step_time(k), rather than for the shortest cycle."""

    name = "target"
    summary = "the packing density and cycle with the least expected time-to-target (tight at several margins)"
    options = ("staleness", "slowdown")

    def __init__(self, staleness: object = None, slowdown: float | None = None) -> None:
        from pipefisher.objective import DEFAULT_SLOWDOWN, MEASURED_STALENESS, StalenessCurve

        if isinstance(staleness, str):
            staleness = StalenessCurve.parse(staleness)
        self.staleness = staleness if isinstance(staleness, StalenessCurve) else MEASURED_STALENESS
        self.slowdown = DEFAULT_SLOWDOWN if slowdown is None else float(slowdown)

    def pack(self, job: Job, margin: float = DEFAULT_MARGIN) -> JobSchedule:
        from pipefisher.objective import Tradeoff, choose, tradeoff

        candidates = tradeoff(job, TightPolicy().pack, margin, self.staleness, self.slowdown)
        best = choose(candidates)
        weighed = Tradeoff(tuple(candidates), best, self.staleness, self.slowdown)
        return dataclasses.replace(best.schedule, policy=self.name, tradeoff=weighed)
