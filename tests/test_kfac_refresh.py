"""A factor's refresh in pieces (pipefisher.kfac.refresh): the math against the whole refresh, and the
runtime's rule of which inverse label does what (KFAC.inv, the executor's completions), resumes included."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.kfac import factors as fx
from pipefisher.kfac.refresh import MAX_BLOCK, Refresh, _stage_flops, cholesky_plan, pieces_for, split_costs
from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job.dist import single_process
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.checks import single_iteration_schedule
from pipefisher.runtime.pipeline.engine import PipelineEngine
from pipefisher.runtime.pipeline.executor import ScheduleExecutor
from pipefisher.runtime.pipeline.labels import parse_label
from pipefisher.runtime.train.trainer import Trainer, TrainOptions
from pipefisher.runtime.train.update import make_kfac
from pipefisher.schedule.file import meta_path, save_schedule
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START

from _schedules import tiny


def _factor(n: int, rows: int = 64, bias: bool = False, seed: int = 0) -> torch.Tensor:
    """A covariance as a refresh sees one (factor A with its bias column where ``bias``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n - bias, generator=g) * torch.linspace(2.0, 0.1, n - bias)
    return fx.cov_a(x, bias)


def _run(refresh: Refresh) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    steps = 0
    while not refresh.step():
        steps += 1
    assert steps + 1 == refresh.pieces
    return refresh.result()


@pytest.mark.parametrize("n, bias", [(3, False), (7, False), (130, True), (257, True)])
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_pieces_give_the_whole_damped_inverse(n, bias, p):
    f = _factor(n, rows=4 * n, bias=bias)
    whole, want, ok_whole = fx.inverse_findings(f, 1e-3)
    inv, findings, ok = _run(Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=p))
    assert torch.equal(findings, want) and bool(ok) and bool(ok_whole)
    # in float64 exact to rounding against the damped matrix itself (its lower triangle, as Cholesky reads
    # it: float32's product is not exactly symmetric), and in float32 as close to it as the whole inverse
    inv64, _, _ = _run(Refresh(f.double(), 1e-3, method="cholesky", dtype=torch.float64, pieces=p))
    low = f.double().tril()
    damped = low + low.tril(-1).t() + 1e-3 * torch.eye(n, dtype=torch.float64)
    assert torch.allclose(damped @ inv64, torch.eye(n, dtype=torch.float64), atol=1e-9)
    error = lambda x: float((x.double() - inv64).norm() / inv64.norm())
    assert error(inv) <= 4 * error(whole) + 1e-6, (error(inv), error(whole))


@pytest.mark.parametrize("n, p", [(1, 2), (3, 8), (40, 4), (300, 7), (1024, 16), (4096, 3)])
def test_the_plan_cuts_even_pieces_of_the_cost_model_over_every_column_once(n, p):
    tasks, ranges = cholesky_plan(n, p)
    assert len(ranges) == p and ranges[0][0] == 0 and ranges[-1][1] == len(tasks)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    chol = [(j0, j1) for stage, j0, j1, _ in tasks if stage == "chol"]
    inv = [(j0, j1) for stage, j0, j1, _ in tasks if stage == "inv"]
    assert [t[0] for t in tasks] == ["chol"] * len(chol) + ["inv"] * len(inv)  # all of L before X
    assert chol[0][0] == 0 and chol[-1][1] == n and all(a[1] == b[0] for a, b in zip(chol, chol[1:]))
    assert inv[0][1] == n and inv[-1][0] == 0 and all(a[0] == b[1] for a, b in zip(inv, inv[1:]))  # back
    assert all(0 < j1 - j0 <= MAX_BLOCK["cpu"] for _, j0, j1, _ in tasks)
    total = _stage_flops(n, p, 2 * n)
    assert sum(c for *_, c in tasks) == pytest.approx(total)
    # each piece within one column's cost (the largest: the inverse's first) of an even share
    column = _stage_flops(n, p, 2 * n) - _stage_flops(n, p, 2 * n - 1)
    for a, b in ranges:
        assert abs(sum(c for *_, c in tasks[a:b]) - total / p) <= column + 1e-9 * total


