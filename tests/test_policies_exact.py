"""The optional ``exact`` policy (CP-SAT): never worse than ``tight`` without overlap (``exact`` never
overlaps cycles), always valid, bounds that hold."""
from __future__ import annotations

import os
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipefisher.errors import InputError
from pipefisher.policies import get_policy
from pipefisher.policies.exact import MISSING_ORTOOLS, ExactPolicy
from pipefisher.policies.tight import pack_node
from pipefisher.rules import validate, validate_node
from pipefisher.schedule.problem import node_model
from pipefisher.schedule.timeline import job_from_dicts
from pipefisher.sim.random_jobs import random_raw_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------
# Without OR-Tools


def _hide_ortools(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ortools", "ortools.sat", "ortools.sat.python", "ortools.sat.python.cp_model"):
        monkeypatch.setitem(sys.modules, name, None)  # ``import`` of a None entry raises ImportError


def test_without_ortools_the_policy_is_an_input_error_saying_how_to_install_it(monkeypatch):
    _hide_ortools(monkeypatch)
    with pytest.raises(InputError) as err:
        get_policy("exact")
    assert str(err.value) == MISSING_ORTOOLS
    assert "\n" not in str(err.value)
    assert str(err.value) == ("the 'exact' policy needs OR-Tools: pip install 'pipefisher[exact]' "
                              "(in a clone: pip install -c constraints.txt -e '.[exact]')")
    with pytest.raises(InputError):
        ExactPolicy().pack(job_from_dicts(random_raw_job(0)))


def test_without_ortools_the_cli_prints_one_line(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from pipefisher.cli import main

    _hide_ortools(monkeypatch)
    res = CliRunner().invoke(main, ["schedule", "--policy", "exact"])
    assert res.exit_code == 2, res.output
    assert MISSING_ORTOOLS in res.output
    assert "Traceback" not in res.output


def test_get_policy_options():
    with pytest.raises(InputError, match="takes no options"):
        get_policy("best-fit", time_limit=1.0)
    with pytest.raises(InputError, match="policy 'tight' takes only overlap, not time_limit"):
        get_policy("tight", time_limit=1.0)
    assert get_policy("tight", time_limit=None).name == "tight"  # None: not given
    with pytest.raises(InputError, match="unknown policy"):
        get_policy("nope")


# ----------------------------------------------------------------------------------------------------
# With OR-Tools


def _needs_ortools() -> None:
    pytest.importorskip("ortools")


def _check_job(job, time_limit: float, margin: float = 0.05) -> tuple:
    tight = get_policy("tight", overlap=False).pack(job, margin)
    exact = get_policy("exact", time_limit=time_limit).pack(job, margin)
    assert exact.policy == "exact"
    assert not validate(exact.to_file_data(), job, margin=margin)
    for t, e in zip(tight.nodes, exact.nodes):
        f = e.figures
        assert f.iterations <= t.figures.iterations
        assert t.figures.lower_bound <= f.lower_bound <= f.iterations
        assert f.extra["gap"] == f.iterations - f.lower_bound
        assert f.extra["optimal"] == (f.iterations == f.lower_bound)
        assert isinstance(f.extra["exact_status"], str) and f.extra["exact_seconds"] >= 0
    return tight, exact


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
def test_exact_is_never_longer_than_tight_and_always_valid(seed):
    _needs_ortools()
    _check_job(job_from_dicts(random_raw_job(seed)), time_limit=0.3)


@pytest.mark.parametrize("margin", [0.0, 0.3])
def test_other_margins(margin):
    _needs_ortools()
    for seed in (41, 62, 94):
        _check_job(job_from_dicts(random_raw_job(seed)), time_limit=0.5, margin=margin)


def _simulated(config: str, order: str, stages: int, micro_batches: int):
    from pipefisher.sim.costs import cost_model_from_dict
    from pipefisher.sim.simulator import simulate_timelines

    path = os.path.join(ROOT, "pipefisher", "bundled", "cost_models", config)
    with open(path) as f:
        model = cost_model_from_dict(yaml.safe_load(f), path)
    timelines, _ = simulate_timelines(model, order=order, stages=stages, micro_batches=micro_batches)
    return job_from_dicts(timelines)


def test_simulated_job_exact_proves_a_bound_above_tights():
    """BERT-Base, GPipe, 8 stages x 16 micro-batches: tight's last node takes 2 iterations against a bound
    of 1; exact proves that no single-iteration cycle exists."""
    _needs_ortools()
    job = _simulated("bert-base-4stages.yaml", "gpipe", 8, 16)
    tight, exact = _check_job(job, time_limit=5.0)
    t, e = tight.nodes[7].figures, exact.nodes[7].figures
    assert (t.iterations, t.lower_bound) == (2, 1)
    assert (e.iterations, e.lower_bound) == (2, 2)
    assert e.extra["optimal"] and e.extra["exact_status"] == "proven optimal"


@pytest.mark.parametrize("config,order", [("bert-large-8stages.yaml", "1f1b"), ("bert-base-4stages.yaml", "1f1b")])
def test_simulated_jobs(config, order):
    _needs_ortools()
    _check_job(_simulated(config, order, 4, 8), time_limit=1.0)


@pytest.mark.parametrize("seed,node,tight_k,best", [(41, 0, 5, 4), (62, 0, 12, 11)])
def test_exact_finds_shorter_cycles_than_tight(seed, node, tight_k, best):
    """Nodes of the generated suite where tight's greedy walks and fixed-length construction are not
    optimal: CP-SAT finds the shorter cycle and proves it optimal (found by scripts/policy_suites.py)."""
    _needs_ortools()
    from pipefisher.policies.exact import pack_node_exact

    job = job_from_dicts(random_raw_job(seed))
    start = pack_node(job.nodes[node], job.span)
    assert start.figures.iterations == tight_k
    found = pack_node_exact(job.nodes[node], job.span, time_limit=20.0)
    f = found.figures
    assert f.iterations == best < tight_k
    assert f.lower_bound == best and f.extra["optimal"] and f.extra["gap"] == 0
    assert f.extra["exact_status"] == "improved, proven optimal"
    assert f.extra["tight_iterations"] == tight_k
    assert not validate_node(0, job.nodes[node], found.iterations, job.span)


@pytest.mark.parametrize("seed,node", [(41, 0), (62, 0), (94, 1), (30, 0), (61, 2)])
def test_proof_model_is_a_relaxation_of_the_solution_model(seed, node):
    """Where the proof model says "no k-iteration cycle", the solution model finds none either; where
    the solution model finds one, it validates."""
    _needs_ortools()
    from pipefisher.policies.bounds import model_bounds
    from pipefisher.policies.cycle import node_schedule
    from pipefisher.policies.exact import _solve, cp_model_module

    cp = cp_model_module()
    job = job_from_dicts(random_raw_job(seed))
    model = node_model(job.nodes[node], job.span)
    start = pack_node(job.nodes[node], job.span)
    for k in range(max(1, start.figures.lower_bound - 1), start.figures.iterations + 1):
        proof, _ = _solve(cp, model, k, True, 5.0)
        solution, packed = _solve(cp, model, k, False, 5.0)
        if proof == "infeasible":
            assert solution == "infeasible"
        if packed is not None:
            schedule = node_schedule(model, packed, model_bounds(model))
            assert not validate_node(0, job.nodes[node], schedule.iterations, job.span)
    # tight's own cycle length is always feasible for the relaxation
    assert _solve(cp, model, start.figures.iterations, True, 5.0)[0] == "feasible"


def test_time_limit_zero_keeps_tight():
    _needs_ortools()
    job = job_from_dicts(random_raw_job(41))
    tight = get_policy("tight", overlap=False).pack(job)
    exact = get_policy("exact", time_limit=0).pack(job)
    assert [n.iterations for n in exact.nodes] == [n.iterations for n in tight.nodes]
    assert exact.nodes[0].figures.extra["exact_status"] == "time limit"
    with pytest.raises(InputError):
        get_policy("exact", time_limit=-1)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8)])
def test_chimera_jobs_are_aligned(stages, micro_batches):
    _needs_ortools()
    from pipefisher.rules.groups import chimera_groups, is_chimera_job

    job = _simulated("bert-base-4stages.yaml", "chimera", stages, micro_batches)
    assert is_chimera_job(job)
    _, exact = _check_job(job, time_limit=1.0)
    assert not validate(exact.to_file_data(), job, groups=chimera_groups(stages))
    assert all("sync_group" in n.figures.extra for n in exact.nodes)
