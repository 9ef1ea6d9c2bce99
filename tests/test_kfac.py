"""K-FAC in one process against a hand-written reference on the same micro-batches."""
from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipefisher.kfac import KFAC, kfac_modules
from pipefisher.kfac import factors as fx
from pipefisher.kfac.defaults import EIGENBASIS_STEP_DECAY
from pipefisher.kfac.factors import BadFactorError
from pipefisher.kfac.kfac import STATE_FORMAT
from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job.config import DataConfig, ModelConfig
from pipefisher.runtime.models.bert import PipelineStage

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_position=16)
DATA = DataConfig(seq_len=8, micro_batch_size=2, num_micro_batches=3)
DAMPING = 1e-2


def _run_saved(model, kfac, m=3):
    """Forward/backward ``m`` micro-batches (loss / m each) with K-FAC saving on."""
    data = MLMData(DATA, CFG.vocab_size)
    kfac.set_saving(True)
    for i in range(m):
        mb = data.micro_batch(0, 0, i)
        (model(mb.input_ids, mb.labels) / m).backward()
    kfac.set_saving(False)


def _reference(model, m=3):
    """Inputs and output gradients captured by plain hooks, then the textbook formulas in float64."""
    mods = kfac_modules(model)
    xs = {n: [] for n in mods}
    gs = {n: [] for n in mods}
    hooks = []
    for n, mod in mods.items():
        def fwd(_, inp, out, n=n):
            xs[n].append(inp[0].detach().double().reshape(-1, inp[0].shape[-1]))
            out.register_hook(lambda g: gs[n].append(g.detach().double().reshape(-1, g.shape[-1])))
        hooks.append(mod.register_forward_hook(fwd))
    data = MLMData(DATA, CFG.vocab_size)
    model.zero_grad()
    for i in range(m):
        mb = data.micro_batch(0, 0, i)
        (model(mb.input_ids, mb.labels) / m).backward()
    for h in hooks:
        h.remove()
    ref = {}
    for n in mods:
        a = sum(torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1).T
                @ torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1) / len(x) for x in xs[n]) / m
        b = sum((g * m * len(g)).T @ (g * m * len(g)) / len(g) for g in gs[n]) / m
        pi = math.sqrt((a.trace() / a.shape[0]) / (b.trace() / b.shape[0]))
        a_inv = torch.linalg.inv(a + pi * math.sqrt(DAMPING) * torch.eye(a.shape[0], dtype=a.dtype))
        b_inv = torch.linalg.inv(b + math.sqrt(DAMPING) / pi * torch.eye(b.shape[0], dtype=b.dtype))
        w = mods[n]
        grad = torch.cat([w.weight.grad, w.bias.grad[:, None]], 1).double()
        ref[n] = dict(A=a, B=b, pi=pi, A_inv=a_inv, B_inv=b_inv, pre=b_inv @ grad @ a_inv)
    return ref


def _close(x, y, tol=1e-4):
    x, y = x.double(), y.double()
    return float((x - y).norm()) <= tol * max(1.0, float(y.norm()))


def test_modules_skip_embeddings_norms_and_head():
    names = list(kfac_modules(PipelineStage(CFG, 0, 1)))
    assert names[0] == "encoder.layer.0.attention.self.query"
    assert len(names) == 12 and not any(n.startswith("cls") or "embeddings" in n for n in names)


def test_factors_inverses_and_preconditioned_gradients_match_reference():
    model = PipelineStage(CFG, 0, 1)
    ref = _reference(model)
    model.zero_grad()
    kfac = KFAC(model, damping=DAMPING, loss_scale=3)
    _run_saved(model, kfac)
    for n in kfac.names:
        assert kfac.pending("A", n) == kfac.pending("B", n) == 3
        kfac.cov_all("A", n)
        kfac.cov_all("B", n)
        assert _close(kfac.factor(n, "A"), ref[n]["A"])
        assert _close(kfac.factor(n, "B"), ref[n]["B"])
        kfac.inv("A", n)
        assert kfac.factor(n, "A") is None  # cleared
        kfac.inv("B", n)
        assert kfac.refresher.state[n].last_pi == pytest.approx(ref[n]["pi"], rel=1e-4)
        assert _close(kfac.inverse(n, "A"), ref[n]["A_inv"], 1e-3)
        assert _close(kfac.inverse(n, "B"), ref[n]["B_inv"], 1e-3)
    assert kfac.precondition_all() == len(kfac.names)
    for n, mod in kfac_modules(model).items():
        got = torch.cat([mod.weight.grad, mod.bias.grad[:, None]], 1)
        assert _close(got, ref[n]["pre"], 1e-3)


def test_damping_is_finite_for_both_factors_whichever_inverse_runs_first():
    for first in ("A", "B"):
        model = PipelineStage(CFG, 0, 1)
        kfac = KFAC(model, damping=DAMPING, loss_scale=3)
        _run_saved(model, kfac)
        n = kfac.names[0]
        kfac.cov_all("A", n)
        kfac.cov_all("B", n)
        a, b = kfac.factor(n, "A"), kfac.factor(n, "B")
        pi = fx.pi_split(fx.mean_trace(a), fx.mean_trace(b))
        assert math.isfinite(pi) and pi > 0 and pi != 1.0
        second = "B" if first == "A" else "A"
        kfac.inv(first, n)
        assert kfac.stats.pi(n) == pytest.approx(pi)  # the cleared factor still counts with its old scale
        kfac.inv(second, n)
        da, db = fx.damping_terms(DAMPING, pi)
        assert math.isfinite(da) and math.isfinite(db) and da > 0 and db > 0
        for f, mat, d in (("A", a, da), ("B", b, db)):
            inv = kfac.inverse(n, f)
            assert torch.isfinite(inv).all()
            eye = torch.eye(mat.shape[0])
            assert _close(inv @ (mat + d * eye), eye, 1e-3)


def test_cov_takes_the_oldest_micro_batch_and_labels_dispatch():
    model = PipelineStage(CFG, 0, 1)
    kfac = KFAC(model, damping=DAMPING, loss_scale=3)
    assert kfac.apply_label("turn_on_save_inputs_outgrads") and kfac.stats.saving
    data = MLMData(DATA, CFG.vocab_size)
    for i in range(2):
        mb = data.micro_batch(0, 0, i)
        (model(mb.input_ids, mb.labels) / 3).backward()
    kfac.apply_label("turn_off_save_inputs_outgrads")
    n = kfac.names[0]
    first_input = kfac.stats.state[n].inputs[0]
    assert kfac.apply_label(f"cov_kron_A:{n}")
    assert _close(kfac.factor(n, "A"), fx.cov_a(first_input, True))
    assert kfac.pending("A", n) == 1 and kfac.pending("B", n) == 2
    assert not kfac.apply_label("call_forward")
    with pytest.raises(KeyError):
        kfac.apply_label("inv_kron_A:no.such.module")
    with pytest.raises(RuntimeError):
        kfac.inv("B", n)  # nothing accumulated into B yet


