"""K-FAC's update of the gradients: ``B^-1 G A^-1`` in place of each layer's gradient (part of ``-- end --``),
and the KL-clip's ``sum <g, F^-1 g>`` and scaling (:func:`pipefisher.kfac.factors.kl_clip_scale` forms
the factor). Under ``kfac.update: soap`` the refreshes hold eigenbases, not inverses: the gradient is left
to :class:`pipefisher.kfac.eigenbasis.EigenbasisAdam`, which reads them through :meth:`Preconditioner.eigenbases`.
"""
from __future__ import annotations

import torch
from torch import nn

from pipefisher.kfac import factors as fx
from pipefisher.kfac.drift_meter import DriftMeter
from pipefisher.kfac.layers import Bases, LayerState
from pipefisher.kfac.refresher import Refresher


class Preconditioner:
    """The preconditioning of one stage's K-FAC layers with what ``refresher`` installed; each gradient it
    preconditions goes to ``drift`` (when it measures), the gradient the next refresh's drift is taken on."""

    def __init__(self, layers: dict[str, LayerState], refresher: Refresher, drift: DriftMeter) -> None:
        self.layers, self.refresher, self.drift = layers, refresher, drift
        self._grad_dot_step: torch.Tensor | float = 0.0  # sum of <g, F^-1 g> (KL-clip), kept on the device

    def precondition(self, name: str) -> bool:
        """Replace the layer's gradient by ``B^-1 grad A^-1``; False (gradient untouched) without inverses.

        ``grad`` is ``(out, in[+1])`` for every layer kind; a transposed weight (``Conv1D``) is read and
        written back through its :class:`pipefisher.kfac.layers.LayerKind`."""
        st = self.layers[name]
        a_inv, b_inv = self.refresher.installed(name, "A"), self.refresher.installed(name, "B")
        w = st.module.weight
        if self.refresher.method == "eigenbasis":  # bases, not inverses: EigenbasisAdam takes the gradient
            return False
        if a_inv is None or b_inv is None or w.grad is None:
            return False
        g = st.grad_matrix()
        p = fx.precondition(g, a_inv, b_inv)
        self._grad_dot_step = self._grad_dot_step + (p * g).sum()  # no host sync per layer
        if self.drift.enabled:  # the next refresh's drift is measured on this gradient (g: a view without bias)
            self.drift.saw(name, g if st.bias else g.clone(), p, self.refresher.inversions(name))
        st.kind.write_grad(w, p[:, :-1] if st.bias else p)
        if st.bias:
            if st.module.bias.grad is None:
                st.module.bias.grad = p[:, -1].clone()
            else:
                st.module.bias.grad.copy_(p[:, -1])
        return True

    def precondition_all(self) -> int:
        """Precondition every layer that has inverses; sets :attr:`grad_dot_step` for the KL-clip."""
        self._grad_dot_step = 0.0
        return sum(self.precondition(n) for n in self.layers)

    @property
    def grad_dot_step(self) -> torch.Tensor:
        """``sum <g, F^-1 g>`` over the layers of the last :meth:`precondition_all` (the KL-clip's), a 0-dim
        float64 tensor on the device (no host sync)."""
        g = self._grad_dot_step
        if isinstance(g, torch.Tensor):
            return g.to(torch.float64)
        return torch.tensor(g, dtype=torch.float64, device=next(iter(self.parameters()), torch.empty(0)).device)

    def scale_step(self, nu: torch.Tensor | float) -> None:
        """Multiply the preconditioned gradients by ``nu`` (the KL-clip factor; a tensor stays on the device)."""
        if not isinstance(nu, torch.Tensor) and nu == 1.0:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, torch.as_tensor(nu, device=grads[0].device))

    def parameters(self) -> list[nn.Parameter]:
        """The parameters K-FAC preconditions (weights and biases of its layers), in layer order."""
        out = []
        for st in self.layers.values():
            out.append(st.module.weight)
            if st.bias:
                out.append(st.module.bias)
        return out

    def eigenbases(self) -> list[Bases]:
        """Per layer, in layer order: the bases the refreshes installed and their refresh counts
        (:class:`pipefisher.kfac.layers.LayerStates`)."""
        return [self.refresher.bases(n) for n in self.layers]
