"""Adam in the eigenbasis of K-FAC's Kronecker factors: the SOAP update with K-FAC's curvature.

K-FAC preconditions a layer's gradient ``G`` by ``B^-1 G A^-1``: exact for the curvature of the refresh,
and increasingly wrong as the weights move on until the next one, so its steps suffer from stale
curvature (docs/benchmarks.md measures it). SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing
Shampoo using Adam") keeps only the *eigenbases* of the two Kronecker factors from the periodic work and
runs Adam in the rotated coordinates, ``G' = Q_B^T G Q_A``: Adam's second moments follow the gradient's
scale at every step, so a basis a few steps old costs little. Here the bases are those of K-FAC's own
factors (activations ``A`` and output gradients ``B``), computed in the factor's refresh label
(``inv_kron_X``, in a bubble: :func:`eigenbasis`), so the packer places them like any inverse.

Per step and layer (``[W | b]`` as one ``(out, in + 1)`` matrix, as K-FAC sees it), with ``R(X) =
Q_B^T X Q_A`` the rotation into the bases: ``m <- b1 m + (1 - b1) R(G)``, ``v <- b2 v + (1 - b2) R(G)^2``,
``W <- W (1 - lr wd) - lr Q_B [(m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)] Q_A^T``: four matrix products
per layer. Both moments live in the rotated coordinates; when a refresh brings a new basis, the first
moment is carried into it exactly (``Q_new^T Q_old`` on the side that changed, once per refresh), the
second is kept as it is, as SOAP does (a rotation does not carry squares). Until a layer has both
bases, the identity stands for them: plain AdamW.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipefisher.kfac.kfac import LayerStates


JITTER = 1e-6
"""What :func:`factor_eigh` adds to the diagonal of a factor scaled to a largest entry in [0.5, 1): a shift
that leaves the eigenvectors as they are, and keeps float32's ``eigh`` off exactly zero eigenvalues."""


def scaled_factor(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A PSD factor scaled by the power of two nearest its largest (diagonal) entry (exact), with
    :data:`JITTER` on its diagonal, and that power's exponent: what float32's ``eigh`` and a power step
    (:mod:`pipefisher.kfac.refresh`) work on (see :func:`factor_eigh` for why)."""
    top = m.diagonal().abs().amax() if m.numel() else m.new_ones(())  # a PSD factor's largest entries
    _, exponent = torch.frexp(torch.where(torch.isfinite(top), top, torch.ones_like(top)))
    scaled = torch.ldexp(m, -exponent)  # a new tensor: m is not touched
    scaled.diagonal().add_(JITTER)
    return scaled, exponent


def factor_eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of a symmetric PSD factor (its lower triangle), in ``m``'s dtype: eigenvalues (ascending)
    and eigenvectors (columns); both NaN where ``eigh`` fails to converge, for the findings to report
    (:func:`pipefisher.kfac.factors.bad_factor`), not an exception in the middle of a step.

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


def eigenbasis(f: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The eigenvectors of a symmetric PSD factor (columns), computed in ``dtype`` by :func:`factor_eigh`
    and returned in ``f``'s dtype; no damping is needed. Only ``f``'s lower triangle is read (``eigh``'s),
    so a factor symmetric up to rounding needs no symmetrising pass."""
    return factor_eigh(f.to(dtype))[1].to(f.dtype)


class EigenbasisAdam(torch.optim.Optimizer):
    """The SOAP step above for the layers of a K-FAC holder: one :class:`pipefisher.kfac.KFAC`, or a
    device's stage copies (interleaved, ZB-V, DualPipeV, Chimera), through :class:`LayerStates` only.
    Their refreshes hold the bases (``LayerState.inverses`` holds eigenvectors when K-FAC runs with
    ``inverse="eigenbasis"``)."""

    def __init__(self, kfac: LayerStates, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.kfac = kfac
        super().__init__(kfac.parameters(), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        group = self.param_groups[0]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for st in self.kfac.layer_states():
            w = st.module.weight
            if w.grad is None:
                continue
            g = st.grad_matrix()
            qa, qb = st.inverses["A"], st.inverses["B"]
            if qa is None or qb is None:
                qa = qb = None
            state = self.state[w]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g),
                             basis_a=None, basis_b=None, versions=(0, 0))
            self._follow_basis(state, qa, qb, (0, 0) if qa is None else (st.inversions["A"], st.inversions["B"]))
            state["step"] += 1
            t = state["step"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            g_rot = g if qa is None else qb.t() @ g @ qa
            m.mul_(b1).add_(g_rot, alpha=1 - b1)
            v.mul_(b2).addcmul_(g_rot, g_rot, value=1 - b2)
            u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(eps))
            if qa is not None:
                u = qb @ u @ qa.t()
            if wd:
                w.mul_(1 - lr * wd)
            u_w = u[:, :-1] if st.bias else u  # (out, in); a transposed weight is stored (in, out)
            w.add_(u_w.t() if st.kind.transposed else u_w.reshape(w.shape), alpha=-lr)
            if st.bias:
                st.module.bias.add_(u[:, -1], alpha=-lr)

    @staticmethod
    def _follow_basis(state: dict[str, Any], qa: torch.Tensor | None, qb: torch.Tensor | None,
                      versions: tuple[int, int]) -> None:
        """Carry the first moment into the layer's current bases, where a refresh changed them.

        A refresh is told by the layer's inversion counts (plain ints: no comparison of tensors on the
        device, and a resumed run, whose bases are fresh copies, rotates nothing it should not)."""
        if tuple(state["versions"]) == versions:
            return
        old_a, old_b = state["basis_a"], state["basis_b"]
        assert qa is not None and qb is not None  # bases, once there, are only ever replaced
        m = state["exp_avg"] @ (qa if old_a is None else old_a.t() @ qa)
        state["exp_avg"] = (qb.t() if old_b is None else qb.t() @ old_b) @ m
        state["basis_a"], state["basis_b"], state["versions"] = qa, qb, versions
