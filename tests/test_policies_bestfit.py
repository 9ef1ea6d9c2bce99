"""The ``best-fit`` baseline: valid by construction, and never better than ``tight``."""
from __future__ import annotations

from pipefisher.policies import get_policy
from pipefisher.policies.bestfit import pack_best_fit
from pipefisher.rules import validate
from pipefisher.schedule.problem import node_model
from pipefisher.schedule.timeline import job_from_dicts
from pipefisher.sim.random_jobs import random_raw_job


def _node(bubbles: list[int], items: dict[str, int]) -> dict:
    """One forward per bubble, each followed by a bubble of the given length; then one backward."""
    d: dict = {"call_forward": [], "call_backward": []}
    t = 0
    for g in bubbles:
        d["call_forward"].append((t, t + 10))
        t += 10 + g
    d["call_backward"].append((t, t + 10))
    for key, length in items.items():
        d[key] = [(0, length)]
    d["start_end"] = [(0, t + 10)]
    return d


def test_largest_ready_item_that_fits_goes_first() -> None:
    # One bubble of 100 after the forward (m = 1): the inverse of 60 cannot go before its sync, so the
    # bubble takes the covariance piece (30) then the sync (20); the inverse waits for the next iteration.
    job = job_from_dicts([_node([100], {"cov_kron_A:l": 30, "sync_kron_A:l": 20, "inv_kron_A:l": 60})])
    model = node_model(job.nodes[0], job.span)
    packed = pack_best_fit(model)
    assert packed.iterations == 2
    assert [label for _, label, _, _ in packed.in_bubbles[0]] == ["cov_kron_A:l", "sync_kron_A:l"]
    assert [label for _, label, _, _ in packed.in_bubbles[1]] == ["inv_kron_A:l"]


def test_work_that_fits_no_bubble_overflows_at_the_end_of_the_iteration() -> None:
    job = job_from_dicts([_node([100], {"cov_kron_A:l": 30, "inv_kron_A:l": 500})])
    packed = pack_best_fit(node_model(job.nodes[0], job.span))
    assert packed.iterations == 1 and packed.overflow[0] == [("inv_kron_A:l", 500)]


def test_best_fit_is_valid_and_tight_never_loses_to_it() -> None:
    best_fit, tight = get_policy("best-fit"), get_policy("tight")
    for seed in range(60):
        job = job_from_dicts(random_raw_job(seed))
        ours, theirs = tight.pack(job), best_fit.pack(job)
        assert not validate(theirs.to_file_data(), job), seed
        for a, b in zip(ours.nodes, theirs.nodes):
            assert a.figures.iterations <= b.figures.iterations, seed
            assert b.figures.lower_bound is not None and b.figures.lower_bound <= b.figures.iterations


def test_equally_large_items_go_in_key_order_or_with_later_first_in_reverse() -> None:
    # One bubble of 50: two equal pieces (20) of two queues, room for two pieces but three are asked.
    job = job_from_dicts([_node([50], {"cov_kron_A:a": 20, "cov_kron_A:b": 20, "cov_kron_A:c": 20})])
    model = node_model(job.nodes[0], job.span)
    first = [label for _, label, _, _ in pack_best_fit(model).in_bubbles[0]]
    last = [label for _, label, _, _ in pack_best_fit(model, later_first=True).in_bubbles[0]]
    assert first == ["cov_kron_A:a", "cov_kron_A:b"]
    assert last == ["cov_kron_A:c", "cov_kron_A:b"]