def test_the_cost_model_weighs_the_stages_as_they_run():
    """The inverse stage costs about twice the Cholesky (its ``2n^3/3`` against ``n^3/3``, the Cholesky's
    flops weighted as slower), and the inverse's first columns (done last) cost the most."""
    n, p = 1024, 8
    chol, both = _stage_flops(n, p, n), _stage_flops(n, p, 2 * n)
    assert 1.4 < (both - chol) / chol < 2.0
    tasks, ranges = cholesky_plan(n, p)
    widths = [sum(j1 - j0 for _, j0, j1, _ in tasks[a:b]) for a, b in ranges]
    assert widths[-1] < widths[-2] < widths[-3]  # the inverse's pieces narrow towards column 0


@pytest.mark.parametrize("done", [1, 2, 3, 4])
def test_a_refresh_resumed_from_its_state_finishes_bit_for_bit(done, tmp_path):
    f = _factor(50, rows=200)
    whole = _run(Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=5))
    part = Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=5)
    for _ in range(done):
        part.step()
    torch.save(part.state_dict(), tmp_path / "r.pt")
    resumed = Refresh.from_state(torch.load(tmp_path / "r.pt", weights_only=True))
    resumed.finish()
    for a, b in zip(resumed.result(), whole):
        assert torch.equal(a, b)


def test_a_refresh_keeps_its_devices_block_width_into_a_resume_elsewhere(tmp_path, monkeypatch):
    """Blocks as wide as the device's (MAX_BLOCK: 1024 on a GPU, 128 on a CPU); a checkpoint resumed on
    another device keeps the plan it was cut by, and one from before the width was kept, the CPU's."""
    f = _factor(300, rows=400)
    whole = fx.inverse_findings(f, 1e-3, method="cholesky", dtype=torch.float32)[0]
    monkeypatch.setitem(MAX_BLOCK, "cpu", 1024)  # this CPU stands for a GPU
    wide = Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=2)
    assert max(j1 - j0 for _, j0, j1, _ in wide.tasks) == 300  # one block per stage and piece
    wide.step()
    torch.save(wide.state_dict(), tmp_path / "r.pt")
    monkeypatch.setitem(MAX_BLOCK, "cpu", 128)
    resumed = Refresh.from_state(torch.load(tmp_path / "r.pt", weights_only=True))
    assert resumed.tasks == wide.tasks
    resumed.finish()
    assert torch.allclose(resumed.result()[0], whole, rtol=1e-3, atol=1e-4)
    state = Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=2).state_dict()
    del state["chol_block"]
    monkeypatch.setitem(MAX_BLOCK, "cpu", 1024)
    assert max(j1 - j0 for _, j0, j1, _ in Refresh.from_state(state).tasks) <= 128


@pytest.mark.parametrize("p", [1, 2, 3, 6])
def test_a_blocked_eigenbasis_in_pieces_is_the_whole_blocked_one_and_resumes(p, tmp_path):
    """``kfac.basis_block``: a wide factor's eigenbasis refresh is its diagonal blocks' ``eigh``, grouped
    into pieces (more pieces than blocks leave pieces with nothing to do), the same basis as the whole
    blocked refresh, with or without a previous basis, and a checkpoint after any piece continues to it."""
    f = _factor(130, rows=400, bias=True)
    want = fx.eigenbasis(f, block=48)
    findings = fx.inverse_findings(f, 0.0, method="eigenbasis")[1]  # a blocked basis's findings are the same
    for basis in (None, torch.eye(130)):
        q, got, ok = _run(Refresh(f, 0.0, method="eigenbasis", dtype=torch.float32, pieces=p, block=48, basis=basis))
        assert torch.equal(q, want) and torch.equal(got, findings) and bool(ok)
    part = Refresh(f, 0.0, method="eigenbasis", dtype=torch.float32, pieces=p, block=48)
    assert part.mode == "blocks"
    part.step()
    torch.save(part.state_dict(), tmp_path / "r.pt")
    resumed = Refresh.from_state(torch.load(tmp_path / "r.pt", weights_only=True))
    resumed.finish()
    assert torch.equal(resumed.result()[0], want)