def test_cov_stride_builds_the_factors_from_every_s_th_token_row_and_saves_s_times_less():
    """``kfac.cov_stride`` s: factor A from rows 0, s, 2s, ... of each micro-batch's inputs, factor B
    from the same rows of the output gradients, scaled as per-row gradients of the full micro-batch."""
    def run(stride: int):
        torch.manual_seed(0)
        model = PipelineStage(CFG, 0, 1)
        kfac = KFAC(model, damping=DAMPING, loss_scale=3, cov_stride=stride)
        kfac.apply_label("turn_on_save_inputs_outgrads")
        mb = MLMData(DATA, CFG.vocab_size).micro_batch(0, 0, 0)
        (model(mb.input_ids, mb.labels) / 3).backward()
        return kfac

    full, half = run(1), run(2)
    n = full.names[0]
    x, g = full.stats.state[n].inputs[0], full.stats.state[n].outgrads[0]
    assert half.saved_bytes() * 2 == full.saved_bytes()
    assert torch.equal(half.stats.state[n].inputs[0], x[::2]) and half.stats.state[n].inputs[0].is_contiguous()
    half.cov("A", n), half.cov("B", n)
    assert _close(half.factor(n, "A"), fx.cov_a(x[::2], True))
    rows = g.shape[0]  # per-row gradients of the full micro-batch: g x loss_scale x rows
    per_row = g[::2] * (3 * rows)
    assert _close(half.factor(n, "B"), per_row.t() @ per_row / per_row.shape[0])
    with pytest.raises(ValueError, match="cov_stride"):
        KFAC(PipelineStage(CFG, 0, 1), damping=DAMPING, cov_stride=0)


def test_cov_micro_batches_saves_only_the_first_m_and_keeps_the_factor_s_scale():
    """``kfac.cov_micro_batches`` M: only the first M micro-batches after saving turns on are
    saved (inputs and output gradients, M/m of the memory), and the factor is their mean: the same as
    K-FAC over all micro-batches of a step that had only those M (loss / m each), not M/m of it."""
    def run(m_run: int, limit: int | None):
        torch.manual_seed(0)
        model = PipelineStage(CFG, 0, 1)
        kfac = KFAC(model, damping=DAMPING, loss_scale=3, cov_micro_batches=limit)
        data = MLMData(DATA, CFG.vocab_size)
        kfac.set_saving(True)
        for i in range(m_run):  # every micro-batch's loss divided by the step's 3, as the engine does
            mb = data.micro_batch(0, 0, i)
            loss = model(mb.input_ids, mb.labels) / 3
            kfac.end_forward()  # as the engine does after each forward micro-batch
            loss.backward()
        peak = kfac.peak_saved_bytes
        for n in kfac.names:
            for f in "AB":
                kfac.cov_all(f, n)
        return kfac, peak, model, data

    capped, capped_peak, model, data = run(3, 2)
    two, _, _, _ = run(2, None)  # the first two micro-batches alone
    everything, all_peak, _, _ = run(3, None)
    n = capped.names[0]
    assert capped.stats.state[n].counts == {"A": 2, "B": 2} and everything.stats.state[n].counts == {"A": 3, "B": 3}
    assert capped_peak * 3 == all_peak * 2
    def off(x, y):  # relative: factor B's entries are about 1e-10 here
        return float((x.double() - y.double()).norm() / y.double().norm())

    for f in "AB":
        assert off(capped.factor(n, f), two.factor(n, f)) < 1e-5
        assert off(capped.factor(n, f), everything.factor(n, f)) > 1e-2
    assert fx.mean_trace(capped.factor(n, "B")) > 0.5 * fx.mean_trace(everything.factor(n, "B"))  # no 2/3 scale
    capped.set_saving(True)  # a new count starts whenever saving is turned on (again)
    for i in range(3):
        mb = data.micro_batch(0, 1, i)
        loss = model(mb.input_ids, mb.labels) / 3
        capped.end_forward()
        loss.backward()
    assert capped.pending("A", n) == 2 and capped.pending("B", n) == 2
    with pytest.raises(ValueError, match="cov_micro_batches"):
        KFAC(PipelineStage(CFG, 0, 1), damping=DAMPING, cov_micro_batches=0)


# -- K-FAC options on small models ---------------------------------------------------------------
#
# The tests below use a two-layer perceptron (``TinyMLP``) or a single softmax layer (``Softmax``):
# a refresh costs milliseconds, and every quantity can be written out by hand.


class TinyMLP(nn.Module):
    """``x -> fc1 -> tanh -> fc2 -> logits``: two K-FAC layers (4 -> 6 -> 3), cross-entropy loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():  # seeded weights without touching the global generator
            torch.manual_seed(seed)
            self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def _micro_batch(seed: int, rows: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _accumulate(model, kfac, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One saved micro-batch (as the engine runs it), then cov for every layer; returns the new (A, B)."""
    x, y = _micro_batch(seed)
    model.zero_grad()
    kfac.set_saving(True)
    loss = model(x, y)
    kfac.end_forward()
    loss.backward()
    kfac.set_saving(False)
    for n in kfac.names:
        kfac.cov_all("A", n)
        kfac.cov_all("B", n)
    return {n: (kfac.factor(n, "A").clone(), kfac.factor(n, "B").clone()) for n in kfac.names}


def _refresh(model, kfac, seed: int) -> None:
    """A complete refresh: covariance of one micro-batch, then both inverses of every layer."""
    _accumulate(model, kfac, seed)
    for n in kfac.names:
        kfac.inv("A", n)
        kfac.inv("B", n)


def _flat_grad(mod: nn.Linear) -> torch.Tensor:
    """The (out, in + 1) gradient K-FAC preconditions: weight gradient with the bias gradient appended."""
    return torch.cat([mod.weight.grad, mod.bias.grad[:, None]], 1).double()


def _rel(x, y) -> float:
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm())


# 1. damping is validated up front ----------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(damping=0), dict(damping=-1e-3), dict(damping=float("nan")),
                                 dict(damping=1e-3, damping_min=1e-2), dict(damping=1e-3, damping_min=0.0)])
def test_bad_damping_is_refused_when_kfac_is_built(bad):
    with pytest.raises(ValueError, match="damping"):
        KFAC(TinyMLP(), **bad)


# 2. KL-clipping ----------------------------------------------------------------------------------

def test_kl_clip_scale_bounds_the_predicted_kl_change():
    for gds in (1e-6, 0.3, 1.0, 17.0, 4e5, -2.5):  # <g, F^-1 g>; only its size counts
        for lr in (1e-3, 0.1, 1.0):
            for kl_clip in (1e-4, 1e-2, 1.0):
                nu = fx.kl_clip_scale(gds, lr, kl_clip)
                assert 0 < nu <= 1
                assert lr ** 2 * nu ** 2 * abs(gds) <= kl_clip * (1 + 1e-12)
                if lr ** 2 * abs(gds) <= kl_clip:
                    assert nu == 1.0  # a step already inside the trust region is left alone
                else:
                    assert lr ** 2 * nu ** 2 * abs(gds) == pytest.approx(kl_clip)  # clipped to the bound
            assert fx.kl_clip_scale(gds, lr, 0.0) == 1.0  # kl_clip = 0: off


