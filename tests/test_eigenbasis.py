"""Adam in K-FAC's eigenbasis (SOAP with K-FAC's factors): what the step is, checked against AdamW."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipefisher.kfac import KFAC
from pipefisher.kfac.eigenbasis import EigenbasisAdam
from pipefisher.kfac.factors import diagonal_blocks, eigenbasis

from conftest import DEAD_UNIT_SCALES, dead_unit_factors


def _layer(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3, bias=bias))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _step_alike(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer], steps: int,
                before=lambda step: None) -> None:  # noqa: ANN001
    """Both models take ``steps`` steps of their optimizers on the same gradients, then hold the same
    parameters; ``before(step)`` runs first at each step."""
    for step in range(steps):
        before(step)
        for model, opt in (a, b):
            _grads(model, step)
            opt.step()
    for x, y in zip(a[0].parameters(), b[0].parameters()):
        assert torch.allclose(x, y, atol=1e-6)


def test_eigenbasis_diagonalises_the_factor():
    x = torch.randn(40, 6)
    f = x.t() @ x / 40
    q = eigenbasis(f)
    rotated = q.t() @ f @ q
    assert torch.allclose(q.t() @ q, torch.eye(6), atol=1e-5)
    assert torch.allclose(rotated, torch.diag(torch.diagonal(rotated)), atol=1e-4)


@pytest.mark.parametrize("scale", DEAD_UNIT_SCALES)
def test_a_low_rank_factor_with_zero_rows_gets_a_finite_right_basis_in_float32(scale):
    """Factors with dead units' zero rows (:func:`conftest.dead_unit_factors`), as the tiny config's
    layers had after a few steps at optim.lr 0.1, on which float32's ``eigh`` returned NaN or did not
    converge: scaled and shifted first, the basis is orthonormal and diagonalises the factor to
    float32's precision."""
    for name, f in dead_unit_factors(scale):
        q = eigenbasis(f).double()
        assert torch.isfinite(q).all(), name
        rotated = q.t() @ f.double() @ q
        off = rotated - torch.diag(torch.diagonal(rotated))
        assert torch.allclose(q.t() @ q, torch.eye(64, dtype=torch.float64), atol=1e-5), name
        assert off.norm() <= 1e-5 * f.double().norm(), name


def test_an_eigh_that_does_not_converge_is_refused_in_one_line_naming_float64(monkeypatch):
    """Where ``eigh`` itself fails, the basis is NaN for the refresh's findings (no exception mid-step),
    and the refusal names the setting that computes it in float64."""
    from pipefisher.kfac.factors import BadFactorError, damped_inverse

    def fails(m: torch.Tensor) -> None:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", fails)
    assert torch.isnan(eigenbasis(torch.eye(4))).all()
    with pytest.raises(BadFactorError, match=r"^layer 0 factor B: the eigenbasis is not finite .*"
                                             r"try kfac.inverse_dtype: float64\)$"):
        damped_inverse(torch.eye(4), 1e-3, method="eigenbasis", what="layer 0 factor B")


@pytest.mark.parametrize("bias", [True, False])
def test_without_bases_it_is_adamw(bias):
    """Before a layer's first refresh the identity stands for its bases: the step is AdamW's, weight
    decay on the weight only."""
    ours, ref = _layer(bias), _layer(bias)
    kfac = KFAC(ours, inverse="eigenbasis", ignore=())
    opt = EigenbasisAdam(kfac, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    groups = [{"params": [ref[0].weight], "weight_decay": 0.1}]
    if bias:
        groups.append({"params": [ref[0].bias], "weight_decay": 0.0})
    adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.98), eps=1e-8)
    _step_alike((ours, opt), (ref, adamw), 3)


