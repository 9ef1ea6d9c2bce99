"""The K-FAC math on plain tensors: covariance contributions, the pi damping split, inverses, KL-clip.

Kept free of module and process-group state so tests can compare it with a hand-written reference.
"""
from __future__ import annotations

import math

import torch


class BadFactorError(RuntimeError):
    """A factor that cannot be inverted honestly (not finite, or not positive definite after damping).

    The message is one line that names the layer and the factor, so a run that stops on it says where.
    """


def add_cov_a(acc: torch.Tensor | None, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """Add factor A of one micro-batch, ``[x, 1]^T [x, 1] / n`` over its ``n`` input rows, into ``acc``
    in place (a new sum when ``acc`` is None); returns the sum.

    A linear layer with bias is a bias-free layer on inputs with a constant 1 appended; that column is
    never built: the ``x^T x`` block goes in with one ``addmm_``, the bias row and column are the mean
    row ``x.sum(0) / n``, and the corner is 1.
    """
    x = x.reshape(-1, x.shape[-1]).float()
    n, d = x.shape
    if acc is None:
        acc = x.new_zeros(d + bias, d + bias)
    acc[:d, :d].addmm_(x.t(), x, alpha=1.0 / n)
    if bias:
        mean = x.sum(0) / n
        acc[:d, d] += mean
        acc[d, :d] += mean
        acc[d, d] += 1.0
    return acc


def add_cov_b(acc: torch.Tensor | None, g: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """Add factor B of one micro-batch, ``(s g)^T (s g) / n`` with ``s = loss_scale * n``, into ``acc``
    in place (a new sum when ``acc`` is None); returns the sum.

    The saved output gradients are those of ``mean-over-rows loss / loss_scale``; multiplying by
    ``s`` turns them back into per-row gradients, the quantity whose covariance K-FAC wants. The
    scale goes into the ``addmm_``'s alpha (``s^2 / n``), so no scaled copy of ``g`` is made.
    """
    g = g.reshape(-1, g.shape[-1]).float()
    n, d = g.shape
    if acc is None:
        acc = g.new_zeros(d, d)
    return acc.addmm_(g.t(), g, alpha=(loss_scale * n) ** 2 / n)


def cov_a(x: torch.Tensor, bias: bool) -> torch.Tensor:
    """Factor A of one micro-batch on its own (:func:`add_cov_a` into nothing)."""
    return add_cov_a(None, x, bias)


def cov_b(g: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """Factor B of one micro-batch on its own (:func:`add_cov_b` into nothing)."""
    return add_cov_b(None, g, loss_scale)


def running_average(old: torch.Tensor | None, new: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay * old + (1 - decay) * new``; the first refresh (no ``old``) uses what it has."""
    if old is None or decay == 0.0:
        return new
    return old * decay + new * (1.0 - decay)


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


def damped_inverse(f: torch.Tensor, damping: float, *, method: str = "cholesky",
                   dtype: torch.dtype = torch.float32, what: str = "factor") -> torch.Tensor:
    """``(F + damping I)^-1`` of a symmetric PSD factor, computed in ``dtype``, returned in F's dtype.

    ``cholesky`` is the fast path; ``eigen`` clips the small negative eigenvalues that rounding leaves
    in a PSD factor to zero before damping, so it survives nearly singular factors. Anything else is
    a :class:`BadFactorError` naming ``what``, never a silently wrong inverse: a factor with NaN or
    infinity, one whose damped matrix is not positive definite, or an inverse that is not finite.
    """
    if damping <= 0 or not math.isfinite(damping):
        raise BadFactorError(f"{what}: damping must be positive and finite, not {damping!r}")
    if not bool(torch.isfinite(f).all()):
        raise BadFactorError(f"{what}: the factor holds NaN or infinite values")
    m = f.to(dtype)
    m = (m + m.t()) / 2
    eye = torch.eye(m.shape[0], dtype=dtype, device=m.device)
    if method == "eigen":
        vals, vecs = torch.linalg.eigh(m)
        scale = float(vals.abs().max()) if vals.numel() else 0.0
        if float(vals.min()) < -1e-4 * max(scale, 1e-30) - damping:
            raise BadFactorError(f"{what}: not positive semi-definite (smallest eigenvalue "
                                 f"{float(vals.min()):.3g}, largest {scale:.3g})")
        inv = (vecs / (vals.clamp_min(0.0) + damping)) @ vecs.t()
    elif method == "cholesky":
        chol, info = torch.linalg.cholesky_ex(m + damping * eye)
        if int(info) != 0:
            raise BadFactorError(f"{what}: not positive definite after damping {damping:.3g} "
                                 f"(Cholesky failed at column {int(info)}; try kfac.inverse: eigen, "
                                 "kfac.inverse_dtype: float64 or more damping)")
        inv = torch.cholesky_inverse(chol)
    else:
        raise ValueError(f"inverse method must be 'cholesky' or 'eigen', not {method!r}")
    if not bool(torch.isfinite(inv).all()):
        raise BadFactorError(f"{what}: the damped inverse is not finite")
    return inv.to(f.dtype)


def precondition(grad: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor) -> torch.Tensor:
    """``B^-1 G A^-1`` for a gradient ``G`` of shape (out, in[+1])."""
    return b_inv @ grad @ a_inv


def drift_terms(new: torch.Tensor, old: torch.Tensor,
                older: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(||new - old||_F^2, ||new - older||_F^2, ||new||_F^2)`` of one layer's preconditioned gradients (the
    second None without ``older``), as 0-dim tensors.

    Kept as tensors (no host sync where they are computed) and as squares, so that layers, stages and
    replicas add up before a refresh's figures are formed (:mod:`pipefisher.drift`)."""
    new = new.float()
    far = None if older is None else (new - older.float()).square().sum()
    return (new - old.float()).square().sum(), far, new.square().sum()


def kl_clip_scale(grad_dot_step: float, lr: float, kl_clip: float) -> float:
    """The factor nu <= 1 that keeps a preconditioned step's predicted KL change under ``kl_clip``.

    Ba et al. (2017): with ``v = F^-1 g`` the step ``-lr v`` changes the model's output distribution
    by about ``lr^2 v^T F v / 2 = lr^2 g^T v / 2``; nu = min(1, sqrt(kl_clip / (lr^2 |g^T v|))).
    ``kl_clip <= 0`` turns it off (nu = 1).
    """
    if kl_clip <= 0 or lr <= 0:
        return 1.0
    quad = lr * lr * abs(grad_dot_step)
    if not math.isfinite(quad):
        return 0.0
    if quad <= 0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / quad))
