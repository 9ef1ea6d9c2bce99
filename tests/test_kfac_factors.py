"""The covariance pieces of :mod:`pipefisher.kfac.factors`, added in place, against the plain formulas."""
from __future__ import annotations

import pytest
import torch

from pipefisher.kfac import factors as fx


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
