"""Lower bounds on the cycle: each is a true bound, and each catches what it is meant to catch."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipefisher.schedule.problem import fits
from pipefisher.policies.bounds import (
    Chain,
    ceil_ratio,
    chain_finish,
    first_iteration_bound,
    fittable_work,
    node_bounds,
    one_iteration_possible,
    placed_time,
    size_class_bound,
    volume_bound,
)


def test_fits_is_the_published_rule_with_its_margin() -> None:
    assert fits(100, 106)
    assert not fits(100, 105)  # strict: 105 is not room for 100 * 1.05
    assert fits(0, 1) and not fits(0, 0)


def test_ceil_ratio_is_exact_for_ints_and_never_too_high_for_floats() -> None:
    assert ceil_ratio(10, 5) == 2 and ceil_ratio(11, 5) == 3 and ceil_ratio(0, 5) == 0
    assert ceil_ratio(0.3, 0.1) == 3  # 0.3 / 0.1 = 3.0000000000000004 in floats


def test_volume_bound() -> None:
    assert volume_bound(0, 0) == 1
    assert volume_bound(250, 100) == 3
    assert volume_bound(300, 100) == 3


def test_size_classes_put_big_items_in_big_bubbles() -> None:
    # Three items of 90 only fit the one bubble of 100: three iterations, though the volume is low.
    bubbles = [100, 50, 50, 50, 50]
    assert volume_bound(270, sum(bubbles)) == 1
    assert size_class_bound([(90, 3)], bubbles) == 3


def test_counting_bound() -> None:
    # A bubble of 100 holds at most one item of 60 (60 + 60 * 1.05 > 100), so four need four iterations.
    assert size_class_bound([(60, 4)], [100]) == 4
    # and at most three of 30 ((3 + 0.05) * 30 < 100), so seven need three.
    assert size_class_bound([(30, 7)], [100]) == 3


def test_chain_finish_follows_the_chain_through_the_bubbles() -> None:
    bubbles = [(1, 100), (3, 400), (5, 100)]
    # last piece after pipeline item 4 (only bubble 2 of iteration 0 is after it); a sync of 300 only
    # fits bubble 1, so it waits for iteration 1; the inverse of 90 fits bubble 2 of iteration 1.
    assert chain_finish((4, 10), [300], [90], bubbles) == 1
    # an inverse that only fits the big bubble, after the sync that needs it too: iteration 2
    assert chain_finish((4, 10), [300], [300], bubbles) == 2
    # overflow (fits no bubble) ends the iteration: the inverse goes to the next one
    assert chain_finish((0, 10), [1000], [10], bubbles) == 1
    assert chain_finish(None, [], [], bubbles) == 0


def test_one_iteration_needs_room_after_each_release() -> None:
    bubbles = [(1, 100), (2, 100)]
    early = Chain(((0, 50),), (40,))
    late = Chain(((1, 50),), (60,))
    assert one_iteration_possible([early], bubbles)
    assert not one_iteration_possible([late], bubbles)  # 110 of work after item 1, 100 of room
    assert not one_iteration_possible([Chain((), (10,), tail_after_overflow=True)], bubbles)


def test_first_iteration_holds_only_work_released_before_each_bubble() -> None:
    # bubble at position 0 (before any forward), bubble at position 2; 15 of work released at 1
    bubbles = [(0, 10), (2, 10)]
    chains = [Chain(((1, 5),), ()), Chain(((1, 5),), ()), Chain(((1, 5),), ())]
    assert volume_bound(15, 20) == 1
    assert first_iteration_bound(chains, bubbles, 20) == 2  # iteration 0 holds 10 at most
    # a sync/inverse is released with its factor's last piece
    assert first_iteration_bound([Chain(((0, 5),), (4,))], [(1, 10)], 10) == 1
    assert first_iteration_bound([Chain(((1, 5),), (30,))], [(0, 20), (2, 20)], 40) == 2


def test_node_bounds_leave_out_work_that_fits_no_bubble() -> None:
    b = node_bounds([(500, 1), (40, 4)], [100, 100])
    assert b.forced_items == 1 and b.fittable_work == 160 and b.volume == 1 and b.tight == 1
    # four of 50: one per bubble (50 + 50 * 1.05 > 100), so two iterations though the volume fits one
    assert node_bounds([(50, 4)], [100, 100]).tight == 2


# -- the bounds are bounds: brute force on tiny instances ------------------------------------------


def _best_assignment(items: list[int], bubbles: list[int], k: int) -> bool:
    """Whether the items fit k copies of the bubbles (no dependencies), by exhaustive search."""
    bins = bubbles * k
    used = [0] * len(bins)
    small = [10**9] * len(bins)
    order = sorted(items, reverse=True)

    def place(i: int) -> bool:
        if i == len(order):
            return True
        d = order[i]
        for j, g in enumerate(bins):
            low = min(small[j], d)
            # necessary for any order: the last item (at least the smallest) needs its margin
            if used[j] + d + 0.05 * low < g:
                used[j] += d
                old, small[j] = small[j], low
                if place(i + 1):
                    return True
                used[j] -= d
                small[j] = old
        return False

    return place(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.lists(st.integers(1, 100), min_size=1, max_size=3))
def test_size_and_volume_bounds_never_exceed_the_optimum(items: list[int], bubbles: list[int]) -> None:
    largest = max(bubbles)
    items = [d for d in items if fits(d, largest)]
    if not items:
        return
    bound = node_bounds([(d, 1) for d in items], bubbles).tight
    # Only the smallest item's margin is charged per bubble: a relaxation of the packer's rule, so this
    # optimum is no more than what any policy achieves.
    k = 1
    while not _best_assignment(items, bubbles, k):
        k += 1
    assert bound <= k


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=5),
       st.lists(st.tuples(st.integers(0, 4), st.integers(1, 100)), min_size=1, max_size=3))
def test_first_iteration_bound_never_exceeds_the_optimum(pieces: list[tuple[int, int]],
                                                        bubbles: list[tuple[int, int]]) -> None:
    largest = max(g for _, g in bubbles)
    pieces = [(r, d) for r, d in pieces if fits(d, largest)]
    if not pieces:
        return
    bound = first_iteration_bound([Chain((p,), ()) for p in pieces], bubbles, sum(g for _, g in bubbles))

    def feasible(k: int) -> bool:
        bins = [(i, pos, g) for i in range(k) for pos, g in bubbles]
        used = [0] * len(bins)
        order = sorted(pieces, key=lambda p: -p[1])

        def place(j: int) -> bool:
            if j == len(order):
                return True
            r, d = order[j]
            for b, (i, pos, g) in enumerate(bins):
                if (i > 0 or r < pos) and used[b] + d * 1.05 < g:
                    used[b] += d
                    if place(j + 1):
                        return True
                    used[b] -= d
            return False

        return place(0)

    k = 1
    while not feasible(k):
        k += 1
    assert bound <= k


def test_fittable_work_sums_the_pieces_that_fit_a_bubble_in_work_order() -> None:
    # the fast sum (every piece fits) and the filtered one give the plain walk's figure to the bit,
    # on integer nanoseconds and on float seconds alike
    import random

    from pipefisher.schedule.problem import node_model
    from pipefisher.schedule.timeline import job_from_dicts
    from pipefisher.sim.random_jobs import random_raw_job

    cases = set()
    for seed in range(12):
        raw = random_raw_job(seed)
        origin = raw[0]["start_end"][0][0]
        scale = random.Random(seed).uniform(0.9, 1.1) / 1e9
        def secs(t):
            return None if t is None else (t - origin) * scale

        seconds = [{k: [(secs(s), secs(e)) for s, e in v] for k, v in node.items()} for node in raw]
        for job in (job_from_dicts(raw), job_from_dicts(seconds)):
            for node in job.nodes:
                for margin in (0.05, 4.0):
                    model = node_model(node, job.span, margin)
                    walked = sum(d for w in model.work for d in w.pieces if d * model.scale < model.largest)
                    got = fittable_work(model)
                    assert got == walked and type(got) is type(walked)
                    cases.add(all(d * model.scale < model.largest for w in model.work for d in w.pieces))
    assert cases == {True, False}  # both ways are taken


def test_placed_time_is_the_placements_lengths_summed_in_order() -> None:
    placed = [(0, "a", 0.1, 0.30000000000000004), (1, "b", 0.7, 1.1), (1, "c", 1.1, 1.3)]
    assert placed_time(placed) == sum(e - s for _, _, s, e in placed)
    assert placed_time([(0, "a", 3, 10), (2, "b", 10, 11)]) == 8 and placed_time([]) == 0
