"""Adam in the eigenbasis of K-FAC's Kronecker factors: the SOAP update with K-FAC's curvature.

K-FAC preconditions a layer's gradient ``G`` by ``B^-1 G A^-1``: exact for the curvature of the refresh,
and increasingly wrong as the weights move on until the next one, so its steps suffer from stale
curvature (docs/benchmarks.md measures it). SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing
Shampoo using Adam") keeps only the *eigenbases* of the two Kronecker factors from the periodic work and
runs Adam in the rotated coordinates, ``G' = Q_B^T G Q_A``: Adam's second moments follow the gradient's
scale at every step, so a basis a few steps old costs little. Here the bases are those of K-FAC's own
factors (activations ``A`` and output gradients ``B``), computed in the factor's refresh label
(``inv_kron_X``, in a bubble: :func:`pipefisher.kfac.factors.eigenbasis`), so the packer places them like any inverse.

Per step and layer (``[W | b]`` as one ``(out, in + 1)`` matrix, as K-FAC sees it), with
``R(X) = Q_B^T X Q_A`` the rotation into the bases: ``m <- b1 m + (1 - b1) R(G)``,
``v <- b2 v + (1 - b2) R(G)^2``,
``W <- W (1 - lr wd) - lr Q_B [(m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)] Q_A^T``: four matrix
products per layer. With ``nesterov`` (``kfac.nesterov``; the race's benchmark sets it) the first moment looks one step
ahead, as Nesterov's momentum does (NAdam with a constant ``b1``, Dozat 2016, "Incorporating Nesterov
Momentum into Adam"): ``b1 m / (1 - b1^(t+1)) + (1 - b1) R(G) / (1 - b1^t)`` in place of
``m / (1 - b1^t)``. Muon, which the race measures against, steps with Nesterov's momentum too; at 1000
steps of the race the look-ahead gained 0.001-0.015 of held-out loss a seed, and both races were won with
it (docs/benchmarks.md). Both moments live in the rotated coordinates; when a refresh brings a new basis,
the first moment is carried into it exactly (``Q_new^T Q_old`` on the side that changed, once per
refresh), the second is kept as it is, as SOAP does (a rotation does not carry squares). The carrying runs
where the refresh installs the basis, in its inverse label (in a bubble, told through
:meth:`LayerStates.on_refresh`), not in ``-- end --`` on the step's critical path: the moment changes only
in ``-- end --``, so either place gives the same moment. Until a layer has both bases, the identity stands
for them: plain AdamW. Under ``kfac.basis_block`` a wide factor's basis is block-diagonal
(:func:`pipefisher.kfac.factors.diagonal_blocks`), and every product with it goes block by block: ``n b``
work per row instead of ``n^2``.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from pipefisher.kfac.factors import diagonal_blocks
from pipefisher.kfac.layers import Bases, LayerState, LayerStates


class EigenbasisAdam(torch.optim.Optimizer):
    """The SOAP step above for the layers of a K-FAC holder: one :class:`pipefisher.kfac.KFAC`, or a
    device's stage copies (interleaved, ZB-V, DualPipeV, Chimera), through :class:`LayerStates` only:
    its layers, their parameters, and the bases their refreshes installed (K-FAC with
    ``inverse="eigenbasis"``, :meth:`LayerStates.eigenbases`). ``basis_block``: the K-FAC's own
    (``kfac.basis_block``), by which its bases are block-diagonal. ``rotation_dtype``
    (``kfac.rotation_dtype``): the dtype of each step's four products (the gradient into the bases, the
    step out of them); the moments, Adam's arithmetic and the moment's rotation at a refresh stay in the
    parameters' dtype. ``bfloat16`` runs the products 3.4x faster on a CPU with AVX512-BF16 (and on
    GPUs' tensor cores) at about 3 significant digits per element. ``nesterov``: the first moment's
    look-ahead above (False, the default: SOAP's plain Adam, which the tests compare with torch's)."""

    def __init__(self, kfac: LayerStates, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, basis_block: int = 0,
                 rotation_dtype: torch.dtype = torch.float32, nesterov: bool = False) -> None:
        self.kfac, self.basis_block, self.rotation_dtype, self.nesterov = kfac, basis_block, rotation_dtype, nesterov
        self._cast: dict[int, tuple[tuple[int, int], torch.Tensor, torch.Tensor]] = {}  # id(weight) -> bases cast
        super().__init__(kfac.parameters(), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        follow = weakref.WeakMethod(self._refreshed)  # an optimizer built anew leaves no live listener behind
        kfac.on_refresh(lambda layer, bases: None if (call := follow()) is None else call(layer, bases))

    def _blocks(self, g_shape: tuple[int, ...]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The diagonal blocks of the layer's rows (factor B's side) and columns (A's)."""
        return diagonal_blocks(g_shape[0], self.basis_block), diagonal_blocks(g_shape[1], self.basis_block)

    @torch.no_grad()
    def _refreshed(self, layer: LayerState, bases: Bases) -> None:
        """A refresh of one of ``layer``'s factors ended (in its inverse label): carry the first moment into
        the bases now (:meth:`_follow_basis`), so that ``-- end --`` finds nothing to rotate. Before the
        layer's first step, or while it lacks one of its bases, there is no moment in any basis yet: the
        step starts it."""
        qa, qb, versions = bases
        state = self.state.get(layer.module.weight)
        if not state or qa is None or qb is None:
            return
        self._follow_basis(state, qa, qb, versions, *self._blocks(state["exp_avg"].shape))

    def _bases_in(self, w: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor,
                  versions: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's bases in :attr:`rotation_dtype`, cast once per refresh (kept out of the state: a
        checkpoint holds the bases once, in their own dtype)."""
        if qa.dtype == self.rotation_dtype:
            return qa, qb
        kept = self._cast.get(id(w))
        if kept is None or kept[0] != versions:
            kept = (versions, qa.to(self.rotation_dtype), qb.to(self.rotation_dtype))
            self._cast[id(w)] = kept
        return kept[1], kept[2]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        group = self.param_groups[0]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for st, (qa, qb, versions) in zip(self.kfac.layer_states(), self.kfac.eigenbases()):
            w = st.module.weight
            if w.grad is None:
                continue
            g = st.grad_matrix()
            if qa is None or qb is None:
                qa = qb = None
            state = self.state[w]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g),
                             basis_a=None, basis_b=None, versions=(0, 0))
            rows, cols = self._blocks(g.shape)
            self._follow_basis(state, qa, qb, (0, 0) if qa is None else versions, rows, cols)
            state["step"] += 1
            t = state["step"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if qa is not None:
                qa_r, qb_r = self._bases_in(w, qa, qb, versions)
                low = g.to(self.rotation_dtype)  # Q_B^T G Q_A
                g_rot = times(qa_r, times(qb_r, low, rows, True).t(), cols, True).t().to(g.dtype)
            else:
                g_rot = g
            m.mul_(b1).add_(g_rot, alpha=1 - b1)
            v.mul_(b2).addcmul_(g_rot, g_rot, value=1 - b2)
            if self.nesterov:  # b1 m / (1 - b1^(t+1)) + (1 - b1) R(G) / (1 - b1^t)
                first = m.mul(b1 / (1 - b1 ** (t + 1))).add_(g_rot, alpha=(1 - b1) / (1 - b1 ** t))
            else:
                first = m / (1 - b1 ** t)
            u = first.div_((v / (1 - b2 ** t)).sqrt_().add_(eps))
            if qa is not None:
                u = times(qa_r, times(qb_r, u.to(self.rotation_dtype), rows).t(), cols).t().to(g.dtype)  # Q_B u Q_A^T
            if wd:
                w.mul_(1 - lr * wd)
            u_w = u[:, :-1] if st.bias else u  # (out, in); a transposed weight is stored (in, out)
            w.add_(u_w.t() if st.kind.transposed else u_w.reshape(w.shape), alpha=-lr)
            if st.bias:
                st.module.bias.add_(u[:, -1], alpha=-lr)

    @staticmethod
    def _follow_basis(state: dict[str, Any], qa: torch.Tensor | None, qb: torch.Tensor | None,
                      versions: tuple[int, int], rows: list[tuple[int, int]], cols: list[tuple[int, int]]) -> None:
        """Carry the first moment into the layer's current bases, where a refresh changed them.

        A refresh is told by the layer's inversion counts (plain ints: no comparison of tensors on the
        device, and a resumed run, whose bases are fresh copies, rotates nothing it should not). Only a
        side whose count changed is rotated (a refresh replaces one factor's basis), and each side's
        product goes through the moment (:func:`_rotate`). It runs at the refresh (:meth:`_refreshed`); the
        step calls it too, for bases installed without telling (a layer's first step, a test's hand)."""
        if tuple(state["versions"]) == versions:
            return
        assert qa is not None and qb is not None  # bases, once there, are only ever replaced
        (was_a, was_b), (now_a, now_b) = state["versions"], versions
        m = state["exp_avg"]
        if now_a != was_a:  # m Q_old_a^T Q_a
            m = _rotate(m.t(), state["basis_a"], qa, cols).t()
        if now_b != was_b:  # Q_b^T Q_old_b m
            m = _rotate(m, state["basis_b"], qb, rows)
        state["exp_avg"] = m.contiguous()
        state["basis_a"], state["basis_b"], state["versions"] = qa, qb, versions


def times(q: torch.Tensor, x: torch.Tensor, blocks: list[tuple[int, int]], transpose: bool = False) -> torch.Tensor:
    """``q x`` (``q^T x`` with ``transpose``) for a basis ``q`` that is block-diagonal on ``blocks`` (the
    rows of ``x``): one product per block, the zeros between them never multiplied."""
    if len(blocks) == 1:
        return (q.t() if transpose else q) @ x
    parts = [q[j0:j1, j0:j1] for j0, j1 in blocks]
    return torch.cat([(b.t() if transpose else b) @ x[j0:j1] for b, (j0, j1) in zip(parts, blocks)])


def _rotate(m: torch.Tensor, old: torch.Tensor | None, new: torch.Tensor,
            blocks: list[tuple[int, int]]) -> torch.Tensor:
    """``new^T old m`` (``new^T m`` from the identity), in the cheaper order: a moment with fewer columns
    than the basis is wide goes through the moment (two products of the moment's size) rather than
    through ``new^T old`` (a product of two bases: on a 512-wide factor of ``configs/small.yaml``, about
    2.5x the work of the moment's two); block-diagonal bases always through the moment, block by block."""
    if old is None:
        return times(new, m, blocks, True)
    n, r = new.shape[0], m.shape[1]
    if r < n or len(blocks) > 1:
        return times(new, times(old, m, blocks), blocks, True)
    return (new.t() @ old) @ m