def test_a_factor_no_wider_than_the_block_is_one_exact_eigh_in_its_first_piece():
    """Under ``kfac.basis_block`` no eigenbasis is the power step's approximation: a factor one block covers
    gets the whole ``eigh`` in its first piece (the others do nothing), the basis of one piece; without a
    block the pieces still take the power step, and a Cholesky refresh ignores the block."""
    f = _factor(40, rows=160)
    whole = _run(Refresh(f, 0.0, method="eigenbasis", dtype=torch.float32, pieces=1, block=40, basis=torch.eye(40)))
    split = Refresh(f, 0.0, method="eigenbasis", dtype=torch.float32, pieces=2, block=40, basis=torch.eye(40))
    assert split.mode == "blocks"
    split.step()
    assert split.t["q"].abs().sum() > 0  # the eigh ran in the first piece
    split.step()
    assert torch.allclose(split.result()[0], whole[0], atol=1e-6) and bool(split.result()[2])
    assert Refresh(f, 0.0, method="eigenbasis", dtype=torch.float32, pieces=2, basis=torch.eye(40)).mode == "power"
    assert Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=2, block=8).mode == "cholesky"


@pytest.mark.parametrize("factored", [5, 23, 40])
def test_a_first_plan_checkpoint_mid_refresh_continues_to_the_inverse(factored):
    """A checkpoint the first plan wrote (no ``plan``; ``W`` in its tensors; its cut of the columns, not
    this plan's): the refresh continues from the columns it factored, over the pieces left."""
    n, p = 40, 4
    f = _factor(n, rows=160)
    want, findings, _ = fx.inverse_findings(f.double(), 1e-3, dtype=torch.float64)
    low = torch.linalg.cholesky(f.double() + 1e-3 * torch.eye(n, dtype=torch.float64))
    state = Refresh(f.double(), 1e-3, method="cholesky", dtype=torch.float64, pieces=p).state_dict()
    del state["plan"]
    t = state["tensors"]
    t["l"][:, :factored] = low[:, :factored]
    t["w"], t["x"] = torch.full_like(low, 7.0), torch.full_like(low, 7.0)  # the first plan's partial W, X
    if factored == n:
        del t["m"]
    state["done"] = 2
    resumed = Refresh.from_state(state)
    steps = 0
    while not resumed.step():
        steps += 1
    assert steps + 1 == p - 2
    inv, got, ok = resumed.result()
    assert bool(ok) and torch.equal(got, findings)
    assert torch.allclose(inv, want, rtol=1e-9, atol=1e-9)


def test_one_piece_is_the_whole_refresh_bit_for_bit():
    f = _factor(40, bias=True)
    for method in ("cholesky", "eigen", "eigenbasis"):
        got = _run(Refresh(f, 1e-3, method=method, dtype=torch.float32, pieces=1, basis=torch.eye(40)))
        for a, b in zip(got, fx.inverse_findings(f, 1e-3, method=method)):
            assert torch.equal(a, b), method


@pytest.mark.parametrize("bad", ["indefinite", "nan"])
def test_a_bad_factor_has_the_same_findings_in_pieces(bad):
    f = _factor(33)
    if bad == "indefinite":
        f[20, 20] = -5.0  # the leading minor of order 21 is not positive definite
    else:
        f[12, 3] = f[3, 12] = float("nan")
    _, want, ok_whole = fx.inverse_findings(f, 1e-3)
    for p in (2, 4):
        _, findings, ok = _run(Refresh(f, 1e-3, method="cholesky", dtype=torch.float32, pieces=p))
        reason = fx.bad_factor(findings.tolist(), "cholesky", "layer x factor A")
        assert reason is not None and reason == fx.bad_factor(want.tolist(), "cholesky", "layer x factor A")
        assert not bool(ok) and not bool(ok_whole)
    if bad == "indefinite":
        assert "Cholesky failed at column 21" in reason


