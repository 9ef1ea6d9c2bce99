"""A literal, slow transcription of the published PipeFisher packer (``docs/compat-policy.md``).

It exists for two reasons only: as the oracle that the fast :mod:`pipefisher.policies.compat` is
checked against on generated jobs, and as the same-run speed baseline of ``scripts/bench_compat.py``.
It keeps the published tool's data structures on purpose (deep copies, whole-list rescans), so do not
"fix" it; it is not a registered policy.
"""
from __future__ import annotations

import copy
from typing import Any

from pipefisher.schedule.timeline import BACKWARD, FORWARD, KFAC_KINDS, COV_KINDS, Job, NodeTimeline

MARGIN = 0.05


class RefItem:
    def __init__(self, label: str, start: Any, end: Any, priority: int = 0) -> None:
        self.label, self.start, self.end, self.priority = label, start, end, priority

    @property
    def duration(self) -> Any:
        return self.end - self.start


class RefQueue(RefItem):
    def __init__(self, label: str, start: Any, end: Any, priority: int, pieces: int) -> None:
        super().__init__(label, start, end, priority)
        self.pieces = pieces
        self.step = (end - start) // pieces
        self.next_id: int | None = 0

    def pop(self) -> RefItem:
        i = self.next_id
        assert i is not None
        self.next_id = i + 1 if i + 1 < self.pieces else None
        return RefItem(self.label, self.start + i * self.step, self.start + (i + 1) * self.step, self.priority)


def _blocked(w: RefItem, work: list[RefItem]) -> bool:
    def pending(*kinds: str) -> bool:
        return any(k in x.label for x in work for k in kinds)

    if "sync_kron_A" in w.label and pending("cov_kron_A"):
        return True
    if "sync_kron_B" in w.label and pending("cov_kron_B"):
        return True
    if "inv_kron_A" in w.label and pending("cov_kron_A", "sync_kron_A"):
        return True
    if "inv_kron_B" in w.label and pending("cov_kron_B", "sync_kron_B"):
        return True
    return False


def ref_fill(work: list[RefItem], base: list[RefItem], nf: int, nb: int) -> list[RefItem]:
    out = [base[0]]
    prev = base[0]
    for nxt in base[1:]:
        if prev.label == FORWARD:
            nf += 1
        elif prev.label == BACKWARD:
            nb += 1
        t, limit = prev.end, nxt.start
        while True:
            placed = False
            for w in work:  # removing while iterating skips the next item: reproduced on purpose
                if isinstance(w, RefQueue):
                    while t + w.step * (1 + MARGIN) < limit:
                        if "cov_kron_A" in w.label and nf < w.next_id + 1:
                            break
                        if "cov_kron_B" in w.label and nb < w.next_id + 1:
                            break
                        piece = w.pop()
                        d = piece.duration
                        piece.start, piece.end = t, t + d
                        out.append(piece)
                        t += d
                        placed = True
                        if w.next_id is None:
                            work.remove(w)
                            break
                elif t + w.duration * (1 + MARGIN) < limit and not _blocked(w, work):
                    d = w.duration
                    w.start, w.end = t, t + d
                    out.append(w)
                    t += d
                    work.remove(w)
                    placed = True
            if not placed:
                break
        out.append(nxt)
        prev = nxt
    return out


def _zero(t: Any) -> Any:
    return 0 if t is None else t


def ref_pack_node(node: NodeTimeline, span: Any) -> tuple[list[list[str]], int, float]:
    pipeline = [RefItem("-- start --", 0, 0)]
    for word in (FORWARD, BACKWARD):
        for key, ivs in node.entries.items():
            if word in key:
                pipeline += [RefItem(key, _zero(iv.start), _zero(iv.end)) for iv in ivs]
    pipeline.append(RefItem("-- end --", span, span))
    pipeline.sort(key=lambda x: x.start)
    n = sum(1 for x in pipeline if x.label == FORWARD)

    work: list[RefItem] = []
    for priority, kind in enumerate(KFAC_KINDS):
        for key, ivs in node.entries.items():
            if kind in key:
                for iv in ivs:
                    s, e = _zero(iv.start), _zero(iv.end)
                    work.append(RefQueue(key, s, e, priority, n) if kind in COV_KINDS else RefItem(key, s, e, priority))
    work.sort(key=lambda x: x.start)
    work.sort(key=lambda x: x.priority)

    sched = ref_fill(work, pipeline, 0, 0)
    sched.append(RefItem("turn_off_save_inputs_outgrads", sched[-1].end, sched[-1].end))
    while work:
        trial = copy.deepcopy(work)
        attempt = ref_fill(trial, sched, n, n)
        if not trial:
            sched = attempt
            break
        before = len(work)
        sched += ref_fill(work, pipeline, n, n)
        if len(work) == before:
            sched += work
            work = []
    sched.append(RefItem("turn_on_save_inputs_outgrads", sched[-1].end, sched[-1].end))

    iterations = sum(1 for x in sched if x.label == "-- start --")
    usage = sum(x.end - x.start for x in sched) / (span * iterations) * 100
    labels: list[list[str]] = [[]]
    for x in sched:
        if x.label == "-- start --" and labels[-1]:
            labels.append([])
        labels[-1].append(x.label)
    return labels, iterations, usage


def ref_pack_job(job: Job) -> tuple[list[list[list[str]]], list[str]]:
    """The schedule file and report lines the published tool writes for ``job``."""
    schedules, lines = [], []
    for i, node in enumerate(job.nodes):
        labels, iterations, usage = ref_pack_node(node, job.span)
        schedules.append(labels)
        lines.append(f"node{i}:{iterations} pipeline iterations (usage: {usage:.2f} %)")
    return schedules, lines