def test_kl_clip_end_to_end_scales_the_preconditioned_step_into_the_bound():
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=())
    _refresh(model, kfac, seed=1)
    x, y = _micro_batch(seed=2)
    model.zero_grad()
    model(x, y).backward()
    mods = {"fc1": model.fc1, "fc2": model.fc2}
    raw = {n: _flat_grad(m) for n, m in mods.items()}  # before preconditioning overwrites them
    assert kfac.precondition_all() == 2
    pre = {n: _flat_grad(m) for n, m in mods.items()}
    assert float(kfac.grad_dot_step) == pytest.approx(sum(float((pre[n] * raw[n]).sum()) for n in mods), rel=1e-5)
    lr = 0.5
    kl_clip = 0.01 * lr ** 2 * float(kfac.grad_dot_step)  # small enough that the clip is active
    nu = fx.kl_clip_scale(kfac.grad_dot_step, lr, kl_clip)
    assert 0 < nu < 1
    kfac.scale_step(nu)
    step = {n: _flat_grad(m) for n, m in mods.items()}
    for n in mods:
        assert _close(step[n], nu * pre[n], 1e-6)
    # The predicted KL change of the step lr * s is lr^2 <s, C s> with C the damped K-FAC curvature
    # (C^-1 = A^-1 (x) B^-1 is what preconditioned). Since C p = g, that is lr^2 * nu * <s, g>.
    kl = 0.0
    for n in mods:
        a = torch.linalg.inv(kfac.inverse(n, "A").double())
        b = torch.linalg.inv(kfac.inverse(n, "B").double())
        kl += lr ** 2 * float((step[n] * (b @ step[n] @ a)).sum())
    assert kl == pytest.approx(lr ** 2 * float(nu) * sum(float((step[n] * raw[n]).sum()) for n in mods), rel=1e-3)
    assert kl <= kl_clip * (1 + 1e-3)
    assert kl == pytest.approx(kl_clip, rel=1e-3)  # the clip is tight, not just a bound


# 3. running-average factors ----------------------------------------------------------------------

def test_eigenbases_average_their_factors_per_step_by_default_and_inverses_do_not():
    """Unset, ``factor_decay`` is the kind's own (:func:`factor_decay_of`): eigenbases weigh the old factor
    SOAP's 0.95 per step (or ``factor_decay_per_step``), so its k-th power for a refresh every k steps
    (:meth:`KFAC.refresh_every`); inverses keep only the newest. A value given is the weight per refresh,
    whatever k."""
    soap = KFAC(TinyMLP(), ignore=(), inverse="eigenbasis")
    assert soap.stats.factor_decay == EIGENBASIS_STEP_DECAY == 0.95
    soap.refresh_every(3)
    assert soap.stats.factor_decay == pytest.approx(0.95 ** 3)
    mine = KFAC(TinyMLP(), ignore=(), inverse="eigenbasis", factor_decay_per_step=0.8)
    mine.refresh_every(3)
    assert mine.stats.factor_decay == pytest.approx(0.8 ** 3)
    plain = KFAC(TinyMLP(), ignore=())
    plain.refresh_every(3)
    assert plain.stats.factor_decay == 0.0
    for kind in ("cholesky", "eigenbasis"):
        given = KFAC(TinyMLP(), ignore=(), inverse=kind, factor_decay=0.7)
        given.refresh_every(4)
        assert given.stats.factor_decay == 0.7
        assert given.averaging_line() == ("factors averaged across refreshes: the old factor weighs 0.7 a refresh "
                                          "(kfac.factor_decay)")
    with pytest.raises(ValueError, match=r"factor_decay_per_step must be in \[0, 1\), not 1.0"):
        KFAC(TinyMLP(), ignore=(), inverse="eigenbasis", factor_decay_per_step=1.0)


def test_the_run_says_how_its_factors_are_averaged():
    """The line a run prints per stage: the weight a refresh and where it comes from (the weight per step
    at the cycle the schedule or ``kfac.interval`` gave); nothing where each refresh keeps its own factor."""
    soap = KFAC(TinyMLP(), ignore=(), inverse="eigenbasis", factor_decay_per_step=0.8)
    soap.refresh_every(3)
    assert soap.averaging_line() == ("factors averaged across refreshes: the old factor weighs 0.512 a refresh "
                                     "(0.8 a step, a refresh every 3 steps)")
    soap.refresh_every(1)
    assert soap.averaging_line().endswith("weighs 0.8 a refresh (0.8 a step, a refresh every 1 step)")
    assert KFAC(TinyMLP(), ignore=(), inverse="eigenbasis").averaging_line().endswith(
        "weighs 0.95 a refresh (0.95 a step, a refresh every 1 step)")
    assert KFAC(TinyMLP(), ignore=()).averaging_line() is None
    assert KFAC(TinyMLP(), ignore=(), inverse="eigenbasis", factor_decay=0.0).averaging_line() is None


def test_running_average_factors_match_their_closed_form_and_are_what_is_inverted():
    d, damping = 0.7, 1e-2
    model = TinyMLP()
    kfac = KFAC(model, damping=damping, ignore=(), factor_decay=d)
    new = []  # per refresh: the new factors of that refresh's micro-batch
    for seed in (11, 12, 13):
        new.append(_accumulate(model, kfac, seed))
        for n in kfac.names:
            kfac.inv("A", n)
            kfac.inv("B", n)
    for n in kfac.names:
        (a1, b1), (a2, b2), (a3, b3) = (f[n] for f in new)
        # R1 = F1; R2 = d R1 + (1 - d) F2; R3 = d R2 + (1 - d) F3
        ra = d * d * a1 + d * (1 - d) * a2 + (1 - d) * a3
        rb = d * d * b1 + d * (1 - d) * b2 + (1 - d) * b3
        assert _close(kfac.stats.state[n].running["A"], ra, 1e-5)
        assert _close(kfac.stats.state[n].running["B"], rb, 1e-5)
        pi = fx.pi_split(fx.mean_trace(ra), fx.mean_trace(rb))
        assert float(kfac.refresher.state[n].last_pi) == pytest.approx(float(pi), rel=1e-5)
        da, db = fx.damping_terms(damping, pi)
        want_a = torch.linalg.inv(ra.double() + da * torch.eye(ra.shape[0], dtype=torch.float64))
        want_b = torch.linalg.inv(rb.double() + db * torch.eye(rb.shape[0], dtype=torch.float64))
        assert _close(kfac.inverse(n, "A"), want_a, 1e-4)
        assert _close(kfac.inverse(n, "B"), want_b, 1e-4)
        only_last = torch.linalg.inv(a3.double() + da * torch.eye(a3.shape[0], dtype=torch.float64))
        assert not _close(kfac.inverse(n, "A"), only_last, 1e-2)  # not the inverse of F3 alone


def test_a_factors_scale_is_the_mean_trace_of_its_average_without_forming_it():
    d = 0.7
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=(), factor_decay=d)
    for seed in (11, 12):
        _accumulate(model, kfac, seed)
        for n in kfac.names:
            for f in "AB":  # new covariance, with no running average yet and then with one
                assert float(kfac.stats.scale(n, f)) == pytest.approx(float(fx.mean_trace(kfac.stats.averaged(n, f))), rel=1e-6)
            kfac.inv("A", n)  # A cleared: its scale is its running average's, as the inverse left it
            assert float(kfac.stats.scale(n, "A")) == pytest.approx(float(fx.mean_trace(kfac.stats.state[n].running["A"])),
                                                              rel=1e-6)
            kfac.inv("B", n)


# 4. damping schedule -----------------------------------------------------------------------------