def test_eigenbasis_pieces_take_a_power_step_from_the_previous_basis():
    n = 48
    vals = torch.linspace(2.0, 0.2, n, dtype=torch.float64)  # distinct eigenvalues, apart
    q = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    f = ((q * vals) @ q.t()).float()
    nudge = 1e-5 * torch.randn(n, n, generator=torch.Generator().manual_seed(2))
    previous = fx.eigenbasis(f + (nudge + nudge.t()))  # last refresh's basis: a nearby factor's
    exact = fx.eigenbasis(f)
    for p in (1, 2, 3, 5):
        basis, findings, ok = _run(Refresh(f, 1e-3, method="eigenbasis", dtype=torch.float32, pieces=p,
                                           basis=previous))
        assert bool(ok) and findings[4] == 1
        assert torch.allclose(basis.t() @ basis, torch.eye(n), atol=1e-5)  # orthonormal
        if p > 1:  # each column stays in its place, with its sign: close to eigh's (and the previous) column
            assert (basis * exact).sum(0).abs().min() > 0.99
            assert (basis * previous).sum(0).min() > 0.99
    # the first refresh (no previous basis) is eigh, whatever the pieces
    first, _, _ = _run(Refresh(f, 1e-3, method="eigenbasis", dtype=torch.float32, pieces=3))
    assert torch.equal(first, exact)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_power_step_stays_a_basis_for_a_factor_of_lower_rank_than_its_width(p):
    """Fewer rows than columns (a factor's rank below its width, as a 4096-wide factor of 2048 rows): the
    blocks past the rank are rounding noise once the blocks done are out; orthogonalised once before their
    QR, the basis lost orthogonality (max |Q^T Q - I| 0.38-1.0 here; 2.8 in norm at 4096 on a GPU)."""
    def factor(seed: int) -> torch.Tensor:
        x = torch.randn(128, 256, generator=torch.Generator().manual_seed(seed))
        return x.t() @ x / x.shape[0]
    f, previous = factor(0), fx.eigenbasis(factor(1))
    basis, _, ok = _run(Refresh(f, 1e-3, method="eigenbasis", dtype=torch.float32, pieces=p, basis=previous))
    assert bool(ok)
    assert (basis.t() @ basis - torch.eye(256)).abs().max() < 1e-5

    def off_diagonal(q: torch.Tensor) -> float:
        rotated = q.double().t() @ f.double() @ q.double()
        return float((rotated - rotated.diagonal().diag()).norm() / rotated.norm())
    # the same power step by one Householder QR, the columns of the largest eigenvalues first, as in pieces
    whole = torch.linalg.qr((fx.scaled_factor(f)[0] @ previous).flip(1))[0]
    assert off_diagonal(basis) == pytest.approx(off_diagonal(whole), abs=1e-3)


def test_auto_pieces_and_the_split_of_the_work():
    assert [pieces_for(w, "auto", "cholesky") for w in (128, 512, 513, 1024, 4096)] == [1, 1, 2, 2, 8]
    assert pieces_for(513, 4, "eigen") == 1 and pieces_for(3, 8, "cholesky") == 3
    ranges = split_costs([1.0] * 12, 4)
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 12)]
    from pipefisher.kfac import KFAC

    with pytest.raises(ValueError, match="needs inverse cholesky or eigenbasis"):
        KFAC(torch.nn.Sequential(torch.nn.Linear(2, 2)), inverse="eigen", refresh_pieces=2)


