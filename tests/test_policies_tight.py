"""The ``tight`` policy: valid by construction, never worse than an honest valid ``compat``, near the bound."""
from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _realistic_jobs import realistic_family, realistic_job, realistic_shapes
from _valid_schedules import PLAIN_GREEDIES, plain_greedy_cycle
from conftest import COMPAT_CASES, case_timelines, small_node
from pipefisher.policies import DEFAULT_POLICY, get_policy
from pipefisher.policies.bestfit import pack_best_fit
from pipefisher.policies.bounds import model_bounds
from pipefisher.policies.compat import pack_node_slots
from pipefisher.schedule.packed import split_iterations
from pipefisher.policies.tight import (_pack_fixed, fixed_fails_at_once, honest_compat, pack_fixed, pack_greedy,
                                       pack_node, pack_nodes, shorter_valid_compat)
from pipefisher.outputs.report import usage_lines
from pipefisher.rules import validate, validate_node
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.problem import fits
from pipefisher.schedule.problem import COV, NodeModel, node_model
from pipefisher.schedule.timeline import COV_KINDS, Job, TimelineKey, job_from_dicts, load_job
from pipefisher.sim.random_jobs import random_raw_job

TIGHT = get_policy("tight")




def check_job(job: Job, against_compat: bool = True) -> None:
    """Every property the issue asks for, on one job."""
    packed = TIGHT.pack(job)
    data = packed.to_file_data()
    assert validate(data, job, overlap=packed.overlap) == []
    for i, (node, ns) in enumerate(zip(job.nodes, packed.nodes)):
        f = ns.figures
        assert f.lower_bound is not None and f.iterations >= f.lower_bound >= f.extra["volume_bound"] >= 1
        assert f.usage <= 100 + 1e-9
        assert f.cycle_time == pytest.approx(f.pipeline_busy + f.kfac_placed + f.bubble_left)
        # every piece present exactly as often as the timeline asks
        m = {False: node.micro_batches(False), True: node.micro_batches(True)}
        want = Counter()
        for key, ivs in node.entries.items():
            parsed = TimelineKey.parse(key)
            if parsed.is_kfac:
                want[key] += len(ivs) * (m[parsed.up_pipe] if parsed.kind in COV_KINDS else 1)
        got = Counter(label for it in data[i] for label in it if TimelineKey.parse(label).is_kfac)
        assert +got == +want
        # overflow only for work that fits no bubble, and after the last pipeline item
        model = node_model(node, job.span)
        largest = max((b.length for b in model.bubbles), default=0)
        total = 0
        for p in ns.placements:
            if p.category in COV_KINDS or TimelineKey.parse(p.label).is_kfac:
                if p.start >= model.base:  # after the iteration's pipeline: overflow
                    assert not fits(p.duration, largest), (i, p)
                    total += p.duration
        assert total == pytest.approx(f.overflow)
        # never a longer cycle than a valid compat schedule that measures the work truly
        theirs = honest_compat(node, job.span) if against_compat else None
        if theirs is not None:
            assert f.iterations <= theirs.figures.iterations, (i, f.iterations, theirs.figures.iterations)


def test_the_default_policy_packs_tight_for_the_users_objective() -> None:
    """``target`` (the default) weighs tight schedules at several densities; tight stays by name."""
    assert DEFAULT_POLICY == "target"


def test_small_job_markers_and_order() -> None:
    job = job_from_dicts([small_node(), small_node(offset=30, module="layer.1")])
    packed = TIGHT.pack(job)
    check_job(job)
    for node in packed.to_file_data():
        assert node[0][0] == START and SAVE_OFF in node[0][node[0].index(END):]
        assert node[-1][-1] == SAVE_ON
        for it in node:
            assert it[0] == START and it.count(END) == 1


@pytest.mark.parametrize("case", COMPAT_CASES, ids=lambda p: p.name)
def test_published_vectors(case) -> None:
    check_job(load_job(case_timelines(case)))


