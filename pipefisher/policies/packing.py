"""One path from profiled timelines to a schedule file: pack, check by ``pipefisher validate``'s rules, save.

``pipefisher run``, ``pipefisher schedule`` and :func:`pipefisher.runtime.torch_pp.wrap` all pack through
:func:`pack_job`, check by :attr:`Packing.violations` (``run`` and ``wrap``: ``schedule`` leaves that to
``validate``) and write through :meth:`Packing.save`, so each records the same metadata beside its
schedule (:func:`pipefisher.schedule.file.save_schedule`): the margins, the timelines, and
``packed_for``, the job it fits (what the timelines say, plus the run config's shape where the caller
knows it). Torch-free: the scheduling path uses it.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Mapping

from pipefisher.rules import Violation, validate
from pipefisher.schedule.file import job_layout, save_schedule
from pipefisher.schedule.packed import JobSchedule, Policy
from pipefisher.schedule.timeline import Job, inflate_kfac


@dataclass(frozen=True)
class Packing:
    """A job packed by a policy: ``job`` as packed (K-FAC times x ``kfac_margin``), its ``schedule`` and
    the ``timelines`` it was packed from."""

    job: Job
    schedule: JobSchedule
    timelines: list[str]
    kfac_margin: float = 1.0

    @functools.cached_property
    def violations(self) -> list[Violation]:
        """Every rule of ``validate`` the schedule breaks, by the room rule of the margin it was packed
        under (``target`` may choose its own); checked when first asked (``pipefisher schedule`` prints
        the published report, and leaves the check to ``validate``)."""
        packed = self.schedule
        return validate(packed.to_file_data(), self.job, margin=packed.margin, overlap=packed.overlap)

    @property
    def problem(self) -> str | None:
        """The violations in one line (how many, the first), or None where there are none."""
        if not self.violations:
            return None
        return f"the schedule breaks {len(self.violations)} rule(s) of pipefisher validate; first: {self.violations[0]}"

    def save(self, path: str | os.PathLike[str], packed_for: Mapping[str, Any] | None = None) -> None:
        """Write the schedule and its metadata atomically; ``packed_for``: the run config's shape
        (:func:`pipefisher.runtime.pipeline.checks.packed_for`), over what the timelines say of the job."""
        save_schedule(path, self.schedule, timelines=self.timelines, kfac_margin=self.kfac_margin,
                      packed_for={**job_layout(self.job), **(packed_for or {})})


def pack_job(job: Job, packer: Policy, margin: float, *, kfac_margin: float = 1.0) -> Packing:
    """Pack ``job`` with its K-FAC times x ``kfac_margin`` (slack for work that runs slower than
    profiled, :func:`pipefisher.schedule.timeline.inflate_kfac`) by ``packer`` under the room rule's ``margin``;
    :attr:`Packing.violations` checks it."""
    timelines = [n.path for n in job.nodes]
    job = inflate_kfac(job, kfac_margin)
    return Packing(job, packer.pack(job, margin), timelines, kfac_margin)