def test_damping_decays_once_per_complete_refresh_down_to_its_floor():
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, damping_decay=0.5, damping_min=1e-3, ignore=())
    seen = []
    for seed in range(6):
        damping = kfac.refresher.damping_of("fc1")
        seen.append(damping)
        new = _accumulate(model, kfac, seed)
        kfac.inv("A", "fc1")
        assert kfac.refresher.damping_of("fc1") == damping  # half a refresh does not count
        kfac.inv("B", "fc1")
        # ... and the inverse just computed used this refresh's damping
        a, b = new["fc1"]
        da, _ = fx.damping_terms(damping, fx.pi_split(fx.mean_trace(a), fx.mean_trace(b)))
        eye = torch.eye(a.shape[0])
        assert _close(kfac.inverse("fc1", "A") @ (a + da * eye), eye, 1e-3)
    assert seen == pytest.approx([1e-2, 5e-3, 2.5e-3, 1.25e-3, 1e-3, 1e-3], rel=1e-12)
    assert kfac.refresher.damping_of("fc2") == 1e-2  # fc2 was never refreshed: each layer keeps its own count


# 5. inverse methods ------------------------------------------------------------------------------

def _psd_with_eigenvalues(vals, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(vals), len(vals), generator=g, dtype=torch.float64))
    return q @ torch.diag(torch.tensor(vals, dtype=torch.float64)) @ q.T


def test_eigen_and_cholesky_inverses_agree_with_a_plain_inverse():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 7, generator=g)
    f = x.T @ x / 40  # random PSD, float32
    want = torch.linalg.inv(f.double() + 1e-2 * torch.eye(7, dtype=torch.float64))
    for method in ("eigen", "cholesky"):
        for dtype in (torch.float32, torch.float64):
            got = fx.damped_inverse(f, 1e-2, method=method, dtype=dtype)
            assert got.dtype == torch.float32  # computed in dtype, returned in the factor's dtype
            assert _close(got, want, 1e-4 if dtype == torch.float64 else 1e-3)
    with pytest.raises(ValueError, match="inverse method"):
        fx.damped_inverse(f, 1e-2, method="lu")


def test_eigen_inverse_survives_a_rank_deficient_factor_with_rounding_negative_eigenvalues():
    # Rank 3 of 6; the zero eigenvalues came out as tiny negatives, as rounding leaves them, and the
    # damping is smaller than they are: F + damping I is NOT positive definite, so Cholesky refuses.
    vals = [3.0, 2.0, 1.0, 0.0, -2e-9, -1e-7]
    f = _psd_with_eigenvalues(vals)
    damping = 1e-9
    with pytest.raises(BadFactorError, match="not positive definite"):
        fx.damped_inverse(f, damping, method="cholesky", dtype=torch.float64)
    got = fx.damped_inverse(f, damping, method="eigen", dtype=torch.float64)
    want = _psd_with_eigenvalues([1 / (max(v, 0.0) + damping) for v in vals])  # negatives clipped to 0
    assert torch.isfinite(got).all() and _close(got, want, 1e-6)
    # A float32 rank-deficient covariance (3 rows, 8 columns) through both float32 paths.
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    cov = x.T @ x / 3
    want = torch.linalg.inv(cov.double() + 1e-3 * torch.eye(8, dtype=torch.float64))
    assert _close(fx.damped_inverse(cov, 1e-3, method="eigen"), want, 1e-3)
    # ... but a clearly indefinite matrix is no rounding error: eigen refuses it too.
    with pytest.raises(BadFactorError, match="not positive semi-definite"):
        fx.damped_inverse(_psd_with_eigenvalues([3.0, 1.0, -0.5]), 1e-3, method="eigen")


# 6. never a silent wrong inverse -----------------------------------------------------------------

def _poison(kfac, name: str, factor: str, matrix: torch.Tensor) -> None:
    """Make ``matrix`` the new factor of ``name`` (what cov + sync would leave)."""
    st = kfac.stats.state[name]
    st.sums[factor], st.counts[factor] = matrix, 1


def test_a_bad_factor_stops_with_one_line_naming_the_layer_and_factor():
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=())
    _refresh(model, kfac, seed=0)
    dim = kfac.layers["fc1"].module.in_features + 1
    kept = kfac.inverse("fc1", "A").clone()
    _poison(kfac, "fc1", "A", torch.full((dim, dim), float("nan")))
    kfac.inv("A", "fc1")  # reads nothing: the inverse before stays in use, on the device
    assert torch.equal(kfac.inverse("fc1", "A"), kept)
    with pytest.raises(BadFactorError) as err:
        kfac.check_inverses()  # what the refresh's last inverse does: its findings read, once
    msg = str(err.value)
    assert msg.startswith("K-FAC layer fc1 factor A: ") and "\n" not in msg and "NaN" in msg
    _poison(kfac, "fc1", "A", -1e3 * torch.eye(dim))  # finite but not positive definite
    with pytest.raises(BadFactorError) as err:
        kfac.inv("A", "fc1")
        kfac.check_inverses()
    msg = str(err.value)
    assert msg.startswith("K-FAC layer fc1 factor A: ") and "\n" not in msg
    assert "not positive definite" in msg


def test_skip_keeps_the_previous_inverse_counts_it_and_warns_once():
    model = TinyMLP()
    warnings = []
    kfac = KFAC(model, damping=1e-2, ignore=(), on_bad_factor="skip", warn=warnings.append)
    _refresh(model, kfac, seed=0)
    kept = kfac.inverse("fc2", "B").clone()
    running = kfac.stats.state["fc2"].running["B"].clone()
    dim = kfac.layers["fc2"].module.out_features
    _poison(kfac, "fc2", "B", torch.full((dim, dim), float("nan")))
    kfac.inv("B", "fc2")  # does not raise
    st = kfac.refresher.state["fc2"]
    assert not warnings and st.skipped == 0  # not read yet: the refresh's findings are read at its end
    for name in ("fc1", "fc2"):  # the refresh's other inverses: the last one reads every finding at once
        for f in ("A", "B"):
            if (name, f) != ("fc2", "B"):
                _poison(kfac, name, f, kfac.stats.state[name].running[f].clone())
                kfac.inv(f, name)
    assert torch.equal(kfac.inverse("fc2", "B"), kept) and torch.equal(kfac.stats.state["fc2"].running["B"], running)
    assert st.skipped == 1 and kfac.refresher.state["fc1"].skipped == 0
    assert kfac.factor("fc2", "B") is None  # the bad refresh is dropped, the next one starts clean
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("K-FAC layer fc2 factor B: ") and "skip" in warnings[0]
    _poison(kfac, "fc2", "B", -1e3 * torch.eye(dim))
    kfac.inv("B", "fc2")
    kfac.check_inverses()
    assert st.skipped == 2 and len(warnings) == 2 and torch.equal(kfac.inverse("fc2", "B"), kept)


def test_without_warn_a_skip_is_a_warning_of_the_kfac_logger(caplog):
    """A library user who passes no ``warn`` still hears of a skipped refresh: as a logging warning (on stderr
    while logging is unconfigured, never on stdout)."""
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=(), on_bad_factor="skip")
    _refresh(model, kfac, seed=0)
    _poison(kfac, "fc2", "B", -1e3 * torch.eye(kfac.layers["fc2"].module.out_features))
    with caplog.at_level(logging.WARNING, logger="pipefisher"):
        kfac.inv("B", "fc2")
        kfac.check_inverses()
    assert [(r.name, r.levelno) for r in caplog.records] == [("pipefisher.kfac.refresher", logging.WARNING)]
    assert caplog.records[0].getMessage().startswith("K-FAC layer fc2 factor B: ") and kfac.refresher.state["fc2"].skipped == 1


