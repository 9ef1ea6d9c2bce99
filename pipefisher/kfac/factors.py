"""The K-FAC math on plain tensors: covariance contributions, the pi damping split, inverses.

Kept free of module and process-group state so tests can compare it with a hand-written reference.
"""
from __future__ import annotations

import math

import torch


def with_bias_column(x: torch.Tensor) -> torch.Tensor:
    """``[x, 1]``: a linear layer with bias is a bias-free layer on inputs with a constant 1 appended."""
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)


def cov_a(x: torch.Tensor, bias: bool) -> torch.Tensor:
    """Factor A of one micro-batch: ``x^T x / n`` over its ``n`` input rows (with the bias column)."""
    x = x.reshape(-1, x.shape[-1])
    if bias:
        x = with_bias_column(x)
    return x.t() @ x / x.shape[0]


def cov_b(g: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """Factor B of one micro-batch: ``(s g)^T (s g) / n`` with ``s = loss_scale * n``.

    The saved output gradients are those of ``mean-over-rows loss / loss_scale``; multiplying by
    ``s`` turns them back into per-row gradients, the quantity whose covariance K-FAC wants.
    """
    g = g.reshape(-1, g.shape[-1])
    n = g.shape[0]
    gs = g * (loss_scale * n)
    return gs.t() @ gs / n


def mean_trace(f: torch.Tensor) -> float:
    """``tr(F) / dim F``, the scale the pi rule balances."""
    return float(torch.diagonal(f).sum()) / f.shape[0]


def pi_split(trace_a: float | None, trace_b: float | None) -> float:
    """pi = sqrt((tr A / dim A) / (tr B / dim B)); 1 where either scale is unknown or not positive.

    Both scales must be taken before either factor is cleared: a cleared factor has scale 0, which
    gives pi = 0 or infinity and so infinite damping on one side.
    """
    if trace_a is None or trace_b is None or not (trace_a > 0 and trace_b > 0):
        return 1.0
    pi = math.sqrt(trace_a / trace_b)
    return pi if math.isfinite(pi) and pi > 0 else 1.0


def damping_terms(damping: float, pi: float) -> tuple[float, float]:
    """Damping added to A and to B: ``pi * sqrt(lambda)`` and ``sqrt(lambda) / pi``."""
    root = math.sqrt(damping)
    return pi * root, root / pi


def damped_inverse(f: torch.Tensor, damping: float) -> torch.Tensor:
    """``(F + damping I)^-1`` of a symmetric PSD factor, via Cholesky (plain inverse as a fallback)."""
    m = f + damping * torch.eye(f.shape[0], dtype=f.dtype, device=f.device)
    m = (m + m.t()) / 2
    chol, info = torch.linalg.cholesky_ex(m)
    if int(info) == 0:
        return torch.cholesky_inverse(chol)
    return torch.linalg.inv(m)


def precondition(grad: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor) -> torch.Tensor:
    """``B^-1 G A^-1`` for a gradient ``G`` of shape (out, in[+1])."""
    return b_inv @ grad @ a_inv