def test_the_config_refuses_pieces_of_an_eigen_refresh_in_one_line():
    from pipefisher.runtime.job.config import apply_overrides

    with pytest.raises(InputError, match="kfac.refresh_pieces > 1 needs kfac.inverse cholesky"):
        apply_overrides(tiny(), ["kfac.inverse=eigen", "kfac.refresh_pieces=2"])
    with pytest.raises(InputError, match="kfac.refresh_pieces must be an integer >= 1, auto or best, not 'many'"):
        apply_overrides(tiny(), ["kfac.refresh_pieces=many"])
    assert apply_overrides(tiny(), ["kfac.refresh_pieces=auto"]).kfac.refresh_pieces == "auto"


def test_best_pieces_is_the_runs_to_resolve_and_never_reaches_kfac():
    """``kfac.refresh_pieces: best`` reads as a setting (pipefisher run resolves it), needs a refresh that is
    split, and a worker given it unresolved refuses in one line before K-FAC is built."""
    from pipefisher.runtime.job.config import apply_overrides

    cfg = apply_overrides(tiny(), ["kfac.refresh_pieces=best"])
    assert cfg.kfac.refresh_pieces == "best"
    with pytest.raises(InputError, match="kfac.refresh_pieces: best tries refreshes in more than 1 piece, which "
                                         "need kfac.inverse cholesky"):
        apply_overrides(tiny(), ["kfac.inverse=eigen", "kfac.refresh_pieces=best"])
    stage = PipelineStage(cfg.model, 0, 2, seed=0)
    with pytest.raises(InputError, match="kfac.refresh_pieces: best is chosen by pipefisher run .*; a worker takes "
                                         "a number or auto"):
        make_kfac(cfg, stage)


def test_the_naive_step_times_each_piece_under_the_factor_key():
    cfg, kfac, engine = _one_stage(3)
    seen: list[str] = []

    class Span:
        def __init__(self, key: str) -> None:
            seen.append(key)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc) -> None:
            return None

    _fill(cfg, engine, kfac)
    kfac.update_curvature(span=Span)
    name = kfac.names[0]
    assert seen.count(f"inv_kron_A:{name}") == 3 and seen.count(f"cov_kron_A:{name}") == 1
    assert kfac.refresher.state[name].inversions == {"A": 1, "B": 1}


# -- the runtime's rule, on one stage of configs/tiny.yaml ----------------------------------------------


def _one_stage(pieces: int):
    """configs/tiny.yaml on one stage with refreshes in ``pieces``: its config, K-FAC and engine."""
    cfg = tiny(pipeline={"stages": 1}, kfac={"refresh_pieces": pieces})
    stage = PipelineStage(cfg.model, 0, 1, seed=cfg.data.seed)
    kfac = make_kfac(cfg, stage)
    engine = PipelineEngine(stage, single_process(), MLMData(cfg.data, cfg.model.vocab_size),
                            cfg.data.num_micro_batches, kfac=kfac)
    return cfg, kfac, engine


def _fill(cfg, engine, kfac) -> None:
    """One pipeline step with saving on (micro-batches for the covariance)."""
    from pipefisher.runtime.pipeline.engine import pipeline_ops

    kfac.set_saving(True)
    engine.begin_step(0)
    for op in pipeline_ops(cfg.pipeline.order, 0, 1, cfg.data.num_micro_batches):
        engine.op(op)()
    engine.finish_step()


def _with_pieces(labels: list[str], p: int, before: int = 0) -> list[str]:
    """``labels`` (one iteration) with each inverse label ``p`` times: ``before`` of them at the start of
    the iteration (before the factor's completion: an overlapping schedule), the rest where it stood."""
    invs = [lb for lb in labels if parse_label(lb).kind == "inv_kron"]
    out = [START] + [lb for lb in invs for _ in range(before)]
    for lb in labels[1:]:
        out += [lb] * (p - before) if lb in invs else [lb]
    return out


def _executor(p: int, before: int):
    cfg, kfac, engine = _one_stage(p)
    labels = _with_pieces(single_iteration_schedule(cfg)[0][0], p, before)
    log: list = []
    ex = ScheduleExecutor([labels], engine, {0: kfac}, lambda: log.append(("end", _versions(kfac))),
                          recorder=_Versions(kfac, log))
    kfac.set_saving(True)  # as step 0 leaves it
    return cfg, kfac, ex, log, labels