# 7. true Fisher ----------------------------------------------------------------------------------

class Softmax(nn.Module):
    """One K-FAC layer straight before a softmax: its output gradients are ``(p - e_y) / rows``."""

    def __init__(self, d: int = 4, classes: int = 5) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.fc = nn.Linear(d, classes)
        with torch.no_grad():
            self.fc.weight.mul_(4)  # confident-ish predictions, far from uniform

    def forward(self, x):
        return self.fc(x)


ROWS = 8000
"""Rows of the true-Fisher test. B is a mean over rows of ``(p - e_y)(p - e_y)^T`` with ``y`` sampled:
its relative Frobenius distance to the exact expectation shrinks as ``1/sqrt(rows)``, measured at about
0.03 for 4000 rows (at most 0.054 over 30 seeds), so about 0.02 here. The 0.1 tolerance is five times
that: a sampling fluke cannot fail it, while a wrong sign, scale or label source misses by far more."""


def _softmax_b(fisher: str, sample_seed: int = 0, labels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Factor B of ``Softmax`` on ``ROWS`` fixed rows, and the model's probabilities there."""
    model = Softmax()
    x = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1))
    kfac = KFAC(model, fisher=fisher, ignore=(), loss_scale=1)
    kfac.set_saving(True)
    logits = model(x)
    probs = torch.softmax(logits.detach(), dim=-1)
    if fisher == "true":
        # What PipelineStage.forward(sample=...) and PipelineEngine._sampled_backward do.
        drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(sample_seed)).squeeze(1)
        sampled_loss = F.cross_entropy(logits, drawn)
        kfac.end_forward()
        outs = kfac.take_forward()
        assert [st.module for st, _ in outs] == [model.fc]
        grads = torch.autograd.grad(sampled_loss, [o for _, o in outs], retain_graph=True)
        kfac.save_outgrads(outs, grads)
    else:
        kfac.end_forward()
        F.cross_entropy(logits, labels).backward()
    kfac.set_saving(False)
    assert kfac.cov_all("B", "fc") == 1
    return kfac.factor("fc", "B"), probs


def test_true_fisher_factor_b_matches_the_exact_softmax_fisher():
    b, p = _softmax_b("true")
    exact = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).mean(0)  # E_y[(p - e_y)(p - e_y)^T]
    assert _rel(b, exact) < 0.1
    b_again, _ = _softmax_b("true", sample_seed=0)
    assert torch.equal(b, b_again)  # same generator seed, same labels, same factor
    b_other, _ = _softmax_b("true", sample_seed=1)
    assert not torch.equal(b, b_other) and _rel(b_other, exact) < 0.1
    # The empirical Fisher uses the training labels; with labels the model does not predict (here its
    # least likely class) factor B is a different matrix altogether.
    b_emp, _ = _softmax_b("empirical", labels=p.argmin(dim=1))
    assert _rel(b_emp, exact) > 1.0 and _rel(b_emp, b) > 1.0


def test_true_fisher_records_nothing_while_saving_is_off():
    model = Softmax()
    kfac = KFAC(model, fisher="true", ignore=())
    assert not kfac.samples_labels
    model(torch.randn(3, 4)).sum().backward()
    kfac.end_forward()
    assert kfac.take_forward() is None and kfac.pending("B", "fc") == 0
    kfac.set_saving(True)
    assert kfac.samples_labels  # the engine must sample labels for this forward
    model(torch.randn(3, 4))
    kfac.end_forward()
    assert kfac.pending("A", "fc") == 1 and len(kfac.take_forward()) == 1
    assert kfac.take_forward() is None  # one list per forwarded micro-batch


def test_true_fisher_samples_labels_for_the_capped_micro_batches_only():
    """With ``cov_micro_batches`` 1 the micro-batches after the first are not saved, so they run no
    sampled-label backward either (every stage counts the same micro-batches: their sends still pair)."""
    model = Softmax()
    kfac = KFAC(model, fisher="true", ignore=(), cov_micro_batches=1)
    kfac.set_saving(True)
    for _ in range(3):
        model(torch.randn(3, 4))
        kfac.end_forward()
    assert not kfac.samples_labels and kfac.pending("A", "fc") == 1
    assert len(kfac.take_forward()) == 1 and kfac.take_forward() is None and kfac.take_forward() is None
    kfac.set_saving(True)  # a new count
    assert kfac.samples_labels


# 8. compact saving -------------------------------------------------------------------------------

def test_saved_bytes_are_counted_as_tensors_come_and_go_with_their_high_water_mark():
    """The running count equals a scan of the queues at every point; the peak keeps the most it held,
    also after covariance pieces have freed some (as in a scheduled cycle, mid-iteration)."""
    model = PipelineStage(CFG, 0, 1)
    kfac = KFAC(model, damping=DAMPING, loss_scale=3)
    _run_saved(model, kfac)
    full = kfac.saved_bytes()
    assert full > 0 and kfac.saved_now == full and kfac.peak_saved_bytes == full
    n = kfac.names[0]  # the query: its input is shared with key and value, so it frees nothing alone
    kfac.cov_all("A", n)
    assert kfac.saved_now == kfac.saved_bytes() == full
    kfac.cov_all("B", n)
    assert kfac.saved_now == kfac.saved_bytes() < full
    for m in kfac.names[1:3]:
        kfac.cov_all("A", m)
    assert kfac.saved_now == kfac.saved_bytes() and kfac.peak_saved_bytes == full
    kfac.reset_peak_saved()
    assert kfac.peak_saved_bytes == kfac.saved_now
    kfac.clear_saved()
    assert kfac.saved_now == kfac.saved_bytes() == 0


def test_bfloat16_saving_halves_memory_keeps_factors_and_shares_qkv_inputs():
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = PipelineStage(CFG, 0, 1)
        kfac = KFAC(model, damping=DAMPING, loss_scale=3, save_dtype=dtype)
        _run_saved(model, kfac)
        runs[dtype] = kfac
    small, full = runs["bfloat16"], runs["float32"]
    for st in small.stats.state.values():
        assert all(t.dtype == torch.bfloat16 for t in (*st.inputs, *st.outgrads))
    assert small.saved_bytes() * 2 == full.saved_bytes()

    attn = "encoder.layer.0.attention.self."
    q, k, v = (small.stats.state[attn + w] for w in ("query", "key", "value"))
    for i in range(3):  # every micro-batch: one saved input for the three projections
        assert q.inputs[i] is k.inputs[i] is v.inputs[i]
    assert small.stats.state[attn[:-len("self.")] + "output.dense"].inputs[0] is not q.inputs[0]
    naive = sum(t.numel() * t.element_size()
                for st in small.stats.state.values() for t in (*st.inputs, *st.outgrads))
    shared = sum(t.numel() * t.element_size() for t in q.inputs) * 2 * CFG.num_layers  # k and v, per layer
    assert small.saved_bytes() == naive - shared  # the shared input is counted once

    for n in small.names:
        for f in ("A", "B"):
            small.cov_all(f, n)
            full.cov_all(f, n)
            assert small.factor(n, f).dtype == torch.float32  # covariance itself is computed in float32
            assert _rel(small.factor(n, f), full.factor(n, f)) < 1e-2
    assert small.saved_bytes() == full.saved_bytes() == 0


# -- layer kinds: Hugging Face's Conv1D (weight stored (in, out)) and the coverage summary ----------