def test_placements_are_in_time_order_within_each_iteration() -> None:
    job = job_from_dicts(random_raw_job(3, nodes=2, micro_batches=6, layers=3, heavy=True))
    for node in TIGHT.pack(job).nodes:
        by_iter: dict[int, list] = {}
        for p in node.placements:
            by_iter.setdefault(p.iteration, []).append(p)
        for places in by_iter.values():
            work = [p for p in places if p.category not in ("marker",)]
            assert all(a.end <= b.start or a.start <= b.start for a, b in zip(work, work[1:]))
            for a, b in zip(work, work[1:]):
                if a.category not in ("forward", "backward") or b.category not in ("forward", "backward"):
                    assert a.end <= b.start + 1e-12


def test_report_line_carries_the_bound() -> None:
    job = job_from_dicts(random_raw_job(5))
    for line, node in zip(usage_lines(TIGHT.pack(job)), TIGHT.pack(job).nodes):
        assert line.startswith("node") and f"[lower bound {node.figures.lower_bound}" in line


def test_forced_overflow_lengthens_only_its_iteration() -> None:
    # one bubble of 100 between the forward and the backward; an inverse of 1000 fits nowhere
    d = {"start_end": [(0, 5000)], "call_forward": [(0, 100)], "call_backward": [(200, 300)],
         "cov_kron_A:l": [(400, 410)], "inv_kron_A:l": [(500, 1500)]}
    job = job_from_dicts([d])
    packed = TIGHT.pack(job)
    check_job(job)
    f = packed.nodes[0].figures
    assert f.iterations == 1 and f.overflow == 1000 and f.cycle_time == 300 + 1000
    labels = packed.to_file_data()[0][0]
    assert labels.index("inv_kron_A:l") > labels.index("call_backward")


def test_pieces_split_exactly() -> None:
    d = small_node(m=3)
    d["cov_kron_A:layer.0"] = [(0, 10)]
    job = job_from_dicts([d])
    model = node_model(job.nodes[0], job.span)
    cov = [w for w in model.work if w.kind == COV and w.label == "cov_kron_A:layer.0"][0]
    assert cov.pieces == (4, 3, 3)
    d = {k: [tuple(x / 1e9 for x in iv) for iv in v] for k, v in d.items()}
    model = node_model(job_from_dicts([d]).nodes[0], job_from_dicts([d]).span)
    cov = [w for w in model.work if w.kind == COV and w.label == "cov_kron_A:layer.0"][0]
    assert sum(cov.pieces) == pytest.approx(10 / 1e9) and all(p > 0 for p in cov.pieces)


def test_none_times_are_no_time() -> None:
    # (An interval that ends before it starts is refused on loading: test_timeline.)
    d = small_node()
    d["inv_kron_B:layer.0"] = [(None, None)]
    d["sync_kron_B:layer.0"] = [(50, None)]
    job = job_from_dicts([d])
    check_job(job)
    assert all(p.duration >= 0 for p in TIGHT.pack(job).nodes[0].placements)


@pytest.mark.parametrize("chunk", range(3))
def test_random_jobs_of_every_shape(chunk: int) -> None:
    for seed in range(chunk * 60, (chunk + 1) * 60):
        check_job(job_from_dicts(random_raw_job(seed)))


def test_takes_a_shorter_valid_compat_cycle_where_packing_misses_the_bound() -> None:
    # Where the packer cannot prove its cycle optimal, the published construction is tried too and
    # taken if it is shorter, dependency-correct, and keeps its work inside the bubbles. (No random
    # job has needed it since the first-iteration bound and the small-last layout: this pretends the
    # packer came out one iteration longer than compat.)
    job = job_from_dicts(random_raw_job(0))
    node = job.nodes[0]
    theirs = honest_compat(node, job.span)
    assert theirs is not None
    ours = pack_node(node, job.span)
    longer = replace(ours, figures=replace(ours.figures, iterations=theirs.figures.iterations + 1))
    got = shorter_valid_compat(node, job.span, node_model(node, job.span), longer)
    assert got.iterations == theirs.iterations and got.figures.extra["construction"] == "compat"
    assert got.figures.lower_bound == ours.figures.lower_bound
    assert shorter_valid_compat(node, job.span, node_model(node, job.span), ours) is ours


