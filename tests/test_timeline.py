"""Loading profiled timelines: order, last step, shared clock, value types, and bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import small_node
from pipefisher.errors import InputError
from pipefisher.schedule.timeline import (
    Interval, TimelineKey, expand_paths, format_time, job_from_dicts, load_job, natural_key,
)


def test_natural_sort_puts_node2_before_node10(write_pickle) -> None:
    paths = [write_pickle(f"run_node{i}_timeline.pickle", small_node(offset=i)) for i in (10, 2, 1, 0, 9, 3, 8, 4, 7, 5, 6)]
    job = load_job(paths)
    assert [n.path.rsplit("/", 1)[1] for n in job.nodes] == [f"run_node{i}_timeline.pickle" for i in range(11)]
    assert sorted(["a10", "a9", "a1"], key=natural_key) == ["a1", "a9", "a10"]


def test_comma_separated_paths_are_split() -> None:
    assert expand_paths(["a.pickle,b.pickle", "c.pickle"]) == ["a.pickle", "b.pickle", "c.pickle"]


def test_time_zero_is_node0_first_forward_and_span_its_last_backward() -> None:
    job = job_from_dicts([small_node(offset=1000), small_node(offset=1050)])
    assert job.origin == 1000
    node0 = job.nodes[0]
    assert node0.forwards()[0].start == 0
    assert job.span == node0.backwards()[-1].end
    assert job.nodes[1].forwards()[0].start == 50


def test_up_pipe_can_start_the_clock_and_end_the_span() -> None:
    d = small_node(offset=1000)
    d["call_forward:up_pipe"] = [(900, 950)]
    d["call_backward:up_pipe"] = [(5000, 5100)]
    job = job_from_dicts([d])
    assert job.origin == 900
    assert job.span == 5100 - 900


def test_only_the_last_profiled_step_is_kept() -> None:
    one = small_node(offset=0)
    two = small_node(offset=10_000)
    both = {k: one[k] + two[k] for k in one}
    job = job_from_dicts([both])
    assert job.steps == 2
    assert len(job.nodes[0].forwards()) == 2
    assert job.origin == 10_000  # the clock starts at the kept step's first forward


def test_numpy_scalars_become_python_numbers_and_floats_stay_floats() -> None:
    d = small_node()
    d["call_forward"] = [(np.int64(s), np.int64(e)) for s, e in d["call_forward"]]
    job = job_from_dicts([d])
    assert type(job.nodes[0].forwards()[0].end) is int
    f = {k: [(s / 1e9, e / 1e9) for s, e in v] for k, v in small_node().items()}
    assert isinstance(job_from_dicts([f]).span, float)


def test_none_times_are_kept_and_count_as_no_work() -> None:
    d = small_node()
    d["inv_kron_A:layer.0"] = [(None, None)]
    iv = job_from_dicts([d]).nodes[0].intervals("inv_kron_A:layer.0")[0]
    assert iv == Interval(None, None) and iv.duration == 0


@pytest.mark.parametrize("key, parsed", [
    ("cov_kron_A", TimelineKey("cov_kron_A")),
    ("cov_kron_B:encoder.layer.0.attention.self.query", TimelineKey("cov_kron_B", "encoder.layer.0.attention.self.query")),
    ("inv_kron_A:enc.l3:up_pipe", TimelineKey("inv_kron_A", "enc.l3", True)),
    ("call_forward:up_pipe", TimelineKey("call_forward", None, True)),
])
def test_keys_parse_with_and_without_module_and_pipe(key: str, parsed: TimelineKey) -> None:
    assert TimelineKey.parse(key) == parsed
    assert str(parsed) == key


def test_json_timelines_load_like_pickles(tmp_path) -> None:
    path = tmp_path / "run_node0_timeline.json"
    path.write_text(json.dumps(small_node()))
    job = load_job([str(path)])
    assert job.nodes[0].micro_batches() == 2


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("call_forward"), "has no 'call_forward' key"),
    (lambda d: d.pop("call_backward"), "has no 'call_backward' key"),
    (lambda d: d["call_backward"].pop(), "has 2 'call_forward' but 1 'call_backward' intervals"),
    (lambda d: d.__setitem__("cov_kron_A:layer.0", [(1, 2, 3)]), "interval 0 is not a \\(start, end\\) pair"),
    (lambda d: d.__setitem__("cov_kron_A:layer.0", [(1, "2")]), "has a str time, not a number or None"),
    (lambda d: d.__setitem__("cov_kron_A:layer.0", 5), "holds a int, not a list of intervals"),
    (lambda d: d.__setitem__("call_forward", [(None, 1), (2, 3)]), "node 0's first forward has no start time"),
])
def test_bad_structure_names_the_file_and_the_problem(write_pickle, mutate, message) -> None:
    d = small_node()
    mutate(d)
    path = write_pickle("bad_node0_timeline.pickle", d)
    with pytest.raises(InputError, match=message) as err:
        load_job([path])
    assert str(err.value).startswith(path + ": ")


def test_a_pickle_that_is_not_a_dict_is_refused(write_pickle) -> None:
    path = write_pickle("list_node0.pickle", [1, 2])
    with pytest.raises(InputError, match="holds a list, not a dict"):
        load_job([path])


def test_no_files_is_an_error() -> None:
    with pytest.raises(InputError, match="no timeline files"):
        load_job([])


def test_a_key_with_fewer_intervals_than_steps_keeps_them_all_like_the_published_tool(write_pickle) -> None:
    """The published loader slices values[-(len(values) // n):]: with len < n that is values[-0:], all."""
    steps = [small_node(offset=i * 10_000) for i in range(3)]
    d = {k: sum((s[k] for s in steps), []) for k in steps[0]}
    d["inv_kron_A:layer.0"] = [steps[1]["inv_kron_A:layer.0"][0]]  # the inverse ran in one of three steps
    d["inv_kron_B:layer.0"] = []
    job = load_job([write_pickle("run_node0_timeline.pickle", d)])
    assert job.steps == 3 and len(job.nodes[0].forwards()) == 2
    (inv,) = job.nodes[0].intervals("inv_kron_A:layer.0")
    assert inv.duration == 20 and inv.start == steps[1]["inv_kron_A:layer.0"][0][0] - job.origin
    assert job.nodes[0].intervals("inv_kron_B:layer.0") == ()
    assert len(job.nodes[0].intervals("cov_kron_A:layer.0")) == 1  # 3 intervals // 3 steps: the last one


# ----------------------------------------------------------------------------------------------------
# Files of different jobs are refused (unless allow_mixed)


def _one_line_error(paths, match: str) -> str:
    with pytest.raises(InputError, match=match) as err:
        load_job(paths)
    assert "\n" not in str(err.value) and "--allow-mixed" in str(err.value)
    load_job(paths, allow_mixed=True)  # what the user may still ask for
    return str(err.value)


def test_node_files_of_two_prefixes_are_refused(write_pickle) -> None:
    paths = [write_pickle("a_node0_timeline.pickle", small_node()),
             write_pickle("a_node1_timeline.pickle", small_node(offset=50)),
             write_pickle("b_node2_timeline.pickle", small_node(offset=100))]
    text = _one_line_error(paths, "different name prefixes")
    assert "a_node0_timeline.pickle" in text and "b_node2_timeline.pickle" in text


def test_a_missing_or_repeated_node_index_is_refused(tmp_path, write_pickle) -> None:
    a = write_pickle("run_node0_timeline.pickle", small_node())
    c = write_pickle("run_node2_timeline.pickle", small_node(offset=100))
    assert "run_node1_timeline.*: is missing" in _one_line_error([a, c], "is missing")
    (tmp_path / "other").mkdir()
    again = write_pickle("other/run_node0_timeline.pickle", small_node(offset=50))
    _one_line_error([a, again], "is node 0 again")
    (tmp_path / "0th").mkdir()
    first = write_pickle("0th/run_node1_timeline.pickle", small_node(offset=50))  # sorts before 'run_node0'
    _one_line_error([a, first], "is named node 1 but is node 0 by the natural sort")


def test_the_same_file_twice_is_refused(write_pickle) -> None:
    a = write_pickle("x.pickle", small_node())
    _one_line_error([a, a], "is given twice")
    _one_line_error([f"{a},{a}"], "is given twice")  # the published comma-separated form too


def test_node_files_of_other_runs_are_refused_by_their_start_end(write_pickle) -> None:
    two_steps = small_node(offset=50)
    two_steps["start_end"] = [(-1000, -1), two_steps["start_end"][0]]
    paths = [write_pickle("n0.pickle", small_node()), write_pickle("n1.pickle", two_steps)]
    assert "profiled 2 step(s)" in _one_line_error(paths, "different jobs")
    paths = [write_pickle("n0.pickle", small_node()), write_pickle("n1.pickle", small_node(offset=10**9))]
    assert "does not overlap" in _one_line_error(paths, "different runs")


def test_every_published_and_profiled_job_still_loads() -> None:
    """Real jobs differ in span per node (Chimera's nodes end their pipes at different times) and
    their step ends differ per node; none of that is taken for mixing."""
    from pathlib import Path

    from conftest import COMPAT_CASES, DATA, case_timelines

    jobs = [case_timelines(c) for c in COMPAT_CASES]
    jobs += [sorted(str(p) for p in d.glob("*_timeline.pickle")) for d in (DATA / "profiles").iterdir()]
    examples = Path(__file__).resolve().parent.parent / "pipefisher" / "bundled" / "examples"
    jobs += [sorted(str(p) for p in d.glob("*_timeline.pickle")) for d in examples.glob("*") if d.is_dir()]
    assert len(jobs) >= 14
    for paths in jobs:
        assert len(load_job(paths).nodes) == len(paths)


@pytest.mark.parametrize("key, parsed", [
    ("call_forward:chunk1", TimelineKey("call_forward", None, False, 1)),
    ("call_backward:chunk12", TimelineKey("call_backward", None, False, 12)),
    ("cov_kron_A:encoder.layer.5.attention.self.query:chunk1",
     TimelineKey("cov_kron_A", "encoder.layer.5.attention.self.query", False, 1)),
    ("sync_kron_B:chunk2", TimelineKey("sync_kron_B", None, False, 2)),
    ("inv_kron_A:layers.0.fc:chunk3", TimelineKey("inv_kron_A", "layers.0.fc", False, 3)),
    # not chunk suffixes: chunk 0 has none, and a module that merely ends in 'chunk<j>' is a module
    ("cov_kron_A:layer.0:chunk0", TimelineKey("cov_kron_A", "layer.0:chunk0")),
    ("cov_kron_A:mychunk1", TimelineKey("cov_kron_A", "mychunk1")),
])
def test_chunk_keys_parse_and_round_trip(key: str, parsed: TimelineKey) -> None:
    assert TimelineKey.parse(key) == parsed
    assert str(parsed) == key


def test_a_chunks_layers_are_another_layer_copy_than_chunk_0s() -> None:
    assert TimelineKey.parse("cov_kron_A:l.0:chunk1").layer != TimelineKey.parse("cov_kron_A:l.0").layer


def _interleaved_node() -> dict[str, list[tuple[int, int]]]:
    """Two chunks, two micro-batches each, in interleaved order: F0 F0' F1 F1' ... (chunk 1 primed)."""
    d = small_node()
    d["call_forward:chunk1"] = [(1000, 1050), (1100, 1150)]
    d["call_backward:chunk1"] = [(1200, 1300), (1400, 1500)]
    return d


def test_per_chunk_micro_batch_counts() -> None:
    node = job_from_dicts([_interleaved_node()]).nodes[0]
    assert node.chunks == (0, 1)
    assert node.micro_batches() == 2 and node.micro_batches(chunk=1) == 2 and node.micro_batches(chunk=2) == 0
    assert node.pipe_keys() == ("call_forward", "call_forward:up_pipe", "call_backward", "call_backward:up_pipe",
                                "call_backward:weight", "call_backward:weight:up_pipe",
                                "call_forward:chunk1", "call_backward:chunk1", "call_backward:weight:chunk1")
    published = job_from_dicts([small_node()]).nodes[0]
    assert published.chunks == (0,) and len(published.pipe_keys()) == 6


def test_a_chunk_with_unequal_forwards_and_backwards_is_refused(write_pickle) -> None:
    d = _interleaved_node()
    d["call_backward:chunk1"].pop()
    path = write_pickle("bad_node0_timeline.pickle", d)
    with pytest.raises(InputError, match="has 2 'call_forward:chunk1' but 1 'call_backward:chunk1' intervals"):
        load_job([path])


def test_times_in_messages_carry_their_unit() -> None:
    assert format_time(39716698) == "39.717 ms"  # integer nanoseconds (GPU profiles)
    assert format_time(97) == "97 ns"
    assert format_time(0.0397) == "0.0397 s"  # float seconds (CPU or hand-made profiles)


def test_an_interval_that_ends_before_it_starts_is_refused(write_pickle) -> None:
    d = small_node()
    d["sync_kron_B:layer.0"] = [(50, 40)]
    path = write_pickle("node0.pickle", d)
    with pytest.raises(InputError, match=r"node0.pickle: key 'sync_kron_B:layer.0' interval 0 ends before it "
                                         r"starts: \(50 ns, 40 ns\)"):
        load_job([path])


def test_plain_number_pairs_are_taken_as_they_are_and_anything_else_is_still_checked(write_pickle) -> None:
    # (start, end) tuples of plain ints or floats (the usual pickle) skip the conversion; a bool is no
    # time though it is an int, and an end before its start is refused on that path too
    d = small_node()
    d["sync_kron_B:layer.0"] = [(40, 50.5)]
    job = load_job([write_pickle("node0.pickle", d)])
    assert [(iv.start, iv.end) for iv in job.nodes[0].intervals("sync_kron_B:layer.0")] == [(40, 50.5)]
    d["sync_kron_B:layer.0"] = [(True, 50)]
    with pytest.raises(InputError, match="interval 0 has a bool time, not a number or None"):
        load_job([write_pickle("node0.pickle", d)])
    d["sync_kron_B:layer.0"] = [(50.5, 40)]
    with pytest.raises(InputError, match=r"interval 0 ends before it starts"):
        load_job([write_pickle("node0.pickle", d)])


# ----------------------------------------------------------------------------------------------------
# The median step of a multi-step profile


def _four_steps() -> dict:
    """Four steps of one node, each given relative to its own start: step 0 is a slow warm-up."""
    rel = [  # start_end end, forwards, backwards, update, precondition
        (500, [(0, 200), (200, 300)], [(300, 400), (400, 450)], (450, 500), (460, 490)),
        (95, [(0, 10), (10, 30)], [(30, 50), (50, 80)], (80, 95), (82, 88)),
        (99, [(0, 14), (14, 28)], [(28, 60), (60, 90)], (90, 99), (91, 98)),
        (100, [(0, 12), (12, 34)], [(34, 55), (55, 75)], (75, 100), (90, 95)),
    ]
    starts = [7, 1003, 2011, 3005]
    raw: dict = {k: [] for k in ("start_end", "call_forward", "call_backward", "update", "precondition")}
    for s0, (end, fwd, bwd, upd, pre) in zip(starts, rel):
        raw["start_end"].append((s0, s0 + end))
        raw["call_forward"] += [(s0 + a, s0 + b) for a, b in fwd]
        raw["call_backward"] += [(s0 + a, s0 + b) for a, b in bwd]
        raw["update"].append((s0 + upd[0], s0 + upd[1]))
        raw["precondition"].append((s0 + pre[0], s0 + pre[1]))
    return raw


def test_median_step_takes_per_interval_medians_relative_to_each_step_start() -> None:
    from pipefisher.schedule.timeline import median_step

    raw = _four_steps()
    med = median_step(raw)
    base = 3005  # the last step's start
    want = {"start_end": [(0, 99)], "call_forward": [(0, 12), (12, 30)], "call_backward": [(30, 55), (55, 80)],
            "update": [(80, 99)], "precondition": [(90, 95)]}
    assert med == {k: [(base + a, base + b) for a, b in v] for k, v in want.items()}
    assert list(med) == list(raw)  # key order kept (the compat policy reads it)
    assert all(isinstance(t, int) for v in med.values() for pair in v for t in pair)
    # with the warm-up step offered too, it is left out all the same: 5x slower than the others
    assert median_step(raw, skip=0) == med
    job = job_from_dicts([med])
    assert job.steps == 1 and job.span == 80 and job.nodes[0].forwards()[1] == Interval(12, 30)


def _steps_taking(durations: list[int]) -> dict:
    """One node's profile whose step j takes ``durations[j]``: a forward over its first 40 %, the update
    over its last 10 % (as another process slowing the node stretches every interval alike)."""
    raw: dict = {"start_end": [], "call_forward": [], "update": []}
    for j, d in enumerate(durations):
        s0 = 1000 * j
        raw["start_end"].append((s0, s0 + d))
        raw["call_forward"].append((s0, s0 + 4 * d // 10))
        raw["update"].append((s0 + 9 * d // 10, s0 + d))
    return raw


def test_median_step_leaves_out_steps_another_process_slowed() -> None:
    """A run of slow steps (6 of 9 about 45 % slower, as measured on a shared CPU) moves a plain median;
    the median of the steady steps (within STEADY of the fastest) is the node's own cost."""
    from pipefisher.schedule.timeline import STEADY, median_step, slowed_profile, steady_steps

    took = [300, 320, 330, 325, 318, 310, 315, 220, 216, 226]  # warm-up, six slowed, three quiet
    raw = _steps_taking(took)
    used, steady = steady_steps(raw)
    assert used == list(range(1, 10)) and steady == [7, 8, 9]
    assert all(took[j] <= 216 * (1 + STEADY) for j in steady)
    med = median_step(raw)
    assert med["start_end"] == [(9000, 9000 + 220)]  # placed at the last step's start
    assert med["call_forward"] == [(9000, 9000 + 88)] and med["update"] == [(9000 + 198, 9000 + 220)]
    # what a run says of it: 6 of 9 left out, fastest and slowest; one slow step is jitter, nothing said
    assert slowed_profile(raw) == (6, 9, 216, 330)
    assert slowed_profile(_steps_taking([300, 220, 216, 226, 290, 221])) is None
    # never fewer than the two fastest: their mean, floored (integers stay integers)
    raw = _steps_taking([500, 100, 131, 160])
    assert steady_steps(raw) == ([1, 2, 3], [1, 2])
    assert median_step(raw)["start_end"] == [(3000, 3000 + (100 + 131) // 2)]
    # every step steady: the plain median of the used ones; too few steps: the last step alone
    assert steady_steps(_steps_taking([500, 100, 104, 107])) == ([1, 2, 3], [1, 2, 3])
    assert steady_steps(_steps_taking([500, 100])) == ([], [])
    assert median_step(_steps_taking([500, 100]))["start_end"] == [(1000, 1100)]


def test_median_step_keeps_order_and_nesting() -> None:
    """Medians of starts and of ends, taken separately, keep every order that holds in every step."""
    import random

    from pipefisher.schedule.timeline import median_step

    rng = random.Random(3)
    for _ in range(50):
        n, per = rng.randint(3, 9), rng.randint(1, 4)
        raw: dict = {"start_end": [], "call_forward": [], "call_backward": [], "update": [], "precondition": []}
        for j in range(n):
            t = s0 = j * 10_000 + rng.randint(0, 50)
            for key in ("call_forward", "call_backward"):
                for _ in range(per):
                    a = t + rng.randint(0, 30)
                    t = a + rng.randint(0, 300)
                    raw[key].append((a, t))
            u0 = t + rng.randint(0, 30)
            p0 = u0 + rng.randint(0, 20)
            p1 = p0 + rng.randint(0, 200)
            u1 = p1 + rng.randint(0, 20)
            raw["update"].append((u0, u1))
            raw["precondition"].append((p0, p1))
            raw["start_end"].append((s0, u1 + rng.randint(0, 10)))
        med = median_step(raw, skip=rng.randint(0, 2))
        flat = med["call_forward"] + med["call_backward"]
        assert all(a <= b for a, b in flat) and all(b <= c for (_, b), (c, _) in zip(flat, flat[1:]))
        (u0, u1), = med["update"]
        (p0, p1), = med["precondition"]
        (s0, s1), = med["start_end"]
        assert s0 <= flat[0][0] and flat[-1][1] <= u0 <= p0 <= p1 <= u1 <= s1


def test_median_step_falls_back_to_the_last_step_with_few_steps() -> None:
    from pipefisher.schedule.timeline import _last_step, median_step

    raw = _four_steps()
    two = {k: v[len(v) // 2:] for k, v in raw.items()}  # steps 2 and 3: one left after the warm-up
    assert median_step(two) == {k: v[len(v) // 2:] for k, v in two.items()} == _last_step(two)[0]
    one = {k: v[-(len(v) // 4):] for k, v in raw.items()}
    assert median_step(one) == one and median_step(one, skip=0) == one
    # skip=0 with two steps: the mean of both, floored for integers, exact for floats
    med = median_step(two, skip=0)
    assert med["start_end"] == [(3005, 3005 + 99)] and med["call_forward"][1] == (3005 + 13, 3005 + 31)
    floats = {k: [(a / 1e3, b / 1e3) for a, b in v] for k, v in two.items()}
    fmed = median_step(floats, skip=0)
    assert fmed["start_end"] == [pytest.approx((3.005, 3.005 + 0.0995))]
    assert all(isinstance(t, float) for v in fmed.values() for pair in v for t in pair)
    with pytest.raises(ValueError):
        median_step(raw, skip=-1)


def test_median_step_keeps_odd_keys_last_slice_as_the_loader_would() -> None:
    from pipefisher.schedule.timeline import median_step

    raw = _four_steps()
    raw["inv_kron_A:l"] = [(2500, 2600)]  # fewer intervals than steps: the loader keeps them all
    raw["cov_kron_A:l"] = [(i, i + 1) for i in range(0, 3000, 500)]  # 6, not a multiple of 4: the last 1
    raw["sync_kron_A:l"] = [(1000, 1001), (2000, None), (3010, 3011), (3020, 3030)]  # a None bound
    raw["numpy"] = [(np.int64(s), np.int64(e)) for s, e in raw["update"]]
    med = median_step(raw)
    assert med["inv_kron_A:l"] == [(2500, 2600)]
    assert med["cov_kron_A:l"] == [(2500, 2501)]
    assert med["sync_kron_A:l"] == [(3020, 3030)]
    assert med["numpy"] == med["update"] and all(type(t) is int for t in med["numpy"][0])
    assert med["call_forward"] == median_step(_four_steps())["call_forward"]
    assert len(job_from_dicts([med]).nodes) == 1