def _versions(kfac) -> dict:
    return {(n, f): st.inversions[f] for n, st in kfac.refresher.state.items() for f in "AB"}


class _Versions:
    """A recorder that logs every inverse label with the inversion counts after it."""

    def __init__(self, kfac, log: list) -> None:
        self.kfac, self.log = kfac, log

    def attach(self, engine) -> None:
        return None

    def begin_step(self, step: int, iteration: int) -> None:
        self.log.append(("step", step))

    def wrap(self, label: str, call):
        def logged() -> None:
            call()
            if parse_label(label).kind == "inv_kron":
                self.log.append((label, _versions(self.kfac)))
        return logged

    def end_step(self) -> None:
        return None


def test_a_non_overlapping_schedule_installs_at_each_factors_last_piece():
    cfg, kfac, ex, log, _ = _executor(p=3, before=0)
    for step in (1, 2):
        ex.run_step(step)
    name = kfac.names[0]
    a = [v[(name, "A")] for lb, v in log if lb == f"inv_kron_A:{name}"]
    assert a == [0, 0, 1, 1, 1, 2]  # begun at the first piece, installed at the third, every cycle
    ends = [v for what, v in log if what == "end"]
    assert [set(e.values()) for e in ends] == [{1}, {2}]  # every factor refreshed once per cycle
    assert kfac.refresher.state[name].flight == {"A": None, "B": None}


def test_an_overlapping_schedule_does_nothing_first_then_continues_the_previous_refresh():
    cfg, kfac, ex, log, labels = _executor(p=2, before=1)
    name = kfac.names[0]
    first_a = labels.index(f"inv_kron_A:{name}")
    assert first_a == 1  # one piece at the start of the iteration, before any covariance
    for step in (1, 2, 3):
        ex.run_step(step)
        if step == 1:  # the first cycle: the piece before the completion did nothing, the one after began
            assert kfac.refresher.state[name].inversions == {"A": 0, "B": 0}
            assert kfac.refresher.state[name].flight["A"] is not None and kfac.refresher.state[name].flight["A"]["refresh"].done == 1
    a = [v[(name, "A")] for lb, v in log if lb == f"inv_kron_A:{name}"]
    assert a == [0, 0, 1, 1, 2, 2]  # installed by each next cycle's first label: the previous refresh's end
    ends = [v for what, v in log if what == "end"]
    assert [set(e.values()) for e in ends] == [{0}, {1}, {2}]
    # at a switch to another schedule the refresh in flight ends at once
    ex.switch(ex.iterations, 4)
    assert kfac.refresher.state[name].flight == {"A": None, "B": None} and kfac.refresher.state[name].inversions["A"] == 3


def test_a_switch_refreshes_every_completed_covariance_once_and_the_next_schedule_starts_clean():
    """An overlapping schedule whose refresh runs wholly in the next cycle leaves, at a switch, a factor
    completed but not begun: the switch refreshes it whole (with the refreshes in flight), so the new
    schedule starts as a run does: its pieces before the completion do nothing in its first cycle."""
    cfg, kfac, ex, log, labels = _executor(p=2, before=2)
    name = kfac.names[0]
    for step in (1, 2):
        ex.run_step(step)
    st = kfac.refresher.state[name]
    assert st.inversions == {"A": 1, "B": 1} and st.flight == {"A": None, "B": None} and st.completed == {"A", "B"}
    ex.switch([_with_pieces(single_iteration_schedule(cfg)[0][0], 2, 1)], 3)
    assert st.inversions == {"A": 2, "B": 2} and st.completed == set()  # step 2's covariance, at the switch
    ex.run_step(3)  # the piece before the completion did nothing; the one after began step 3's refresh
    assert st.inversions == {"A": 2, "B": 2} and st.flight["A"]["refresh"].done == 1
    ex.run_step(4)  # ended by step 4's first piece: one refresh per cycle's covariance, none lost
    assert st.inversions == {"A": 3, "B": 3}


