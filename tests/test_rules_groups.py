"""Sync groups: Chimera's replica pairs, the shared-order rule ``validate`` checks over them, and the
``tight`` policy aligning the members of each group (room rules included)."""
from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.policies import get_policy
from pipefisher.policies.tight import OVERLAP_BY_DEFAULT, pack_node
from pipefisher.rules import validate
from pipefisher.rules.groups import (chimera_groups, group_order_violations, identity, is_chimera_job, job_groups,
                                     shared_sequence)
from pipefisher.schedule.timeline import Job, job_from_dicts
from pipefisher.sim.costs import load_cost_model
from pipefisher.sim.random_jobs import random_raw_job
from pipefisher.sim.simulator import simulate_timelines

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B", "inv_kron_A", "inv_kron_B")
START, END, OFF, ON = "-- start --", "-- end --", "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads"


def sim_job(config: str = "bert-base-4stages", order: str = "chimera", stages: int = 2, m: int = 4,
            scale: float = 1.0, seconds: bool = False) -> Job:
    model = load_cost_model(ROOT / "pipefisher" / "bundled" / "cost_models" / f"{config}.yaml")
    timelines, _ = simulate_timelines(model.replace(kfac_scale=scale), order=order, stages=stages,
                                      micro_batches=m)
    if seconds:  # float seconds, as CPU profiles have them
        timelines = [{k: [(s / 1e9, e / 1e9) for s, e in ivs] for k, ivs in d.items()} for d in timelines]
    return job_from_dicts(timelines)


# -- a hand-made two-node Chimera job: node 0 holds layer.0 down and layer.1 up, node 1 the mirror ----

def hand_node(plain: str, up: str) -> dict:
    t = 0
    d: dict = {"start_end": []}
    for key in ("call_forward", "call_forward:up_pipe", "call_backward:up_pipe", "call_backward"):
        d[key] = [(t, t + 100)]
        t += 150
    for kind in KINDS:
        for key in (f"{kind}:{plain}", f"{kind}:{up}:up_pipe"):
            d[key] = [(t, t + 10)]
            t += 10
    d["start_end"] = [(0, t)]
    return d


def hand_schedule(plain: str, up: str) -> list[list[str]]:
    """One iteration: pipeline, covariance, then per layer (layer.0 first) sync and inverse of A and B."""
    own = {plain: f":{plain}", up: f":{up}:up_pipe"}
    labels = [START, "call_forward", "call_forward:up_pipe", "call_backward:up_pipe", "call_backward"]
    labels += [f"{k}{own[x]}" for k in KINDS[:2] for x in (plain, up)]
    labels += [f"{k}{own[x]}" for x in ("layer.0", "layer.1") for k in KINDS[2:]]
    return [labels + [END, OFF, ON]]


@pytest.fixture
def hand_job() -> Job:
    return job_from_dicts([hand_node("layer.0", "layer.1"), hand_node("layer.1", "layer.0")])


@pytest.fixture
def hand_schedules() -> list[list[list[str]]]:
    return [hand_schedule("layer.0", "layer.1"), hand_schedule("layer.1", "layer.0")]


# -- groups and layout inference ----------------------------------------------------------------------

def test_chimera_groups_pair_mirrored_nodes_and_leave_the_middle_alone() -> None:
    assert chimera_groups(1) == [(0,)]
    assert chimera_groups(2) == [(0, 1)]
    assert chimera_groups(4) == [(0, 3), (1, 2)]
    assert chimera_groups(5) == [(0, 4), (1, 3), (2,)]


def test_shared_sequence_keeps_syncs_inverses_and_ends_as_identities() -> None:
    labels = [START, "call_forward", "cov_kron_A:x", "sync_kron_A:x:up_pipe", "inv_kron_A:x", END, OFF]
    assert shared_sequence(labels) == ["sync_kron_A:x", "inv_kron_A:x", END]
    assert identity("sync_kron_A:up_pipe") == "sync_kron_A" and identity("inv_kron_B:a:b") == "inv_kron_B:a:b"


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_simulated_chimera_jobs_are_grouped_in_pairs(stages: int) -> None:
    job = sim_job(stages=stages, config="bert-large-8stages" if stages == 8 else "bert-base-4stages")
    assert is_chimera_job(job)
    assert job_groups(job) == chimera_groups(stages)


