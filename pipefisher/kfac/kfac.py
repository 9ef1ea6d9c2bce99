"""K-FAC state for the ``nn.Linear`` layers of one pipeline stage, one call per piece of work.

The calls map one to one onto schedule labels (see the timeline-and-schedule spec):

- :meth:`KFAC.set_saving` - ``turn_on/off_save_inputs_outgrads``
- :meth:`KFAC.cov` - ``cov_kron_A:<m>`` / ``cov_kron_B:<m>``: add the OLDEST saved micro-batch
- :meth:`KFAC.sync` - ``sync_kron_X:<m>``: average the factor over the data-parallel group
- :meth:`KFAC.inv` - ``inv_kron_X:<m>``: damped inverse, then clear the factor
- :meth:`KFAC.precondition` - part of ``-- end --``: ``B^-1 grad A^-1``

A factor is kept as a running mean of its micro-batch contributions, so it does not matter how the
covariance pieces are spread over time.
"""
from __future__ import annotations

import collections
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.kfac import factors as fx

FACTORS = ("A", "B")
DEFAULT_IGNORE = ("embeddings", "LayerNorm", "cls")


def is_ignored(name: str, ignore: Iterable[str]) -> bool:
    """A module is ignored when a pattern equals one of its dotted name parts or a prefix of its name."""
    parts = name.split(".")
    return any(p in parts or name == p or name.startswith(p + ".") for p in ignore)