def test_refuses_a_compat_cycle_that_counts_the_same_time_twice() -> None:
    # This node's pipeline runs past the step's end marker; compat takes the time after the marker
    # for a bubble, though a backward is still running there, and "validates" in 2 iterations.
    # The lower bound proves 3: compat's two are not an honest cycle, and tight keeps its own 3.
    job = job_from_dicts(random_raw_job(162, nodes=2, micro_batches=8, layers=2, float_seconds=False,
                                        bare_keys=False, up_pipe=False, steps=1, none_prob=0.0, heavy=True))
    node = job.nodes[1]
    slots = pack_node_slots(node, job.span)
    assert len(split_iterations(slots)) == 2 and not validate_node(1, node, split_iterations(slots))
    assert honest_compat(node, job.span) is None
    ours = get_policy("tight", overlap=False).pack(job).nodes[1].figures
    assert ours.iterations == ours.lower_bound == 3
    # overlapping (the default) the bound is 2, and the cycle still 3, not compat's dishonest 2
    assert TIGHT.pack(job).nodes[1].figures.iterations == 3
    check_job(job)


def test_refuses_a_compat_cycle_that_is_short_only_by_working_past_the_pipeline() -> None:
    # compat "validates" in 6 iterations here, but puts sync/inverse work after the pipeline's end,
    # which lengthens its iterations; tight keeps its own 7-iteration cycle.
    job = job_from_dicts(random_raw_job(168))
    check_job(job)
    node = TIGHT.pack(job).nodes[0]
    assert node.figures.iterations == 7 and node.figures.extra.get("construction") != "compat"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    nodes=st.integers(1, 3),
    micro_batches=st.sampled_from([1, 2, 3, 4, 8]),
    layers=st.integers(1, 4),
    float_seconds=st.booleans(),
    bare_keys=st.booleans(),
    up_pipe=st.booleans(),
    steps=st.integers(1, 3),
    none_prob=st.sampled_from([0.0, 0.1]),
    heavy=st.booleans(),
)
def test_properties_on_generated_jobs(**kw) -> None:
    seed = kw.pop("seed")
    check_job(job_from_dicts(random_raw_job(seed, **kw)))


def test_near_the_bound_on_generated_jobs() -> None:
    cycle = bound = 0
    for seed in range(150):
        for node in TIGHT.pack(job_from_dicts(random_raw_job(seed))).nodes:
            cycle += node.figures.iterations
            bound += node.figures.lower_bound
    assert cycle <= 1.15 * bound


REGRESSIONS = Path(__file__).parent / "data" / "regressions"
SLOW = pytest.mark.skipif(os.environ.get("PIPEFISHER_SLOW") != "1", reason=(
    "the whole family, about 22 s on 2 cores: PIPEFISHER_SLOW=1 runs it; every suite run checks a sample"))


def check_never_longer_than_a_plain_greedy(job: Job) -> None:
    """Per node, ``tight``'s cycle is no longer than any plain best-fit greedy's (the oracle's)."""
    for i, (node, ns) in enumerate(zip(job.nodes, TIGHT.pack(job).nodes)):
        model = node_model(node, job.span)
        plain = {v: len(plain_greedy_cycle(model, *v)) for v in PLAIN_GREEDIES}
        assert ns.figures.iterations <= min(plain.values()), (i, ns.figures.iterations, plain)


def test_regression_bert_large_8_stages_meets_the_bound_a_plain_greedy_meets() -> None:
    # BERT-Large, 8 stages of 1F1B, 12 micro-batches of 8 (V100 block costs). Splitting an interval
    # into 12 integer pieces leaves pieces one nanosecond shorter; choosing strictly by size took every
    # factor's longer pieces first and its last ones late, so the big inverses missed the large bubble
    # of iterations 1-3: 5 iterations on nodes 0 and 1, where a plain best-fit that counts a queue's
    # pieces as one size finds the bound, 4.
    job = load_job([str(p) for p in (REGRESSIONS / "bert-large-8stages-m12-bs8").glob("*_timeline.pickle")])
    packed = TIGHT.pack(job)
    assert validate(packed.to_file_data(), job, overlap=packed.overlap) == []
    for i in (0, 1):
        assert len(plain_greedy_cycle(node_model(job.nodes[i], job.span), "queue", "first")) == 4
        assert packed.nodes[i].figures.iterations == packed.nodes[i].figures.lower_bound == 4
    check_never_longer_than_a_plain_greedy(job)