class _HandConv1D(nn.Module):
    """The structure of ``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b``, ``W`` is (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


_HandConv1D.__name__ = "Conv1D"


def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return _HandConv1D
    return Conv1D


def _one_layer_kfac(layer, x, r, steps=2):
    """K-FAC on a lone layer: ``steps`` saved micro-batches of loss ``<layer(x), r> / steps``, then a
    refresh and the preconditioned gradient (factors and inverses kept for comparison)."""
    model = nn.Sequential(layer)
    kfac = KFAC(model, damping=DAMPING, loss_scale=steps, ignore=())
    kfac.set_saving(True)
    for i in range(steps):
        ((model(x[i]) * r[i]).sum() / steps).backward()
        kfac.end_forward()
    kfac.set_saving(False)
    raw = kfac.layers["0"].kind.grad_matrix(layer.weight.grad).clone()
    factors = {}
    for f in ("A", "B"):
        kfac.cov_all(f, "0")
        factors[f] = kfac.factor("0", f).clone()
    kfac.inv("A", "0")
    kfac.inv("B", "0")
    assert kfac.precondition_all() == 1
    return kfac, factors, raw


@pytest.mark.parametrize("conv", [_HandConv1D, _conv1d_class()])
def test_conv1d_gives_the_same_factors_and_preconditioned_gradient_as_its_linear_twin(conv):
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(5, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 5, generator=g))
        lin.bias.copy_(torch.randn(4, generator=g))
    c = conv(4, 5)
    with torch.no_grad():
        c.weight.copy_(lin.weight.t())  # W^T
        c.bias.copy_(lin.bias)
    x, r = torch.randn(2, 3, 6, 5, generator=g), torch.randn(2, 3, 6, 4, generator=g)
    k_lin, f_lin, raw_lin = _one_layer_kfac(lin, x, r)
    k_conv, f_conv, raw_conv = _one_layer_kfac(c, x, r)
    assert k_conv.layers["0"].kind.name == "Conv1D" and k_conv.layers["0"].kind.transposed
    assert _close(raw_conv, raw_lin, 1e-6)  # the (out, in) view of Conv1D's (in, out) gradient
    for f in ("A", "B"):
        assert torch.equal(f_conv[f], f_lin[f])
        assert torch.equal(k_conv.inverse("0", f), k_lin.inverse("0", f))
    assert k_conv.refresher.state["0"].last_pi == k_lin.refresher.state["0"].last_pi
    assert c.weight.grad.shape == (5, 4)  # written back in Conv1D's own layout
    assert _close(c.weight.grad.t(), lin.weight.grad, 1e-6)
    assert _close(c.bias.grad, lin.bias.grad, 1e-6)
    assert float(k_conv.grad_dot_step) == pytest.approx(float(k_lin.grad_dot_step), rel=1e-6)  # the KL-clip's sum
    k_conv.scale_step(0.5)
    k_lin.scale_step(0.5)
    assert _close(c.weight.grad.t(), lin.weight.grad, 1e-6)


def test_conv1d_is_recognised_by_structure_only():
    good = _HandConv1D(4, 5)
    assert list(kfac_modules(nn.Sequential(good), ())) == ["0"]

    class Conv1D(nn.Module):  # the name alone is not enough: no nf
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(5, 4))

    wrong = _HandConv1D(4, 5)
    wrong.nf = 5  # nf must be the weight's second dimension
    other = nn.Conv1d(5, 4, 1)  # torch's convolution is not a linear layer K-FAC handles
    assert kfac_modules(nn.Sequential(Conv1D(), wrong, other), ()) == {}


def test_the_kfac_package_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, pipefisher.kfac; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_run_configs_default_ignore_is_kfacs_own_and_reading_it_needs_no_torch():
    """One definition of the modules K-FAC leaves alone, in the K-FAC package, which the torch-free run
    config reads without importing torch (K-FAC's classes import it when first named)."""
    import inspect
    import subprocess
    import sys

    from pipefisher.kfac import DEFAULT_IGNORE
    from pipefisher.runtime.job.config import KfacConfig

    assert KfacConfig().ignore is DEFAULT_IGNORE
    assert inspect.signature(KFAC).parameters["ignore"].default is DEFAULT_IGNORE
    code = ("import sys; sys.modules['torch'] = None; from pipefisher.runtime.job.config import KfacConfig; "
            "print(KfacConfig().ignore)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == str(DEFAULT_IGNORE), res.stderr


def test_conv1d_kfac_state_survives_a_checkpoint_round_trip():
    def fresh():
        torch.manual_seed(0)
        return _HandConv1D(4, 5)

    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(2, 3, 6, 5, generator=g), torch.randn(2, 3, 6, 4, generator=g)
    a = fresh()
    k_a, _, _ = _one_layer_kfac(a, x, r)
    b = fresh()
    k_b = KFAC(nn.Sequential(b), damping=DAMPING, loss_scale=2, ignore=())
    k_b.load_state_dict(k_a.state_dict())
    ((b(x[0]) * r[0]).sum() / 2 + (b(x[1]) * r[1]).sum() / 2).backward()
    assert k_b.precondition_all() == 1
    assert _close(b.weight.grad, a.weight.grad, 1e-5) and _close(b.bias.grad, a.bias.grad, 1e-5)


def _gpt2(n_layer: int = 1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=n_layer, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_gets_kfac_on_attention_mlp_and_head_and_one_step_matches_a_hand_reference():
    model = _gpt2()
    names = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
             "transformer.h.0.mlp.c_proj", "lm_head"]
    m = 2
    kfac = KFAC(model, damping=DAMPING, loss_scale=m)
    assert kfac.names == names
    assert [kfac.layers[n].kind.name for n in names] == ["Conv1D"] * 4 + ["Linear"]

    ref_name = "transformer.h.0.attn.c_attn"
    layer = model.get_submodule(ref_name)
    xs, gs = [], []

    def fwd(_, inp, out):
        xs.append(inp[0].detach().double().reshape(-1, inp[0].shape[-1]))
        out.register_hook(lambda g: gs.append(g.detach().double().reshape(-1, g.shape[-1])))

    hook = layer.register_forward_hook(fwd)
    g = torch.Generator().manual_seed(5)
    kfac.set_saving(True)
    for _ in range(m):
        ids = torch.randint(0, 50, (2, 8), generator=g)
        (model(input_ids=ids, labels=ids).loss / m).backward()
        kfac.end_forward()
    kfac.set_saving(False)
    hook.remove()
    kfac.update_curvature()

    ones = lambda x: torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)  # noqa: E731
    a = sum(ones(x).T @ ones(x) / len(x) for x in xs) / m
    b = sum((gr * m * len(gr)).T @ (gr * m * len(gr)) / len(gr) for gr in gs) / m
    pi = math.sqrt((a.trace() / a.shape[0]) / (b.trace() / b.shape[0]))
    a_inv = torch.linalg.inv(a + pi * math.sqrt(DAMPING) * torch.eye(a.shape[0], dtype=a.dtype))
    b_inv = torch.linalg.inv(b + math.sqrt(DAMPING) / pi * torch.eye(b.shape[0], dtype=b.dtype))
    grad = torch.cat([layer.weight.grad.t(), layer.bias.grad[:, None]], 1).double()  # (out, in + 1)
    pre = b_inv @ grad @ a_inv

    before = {n: (model.get_submodule(n).weight.detach().clone(), model.get_submodule(n).bias)
              for n in names}  # by layer: the tied lm_head weight has no name of its own in named_parameters
    bias_before = layer.bias.detach().clone()
    assert kfac.precondition_all() == len(names)
    lr = 0.1
    torch.optim.SGD(model.parameters(), lr=lr).step()
    for n in names:
        w = model.get_submodule(n).weight
        assert torch.isfinite(w).all() and not torch.equal(w, before[n][0])
    assert _close(layer.weight.detach() - before[ref_name][0], -lr * pre[:, :-1].t(), 1e-3)
    assert _close(layer.bias.detach() - bias_before, -lr * pre[:, -1], 1e-3)


def test_coverage_of_the_builtin_bert_stages():
    from pipefisher.kfac.kfac import coverage

    first, last = coverage(PipelineStage(CFG, 0, 2)), coverage(PipelineStage(CFG, 1, 2))
    assert first.line("stage 0") == ("K-FAC covers 6 layers (6 Linear) on stage 0; first-order only: "
                                     "Embedding (2), LayerNorm (3)")
    assert last.line("stage 1") == ("K-FAC covers 6 layers (6 Linear) on stage 1; first-order only: "
                                    "LayerNorm (3); ignored by kfac.ignore: cls.predictions.transform.dense, "
                                    "cls.predictions.decoder")
    assert coverage(PipelineStage(CFG, 0, 1), ignore=("encoder",)).line("stage 0", show=2) == (
        "K-FAC covers 2 layers (2 Linear) on stage 0; first-order only: Embedding (2), LayerNorm (6); "
        "ignored by kfac.ignore: encoder.layer.0.attention.self.query, encoder.layer.0.attention.self.key "
        "and 10 more")


def test_coverage_of_a_small_gpt2_counts_conv1d_and_reports_the_tied_head():
    from pipefisher.kfac.kfac import coverage

    model = _gpt2(n_layer=2)
    assert coverage(model).line("stage 0") == (
        "K-FAC covers 9 layers (8 Conv1D, 1 Linear) on stage 0; first-order only: Embedding (1), "
        "LayerNorm (5); weight shared (K-FAC preconditions the summed gradient): lm_head with transformer.wte")
    assert coverage(model, ignore=("lm_head",)).line("stage 0") == (
        "K-FAC covers 8 layers (8 Conv1D) on stage 0; first-order only: Embedding (2), LayerNorm (5); "
        "ignored by kfac.ignore: lm_head")


def test_a_layer_its_parent_uses_functionally_is_left_to_the_first_order_optimizer():
    from pipefisher.kfac.kfac import coverage

    class Block(nn.Module):  # MultiheadAttention uses out_proj's weight directly: no hook ever fires
        def __init__(self):
            super().__init__()
            self.attn, self.fc = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(self.attn(x, x, x, need_weights=False)[0])

    model = Block()
    kfac = KFAC(model, damping=DAMPING, ignore=())
    assert kfac.names == ["fc"]
    kfac.set_saving(True)
    model(torch.randn(2, 5, 4)).sum().backward()
    kfac.set_saving(False)
    kfac.update_curvature()  # every K-FAC layer was seen, so every factor has covariance to invert
    assert kfac.precondition_all() == 1
    assert coverage(model, ()).first_order == {"MultiheadAttention": 1, "NonDynamicallyQuantizableLinear": 1}


# 8. drift: how far a refresh moves the preconditioned gradient ------------------------------------

def _inverses(kfac, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return kfac.inverse(name, "A").clone(), kfac.inverse(name, "B").clone()


def _hand_drift(g: torch.Tensor, old, new) -> tuple[float, float]:
    """``||B_n G A_n - B_o G A_o||^2`` and ``||B_n G A_n||^2`` in float64 (old, new: (A^-1, B^-1))."""
    p_new = new[1].double() @ g @ new[0].double()
    p_old = old[1].double() @ g @ old[0].double()
    return float((p_new - p_old).square().sum()), float(p_new.square().sum())


def _step_gradients(model, seed: int) -> None:
    """One step's gradients, nothing saved for K-FAC (saving is off)."""
    x, y = _micro_batch(seed)
    model.zero_grad()
    model(x, y).backward()


def _drifts(kfac) -> dict[str, tuple[float, float]]:
    """Per layer: (||P_new - P_old||^2, ||P_new||^2)."""
    return {n: (float(c), float(s)) for n, c, _, s in kfac.take_drift()}


def _two_back(kfac) -> dict[str, float | None]:
    """Per layer: ||P_new - P_older||^2 (None without a refresh two back)."""
    return {n: None if c2 is None else float(c2) for n, _, c2, _ in kfac.take_drift()}


class NoBiasMLP(TinyMLP):
    """TinyMLP without biases: K-FAC's gradient is then a view of ``weight.grad`` (kept as a copy)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.fc1, self.fc2 = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)


def _grad_matrix(mod: nn.Linear) -> torch.Tensor:
    return _flat_grad(mod) if mod.bias is not None else mod.weight.grad.double().clone()


@pytest.mark.parametrize("make", [TinyMLP, NoBiasMLP])
def test_drift_is_zero_when_a_refresh_keeps_the_inverses_and_matches_a_hand_computation_when_it_moves_them(make):
    model = make()
    kfac = KFAC(model, damping=1e-2, ignore=())
    _refresh(model, kfac, seed=0)
    assert kfac.take_drift() == []  # a first refresh has nothing to compare with
    first = {n: _inverses(kfac, n) for n in kfac.names}
    _step_gradients(model, seed=1)
    assert kfac.precondition_all() == 2
    _refresh(model, kfac, seed=0)  # the same micro-batch on the same weights: the same inverses
    assert all(torch.equal(_inverses(kfac, n)[f], first[n][f]) for n in kfac.names for f in (0, 1))
    same = _drifts(kfac)
    assert set(same) == {"fc1", "fc2"} and all(c == 0.0 and s > 0 for c, s in same.values())
    _step_gradients(model, seed=2)
    g = {n: _grad_matrix(kfac.layers[n].module) for n in kfac.names}  # G: what precondition_all sees
    kfac.precondition_all()
    _refresh(model, kfac, seed=3)  # another micro-batch: other factors
    moved = _drifts(kfac)
    for n in kfac.names:
        change, norm = _hand_drift(g[n], first[n], _inverses(kfac, n))
        assert change > 1e-3 * norm
        assert moved[n] == pytest.approx((change, norm), rel=1e-4)


def test_a_refresh_spread_over_steps_compares_the_inverses_it_started_from_on_the_latest_gradient():
    """inv A, then a step preconditioned with the new A and the old B, then inv B: the drift compares both
    new inverses with both old ones on that step's gradient (the mixed preconditioned gradient is not the
    old one), and a checkpoint between the two labels keeps what it needs."""
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=())
    _refresh(model, kfac, seed=0)
    old = _inverses(kfac, "fc1")
    _step_gradients(model, seed=1)
    kfac.precondition_all()
    _accumulate(model, kfac, seed=3)
    kfac.inv("A", "fc1")
    _step_gradients(model, seed=2)
    g = _flat_grad(model.fc1)
    kfac.precondition_all()  # new A, old B
    twin = TinyMLP()
    twin.load_state_dict(model.state_dict())
    resumed = KFAC(twin, damping=1e-2, ignore=())
    resumed.load_state_dict(kfac.state_dict())
    for k in (kfac, resumed):
        k.inv("B", "fc1")
    change, norm = _hand_drift(g, old, _inverses(kfac, "fc1"))
    assert _drifts(kfac)["fc1"] == pytest.approx((change, norm), rel=1e-4)
    assert _drifts(resumed)["fc1"] == pytest.approx((change, norm), rel=1e-4)


def test_a_factor_kept_for_a_bad_refresh_counts_as_unchanged_and_a_refresh_that_changed_nothing_is_no_sample():
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=(), on_bad_factor="skip", warn=lambda msg: None)
    _refresh(model, kfac, seed=0)
    old = _inverses(kfac, "fc2")
    _step_gradients(model, seed=1)
    g = _flat_grad(model.fc2)
    kfac.precondition_all()
    _accumulate(model, kfac, seed=3)
    dim = kfac.layers["fc2"].module.out_features
    _poison(kfac, "fc2", "B", torch.full((dim, dim), float("nan")))
    kfac.inv("A", "fc2")
    kfac.inv("B", "fc2")  # kept: the previous B^-1
    new = _inverses(kfac, "fc2")
    assert torch.equal(new[1], old[1])
    assert _drifts(kfac)["fc2"] == pytest.approx(_hand_drift(g, old, new), rel=1e-4)
    for f in ("A", "B"):  # both factors bad: the inverses did not move, there is nothing to measure
        _poison(kfac, "fc2", f, torch.full((dim + (f == "A") * 4,) * 2, float("nan")))
        kfac.inv(f, "fc2")
    [(_, _, _, norm)] = [x for x in kfac.take_drift() if x[0] == "fc2"]
    assert math.isnan(norm)  # decided on the device, before the findings are read: the reader drops it


def test_a_kfac_that_does_not_measure_drift_keeps_no_gradient():
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=(), drift=False)
    for seed in range(3):
        _refresh(model, kfac, seed)
        kfac.precondition_all()
    assert kfac.take_drift() == [] and all(st.last_grad is None for st in kfac.drift.state.values())


def test_every_refresh_also_measures_the_change_since_the_refresh_before_the_last():
    """Refreshes r0, r1, r2 on other micro-batches: r1 has no refresh two back, r2 compares its inverses
    with r0's as well as r1's, on the same gradient; a checkpoint after r1 keeps r0's inverses for it."""
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=())
    inverses = []
    for seed in (0, 3):
        _refresh(model, kfac, seed)
        inverses.append(_inverses(kfac, "fc2"))
        _step_gradients(model, seed + 1)
        g = _flat_grad(model.fc2)  # G, before precondition_all puts B^-1 G A^-1 in its place
        kfac.precondition_all()
    assert _two_back(kfac) == {"fc1": None, "fc2": None}  # r1: no refresh two back yet
    twin = TinyMLP()
    twin.load_state_dict(model.state_dict())
    resumed = KFAC(twin, damping=1e-2, ignore=())
    resumed.load_state_dict(kfac.state_dict())
    _refresh(model, kfac, seed=4)
    _refresh(twin, resumed, seed=4)
    far, _ = _hand_drift(g, inverses[0], _inverses(kfac, "fc2"))
    near, _ = _hand_drift(g, inverses[1], _inverses(kfac, "fc2"))
    for k in (kfac, resumed):
        [(_, change, change2, _)] = [x for x in k.take_drift() if x[0] == "fc2"]
        assert float(change) == pytest.approx(near, rel=1e-4) and float(change2) == pytest.approx(far, rel=1e-4)
    assert far != pytest.approx(near, rel=1e-3)


