"""A packed cycle becomes a node's schedule once: labels and figures now, placements when first read."""
from __future__ import annotations

import pickle

from pipefisher.examples import example_timelines
from pipefisher.policies import get_policy
from pipefisher.policies.base import LazyPlacements, Placement, split_iterations
from pipefisher.timeline import load_job


def test_placements_follow_the_labels_of_every_iteration() -> None:
    job = load_job(example_timelines())
    for node in get_policy("tight").pack(job).nodes:
        assert split_iterations(node.placements) == [list(it) for it in node.iterations]
        iterations = [p.iteration for p in node.placements]
        assert iterations == sorted(iterations)


def test_lazy_placements_are_built_once_and_behave_as_their_tuple() -> None:
    built = []
    items = (Placement("-- start --", 0, 0, 0), Placement("call_forward", 0, 5, 0))

    def build() -> tuple[Placement, ...]:
        built.append(1)
        return items

    lazy = LazyPlacements(build)
    assert built == []  # nothing until read
    assert len(lazy) == 2 and lazy[1].label == "call_forward" and list(lazy) == list(items)
    assert lazy == items and lazy == LazyPlacements(lambda: items) and lazy != items[:1]
    assert pickle.loads(pickle.dumps(lazy)) == items and type(pickle.loads(pickle.dumps(lazy))) is tuple
    assert built == [1]