def test_with_bases_it_is_adam_in_the_rotated_coordinates():
    """With fixed bases ``Q_A``, ``Q_B`` the step equals AdamW on ``Q_B^T [W|b] Q_A`` fed the rotated
    gradients, rotated back: Adam's per-coordinate scaling happens in the factors' eigenbasis."""
    model = _layer(True)
    kfac = KFAC(model, inverse="eigenbasis", ignore=())
    st = kfac.refresher.state["0"]
    qa = torch.linalg.qr(torch.randn(6, 6))[0]
    qb = torch.linalg.qr(torch.randn(3, 3))[0]
    st.installed["A"], st.installed["B"] = qa, qb
    opt = EigenbasisAdam(kfac, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    full = torch.cat([model[0].weight.detach(), model[0].bias.detach()[:, None]], dim=1)
    rotated = nn.Parameter(qb.t() @ full @ qa)
    adam = torch.optim.Adam([rotated], lr=1e-2, betas=(0.9, 0.98), eps=1e-8)
    for step in range(4):
        _grads(model, step)
        g = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], dim=1)
        rotated.grad = qb.t() @ g @ qa
        opt.step()
        adam.step()
    after = torch.cat([model[0].weight.detach(), model[0].bias.detach()[:, None]], dim=1)
    assert torch.allclose(after, qb @ rotated.detach() @ qa.t(), atol=1e-5)


def test_with_nesterov_the_first_moment_looks_one_step_ahead():
    """``nesterov``: NAdam with a constant ``b1`` in the rotated coordinates, written out here step by step
    (``b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)`` over Adam's denominator); it moves the weights
    differently from plain Adam from the first step on."""
    model = _layer(True)
    plain = copy.deepcopy(model)
    kfac, kfac_plain = KFAC(model, inverse="eigenbasis", ignore=()), KFAC(plain, inverse="eigenbasis", ignore=())
    qa = torch.linalg.qr(torch.randn(6, 6))[0]
    qb = torch.linalg.qr(torch.randn(3, 3))[0]
    for k in (kfac, kfac_plain):
        k.refresher.state["0"].installed["A"], k.refresher.state["0"].installed["B"] = qa, qb
    lr, b1, b2, eps = 1e-2, 0.9, 0.98, 1e-8
    opt = EigenbasisAdam(kfac, lr=lr, betas=(b1, b2), eps=eps, nesterov=True)
    opt_plain = EigenbasisAdam(kfac_plain, lr=lr, betas=(b1, b2), eps=eps)
    w = torch.cat([model[0].weight.detach(), model[0].bias.detach()[:, None]], dim=1)
    m, v = torch.zeros(3, 6), torch.zeros(3, 6)
    for t in range(1, 5):
        _grads(model, t)
        _grads(plain, t)
        g = qb.t() @ torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], dim=1) @ qa
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        first = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t)
        w = w - lr * qb @ (first / ((v / (1 - b2 ** t)).sqrt() + eps)) @ qa.t()
        opt.step()
        opt_plain.step()
        ours = torch.cat([model[0].weight.detach(), model[0].bias.detach()[:, None]], dim=1)
        assert torch.allclose(ours, w, atol=1e-6), t
        assert not torch.allclose(ours, torch.cat([plain[0].weight.detach(), plain[0].bias.detach()[:, None]], dim=1))


def test_a_refresh_stores_the_factor_eigenbasis_not_an_inverse():
    model = _layer(True)
    kfac = KFAC(copy.deepcopy(model), inverse="eigenbasis", ignore=())
    kfac.set_saving(True)
    layer = kfac.layers["0"].module
    out = layer(torch.randn(8, 5))
    out.sum().backward()
    kfac.update_curvature()
    q = kfac.inverse("0", "A")
    a = kfac.stats.state["0"].running["A"]  # the factor as it was decomposed
    assert q is not None and a is not None
    assert torch.allclose(q.t() @ q, torch.eye(6), atol=1e-5)
    rotated = q.t() @ a @ q
    assert torch.allclose(rotated, torch.diag(torch.diagonal(rotated)), atol=1e-4)
    assert not kfac.precondition("0")  # the gradient is left to EigenbasisAdam


