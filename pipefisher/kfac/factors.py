"""The K-FAC math on plain tensors: covariance contributions, the pi damping split, inverses, eigenbases,
KL-clip.

Kept free of module and process-group state so tests can compare it with a hand-written reference.
"""
from __future__ import annotations

import math

import torch


JITTER = 1e-6
"""What :func:`factor_eigh` adds to the diagonal of a factor scaled to a largest entry in [0.5, 1): a shift
that leaves the eigenvectors as they are, and keeps float32's ``eigh`` off exactly zero eigenvalues."""


def scaled_factor(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A PSD factor scaled by the power of two nearest its largest (diagonal) entry (exact), with
    :data:`JITTER` on its diagonal, and that power's exponent: what float32's ``eigh`` and a power step
    (:mod:`pipefisher.kfac.refresh`) work on (see :func:`factor_eigh` for why)."""
    top = m.diagonal().abs().amax() if m.numel() else m.new_ones(())  # a PSD factor's largest entries
    _, exponent = torch.frexp(torch.nan_to_num(top, nan=1.0, posinf=1.0, neginf=1.0))
    limit = int(math.log2(torch.finfo(m.dtype).max)) - 1  # 2^-exponent stays finite (a denormal top: scaled less)
    exponent = exponent.clamp(-limit, limit)
    # times the power of two as one number: exact as ldexp, where ldexp over the whole factor took 15x a
    # product's time on a CPU core (40 us of a 128-wide block's 470 us eigh)
    scaled = m * torch.ldexp(torch.ones((), dtype=m.dtype, device=m.device), -exponent)  # m is not touched
    scaled.diagonal().add_(JITTER)
    return scaled, exponent


def factor_eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of a symmetric PSD factor (its lower triangle), in ``m``'s dtype: eigenvalues (ascending)
    and eigenvectors (columns); both NaN where ``eigh`` fails to converge, for the findings to report
    (:func:`bad_factor`), not an exception in the middle of a step.

    Why the factor is not handed to ``eigh`` as it is: a unit whose input or output gradient is exactly
    zero (a dead unit) gives the factor a zero row and column, and float32's ``eigh`` returned NaN for, or
    failed to converge on, about one in six of such factors (half or most of the rows zero; at any scale,
    more often far below 1: the tiny config's factor B of 1e-21 after a few steps at lr 0.1). The factor
    is scaled by the power of two nearest its largest (diagonal) entry (exact), then :data:`JITTER` is added to its
    diagonal (a shift: the same eigenvectors, to float32's precision, and no eigenvalue exactly zero); the
    eigenvalues are shifted and scaled back."""
    scaled, exponent = scaled_factor(m)
    try:
        vals, vecs = torch.linalg.eigh(scaled)
    except torch.linalg.LinAlgError:  # did not converge: a decomposition that says so
        return m.new_full(m.shape[:1], float("nan")), torch.full_like(m, float("nan"))
    return torch.ldexp(vals - JITTER, exponent), vecs


def eigenbasis(f: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = 0) -> torch.Tensor:
    """The eigenvectors of a symmetric PSD factor (columns), computed in ``dtype`` by :func:`factor_eigh`
    and returned in ``f``'s dtype; no damping is needed. Only ``f``'s lower triangle is read (``eigh``'s),
    so a factor symmetric up to rounding needs no symmetrising pass. ``block``: a factor wider than it is
    taken as its :func:`diagonal_blocks` alone, and its basis is block-diagonal (each block's ``eigh``)."""
    blocks = diagonal_blocks(f.shape[0], block)
    if len(blocks) == 1:
        return factor_eigh(f.to(dtype))[1].to(f.dtype)
    q = torch.zeros_like(f)
    for j0, j1 in blocks:
        q[j0:j1, j0:j1] = factor_eigh(f[j0:j1, j0:j1].to(dtype))[1].to(f.dtype)
    return q


def column_blocks(n: int, count: int) -> list[tuple[int, int]]:
    """``count`` (at most ``n``) contiguous column ranges of ``0..n``, as equal as integers allow."""
    count = max(1, min(count, n))
    edges = [round(n * i / count) for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def diagonal_blocks(n: int, block: int) -> list[tuple[int, int]]:
    """The diagonal blocks an ``n``-wide factor is cut into under ``kfac.basis_block`` = ``block``: the
    fewest equal column ranges of at most ``block`` columns each; the whole factor where ``block`` is 0
    or the factor no wider.

    Why: a wide factor's eigenbasis (an ``n^3`` ``eigh``) and the rotations into it (``n^2`` per gradient
    row, every step) cost more than the curvature they carry pays for on a small model; its diagonal
    blocks alone (Shampoo's blocking of its preconditioners) cost ``n b^2`` and ``n b`` (docs/benchmarks.md,
    "Factors cut into diagonal blocks")."""
    if block <= 0 or n <= block:
        return [(0, n)]
    return column_blocks(n, math.ceil(n / block))


class BadFactorError(RuntimeError):
    """A factor that cannot be inverted honestly (not finite, or not positive definite after damping).

    The message is one line that names the layer and the factor, so a run that stops on it says where.
    """


def add_cov_a(acc: torch.Tensor | None, x: torch.Tensor, bias: bool, block: int = 0) -> torch.Tensor:
    """Add factor A of one micro-batch, ``[x, 1]^T [x, 1] / n`` over its ``n`` input rows, into ``acc``
    in place (a new sum when ``acc`` is None); returns the sum. ``block``: only the factor's
    :func:`diagonal_blocks` are computed (the rest stays zero).

    A linear layer with bias is a bias-free layer on inputs with a constant 1 appended; that column is
    never built: the ``x^T x`` block goes in with one ``addmm_``, the bias row and column are the mean
    row ``x.sum(0) / n``, and the corner is 1.
    """
    x = x.reshape(-1, x.shape[-1]).float()
    n, d = x.shape
    if acc is None:
        acc = x.new_zeros(d + bias, d + bias)
    blocks = diagonal_blocks(d + bias, block)
    for j0, j1 in blocks:
        e = min(j1, d)  # the bias column, where it falls in this block, is not in x
        acc[j0:e, j0:e].addmm_(x[:, j0:e].t(), x[:, j0:e], alpha=1.0 / n)
    if bias:
        j0 = blocks[-1][0]  # the bias row and column within the last block only
        mean = x[:, j0:].sum(0) / n
        acc[j0:d, d] += mean
        acc[d, j0:d] += mean
        acc[d, d] += 1.0
    return acc


def add_cov_b(acc: torch.Tensor | None, g: torch.Tensor, loss_scale: float, block: int = 0) -> torch.Tensor:
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
    for j0, j1 in diagonal_blocks(d, block):  # ``block``: the diagonal blocks only, as add_cov_a
        acc[j0:j1, j0:j1].addmm_(g[:, j0:j1].t(), g[:, j0:j1], alpha=(loss_scale * n) ** 2 / n)
    return acc


def cov_a(x: torch.Tensor, bias: bool, block: int = 0) -> torch.Tensor:
    """Factor A of one micro-batch on its own (:func:`add_cov_a` into nothing)."""
    return add_cov_a(None, x, bias, block)


def cov_b(g: torch.Tensor, loss_scale: float, block: int = 0) -> torch.Tensor:
    """Factor B of one micro-batch on its own (:func:`add_cov_b` into nothing)."""
    return add_cov_b(None, g, loss_scale, block)


def running_average(old: torch.Tensor | None, new: torch.Tensor, decay: float,
                    in_place: bool = False) -> torch.Tensor:
    """``decay * old + (1 - decay) * new``; the first refresh (no ``old``) uses what it has. ``in_place``:
    into ``new`` (a tensor the caller owns), two passes and no new factor."""
    if old is None or decay == 0.0:
        return new
    if in_place:
        return new.mul_(1.0 - decay).add_(old, alpha=decay)
    return old * decay + new * (1.0 - decay)


def mean_trace(f: torch.Tensor) -> torch.Tensor:
    """``tr(F) / dim F``, the scale the pi rule balances, as a 0-dim float64 tensor (no host sync)."""
    return torch.diagonal(f).sum().double() / f.shape[0]


def pi_split(trace_a: torch.Tensor | float | None, trace_b: torch.Tensor | float | None) -> torch.Tensor | float:
    """pi = sqrt((tr A / dim A) / (tr B / dim B)); 1 where either scale is unknown or not positive.

    Both scales must be taken before either factor is cleared: a cleared factor has scale 0, which
    gives pi = 0 or infinity and so infinite damping on one side. Computed on the device (a 0-dim
    float64 tensor), so the host need not wait for the factors to know it.
    """
    if trace_a is None or trace_b is None:
        return 1.0
    ta = torch.as_tensor(trace_a, dtype=torch.float64)
    tb = torch.as_tensor(trace_b, dtype=torch.float64, device=ta.device)
    pi = (ta / tb).sqrt()
    ok = (ta > 0) & (tb > 0) & (pi > 0) & (pi < math.inf)  # NaN compares False: not ok
    return torch.where(ok, pi, 1.0)


def damping_terms(damping: float, pi: torch.Tensor | float) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """Damping added to A and to B: ``pi * sqrt(lambda)`` and ``sqrt(lambda) / pi``."""
    root = math.sqrt(damping)
    return pi * root, root / pi


FINDINGS = 6
"""What :func:`inverse_findings` knows of one damped inverse, as numbers: the factor finite (1/0), the
damping, the Cholesky failure column (``cholesky``) or the smallest eigenvalue (``eigen``), the largest
eigenvalue's size (``eigen``, else 0), the inverse finite (1/0), and the micro-batch pieces the factor
holds (fp16 drops those that overflowed; 1 where nothing is dropped)."""


INVERSE_METHODS = ("cholesky", "eigen", "eigenbasis")
"""How a refresh turns a factor into what the update uses: a damped inverse (``cholesky``, ``eigen``) or,
for ``kfac.update: soap``, its eigenvectors (``eigenbasis``, :mod:`pipefisher.kfac.eigenbasis`)."""


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-dim bool tensor: from its greatest and least
    element (NaN propagates to both), two reductions that allocate nothing and read ``t`` in any layout
    (``aminmax`` copies a transposed one, as LAPACK's inverses are); ``torch.isfinite(t).all()`` makes
    a mask in three passes, a tenth of a 513-wide refresh's Cholesky inverse on one CPU core."""
    return torch.isfinite(torch.stack([t.amax(), t.amin()])).all()


def inverse_findings(f: torch.Tensor, damping: torch.Tensor | float, *, method: str = "cholesky",
                     dtype: torch.dtype = torch.float32,
                     pieces: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(F + damping I)^-1`` of a symmetric PSD factor (computed in ``dtype``, returned in F's dtype), its
    :data:`FINDINGS` (a float64 tensor on F's device) and whether it is honest (a 0-dim bool tensor: the
    device-side twin of :func:`bad_factor` finding nothing), without reading anything back: the
    findings are read where it is decided, once for many inverses.

    ``cholesky`` is the fast path; ``eigen`` clips the small negative eigenvalues that rounding leaves
    in a PSD factor to zero before damping, so it survives nearly singular factors. A factor holding
    NaN or infinity is inverted as if those were 0 (its findings say so; the inverse is not to be used).
    ``damping`` comes from :func:`damping_terms` (positive and finite); :func:`bad_factor` checks it.
    """
    if method not in INVERSE_METHODS:
        raise ValueError(f"inverse method must be one of {', '.join(INVERSE_METHODS)}, not {method!r}")
    finite = all_finite(f)
    m = f.to(dtype)  # not symmetrised: Cholesky and eigh read the lower triangle only
    if method == "eigenbasis":  # SOAP's basis for kfac.update: soap: the eigenvectors, no damping
        inv = eigenbasis(torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0), dtype)
        first = second = m.new_zeros((), dtype=torch.float64)
        ok = torch.ones((), dtype=torch.bool, device=m.device)
    elif method == "eigen":
        vals, vecs = factor_eigh(torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0))
        inv = (vecs / (vals.clamp_min(0.0) + damping)) @ vecs.t()
        zero = vals.new_zeros((), dtype=torch.float64)
        first, second = (vals.min().double(), vals.abs().max().double()) if vals.numel() else (zero, zero)
        ok = ~(first < -1e-4 * second.clamp_min(1e-30) - damping)
    else:
        m = m.clone() if m is f else m
        m.diagonal().add_(damping)
        chol, info = torch.linalg.cholesky_ex(m)
        # A failed factorization can stop at a zero pivot, on which cholesky_inverse raises instead of
        # returning: a pivot that is not positive becomes 1 (a successful one has none), so the inverse
        # always comes back and the findings, not an exception, say the factor was not honest.
        pivots = chol.diagonal()
        pivots.copy_(torch.where(pivots > 0, pivots, torch.ones_like(pivots)))
        inv = torch.cholesky_inverse(chol)
        first, second = info, info.new_zeros(())
        ok = info == 0
    inv_finite = all_finite(inv)
    ok = ok & finite & inv_finite
    kept = torch.ones((), device=m.device) if pieces is None else pieces.to(m.device)
    if pieces is not None:
        ok = ok & (kept > 0)
    findings = torch.stack([t.to(torch.float64) for t in (finite, torch.as_tensor(damping, device=m.device),
                                                          first, second, inv_finite, kept)])
    return inv.to(f.dtype), findings, ok


def bad_factor(findings: list[float], method: str, what: str = "factor") -> str | None:
    """The one-line reason an inverse with these :data:`FINDINGS` (read back as numbers) is not honest,
    naming ``what``; None when it is. A factor with no piece (every one dropped for fp16 overflow) is
    not judged here: its caller keeps the previous inverse without a word per layer."""
    finite, damping, first, second, inv_finite, _ = findings
    if not (damping > 0 and math.isfinite(damping)):
        return f"{what}: damping must be positive and finite, not {damping!r}"
    if not finite:
        return f"{what}: the factor holds NaN or infinite values"
    if method == "eigen" and first < -1e-4 * max(second, 1e-30) - damping:
        return f"{what}: not positive semi-definite (smallest eigenvalue {first:.3g}, largest {second:.3g})"
    if method == "cholesky" and int(first) != 0:
        return (f"{what}: not positive definite after damping {damping:.3g} (Cholesky failed at column "
                f"{int(first)}; try kfac.inverse: eigen, kfac.inverse_dtype: float64 or more damping)")
    if not inv_finite and method == "eigenbasis":
        return f"{what}: the eigenbasis is not finite (eigh failed; try kfac.inverse_dtype: float64)"
    if not inv_finite:
        return f"{what}: the damped inverse is not finite (try kfac.inverse_dtype: float64 or more damping)"
    return None


def damped_inverse(f: torch.Tensor, damping: torch.Tensor | float, *, method: str = "cholesky",
                   dtype: torch.dtype = torch.float32, what: str = "factor") -> torch.Tensor:
    """``(F + damping I)^-1`` of a symmetric PSD factor, checked at once (one read of its findings):
    :func:`inverse_findings`, then a :class:`BadFactorError` naming ``what`` where :func:`bad_factor`
    finds it dishonest, never a silently wrong inverse: a factor with NaN or infinity, one whose damped
    matrix is not positive definite, or an inverse that is not finite."""
    if isinstance(damping, float) and not (damping > 0 and math.isfinite(damping)):
        raise BadFactorError(f"{what}: damping must be positive and finite, not {damping!r}")
    inv, findings, _ = inverse_findings(f, damping, method=method, dtype=dtype)
    reason = bad_factor(findings.tolist(), method, what)
    if reason is not None:
        raise BadFactorError(reason)
    return inv


def precondition(grad: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor) -> torch.Tensor:
    """``B^-1 G A^-1`` for a gradient ``G`` of shape (out, in[+1])."""
    return b_inv @ grad @ a_inv


DRIFT_SAMPLE = 32
"""The curvature drift is measured on at most this many evenly spaced rows (or columns, where the gradient
is wider than tall) of the preconditioned gradient, its squares scaled up to the whole
(:func:`sampled_precondition`). Measured whole, it took a sixth of the K-FAC work in the bubbles on
``configs/small.yaml`` (about 12 of 65 ms per refresh on a stage): two to three preconditionings per
layer, and a drift is a ratio of sums over many entries that a sample of them estimates well."""


def drift_stride(shape: tuple[int, int]) -> tuple[int, int]:
    """(axis, stride) of the :data:`DRIFT_SAMPLE` sample of a preconditioned gradient of ``shape``: every
    ``stride``-th row (axis 0) or column (axis 1), along the longer side (the cheaper product); stride 1
    (the whole) where that side has no more than the sample."""
    axis = 0 if shape[0] >= shape[1] else 1
    return axis, max(1, -(-shape[axis] // DRIFT_SAMPLE))


def sampled(pre: torch.Tensor) -> torch.Tensor:
    """The :func:`drift_stride` sample of a whole preconditioned gradient."""
    axis, stride = drift_stride((pre.shape[0], pre.shape[1]))
    return pre[::stride] if axis == 0 else pre[:, ::stride]


def drift_scale(shape: tuple[int, int]) -> float:
    """The whole's size over its :func:`drift_stride` sample's: what the sample's squares are scaled by."""
    axis, stride = drift_stride(shape)
    return shape[axis] / len(range(0, shape[axis], stride))


def sampled_precondition(grad: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor) -> torch.Tensor:
    """``sampled(B^-1 G A^-1)`` (:func:`drift_stride`) at the sample's cost: the rows of ``B^-1`` (or the
    columns of ``A^-1``) it keeps, then the products."""
    axis, stride = drift_stride((grad.shape[0], grad.shape[1]))
    if stride == 1:  # the whole, in the update's order of products (the same numbers, to the bit)
        return precondition(grad, a_inv, b_inv)
    if axis == 0:
        return b_inv[::stride] @ grad @ a_inv
    return b_inv @ (grad @ a_inv[:, ::stride])


def drift_terms(new: torch.Tensor, old: torch.Tensor, older: torch.Tensor | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(||new - old||_F^2, ||new - older||_F^2, ||new||_F^2)`` of one layer's preconditioned gradients (the
    second None without ``older``), as 0-dim tensors, each times ``scale`` (the whole's size over a
    sample's, :func:`sampled`).

    Kept as tensors (no host sync where they are computed) and as squares, so that layers, stages and
    replicas add up before a refresh's figures are formed (:mod:`pipefisher.loop.drift`)."""
    new = new.float()
    far = None if older is None else (new - older.float()).square().sum() * scale
    return (new - old.float()).square().sum() * scale, far, new.square().sum() * scale


def kl_clip_scale(grad_dot_step: torch.Tensor | float, lr: float, kl_clip: float) -> torch.Tensor | float:
    """The factor nu <= 1 that keeps a preconditioned step's predicted KL change under ``kl_clip``.

    Ba et al. (2017): with ``v = F^-1 g`` the step ``-lr v`` changes the model's output distribution
    by about ``lr^2 v^T F v / 2 = lr^2 g^T v / 2``; nu = min(1, sqrt(kl_clip / (lr^2 |g^T v|))).
    ``kl_clip <= 0`` turns it off (nu = 1). A non-finite ``lr^2 |g^T v|`` gives 0, a zero one 1.
    Computed on the device (a float64 tensor) from a tensor ``grad_dot_step``: no host sync.
    """
    if kl_clip <= 0 or lr <= 0:
        return 1.0
    quad = torch.as_tensor(grad_dot_step, dtype=torch.float64).abs() * (lr * lr)
    nu = torch.clamp(torch.sqrt(kl_clip / quad), max=1.0)
    nu = torch.where(quad <= 0, torch.ones_like(quad), nu)
    return torch.where(torch.isfinite(quad), nu, torch.zeros_like(quad))