def test_jobs_without_mirrored_up_pipe_modules_are_not_grouped(hand_job: Job) -> None:
    assert job_groups(sim_job(order="1f1b", stages=4)) == [(0,), (1,), (2,), (3,)]
    for seed in range(40):  # random jobs with up-pipe keys: every node has modules of its own, or bare keys
        for bare in (False, True):
            job = job_from_dicts(random_raw_job(seed, nodes=2 + seed % 3, up_pipe=True, bare_keys=bare))
            assert job_groups(job) == [(n,) for n in range(len(job.nodes))], (seed, bare)
    # one module out of place is enough to refuse the pairing
    node1 = hand_node("layer.1", "layer.0")
    node1["cov_kron_A:layer.2:up_pipe"] = [(0, 1)]
    assert job_groups(job_from_dicts([hand_node("layer.0", "layer.1"), node1])) == [(0,), (1,)]
    assert job_groups(hand_job) == [(0, 1)]


# -- the rule -------------------------------------------------------------------------------------------

def test_a_schedule_whose_members_agree_passes(hand_job: Job, hand_schedules) -> None:
    assert validate(hand_schedules, hand_job, room=False) == []


def test_a_different_sync_order_on_one_member_is_reported(hand_job: Job, hand_schedules) -> None:
    s = copy.deepcopy(hand_schedules)
    labels = s[1][0]
    a, b = labels.index("sync_kron_A:layer.1"), labels.index("sync_kron_B:layer.1")
    labels[a], labels[b] = labels[b], labels[a]
    got = validate(s, hand_job, room=False)
    assert [str(v) for v in got] == [
        "node1 iteration 0: sync_kron_B:layer.1: group-order: node1 runs sync_kron_B:layer.1 where node0 runs "
        "sync_kron_A:layer.1:up_pipe (shared entry 4 of the iteration)"]
    assert validate(s, hand_job, room=False, groups=[]) == []
    assert validate(s, hand_job, room=False, groups=[(0,), (1,)]) == []


def test_an_inverse_on_the_other_side_of_the_end_and_a_cycle_length_are_reported(hand_job, hand_schedules) -> None:
    s = copy.deepcopy(hand_schedules)
    labels = s[0][0]
    labels.remove("inv_kron_B:layer.1:up_pipe")
    labels.insert(labels.index(END) + 1, "inv_kron_B:layer.1:up_pipe")
    got = group_order_violations(s, [(0, 1)])
    assert [(v.node, v.iteration, v.rule) for v in got] == [(1, 0, "group-order")]
    assert "node1 runs inv_kron_B:layer.1 where node0 runs -- end --" in got[0].detail
    s = copy.deepcopy(hand_schedules)
    s[1] = [s[1][0][:-1], [START, "call_forward", "call_forward:up_pipe", "call_backward:up_pipe",
                           "call_backward", END, ON]]
    got = group_order_violations(s, [(0, 1)])
    assert [(v.node, v.iteration, v.rule) for v in got] == [(1, None, "group-cycle")]
    assert str(got[0]) == "node1 cycle: -: group-cycle: node1 has 2 iterations where node0 has 1 (sync group node0, node1)"
    with pytest.raises(ValueError):
        group_order_violations(s, [(0, 2)])


def test_validate_cli_prints_one_line_per_group_violation_and_exits_1(tmp_path, hand_job, hand_schedules) -> None:
    paths = []
    for n, node in enumerate((hand_node("layer.0", "layer.1"), hand_node("layer.1", "layer.0"))):
        paths.append(tmp_path / f"job_node{n}_timeline.pickle")
        paths[-1].write_bytes(pickle.dumps(node))
    s = copy.deepcopy(hand_schedules)
    for n in (0, 1):  # every member puts B's sync first on its own: both disagree in two places
        labels = s[n][0]
        plain = "layer.0" if n == 0 else "layer.1"
        a, b = labels.index(f"sync_kron_A:{plain}"), labels.index(f"sync_kron_B:{plain}")
        labels[a], labels[b] = labels[b], labels[a]
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps(s))
    runner = CliRunner()
    args = ["validate", "--no-room", "--schedule", str(bad), *map(str, paths)]
    result = runner.invoke(main, args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("node")]
    assert lines == [
        "node1 iteration 0: sync_kron_A:layer.0:up_pipe: group-order: node1 runs sync_kron_A:layer.0:up_pipe "
        "where node0 runs sync_kron_B:layer.0 (shared entry 0 of the iteration)"]
    assert runner.invoke(main, args + ["--layout", "none"]).exit_code == 0
    assert runner.invoke(main, args + ["--layout", "chimera"]).exit_code == 1
    good = tmp_path / "good.pickle"
    good.write_bytes(pickle.dumps(hand_schedules))
    assert runner.invoke(main, ["validate", "--no-room", "--layout", "chimera", "--schedule", str(good),
                                *map(str, paths)]).exit_code == 0