def kfac_modules(model: nn.Module, ignore: Iterable[str] = DEFAULT_IGNORE) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules of ``model`` that K-FAC handles, by qualified name, in model order."""
    ignore = tuple(ignore)
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_ignored(n, ignore)}


@dataclass
class LayerState:
    module: nn.Linear
    inputs: collections.deque = field(default_factory=collections.deque)
    outgrads: collections.deque = field(default_factory=collections.deque)
    sums: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    counts: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    inverses: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    last_scale: dict[str, float | None] = field(default_factory=lambda: {"A": None, "B": None})
    last_pi: float | None = None

    @property
    def bias(self) -> bool:
        return self.module.bias is not None

    def factor(self, f: str) -> torch.Tensor | None:
        s = self.sums[f]
        return None if s is None else s / self.counts[f]


class KFAC:
    """K-FAC for one stage (one data-parallel replica of it).

    ``loss_scale`` is the number each micro-batch's mean loss was divided by (the number of
    micro-batches per step), so factor B is built from per-row gradients. ``dp_group`` is the stage's
    data-parallel process group (``None``: no data parallelism).
    """

    def __init__(self, model: nn.Module, *, damping: float = 1e-3, ignore: Iterable[str] = DEFAULT_IGNORE,
                 loss_scale: float = 1.0, dp_group: Any = None, dp_size: int = 1) -> None:
        self.damping = float(damping)
        self.loss_scale = float(loss_scale)
        self.dp_group, self.dp_size = dp_group, int(dp_size)
        self.layers = {n: LayerState(m) for n, m in kfac_modules(model, ignore).items()}
        self.saving = False
        self._handles = [self._hook(st) for st in self.layers.values()]

    # -- saving inputs and output gradients -------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self.layers)

    def set_saving(self, on: bool) -> None:
        """Start or stop saving layer inputs (forward) and output gradients (backward)."""
        self.saving = bool(on)

    def _hook(self, st: LayerState) -> Any:
        def on_forward(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if not (self.saving and torch.is_grad_enabled()):
                return
            st.inputs.append(inputs[0].detach().reshape(-1, inputs[0].shape[-1]))
            if out.requires_grad:
                out.register_hook(lambda g: st.outgrads.append(g.detach().reshape(-1, g.shape[-1])))

        return st.module.register_forward_hook(on_forward)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def pending(self, factor: str, name: str) -> int:
        """Saved micro-batches not yet added into ``factor`` of layer ``name``."""
        st = self.layers[name]
        return len(st.inputs if factor == "A" else st.outgrads)

    def clear_saved(self) -> None:
        for st in self.layers.values():
            st.inputs.clear()
            st.outgrads.clear()

    # -- the per-label work -------------------------------------------------------------------------

    def cov(self, factor: str, name: str) -> bool:
        """Add the oldest saved micro-batch of layer ``name`` into ``factor``; False if none is saved."""
        st = self.layers[name]
        queue = st.inputs if _check(factor) == "A" else st.outgrads
        if not queue:
            return False
        x = queue.popleft()
        contrib = fx.cov_a(x, st.bias) if factor == "A" else fx.cov_b(x, self.loss_scale)
        st.sums[factor] = contrib if st.sums[factor] is None else st.sums[factor] + contrib
        st.counts[factor] += 1
        return True

    def cov_all(self, factor: str, name: str) -> int:
        """Add every saved micro-batch into ``factor``; returns how many."""
        n = 0
        while self.cov(factor, name):
            n += 1
        return n

    def sync(self, factor: str, name: str) -> None:
        """Average ``factor`` of layer ``name`` over the data-parallel group (no-op without one)."""
        st = self.layers[name]
        f = st.factor(_check(factor))
        if f is None:
            raise RuntimeError(f"sync_kron_{factor}:{name}: factor {factor} has no covariance yet")
        if self.dp_size > 1:
            f = f.contiguous()
            dist.all_reduce(f, group=self.dp_group)
            f /= self.dp_size
        st.sums[factor], st.counts[factor] = f, 1

    def pi(self, name: str) -> float:
        """The pi damping split of layer ``name`` from the scales of BOTH factors.

        A factor that still holds covariance gives its current scale; one already inverted (and so
        cleared) this cycle gives the scale it had just before it was cleared.
        """
        st = self.layers[name]
        scales = []
        for f in FACTORS:
            cur = st.factor(f)
            scales.append(fx.mean_trace(cur) if cur is not None else st.last_scale[f])
        return fx.pi_split(*scales)

    def inv(self, factor: str, name: str) -> None:
        """Recompute the damped inverse of ``factor`` of layer ``name``, then clear the factor."""
        st = self.layers[name]
        f = st.factor(_check(factor))
        if f is None:
            raise RuntimeError(f"inv_kron_{factor}:{name}: factor {factor} has no covariance to invert")
        pi = self.pi(name)  # before clearing: uses this factor's scale and the other's
        st.last_pi = pi
        damp_a, damp_b = fx.damping_terms(self.damping, pi)
        st.inverses[factor] = fx.damped_inverse(f, damp_a if factor == "A" else damp_b)
        st.last_scale[factor] = fx.mean_trace(f)
        st.sums[factor], st.counts[factor] = None, 0

    def precondition(self, name: str) -> bool:
        """Replace the layer's gradient by ``B^-1 grad A^-1``; False (gradient untouched) without inverses."""
        st = self.layers[name]
        a_inv, b_inv = st.inverses["A"], st.inverses["B"]
        w = st.module.weight
        if a_inv is None or b_inv is None or w.grad is None:
            return False
        g = w.grad.reshape(w.shape[0], -1)
        if st.bias:
            b = st.module.bias
            bg = b.grad if b.grad is not None else torch.zeros_like(b)
            g = torch.cat([g, bg[:, None]], dim=1)
        p = fx.precondition(g, a_inv, b_inv)
        if st.bias:
            w.grad.copy_(p[:, :-1].reshape(w.shape))
            if st.module.bias.grad is None:
                st.module.bias.grad = p[:, -1].clone()
            else:
                st.module.bias.grad.copy_(p[:, -1])
        else:
            w.grad.copy_(p.reshape(w.shape))
        return True

    def precondition_all(self) -> int:
        return sum(self.precondition(n) for n in self.layers)

    # -- conveniences ----------------------------------------------------------------------------

    def factor(self, name: str, factor: str) -> torch.Tensor | None:
        """The current factor (running mean of its contributions), or None when cleared."""
        return self.layers[name].factor(_check(factor))

    def inverse(self, name: str, factor: str) -> torch.Tensor | None:
        return self.layers[name].inverses[_check(factor)]

    def update_curvature(self, span: Callable[[str], ContextManager[Any]] | None = None) -> None:
        """Naive K-FAC for every layer: all covariance, then sync, then both inverses.

        ``span(key)`` wraps each piece (a profiler uses it); keys are the timeline keys.
        """
        span = span or (lambda key: nullcontext())
        for name in self.layers:
            for f in FACTORS:
                with span(f"cov_kron_{f}:{name}"):
                    self.cov_all(f, name)
        if self.dp_size > 1:
            for name in self.layers:
                for f in FACTORS:
                    with span(f"sync_kron_{f}:{name}"):
                        self.sync(f, name)
        for name in self.layers:
            for f in FACTORS:
                with span(f"inv_kron_{f}:{name}"):
                    self.inv(f, name)

    def apply_label(self, label: str) -> bool:
        """Run one K-FAC schedule label (``cov_kron_A:<m>``, ``turn_off_save_inputs_outgrads``, ...).

        Returns False for labels that are not K-FAC work (pipeline calls, markers).
        """
        if label == "turn_on_save_inputs_outgrads":
            self.set_saving(True)
            return True
        if label == "turn_off_save_inputs_outgrads":
            self.set_saving(False)
            return True
        kind, _, name = label.partition(":")
        work = {"cov_kron": self.cov, "sync_kron": self.sync, "inv_kron": self.inv}.get(kind[:-2])
        if work is None or kind[-2:] not in ("_A", "_B"):
            return False
        if name not in self.layers:
            raise KeyError(f"{label}: this stage has no K-FAC layer named {name!r}")
        work(kind[-1], name)
        return True


def _check(factor: str) -> str:
    if factor not in FACTORS:
        raise ValueError(f"factor must be 'A' or 'B', not {factor!r}")
    return factor
