"""Aligning a Chimera pair (:mod:`pipefisher.policies.align`) with refreshes in pieces: the pieces keep
their order, so the aligned cycle keeps the room rule by construction, as ``validate`` checks it."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipefisher.policies import get_policy
from pipefisher.rules import validate
from pipefisher.rules.groups import chimera_groups, job_groups
from pipefisher.schedule.problem import node_model
from pipefisher.schedule.timeline import load_job

PIECES = Path(__file__).resolve().parent / "data" / "profiles" / "chimera_tiny_2_pieces"
"""A profile of `run --config configs/tiny.yaml --order chimera --set kfac.refresh_pieces=2` (every
inverse key: two intervals, its refresh's two pieces, of different lengths on the two copies)."""


@pytest.mark.parametrize("policy,overlap", [("tight", False), ("tight", True), ("best-fit", False)])
@pytest.mark.parametrize("margin", [0.05, 0.5, 1.0])
def test_aligned_refresh_pieces_run_in_order_and_keep_the_room_rule(policy: str, overlap: bool, margin: float) -> None:
    """At margin 0.5 the aligner used to put an inverse's second piece back before its first (a first
    piece it had put off, for fear of a deadlock, was passed by the second): 6-8 room-rule breaks."""
    job = load_job(sorted(PIECES.glob("*_timeline.pickle")))
    assert job_groups(job) == chimera_groups(2)
    packed = get_policy(policy, overlap=overlap).pack(job, margin)
    assert not packed.overlap  # every piece after its pair's sync: an aligned cycle never overlaps the next
    assert validate(packed.to_file_data(), job, margin=margin) == []
    for n, node in enumerate(packed.nodes):
        durations = node_model(job.nodes[n], job.span, margin).durations
        runs: dict[str, list[int]] = {}
        for p in node.placements:
            if p.label.startswith("inv_kron_"):
                runs.setdefault(p.label, []).append(p.end - p.start)
        assert runs and all(tuple(d) == durations[label] for label, d in runs.items())
        assert any(len(d) == 2 and d[0] != d[1] for d in runs.values())  # pieces that a swap would show