def test_a_new_basis_carries_the_first_moment_over():
    """After a refresh the first moment is the same vector in the new coordinates: a step with a zero
    gradient moves the weights as if the basis had never changed (up to Adam's second moment, which a
    rotation cannot carry: here every coordinate's is equal, so it is exact)."""
    model = _layer(True)
    kfac = KFAC(model, inverse="eigenbasis", ignore=())
    st = kfac.refresher.state["0"]
    opt = EigenbasisAdam(kfac, lr=1e-2, betas=(0.9, 0.9), eps=0.0)
    st.installed["A"], st.installed["B"] = torch.eye(6), torch.eye(3)
    st.inversions = {"A": 1, "B": 1}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state[model[0].weight]
    before = state["basis_b"] @ state["exp_avg"] @ state["basis_a"].t()
    st.installed["A"] = torch.linalg.qr(torch.randn(6, 6))[0]
    st.inversions = {"A": 2, "B": 1}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = state["basis_b"] @ state["exp_avg"] @ state["basis_a"].t()
    assert state["versions"] == (2, 1)
    assert torch.allclose(after, 0.9 * before, atol=1e-6)


def test_over_stage_copies_every_copy_takes_its_own_step_and_the_state_resumes():
    """Over a device's stage copies (:class:`StageCopiesKFAC`) the optimizer steps each copy's layers as
    one over that copy alone would; its state dict, loaded into a fresh one, continues identically."""
    from pipefisher.runtime.pipeline.copies import StageCopiesKFAC

    def copies() -> tuple[list[nn.Sequential], StageCopiesKFAC]:
        models = [_layer(True), _layer(False)]
        kfacs = {j: KFAC(m, inverse="eigenbasis", ignore=()) for j, m in enumerate(models)}
        for j, k in kfacs.items():
            st = k.refresher.state["0"]
            st.installed["A"] = torch.linalg.qr(torch.randn(6 - j, 6 - j, generator=torch.Generator().manual_seed(j)))[0]
            st.installed["B"] = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(9 + j)))[0]
            st.inversions = {"A": 1, "B": 1}
        return models, StageCopiesKFAC(kfacs, order=[1, 0])

    models, holder = copies()
    refs, ref_holder = copies()
    opt = EigenbasisAdam(holder, lr=1e-2, weight_decay=0.1)
    alone = [EigenbasisAdam(ref_holder[j], lr=1e-2, weight_decay=0.1) for j in (0, 1)]
    assert holder.layer_states() == [holder[1].layers["0"], holder[0].layers["0"]]  # canonical order
    for step in range(3):
        for m, r in zip(models, refs):
            _grads(m, step)
            _grads(r, step)
        if step == 2:  # resume: a fresh optimizer over the same copies, from the state dict
            state = opt.state_dict()
            opt = EigenbasisAdam(holder, lr=1e-2, weight_decay=0.1)
            opt.load_state_dict(state)
        opt.step()
        for a in alone:
            a.step()
    for m, r in zip(models, refs):
        for a, b in zip(m.parameters(), r.parameters()):
            assert torch.equal(a, b)


class _Products(torch.overrides.TorchFunctionMode):
    """Records the operand shapes of every matrix product run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", None) in ("matmul", "__matmul__", "mm"):
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("changed", ["A", "B", "AB"])
def test_a_refresh_rotates_the_moment_on_its_side_only_and_through_the_moment(changed):
    """The rotation runs in ``-- end --``, on the step's critical path: a refresh of one factor rotates the
    first moment on that side alone, each side in its cheaper order (through the moment where the basis
    is wider than the moment is long, else the bases' product first), and the moment is the same vector
    in the new bases."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 3))  # A: 21 x 21, B: 3 x 3, moment 3 x 21
    kfac = KFAC(model, inverse="eigenbasis", ignore=())
    st = kfac.refresher.state["0"]
    opt = EigenbasisAdam(kfac, lr=1e-2, betas=(0.9, 0.9), eps=0.0)
    st.installed["A"], st.installed["B"] = (torch.linalg.qr(torch.randn(n, n))[0] for n in (21, 3))
    st.inversions = {"A": 1, "B": 1}
    _grads(model, 1)
    opt.step()
    state = opt.state[model[0].weight]
    before = state["basis_b"] @ state["exp_avg"] @ state["basis_a"].t()
    for factor in changed:
        st.installed[factor] = torch.linalg.qr(torch.randn(*(2 * st.installed[factor].shape[:1])))[0]
        st.inversions[factor] += 1
    with _Products() as seen:
        EigenbasisAdam._follow_basis(state, st.installed["A"], st.installed["B"],
                                     (st.inversions["A"], st.inversions["B"]),
                                     [(0, state["exp_avg"].shape[0])], [(0, state["exp_avg"].shape[1])])
    after = state["basis_b"] @ state["exp_avg"] @ state["basis_a"].t()
    assert torch.allclose(after, before, atol=1e-5)
    cheaper = {"A": min(2 * 3 * 21 ** 2, 21 ** 3 + 3 * 21 ** 2), "B": min(2 * 21 * 3 ** 2, 3 ** 3 + 21 * 3 ** 2)}
    assert sum(x[0] * x[1] * y[1] for x, y in seen.shapes) == sum(cheaper[f] for f in changed), seen.shapes


def _blocky_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 12), nn.Linear(12, 5, bias=False))