# -- the tight policy aligns each group -----------------------------------------------------------------

CHIMERA_CASES = [
    ("bert-base-4stages", 2, 4, 1.0, False),
    ("bert-base-4stages", 2, 8, 1.0, True),
    ("bert-base-4stages", 2, 16, 4.0, False),  # K-FAC x 4: work spans many iterations, with overflow
    ("bert-base-4stages", 4, 2, 1.0, False),
    ("bert-base-4stages", 4, 8, 1.0, False),
    ("bert-base-4stages", 4, 8, 4.0, False),
    ("bert-base-4stages", 4, 8, 16.0, False),  # needed iterations past the padded cycle
    ("bert-large-8stages", 4, 16, 1.0, False),
    ("bert-large-8stages", 6, 8, 16.0, True),
    ("bert-large-8stages", 8, 4, 1.0, False),
    ("bert-large-8stages", 8, 8, 4.0, False),
]


@pytest.mark.parametrize("config,stages,m,scale,seconds", CHIMERA_CASES)
def test_tight_on_chimera_passes_validate_with_groups_and_room(config: str, stages: int, m: int, scale: float,
                                                               seconds: bool) -> None:
    job = sim_job(config, "chimera", stages, m, scale, seconds)
    packed = get_policy("tight").pack(job)
    data = packed.to_file_data()
    assert validate(data, job, groups=chimera_groups(stages)) == []
    # the nodes packed on their own disagree: the alignment is what makes the schedule runnable
    alone = [[list(it) for it in pack_node(node, job.span).iterations] for node in job.nodes]
    assert group_order_violations(alone, chimera_groups(stages))
    for n, node in enumerate(packed.nodes):  # figures follow the rewritten cycle
        f = node.figures
        assert f.iterations == len(node.iterations) == len(packed.nodes[stages - 1 - n].iterations)
        assert f.kfac_placed == pytest.approx(sum(p.duration for p in node.placements if p.category.endswith(("_A", "_B"))))
        assert f.cycle_time == pytest.approx(f.pipeline_busy + f.kfac_placed + f.bubble_left)
        assert 0 < f.usage <= 100 + 1e-9
        assert f.extra["sync_group"] == sorted([n, stages - 1 - n]) and f.lower_bound <= f.iterations


def test_the_chimera_chart_and_report_follow_the_aligned_schedule() -> None:
    job = sim_job(stages=4, m=8)
    packed = get_policy("tight").pack(job)
    for node in packed.nodes:
        assert {p.iteration for p in node.placements} == set(range(node.figures.iterations))
        labels = [p.label for p in node.placements]
        assert labels == [label for it in node.iterations for label in it]


@pytest.mark.parametrize("seed", range(12))
def test_tight_leaves_jobs_without_groups_exactly_as_packed_per_node(seed: int) -> None:
    job = job_from_dicts(random_raw_job(seed, up_pipe=seed % 2 == 0))
    assert get_policy("tight").pack(job).nodes == tuple(pack_node(node, job.span, overlap=OVERLAP_BY_DEFAULT)
                                                  for node in job.nodes)


def test_tight_leaves_pipelines_without_up_pipe_unchanged() -> None:
    job = sim_job(order="1f1b", stages=4, m=8)
    assert get_policy("tight").pack(job).nodes == tuple(pack_node(node, job.span, overlap=OVERLAP_BY_DEFAULT)
                                                  for node in job.nodes)