# 9. checkpoints written before K-FAC's components ---------------------------------------------------

FLAT_STATE = os.path.join(os.path.dirname(__file__), "data", "kfac_flat_state.pt")
"""A K-FAC state in the layout before the components (one flat record per layer), written by that code
(pipefisher at 78f5dff) from :func:`_half_done`'s run: a refresh in pieces in flight, a refresh half done
for the drift, and micro-batches saved and not yet added."""


def _refresh_in_two(kfac) -> None:
    """Both pieces of a refresh of every factor."""
    for n in kfac.names:
        for f in ("A", "B"):
            kfac.inv(f, n)
            kfac.inv(f, n)


def _half_done(model, kfac) -> None:
    """A refresh of every factor in two pieces, a preconditioned step, new covariance, one piece of a new
    refresh of fc1's A, and one more micro-batch saved (its covariance pending)."""
    _accumulate(model, kfac, seed=0)
    _refresh_in_two(kfac)
    _step_gradients(model, seed=1)
    kfac.precondition_all()
    _accumulate(model, kfac, seed=3)
    kfac.inv("A", "fc1")
    x, y = _micro_batch(seed=5)
    kfac.set_saving(True)
    loss = model(x, y)
    kfac.end_forward()
    loss.backward()


def _finish(model, kfac) -> list[torch.Tensor]:
    """The rest of the refresh, the pending covariance, another refresh and step: what it all gave."""
    kfac.inv("A", "fc1")  # its second piece: installed
    for n in kfac.names:
        kfac.cov_all("A", n)
        kfac.cov_all("B", n)
    _refresh_in_two(kfac)
    _step_gradients(model, seed=7)
    kfac.precondition_all()
    drift = [t for _, *terms in kfac.take_drift() for t in terms if t is not None]
    return [kfac.inverse(n, f) for n in kfac.names for f in ("A", "B")] + drift + [
        p.grad for p in model.parameters()]