def test_a_schedule_with_other_piece_counts_than_the_kfac_is_refused_in_one_line():
    cfg, kfac, engine = _one_stage(2)
    labels = single_iteration_schedule(cfg)[0][0]
    with pytest.raises(InputError, match=r"the schedule has 'inv_kron_A:\S+' 1 time\(s\) per cycle, but this "
                                         r"run's K-FAC refreshes that factor in 2 piece\(s\)") as err:
        ScheduleExecutor([labels], engine, {0: kfac}, lambda: None)
    assert "\n" not in str(err.value)


def _train(cfg, **opts) -> Trainer:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = Trainer(cfg, single_process(), TrainOptions.of(progress=False, log_every=10**9, **opts))
        t.result = t.run()
        return t
    finally:
        torch.set_num_threads(threads)


def test_resume_with_a_refresh_in_flight_continues_bit_for_bit(tmp_path):
    cfg = tiny(pipeline={"stages": 1}, optim={"name": "adam", "lr": 0.01, "decay_steps": 6},
               kfac={"refresh_pieces": 2})
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, [[_with_pieces(single_iteration_schedule(cfg)[0][0], 2, before=1)]])
    with open(meta_path(sched), "w") as fh:  # as the packer of an overlapping schedule writes it
        json.dump({"overlap": True, "margin": 0.1}, fh)
    full = _train(cfg, mode="scheduled", schedule=sched, steps=6)
    ck = str(tmp_path / "ck")
    stopped = _train(cfg, mode="scheduled", schedule=sched, steps=3, checkpoint_dir=ck, checkpoint_every=3)
    assert all(st.flight["A"] is not None for st in stopped.kfac.refresher.state.values())  # saved mid-refresh
    state = torch.load(os.path.join(ck, "step-00000003", "stage0-replica0.pt"), weights_only=True)
    assert all(layer["flight"]["A"]["refresh"]["done"] == 1 for layer in state["kfac"][0]["refresh"].values())
    resumed = _train(cfg, mode="scheduled", schedule=sched, steps=6, resume=ck, checkpoint_dir=ck)
    assert resumed.start_step == 3
    for (name, p), q in zip(full.stage.named_parameters(), resumed.stage.parameters()):
        assert torch.equal(p, q), name
    for name, st in full.kfac.refresher.state.items():
        assert torch.equal(st.installed["A"], resumed.kfac.refresher.state[name].installed["A"])


def test_adapt_switches_to_and_from_overlapping_schedules_and_refreshes_every_covariance_once(tmp_path, switch_through):
    """--adapt in one process with a cycle of one step: an overlapping schedule (a piece on each side of
    the completion), then one whose pieces all come in the next cycle, then one that does not overlap.
    Each switch is checked by the new schedule's own rule and ends the refreshes under way, so every
    step's covariance is refreshed exactly once: step 0's naive refresh and one per scheduled step."""
    from pipefisher.loop.closed_loop import Plan

    cfg = tiny(pipeline={"stages": 1}, kfac={"refresh_pieces": 2})
    labels = single_iteration_schedule(cfg)[0][0]
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, [[_with_pieces(labels, 2, before=1)]], overlap=True, margin=0.1)
    later = [Plan([[_with_pieces(labels, 2, before=2)]], "all pieces in the next cycle", overlap=True),
             Plan([[_with_pieces(labels, 2, before=0)]], "no overlap")]

    switch_through(later)
    t = _train(cfg, mode="scheduled", schedule=sched, steps=5, adapt=True)
    assert [(s.step, s.plan.overlap) for s in t.loop.history] == [(1, True), (2, True), (3, False)]
    assert len(t.result.losses) == 5 and all(math.isfinite(x) for x in t.result.losses)
    for st in t.kfac.refresher.state.values():
        assert st.inversions == {"A": 5, "B": 5} and st.flight == {"A": None, "B": None} and not st.completed
