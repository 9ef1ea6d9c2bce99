"""A packed cycle becomes a node's schedule once: labels and figures now, placements when first read."""
from __future__ import annotations

import pickle

from pipefisher.bundled import example_timelines
from pipefisher.policies import get_policy
from pipefisher.schedule.packed import LazyPlacements, Placement, split_iterations
from pipefisher.schedule.timeline import load_job


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


def test_the_kfac_layout_says_what_the_labels_say() -> None:
    """Every iteration is ``-- start --``, the calls in timeline order with each run of K-FAC labels the
    layout places after as many calls as it says, ``-- end --`` and the markers; no two runs in a row are
    of the same label at the same place."""
    from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
    from pipefisher.schedule.problem import node_model

    job = load_job(example_timelines())
    for margin in (0.05, 3.0):  # 3: work that fits no bubble overflows after the last call
        for node, timeline in zip(get_policy("tight").pack(job, margin).nodes, job.nodes):
            keys = [key for key, _, _ in node_model(timeline, job.span).pipeline]
            assert node.layout is not None and len(node.layout) == len(node.iterations)
            for i, (labels, work) in enumerate(zip(node.iterations, node.layout)):
                rebuilt, done = [START], 0
                for calls, label, count in work:
                    rebuilt += keys[done:calls] + [label] * count
                    done = calls
                rebuilt += keys[done:] + [END] + [SAVE_OFF] * (i == 0) + [SAVE_ON] * (i == len(node.layout) - 1)
                assert tuple(rebuilt) == labels
                assert all(a[:2] != b[:2] for a, b in zip(work, work[1:]))
