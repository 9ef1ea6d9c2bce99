"""Who waits for whom at run time (:mod:`pipefisher.rules.waits`), and the ``tight`` policy's
Chimera schedules never deadlocking: on simulated jobs, on jobs whose nodes read their own clocks (as
profiles do), and on real profiles."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipefisher.policies import get_policy
from pipefisher.policies.align import _Member, align_group, job_calls
from pipefisher.policies.tight import OVERLAP_BY_DEFAULT, _shorter_groups, pack_nodes
from pipefisher.rules import validate
from pipefisher.rules.groups import chimera_groups, job_groups, singleton_groups
from pipefisher.rules.waits import call_clock, deadlock_violations
from pipefisher.schedule.packed import NodeSchedule
from pipefisher.schedule.timeline import Job, job_from_dicts, load_job
from pipefisher.sim.costs import load_cost_model
from pipefisher.sim.simulator import simulate_timelines

ROOT = Path(__file__).resolve().parent.parent
START, END, OFF, ON = "-- start --", "-- end --", "turn_off_save_inputs_outgrads", "turn_on_save_inputs_outgrads"
F, B, FU, BU = "call_forward", "call_backward", "call_forward:up_pipe", "call_backward:up_pipe"


def two_nodes(node0: list[str], node1: list[str]) -> list[list[list[str]]]:
    """A one-iteration schedule of a two-node Chimera job (node 0 syncs layer x, node 1 its up-pipe copy)."""
    return [[[START, *node0, OFF, ON]], [[START, *node1, OFF, ON]]]


SYNC0, INV0, SYNC1, INV1 = "sync_kron_A:x", "inv_kron_A:x", "sync_kron_A:x:up_pipe", "inv_kron_A:x:up_pipe"


# -- the wait graph ----------------------------------------------------------------------------------

def test_an_inverse_before_a_call_its_peer_needs_while_the_peer_syncs_after_it_deadlocks() -> None:
    # node 0 waits at its inverse for node 1's sync; node 1 syncs only after its forward, which
    # receives node 0's forward, which comes after node 0's inverse
    s = two_nodes([SYNC0, INV0, F, B, END], [F, SYNC1, INV1, B, END])
    got = deadlock_violations(s, [(0, 1)])
    assert [(v.node, v.iteration, v.label, v.rule) for v in got] == [(0, 0, INV0, "deadlock"), (1, 0, F, "deadlock")]
    assert "at training step 1" in got[0].detail and "waiting for node1's 'sync_kron_A:x:up_pipe'" in got[0].detail
    assert "waiting for node0's 'call_forward'" in got[1].detail
    assert deadlock_violations(s, singleton_groups(2)) == []  # no group: the inverses wait for no one


@pytest.mark.parametrize("node0", [
    [F, SYNC0, INV0, B, END],  # the forward first: node 1 reaches its sync without node 0's inverse
    [SYNC0, F, B, END, INV0],  # the inverse after the end
])
def test_the_same_waits_in_a_safe_order_do_not_deadlock(node0: list[str]) -> None:
    node1 = [F, SYNC1, INV1, B, END] if INV0 in node0[:-1] else [F, SYNC1, B, END, INV1]
    assert deadlock_violations(two_nodes(node0, node1), [(0, 1)]) == []


def test_an_end_waits_for_every_member_to_reach_its_end() -> None:
    # node 0's backward receives node 1's, which node 1 runs only after its end; node 0 ends after it
    s = two_nodes([B, END], [END, B])
    got = deadlock_violations(s, [(0, 1)])
    assert [(v.node, v.label) for v in got] == [(0, B), (1, END)]
    assert deadlock_violations(two_nodes([B, END], [B, END]), [(0, 1)]) == []
    assert deadlock_violations(s, singleton_groups(2)) == []


def test_the_first_deadlocking_step_is_reported_with_each_nodes_iteration() -> None:
    s = [[[START, SYNC0, F, B, END, INV0, OFF], [START, SYNC0, INV0, F, B, END, ON]],  # step 2 deadlocks
         [[START, F, SYNC1, B, END, INV1, OFF], [START, F, SYNC1, INV1, B, END, ON]]]
    got = deadlock_violations(s, [(0, 1)])
    assert [(v.node, v.iteration, v.label) for v in got] == [(0, 1, INV0), (1, 1, F)]
    assert "at training step 2" in got[0].detail
    s[0] = s[0][:1]  # node 0 repeats its safe iteration: no step deadlocks
    s[0][0][-1:] = [OFF, ON]
    assert deadlock_violations(s, [(0, 1)]) == []


def test_single_pipe_jobs_never_deadlock() -> None:
    job = sim_job("bert-base-4stages", "1f1b", 4, 8, 1.0)
    data = get_policy("tight").pack(job).to_file_data()
    assert deadlock_violations(data, job_groups(job)) == []
    # even with every inverse before every call: without sync groups an inverse waits for nobody
    moved = [[[lb for lb in it if lb.startswith("inv_kron")] + [lb for lb in it if not lb.startswith("inv_kron")]
              for it in node] for node in data]
    assert deadlock_violations(moved, singleton_groups(4)) == []


def test_the_call_clock_respects_every_receive() -> None:
    # node 0: down stage 0, up stage 1; node 1: down stage 1, up stage 0 (two micro-batches per pipe)
    orders = [[F, FU, F, BU, FU, B, BU, B], [FU, F, FU, F, B, BU, B, BU]]
    durations = [[3, 2, 3, 0, 2, 4, 0, 4], [2, 3, 2, 3, 4, 0, 4, 0]]
    clock = call_clock(orders, durations)
    ends = {}
    for n in (0, 1):
        seen: dict[str, int] = {}
        for j, (call, (start, end)) in enumerate(zip(orders[n], clock[n])):
            assert end > start and (j == 0 or start >= clock[n][j - 1][1])
            k = seen[call] = seen.get(call, -1) + 1
            ends[n, call, k] = (start, end)
    for k in (0, 1):  # forwards go down stage by stage, backwards up; a call starts after its input ends
        assert ends[1, F, k][0] >= ends[0, F, k][1] and ends[0, FU, k][0] >= ends[1, FU, k][1]
        assert ends[0, B, k][0] >= ends[1, B, k][1] and ends[1, BU, k][0] >= ends[0, BU, k][1]
    # orders that deadlock by themselves still get a clock (the missing receives are ignored)
    assert [len(c) for c in call_clock([[B, F], [B, F]], [[1, 1], [1, 1]])] == [2, 2]


# -- tight never deadlocks ------------------------------------------------------------------------------

def sim_job(config: str, order: str, stages: int, m: int, scale: float, skew: int | None = None) -> Job:
    """A simulated job; with ``skew``, every node but node 0 reads its own clock, shifted by up to 15 %
    of the pipeline time (seeded), in float seconds: what a profile of several processes looks like."""
    model = load_cost_model(ROOT / "pipefisher" / "bundled" / "cost_models" / f"{config}.yaml")
    timelines, _ = simulate_timelines(model.replace(kfac_scale=scale), order=order, stages=stages,
                                      micro_batches=m)
    if skew is not None:
        rng = random.Random(skew)
        span = max(e for d in timelines for ivs in d.values() for _, e in ivs)
        offsets = [0.0] + [rng.uniform(-0.15, 0.15) * span for _ in timelines[1:]]
        timelines = [{k: [((s + off) / 1e9, (e + off) / 1e9) for s, e in ivs] for k, ivs in d.items()}
                     for d, off in zip(timelines, offsets)]
    return job_from_dicts(timelines)


def aligned_without_safety_net(job: Job) -> list[list[list[str]]]:
    """Each group aligned by :func:`align_group` alone, without the check and fallback of ``align_groups``,
    from both of the tight policy's walks, each group's shorter kept as the policy keeps it."""
    groups = job_groups(job)

    def aligned(nodes: tuple[NodeSchedule, ...]) -> tuple[NodeSchedule, ...]:
        calls = job_calls(job, nodes)
        out = list(nodes)
        for group in groups:
            for n, member in zip(group, align_group(job, nodes, group, calls)):
                out[n] = member
        return tuple(out)

    ours, theirs = (aligned(pack_nodes(job, overlap=OVERLAP_BY_DEFAULT, finish_started=f)) for f in (True, False))
    return [[list(it) for it in node.iterations] for node in _shorter_groups(ours, theirs, groups)]


def inverses_before_end(data: list[list[list[str]]]) -> int:
    return sum(1 for node in data for it in node for lb in it[: it.index(END)] if lb.startswith("inv_kron"))


def check_tight(job: Job) -> None:
    groups = job_groups(job)
    assert len(groups) < len(job.nodes)
    packed = get_policy("tight").pack(job)
    data = packed.to_file_data()
    assert validate(data, job, groups=groups) == []  # room, group order, and now deadlock too
    assert deadlock_violations(data, groups) == []
    # the placement alone avoids the cycle: the safety net had nothing to do
    assert aligned_without_safety_net(job) == data
    assert inverses_before_end(data) > 0  # and not by putting every inverse after the end


SIM_CASES = [(config, d, m, scale) for config, d in (("bert-base-4stages", 2), ("bert-base-4stages", 4),
                                                     ("bert-large-8stages", 8))
             for m in (4, 8) for scale in (1.0, 4.0, 16.0)]


@pytest.mark.parametrize("config,stages,m,scale", SIM_CASES)
def test_tight_on_simulated_chimera_jobs_never_deadlocks(config: str, stages: int, m: int, scale: float) -> None:
    check_tight(sim_job(config, "chimera", stages, m, scale))


# every one of these deadlocked before the aligner waited for its syncs on the call clock
SKEWED_CASES = [("bert-base-4stages", 2, 4, 1.0, 0), ("bert-base-4stages", 2, 8, 4.0, 2),
                ("bert-base-4stages", 2, 4, 16.0, 0), ("bert-base-4stages", 4, 4, 1.0, 1),
                ("bert-base-4stages", 4, 8, 4.0, 1), ("bert-base-4stages", 4, 8, 16.0, 1),
                ("bert-large-8stages", 8, 4, 1.0, 0), ("bert-large-8stages", 8, 8, 4.0, 2),
                ("bert-large-8stages", 8, 4, 16.0, 2)]


@pytest.mark.parametrize("config,stages,m,scale,skew", SKEWED_CASES)
def test_tight_never_deadlocks_when_each_node_reads_its_own_clock(config: str, stages: int, m: int, scale: float,
                                                                 skew: int) -> None:
    check_tight(sim_job(config, "chimera", stages, m, scale, skew))


@pytest.mark.parametrize("name,stages", [("chimera_tiny_2", 2), ("chimera_tiny_4", 4)])
def test_tight_never_deadlocks_on_real_profiles(name: str, stages: int) -> None:
    job = load_job(sorted((ROOT / "tests" / "data" / "profiles" / name).glob("*_timeline.pickle")))
    assert job_groups(job) == chimera_groups(stages)
    check_tight(job)


def test_without_waiting_for_the_syncs_the_aligner_deadlocks_and_validate_says_so(monkeypatch) -> None:
    job = sim_job("bert-base-4stages", "chimera", 2, 4, 1.0, skew=0)
    monkeypatch.setattr(_Member, "in_time", lambda self, r, wait: True)  # the placement no longer waits
    assert deadlock_violations(aligned_without_safety_net(job), job_groups(job))
    # the safety net cannot put the inverses after the end (the tails have no room), so it keeps them
    data = get_policy("tight").pack(job).to_file_data()
    got = validate(data, job)
    assert got and {v.rule for v in got} == {"deadlock"} and {v.node for v in got} == {0, 1}


def test_the_call_clock_follows_interleaved_chunks_through_their_virtual_stages() -> None:
    """Chunk 1 of node 0 is virtual stage 2: its forward receives from node 1's chunk 0 forward, and
    node 0's chunk-0 backward from node 1's (not from nobody, as a chunk-blind stage-0 call would)."""
    order = ["call_forward", "call_forward:chunk1", "call_backward:chunk1", "call_backward"]
    clock = call_clock([order, order], [[1, 1, 1, 1], [1, 1, 1, 1]])
    starts = [[start[0] for start, _ in node] for node in clock]
    assert starts == [[0.0, 2.0, 5.0, 7.0], [1.0, 3.0, 4.0, 6.0]]