def test_a_blocked_basis_is_each_diagonal_blocks_own_eigenbasis():
    """``kfac.basis_block``: a factor wider than the block gets a block-diagonal basis, each block the
    eigenbasis of the factor's block; the factor's off-block entries play no part."""
    x = torch.randn(60, 10)
    f = x.t() @ x / 60
    q = eigenbasis(f, block=4)
    blocks = diagonal_blocks(10, 4)
    assert len(blocks) == 3
    for j0, j1 in blocks:
        qb = q[j0:j1, j0:j1]
        rotated = qb.t() @ f[j0:j1, j0:j1] @ qb
        assert torch.allclose(qb.t() @ qb, torch.eye(j1 - j0), atol=1e-5)
        assert torch.allclose(rotated, torch.diag(torch.diagonal(rotated)), atol=1e-4)
    inside = torch.zeros(10, 10, dtype=torch.bool)
    for j0, j1 in blocks:
        inside[j0:j1, j0:j1] = True
    assert torch.equal(q[~inside], torch.zeros(int((~inside).sum())))
    assert torch.equal(eigenbasis(f, block=10), eigenbasis(f))


def test_blocked_rotations_give_the_dense_rotations_step():
    """The optimizer's products go block by block under ``basis_block``: the same steps (rounding
    aside) as dense products with the same block-diagonal bases, first moment carried across a refresh."""
    ours, dense = _blocky_model(), _blocky_model()
    k_ours = KFAC(ours, inverse="eigenbasis", ignore=(), basis_block=4)
    k_dense = KFAC(dense, inverse="eigenbasis", ignore=())
    g = torch.Generator().manual_seed(5)

    def install(version: int) -> None:
        for name, st in k_ours.refresher.state.items():
            for factor in "AB":
                n = k_ours.layers[name].factor_size(factor)
                x = torch.randn(3 * n, n, generator=g)
                q = eigenbasis(x.t() @ x, block=4)
                for k in (k_ours, k_dense):
                    k.refresher.state[name].installed[factor] = q
                    k.refresher.state[name].inversions[factor] = version

    opt = EigenbasisAdam(k_ours, lr=1e-2, weight_decay=0.1, basis_block=4)
    ref = EigenbasisAdam(k_dense, lr=1e-2, weight_decay=0.1)
    install(1)
    # at step 2 a refresh: the first moment rotated into the new bases, block by block
    _step_alike((ours, opt), (dense, ref), 4, before=lambda step: install(2) if step == 2 else None)