def test_regression_which_factors_finish_first_can_decide_the_cycle() -> None:
    # BERT-Large, 8 stages of 1F1B, 12 micro-batches of 4, with syncs: the six big inverses fit only the
    # largest bubble, two per iteration. Taking equally large pieces in key order finishes the small
    # factors of the first layer first and the big chains late (5 iterations); the plain best-fit that
    # takes the last key first meets the bound, 4.
    job = realistic_job("bert-large", 4, "1f1b", 8, 12, sync=True)
    assert len(plain_greedy_cycle(node_model(job.nodes[0], job.span), "piece", "last")) == 4
    assert TIGHT.pack(job).nodes[0].figures.iterations == 4


def test_a_piece_that_fits_only_at_its_own_size_is_not_counted_as_its_longer_sibling() -> None:
    # Found by Hypothesis: node 1's 1-unit covariance interval splits into pieces of 1 and 0, and only
    # the 0 fits the largest bubble with the room rule. Counted as the 1 (its size class), the 0 fit no
    # bubble, was no forced overflow either, and the walk never ended ("packing made no progress").
    job = job_from_dicts([
        {"start_end": [(0, 1515)], "call_forward": [(60, 161), (161, 167)],
         "call_backward": [(168, 249), (249, 275)], "cov_kron_A:n0.l0": [(275, 276)],
         "cov_kron_B:n0.l0": [(276, 576)], "inv_kron_A:n0.l0": [(576, 826), (826, 826), (None, None)],
         "inv_kron_B:n0.l0": [(826, 908)], "cov_kron_A:n0.l1": [(908, 908)], "cov_kron_B:n0.l1": [(908, 1117)],
         "inv_kron_A:n0.l1": [(1117, 1410), (1410, 1462)], "inv_kron_B:n0.l1": [(1462, 1463), (1463, 1515)]},
        {"start_end": [(-202, 534)], "call_forward": [(-201, -175)], "call_backward": [(225, 252)],
         "cov_kron_A:n1.l0": [(252, 533)], "cov_kron_B:n1.l0": [(533, 533)], "inv_kron_A:n1.l0": [(None, None)],
         "inv_kron_B:n1.l0": [(533, 534)]},
    ])
    for v in (False, True):
        assert pack_greedy(node_model(job.nodes[1], job.span), cov_first=v) is not None
    check_job(job)
    check_never_longer_than_a_plain_greedy(job)


def test_never_longer_than_a_plain_greedy_on_a_sample_of_realistic_jobs() -> None:
    for _, job in realistic_family(every=11):
        check_never_longer_than_a_plain_greedy(job)


def _check_family_member(shape: tuple) -> None:
    check_never_longer_than_a_plain_greedy(realistic_job(*shape))


def _one_cpu(cpus: Any) -> None:
    """A pool worker on a CPU of its own: ``tight`` then packs in it without workers of its own."""
    ident = multiprocessing.current_process()._identity
    os.sched_setaffinity(0, {sorted(cpus)[(ident[0] - 1) % len(cpus)] if ident else min(cpus)})


