"""The covariance pieces of :mod:`pipefisher.kfac.factors`, added in place, against the plain formulas."""
from __future__ import annotations

import math

import pytest
import torch

from pipefisher.kfac import factors as fx

from conftest import DEAD_UNIT_SCALES, dead_unit_factors


def _plain_a(x: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[x, 1]^T [x, 1] / n`` with the column of ones built, in float64."""
    x = x.reshape(-1, x.shape[-1]).double()
    if bias:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    return x.t() @ x / x.shape[0]


def _plain_b(g: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """``(s g)^T (s g) / n`` with ``s = loss_scale * n``, in float64."""
    g = g.reshape(-1, g.shape[-1]).double()
    gs = g * (loss_scale * g.shape[0])
    return gs.t() @ gs / g.shape[0]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("bias", [True, False])
def test_factor_a_summed_in_place_equals_the_plain_formula(bias):
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(2, 5, 7, generator=gen) + 0.5 for _ in range(3)]  # (batch, seq, in), off-centre
    acc = fx.add_cov_a(None, pieces[0], bias)
    first = acc
    for x in pieces[1:]:
        acc = fx.add_cov_a(acc, x, bias)
    assert acc is first  # the one sum, added into: no new tensor per piece
    assert acc.shape == (7 + bias, 7 + bias)
    assert _close(acc, sum(_plain_a(x, bias) for x in pieces))
    if bias:  # the bias corner counts the pieces; the bias row is the sum of the pieces' mean rows
        assert float(acc[7, 7]) == 3.0
        assert torch.allclose(acc[7, :7], acc[:7, 7])


def test_factor_b_summed_in_place_equals_the_plain_formula():
    gen = torch.Generator().manual_seed(1)
    pieces = [torch.randn(2, 5, 4, generator=gen) * 1e-3 for _ in range(3)]
    acc = fx.add_cov_b(None, pieces[0], 6.0)
    first = acc
    for g in pieces[1:]:
        acc = fx.add_cov_b(acc, g, 6.0)
    assert acc is first
    assert _close(acc, sum(_plain_b(g, 6.0) for g in pieces))


def test_one_piece_is_the_plain_formula_in_half_precision_inputs_too():
    x = torch.randn(3, 6, dtype=torch.bfloat16)  # saved inputs may be stored in a lower dtype
    got = fx.cov_a(x, True)
    assert got.dtype == torch.float32
    assert _close(got, _plain_a(x.float(), True))
    assert _close(fx.cov_b(x, 2.0), _plain_b(x.float(), 2.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_one_bad_element_anywhere(bad):
    t = torch.randn(5, 5)
    assert bool(fx.all_finite(t))
    for i, j in ((0, 4), (4, 0), (2, 2)):  # above, below and on the diagonal
        u = t.clone()
        u[i, j] = bad
        assert not bool(fx.all_finite(u)), (i, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e-30, 1e-21, 1e-3, 7.0, 1e30])
def test_a_factor_is_scaled_by_exactly_the_power_of_two_of_its_largest_entry(dtype, scale):
    m = (_spd(16, 3).double() * scale).to(dtype)
    got, exponent = fx.scaled_factor(m)
    _, want_exponent = torch.frexp(m.diagonal().amax())
    want = torch.ldexp(m, -want_exponent)
    want.diagonal().add_(fx.JITTER)
    assert torch.equal(exponent, want_exponent) and torch.equal(got, want)
    assert 0.5 <= float(got.diagonal().amax() - fx.JITTER) < 1.0


def test_a_denormal_factor_is_scaled_up_as_far_as_a_finite_power_of_two_goes():
    got, exponent = fx.scaled_factor(torch.full((3, 3), 1e-40))
    assert int(exponent) == -126 and bool(torch.isfinite(got).all()) and float(got.amax()) > 1e-3


def _spd(n: int, seed: int) -> torch.Tensor:
    rows = torch.randn(4 * n, n, generator=torch.Generator().manual_seed(seed))
    return rows.t() @ rows / rows.shape[0]


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_inverse_reads_the_lower_triangle_and_checks_the_whole_factor(method):
    f = _spd(6, 3)
    want = torch.linalg.inv(f.double() + 0.1 * torch.eye(6, dtype=torch.float64))
    lower = f.tril() + torch.triu(torch.full_like(f, 7.0), 1)  # the upper triangle is never read
    for factor in (f, lower):
        inv, findings, ok = fx.inverse_findings(factor, 0.1, method=method)
        assert bool(ok) and torch.allclose(inv.double(), want, rtol=1e-4, atol=1e-5)
    assert torch.equal(f, _spd(6, 3))  # the damping went into a copy, not into the caller's factor
    poisoned = f.clone()
    poisoned[0, 5] = float("nan")  # where Cholesky never looks, the check still does
    _, findings, ok = fx.inverse_findings(poisoned, 0.1, method=method)
    assert not bool(ok) and float(findings[0]) == 0.0
    assert "NaN or infinite" in fx.bad_factor(findings.tolist(), method)


@pytest.mark.parametrize("scale", DEAD_UNIT_SCALES)
def test_the_eigen_inverse_of_a_factor_with_zero_rows_is_honest_in_float32(scale):
    """``kfac.inverse: eigen`` decomposes the factor as the eigenbasis does
    (:func:`pipefisher.kfac.factors.factor_eigh`): on dead units' zero rows, where float32's ``eigh``
    returned NaN or did not converge, the damped inverse is finite and float64's."""
    for name, f in dead_unit_factors(scale):
        damping = 1e-2 * float(f.diagonal().mean())
        want = torch.linalg.inv(f.double() + damping * torch.eye(64, dtype=torch.float64))
        inv, findings, ok = fx.inverse_findings(f, damping, method="eigen")
        assert bool(ok) and fx.bad_factor(findings.tolist(), "eigen") is None, name
        cond = (float(torch.linalg.eigvalsh(f.double())[-1]) + damping) / damping  # about 6e3 here
        assert (inv.double() - want).norm() <= 2 * cond * 6e-8 * want.norm(), name  # float32's precision


def test_a_zero_pivot_is_a_finding_not_an_exception():
    # damping that exactly cancels a negative diagonal entry: Cholesky stops at a zero pivot there, on
    # which torch's cholesky_inverse would raise; the run must get the factor's one-line reason instead
    f = torch.diag(torch.tensor([1.0, 1.0, -1e-3, 1.0, 1.0]))
    _, findings, ok = fx.inverse_findings(f, 1e-3)
    assert not bool(ok)
    assert "not positive definite after damping" in fx.bad_factor(findings.tolist(), "cholesky", "K-FAC layer x factor A")
    assert "Cholesky failed at column 3" in fx.bad_factor(findings.tolist(), "cholesky")
    with pytest.raises(fx.BadFactorError, match="Cholesky failed at column 3"):
        fx.damped_inverse(f, 1e-3, what="K-FAC layer x factor A")


@pytest.mark.parametrize("n, block", [(513, 128), (512, 128), (129, 128), (129, 0), (7, 3), (1, 1)])
def test_diagonal_blocks_cover_the_factor_in_blocks_no_wider_than_asked(n, block):
    blocks = fx.diagonal_blocks(n, block)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    if block == 0 or n <= block:
        assert blocks == [(0, n)]
    else:
        assert max(j1 - j0 for j0, j1 in blocks) <= block and len(blocks) == math.ceil(n / block)


def _blocks_only(f: torch.Tensor, block: int) -> torch.Tensor:
    mask = torch.zeros_like(f, dtype=torch.bool)
    for j0, j1 in fx.diagonal_blocks(f.shape[0], block):
        mask[j0:j1, j0:j1] = True
    return torch.where(mask, f, torch.zeros_like(f))


@pytest.mark.parametrize("bias", [True, False])
def test_a_blocked_factor_is_the_whole_one_on_its_diagonal_blocks_and_zero_off_them(bias):
    """``kfac.basis_block``: the covariance pieces add the diagonal blocks only (the bias row and column
    within the last block), exactly what the whole factor holds there."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 9, 10, generator=g) for _ in range(3)]
    whole = blocked = None
    for x in xs:
        whole = fx.add_cov_a(whole, x, bias)
        blocked = fx.add_cov_a(blocked, x, bias, block=4)
    assert len(fx.diagonal_blocks(10 + bias, 4)) == 3
    assert _close(blocked, _blocks_only(whole, 4).double())
    gb = torch.randn(2, 9, 10, generator=g)
    assert _close(fx.cov_b(gb, 3.0, block=4), _blocks_only(fx.cov_b(gb, 3.0), 4).double())


@pytest.mark.parametrize("shape", [(512, 129), (128, 513), (96, 96), (20, 7), (3, 33)])
def test_the_drift_sample_is_the_whole_preconditioned_gradients_rows_or_columns_at_a_fraction_of_the_cost(shape):
    """The drift is measured on every stride-th row (or column, where the gradient is wider than tall) of
    B^-1 G A^-1, computed from the rows of B^-1 (columns of A^-1) it keeps; a side no longer than the
    sample is whole, to the bit. Its squares scaled by whole over sample estimate the whole's."""
    g = torch.Generator().manual_seed(0)
    out, inp = shape
    grad = torch.randn(out, inp, generator=g, dtype=torch.float64)

    def inverse(n: int) -> torch.Tensor:
        x = torch.randn(2 * n, n, generator=g, dtype=torch.float64)
        return torch.linalg.inv(x.t() @ x / (2 * n) + 0.1 * torch.eye(n, dtype=torch.float64))

    a_old, b_old, a_new, b_new = inverse(inp), inverse(out), inverse(inp), inverse(out)
    whole_new, whole_old = fx.precondition(grad, a_new, b_new), fx.precondition(grad, a_old, b_old)
    axis, stride = fx.drift_stride(shape)
    assert axis == (0 if out >= inp else 1)
    assert stride == max(1, math.ceil(shape[axis] / fx.DRIFT_SAMPLE))
    new = fx.sampled_precondition(grad, a_new, b_new)
    assert new.shape[axis] == len(range(0, shape[axis], stride)) <= fx.DRIFT_SAMPLE
    assert torch.allclose(new, fx.sampled(whole_new), rtol=1e-10, atol=1e-12)
    if stride == 1:
        assert torch.equal(new, whole_new)
    old = fx.sampled(whole_old)
    assert fx.drift_scale(shape) == shape[axis] / new.shape[axis]
    change, _, norm = fx.drift_terms(new, old, scale=fx.drift_scale(shape))
    whole_change, _, whole_norm = fx.drift_terms(whole_new, whole_old)
    assert float(change / norm) == pytest.approx(float(whole_change / whole_norm), rel=0.25)
    assert float(norm) == pytest.approx(float(whole_norm), rel=0.25)