def test_rotations_in_bfloat16_follow_float32s_steps_and_keep_the_state_in_float32():
    """``kfac.rotation_dtype: bfloat16``: the four products of a step in bfloat16 (about 3 digits),
    everything else as in float32: the steps differ from float32's, but not by much, and the optimizer's
    state (moments, bases) holds float32 only, so a checkpoint is the same either way."""
    low, ref = _blocky_model(), _blocky_model()
    k_low = KFAC(low, inverse="eigenbasis", ignore=(), basis_block=4)
    k_ref = KFAC(ref, inverse="eigenbasis", ignore=(), basis_block=4)
    g = torch.Generator().manual_seed(7)
    for name in k_low.refresher.state:
        for factor in "AB":
            n = k_low.layers[name].factor_size(factor)
            x = torch.randn(3 * n, n, generator=g)
            for k in (k_low, k_ref):
                k.refresher.state[name].installed[factor] = eigenbasis(x.t() @ x, block=4)
                k.refresher.state[name].inversions[factor] = 1
    opt = EigenbasisAdam(k_low, lr=1e-2, basis_block=4, rotation_dtype=torch.bfloat16)
    alike = EigenbasisAdam(k_ref, lr=1e-2, basis_block=4)
    start = [p.detach().clone() for p in ref.parameters()]
    for step in range(3):
        for model, o in ((low, opt), (ref, alike)):
            _grads(model, step)
            o.step()
    for a, b, s in zip(low.parameters(), ref.parameters(), start):
        # Adam divides each rotated coordinate by its own scale: one near 0, whose bfloat16 rounding is
        # as large as itself, takes a full-sized step of either sign (on this 5 x 12 layer's first steps
        # about 13 % of the step's norm); the bulk of the step follows float32's
        moved, apart = float((b - s).detach().norm()), float((a - b).detach().norm())
        assert moved > 0 and 0 < apart <= 0.25 * moved
    tensors = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.dtype == torch.float32 for t in tensors)


def _two_layer_kfac() -> tuple[nn.Sequential, KFAC]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    return model, KFAC(model, inverse="eigenbasis", ignore=())


def _kfac_steps(model: nn.Sequential, kfac: KFAC, opt: EigenbasisAdam, steps: int,
                between=lambda: None) -> None:  # noqa: ANN001
    """``steps`` steps of a naive K-FAC loop: save, forward and backward, every factor refreshed (each
    inverse label a refresh), ``between()``, then the optimizer's step."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        kfac.set_saving(True)
        model(torch.randn(16, 6, generator=g)).square().mean().backward()
        kfac.update_curvature()
        kfac.clear_saved()
        between()
        opt.step()
        opt.zero_grad()


def test_a_refresh_carries_the_moment_into_its_basis_in_its_own_label():
    """The moment is carried into a new basis by the refresh's inverse label (in a bubble), so the step's
    end (on the critical path) finds it there and rotates nothing; the steps are those of carrying it
    at the step's end (an optimizer nobody tells of the refreshes)."""
    model, kfac = _two_layer_kfac()
    opt = EigenbasisAdam(kfac, lr=1e-2)
    lazy_model, lazy_kfac = _two_layer_kfac()
    lazy = EigenbasisAdam(lazy_kfac, lr=1e-2)
    lazy_kfac.refresher.listeners = [x for x in lazy_kfac.refresher.listeners if x is lazy_kfac.drift]

    def carried() -> None:  # after the refreshes, before the step: every moment in the installed bases
        for layer, (qa, qb, versions) in zip(kfac.layer_states(), kfac.eigenbases()):
            state = opt.state[layer.module.weight]
            if state:
                assert state["versions"] == versions
                assert state["basis_a"] is qa and state["basis_b"] is qb

    _kfac_steps(model, kfac, opt, 4, carried)
    _kfac_steps(lazy_model, lazy_kfac, lazy, 4)
    assert kfac.refresher.bases("0")[2] == (4, 4)
    with _Products() as seen:  # with nothing refreshed since, the step's end multiplies only the update's 4
        _grads(model, 9)
        opt.step()
    assert len(seen.shapes) == 4 * 2
    _grads(lazy_model, 9)
    lazy.step()
    for a, b in zip(model.parameters(), lazy_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_an_optimizer_built_anew_over_the_same_kfac_leaves_the_old_one_untold_and_collectable():
    """A resumed or rebuilt optimizer registers again; the one it replaces is neither kept alive by K-FAC
    nor rotating its own moments at every refresh."""
    import gc
    import weakref

    model, kfac = _two_layer_kfac()
    old = EigenbasisAdam(kfac, lr=1e-2)
    _kfac_steps(model, kfac, old, 2)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None
    opt = EigenbasisAdam(kfac, lr=1e-2)
    _kfac_steps(model, kfac, opt, 2)  # the dead listener is skipped; the new optimizer is told
    layer = kfac.layer_states()[0]
    assert opt.state[layer.module.weight]["versions"] == kfac.refresher.bases("0")[2] == (4, 4)