@SLOW
def test_never_longer_than_a_plain_greedy_on_realistic_jobs() -> None:
    """The whole family, its jobs (independent of each other) spread over the CPUs this test may use."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(cpus) < 2:
        for shape in realistic_shapes():
            _check_family_member(shape)
        return
    with multiprocessing.get_context("fork").Pool(len(cpus), _one_cpu, (cpus,)) as pool:
        pool.map(_check_family_member, realistic_shapes(), chunksize=1)


# ----------------------------------------------------------------------------------------------------
# Speed at scale: the pruning and the worker processes change no result


def generated_jobs_missing_the_bound() -> list[Job]:
    """Generated jobs, plain and heavy; about one node in five misses its bound, so every candidate runs."""
    return [job_from_dicts(random_raw_job(seed, **kw)) for seed in range(0, 300, 2)
            for kw in ({}, {"heavy": True, "float_seconds": False})]


@pytest.mark.parametrize("overlap", [False, True])
def test_pruned_portfolio_chooses_exactly_what_the_full_one_does(overlap: bool) -> None:
    missed = 0
    for job in generated_jobs_missing_the_bound():
        for node in job.nodes:
            pruned = pack_node(node, job.span, overlap=overlap)
            assert pruned == pack_node(node, job.span, prune=False, overlap=overlap)
            missed += pruned.figures.iterations > pruned.figures.lower_bound
    assert missed >= 100  # the candidates after the first did run, and so did their caps


@pytest.mark.parametrize("overlap", [False, True])
def test_capped_walks_give_up_only_where_they_could_not_be_shorter(overlap: bool) -> None:
    for job in generated_jobs_missing_the_bound()[:120]:
        for node in job.nodes:
            model = node_model(node, job.span, overlap=overlap)
            walks = {"greedy": lambda cap: pack_greedy(model, shorter_than=cap),
                     "cov first": lambda cap: pack_greedy(model, cov_first=True, shorter_than=cap),
                     "best-fit": lambda cap: pack_best_fit(model, shorter_than=cap),
                     "later first": lambda cap: pack_best_fit(model, later_first=True, shorter_than=cap)}
            for name, walk in walks.items():
                full = walk(None)
                for cap in range(max(1, full.iterations - 3), full.iterations + 3):
                    capped = walk(cap)
                    assert capped == full if capped is not None else full.iterations >= cap, (name, cap)


def models_with_their_bound(jobs: int) -> Iterator[tuple[NodeModel, int]]:
    """Every node model of the first ``jobs`` generated jobs, with its lower bound."""
    for job in generated_jobs_missing_the_bound()[:jobs]:
        for node in job.nodes:
            model = node_model(node, job.span)
            yield model, model_bounds(model).tight


def test_fixed_length_is_skipped_only_where_it_fails() -> None:
    skipped = 0
    for model, low in models_with_their_bound(120):
        for k in range(max(1, low - 2), low + 3):
            if fixed_fails_at_once(model, k):
                skipped += 1
                assert pack_fixed(model, k) is None, k
    assert skipped > 0


def test_fixed_length_resumed_from_the_previous_k_builds_exactly_the_same() -> None:
    # Each k after the first resumes step 2 where the previous one stopped (before its first sync or
    # inverse), checking only its own room test over the slots it skips: every k, built or not, is the
    # same as built alone, given up or not.
    resumed = 0
    for model, low in models_with_their_bound(160):
        prefix = None
        for k in range(max(1, low - 2), low + 6):
            resumed += prefix is not None and prefix.slot > 0
            trial, prefix = _pack_fixed(model, k, prefix)
            assert trial == pack_fixed(model, k), k
    assert resumed >= 100


def test_worker_processes_give_the_same_schedules() -> None:
    job = job_from_dicts(random_raw_job(4, heavy=True, float_seconds=False))  # both nodes miss their bound
    assert all(n.figures.iterations > n.figures.lower_bound for n in pack_nodes(job, workers=1))
    assert pack_nodes(job, workers=2) == pack_nodes(job, workers=1)


def test_heavy_regression_job_keeps_its_cycles() -> None:
    # 16 x 128 micro-batches x 48 K-FAC layers, work spilling over ~40 iterations: no node meets its
    # bound, so every candidate runs (the speed benchmark's job, scripts/bench_policy.py --process-only).
    # Cycles overlap by default: nodes 5 and 11 put their last refresh pieces back into earlier
    # iterations (43 and 40 without overlap).
    job = load_job(sorted(str(p) for p in (REGRESSIONS / "heavy-16x128x48").glob("*_timeline.pickle")))
    packed = TIGHT.pack(job)
    assert packed.overlap and validate(packed.to_file_data(), job, overlap=True) == []
    by_node = {Path(n.path).name.split("_")[1]: s.figures.iterations for n, s in zip(job.nodes, packed.nodes)}
    assert by_node == {f"node{i}": k for i, k in enumerate(
        (41, 41, 44, 43, 44, 42, 43, 43, 42, 44, 42, 39, 41, 42, 45, 44))}


@pytest.mark.parametrize("workers", [1, 2])
def test_pack_nodes_hands_each_node_over_in_order_as_it_is_made(workers) -> None:
    from pipefisher.policies.tight import pack_nodes

    from pipefisher.schedule.timeline import load_job

    # node 2's first walk misses its bound: with workers, the rest of its portfolio runs in the pool
    job = load_job([os.path.join(os.path.dirname(__file__), "data", "regressions", "bert-large-8stages-m12-bs8")])
    seen: list = []
    nodes = pack_nodes(job, workers=workers, each=lambda i, node: seen.append((i, node)))
    assert [i for i, _ in seen] == list(range(len(job.nodes)))
    assert tuple(node for _, node in seen) == nodes == pack_nodes(job, workers=workers)


# ----------------------------------------------------------------------------------------------------
# Overlapping cycles


def test_overlap_puts_the_pieces_left_into_the_first_iteration_and_shortens_the_cycle() -> None:
    from conftest import overlapping_node
    from pipefisher.policies import get_policy
    from pipefisher.rules import validate
    from pipefisher.schedule.timeline import job_from_dicts

    job = job_from_dicts([overlapping_node()])
    plain = get_policy("tight", overlap=False).pack(job)
    assert not plain.overlap and plain.nodes[0].figures.iterations == 3
    overlapping = get_policy("tight", overlap=True).pack(job)
    node = overlapping.nodes[0]
    assert overlapping.overlap and node.figures.iterations == 2 and node.figures.lower_bound == 2
    # the previous refresh's last piece in iteration 0's first bubble, before this cycle's sync
    assert node.iterations[0][:3] == ("-- start --", "call_forward", "inv_kron_B:l")
    assert validate(overlapping.to_file_data(), job, overlap=True) == []
    assert [v.rule for v in validate(overlapping.to_file_data(), job)] == ["inv-before-sync"]
    # target packs tight: with the option, the same
    target = get_policy("target", overlap=True).pack(job)
    assert target.overlap and target.nodes[0].figures.iterations == 2


def test_a_capped_overlapping_walk_gives_up_once_its_covariance_alone_reaches_the_cap(monkeypatch) -> None:
    # Only refresh pieces may go back into the room of iterations already walked: the covariance and
    # syncs left still need iterations of their own, so the walk gives up as early as they say (here
    # after 2 of its cap of 4, where the rule "one more iteration reaches the cap" waited for 3).
    import pipefisher.policies.tight as tight

    job = job_from_dicts(random_raw_job(12, heavy=True, float_seconds=False))
    model = node_model(job.nodes[0], job.span, overlap=True)
    cap = pack_greedy(model).iterations
    walked: list[int] = []
    checked = tight.sure_to_reach
    monkeypatch.setattr(tight, "sure_to_reach", lambda done, *rest: walked.append(done) or checked(done, *rest))
    assert pack_greedy(model, cov_first=True, shorter_than=cap) is None
    assert cap == 4 and walked[-1] + 1 < cap


def test_an_attempt_to_put_the_pieces_left_into_earlier_iterations_tests_a_full_bubble_once(monkeypatch) -> None:
    # The heavy job's packing is dense: most bubbles have no room for the smallest refresh piece left,
    # and the attempts (one per iteration once only refresh pieces are left) pass over them at once,
    # rather than testing every factor's next piece (96 factors here) in each.
    import pipefisher.policies.tight as tight

    job = load_job(sorted(str(p) for p in (REGRESSIONS / "heavy-16x128x48").glob("*_timeline.pickle")))
    node = next(n for n in job.nodes if Path(n.path).name.split("_")[1] == "node5")
    model = node_model(node, job.span, overlap=True)
    first = pack_greedy(model)
    assert first.overlap and first.iterations == 42
    tests = Counter()
    monkeypatch.setattr(tight, "fits", lambda *a: tests.update(["fits"]) or fits(*a))
    assert pack_greedy(model, cov_first=True, shorter_than=first.iterations) is None  # after a failed attempt
    assert 0 < tests["fits"] <= 2 * first.iterations * len(model.bubbles)


@pytest.mark.parametrize("piece_ms", [None, 2.0])
def test_overlap_never_lengthens_a_cycle_and_every_realistic_node_validates(piece_ms: float | None) -> None:
    from pipefisher.policies import get_policy
    from pipefisher.rules import validate

    for shape in realistic_shapes()[::16]:
        name, job = str(shape), realistic_job(*shape, piece_ms=piece_ms)
        plain = get_policy("tight", overlap=False).pack(job)
        overlapping = get_policy("tight").pack(job)  # the default
        assert validate(overlapping.to_file_data(), job, margin=overlapping.margin, overlap=overlapping.overlap) == []
        for a, b in zip(plain.nodes, overlapping.nodes):
            assert b.figures.iterations <= a.figures.iterations, name
            assert b.figures.lower_bound <= b.figures.iterations, name


def _gpipe_stage_with_big_factors() -> list[dict[str, list[tuple[int, int]]]]:
    """Node 4 of BERT-Large on P100 at micro-batch 8, GPipe, 8 micro-batches (scripts/bench_paper_jobs.py),
    cut down to its six big factors (microseconds): bubbles of 54, 109.4 and 91.8 ms per iteration
    (before the forwards, between them and the backwards, after the backwards); each factor 8
    covariance pieces of 4.5 ms (A after the forwards, B after the backwards) and a 58.8 ms inverse,
    which only the two larger bubbles hold, one at a time. Node 0 only sets the pipeline's span."""
    stage: dict[str, list[tuple[int, int]]] = {
        "start_end": [(0, 546_900)],
        "call_forward": [(54_000 + 13_500 * i, 67_500 + 13_500 * i) for i in range(8)],
        "call_backward": [(271_400 + 22_960 * i, 294_360 + 22_960 * i) for i in range(8)],
    }
    t = 546_900
    for layer in (12, 13, 14):
        for factor in (f"B:l{layer}.intermediate", f"A:l{layer}.output"):
            stage[f"cov_kron_{factor}"] = [(t, t + 36_350)]
            stage[f"inv_kron_{factor}"] = [(t + 36_350, t + 36_350 + 58_780)]
            t += 36_350 + 58_780
    return [{"start_end": [(0, 546_900)], "call_forward": [(0, 13_500)], "call_backward": [(523_900, 546_900)]},
            stage]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_walk_finishes_a_started_factor_before_starting_equally_large_ones(overlap: bool) -> None:
    # Iteration 0's first larger bubble takes one big factor's pieces and inverse and starts a second
    # factor's pieces. The last bubble then finished two other factors' pieces (taken in key order) and
    # left the started one unfinished, so no inverse fitted there: 4 iterations. Finishing the started
    # factor first lets its inverse into that bubble: 3, the bound (exact's cycle on the paper job).
    job = job_from_dicts(_gpipe_stage_with_big_factors())
    model = node_model(job.nodes[1], job.span, overlap=overlap)
    assert model_bounds(model).tight == 3
    walk = pack_greedy(model)
    assert walk is not None and walk.iterations == 3
    first = walk.in_bubbles[0]
    assert [label for b, label, _, _ in first if b == 2 and label.startswith("inv_")] == ["inv_kron_A:l13.output"]
    packed = get_policy("tight", overlap=overlap).pack(job)
    assert packed.nodes[1].figures.iterations == 3
    assert validate(packed.to_file_data(), job, overlap=packed.overlap) == []


def test_a_sync_group_keeps_the_shorter_aligned_cycle_of_the_two_walks() -> None:
    # BERT-Large, P100, micro-batch 8, Chimera on 8 stages, 8 micro-batches (scripts/bench_paper_jobs.py):
    # the walk that finishes started factors first packs each of nodes 0 and 7 (one sync group) into
    # the bound, 3, but aligned they need 4; aligned from the walk in key order they need 3, as before.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_paper_jobs import PaperJob, build
    from pipefisher.policies.align import align_groups
    from pipefisher.policies.tight import pack_nodes
    from pipefisher.rules.groups import job_groups

    job = build(PaperJob("bert-large", "p100", 8, "chimera", 8, 8))
    finishing = align_groups(job, pack_nodes(job, overlap=True), job_groups(job))
    assert [finishing[n].figures.iterations for n in (0, 7)] == [4, 4]
    packed = get_policy("tight", overlap=True).pack(job)
    assert [packed.nodes[n].figures.iterations for n in (0, 7)] == [3, 3]
    assert validate(packed.to_file_data(), job, overlap=True) == []