def test_a_checkpoint_in_the_layout_before_the_components_resumes_bit_for_bit():
    """The state a run saved before K-FAC was split into components loads (:func:`split_flat_state`) and
    continues exactly as a run that never stopped: the refresh in flight, the drift's half-done refresh
    and the pending micro-batch included. Exactly up to rounding: that refresh was cut into pieces by the
    first plan and continues by this one (:meth:`pipefisher.kfac.refresh.Refresh.from_state`)."""
    model = TinyMLP()
    kfac = KFAC(model, damping=1e-2, ignore=(), refresh_pieces=2)
    _half_done(model, kfac)
    flat = torch.load(FLAT_STATE, weights_only=False)
    assert "format" not in flat and set(flat["layers"]["fc1"]) >= {"sums", "inverses", "last_grad", "flight"}
    twin = TinyMLP()
    twin.load_state_dict(model.state_dict())
    resumed = KFAC(twin, damping=1e-2, ignore=(), refresh_pieces=2)
    resumed.load_state_dict(flat)
    assert resumed.refresher.state["fc1"].flight["A"]["refresh"].done == 1 and resumed.pending("A", "fc1") == 1
    for a, b in zip(_finish(model, kfac), _finish(twin, resumed), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("state,found", [
    ({"format": 3, "curvature": {}, "refresh": {}, "drift": {}}, "of format 3"),
    ({"format": "2"}, "of format '2'"),
    ({"curvature": {}}, "of no format and no flat layers (keys curvature)"),
    ([1, 2], "is a list, not a dict")])
def test_a_state_of_another_format_is_refused_naming_it_and_the_formats_known(state, found):
    """A newer pipefisher's state, or a damaged one, is not loaded as if it were this code's."""
    kfac = KFAC(TinyMLP(), damping=1e-2, ignore=())
    with pytest.raises(ValueError) as err:
        kfac.load_state_dict(state)
    assert str(err.value) == (f"K-FAC state {found}: this pipefisher reads format {STATE_FORMAT} and the flat "
                              "layout before it (no format, one record per layer)")
