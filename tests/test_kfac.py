"""K-FAC in one process against a hand-written reference on the same micro-batches."""
from __future__ import annotations

import math

import pytest
import torch

from pipefisher.kfac import KFAC, kfac_modules
from pipefisher.kfac import factors as fx
from pipefisher.runtime.config import DataConfig, ModelConfig
from pipefisher.runtime.data import MLMData
from pipefisher.runtime.model import PipelineStage

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
        assert kfac.layers[n].last_pi == pytest.approx(ref[n]["pi"], rel=1e-4)
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
        assert kfac.pi(n) == pytest.approx(pi)  # the cleared factor still counts with its old scale
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
    assert kfac.apply_label("turn_on_save_inputs_outgrads") and kfac.saving
    data = MLMData(DATA, CFG.vocab_size)
    for i in range(2):
        mb = data.micro_batch(0, 0, i)
        (model(mb.input_ids, mb.labels) / 3).backward()
    kfac.apply_label("turn_off_save_inputs_outgrads")
    n = kfac.names[0]
    first_input = kfac.layers[n].inputs[0]
    assert kfac.apply_label(f"cov_kron_A:{n}")
    assert _close(kfac.factor(n, "A"), fx.cov_a(first_input, True))
    assert kfac.pending("A", n) == 1 and kfac.pending("B", n) == 2
    assert not kfac.apply_label("call_forward")
    with pytest.raises(KeyError):
        kfac.apply_label("inv_kron_A:no.such.module")
    with pytest.raises(RuntimeError):
        kfac.inv("B", n)  # nothing accumulated into B yet
