"""K-FAC's curvature drift: at every refresh of a layer (once both of its factors went through ``inv``), how far
the refresh moves its preconditioned gradient, ``||P_new(G) - P_old(G)||`` against ``||P_new(G)||`` with
``P(G) = B^-1 G A^-1`` and ``G`` the gradient it preconditioned last, and the same against the inverses of
the refresh before (:mod:`pipefisher.loop.drift` turns them into figures).

It follows the refreshes as their :class:`pipefisher.kfac.refresher.RefreshListener`, reads the inverses
through the refresher's public calls, and is handed each preconditioned gradient by the update
(:meth:`DriftMeter.saw`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pipefisher.kfac import factors as fx
from pipefisher.kfac.layers import FACTORS
from pipefisher.kfac.refresher import Refresher


@dataclass
class LayerDrift:
    """What one layer's next drift is measured with: the gradient last preconditioned, its preconditioned
    gradient and the inversion counts of the inverses that made it; the inverses this refresh replaced
    (None: there was none yet), the factors this refresh has been through inv so far (inverted, or kept
    for fp16 / on_bad_factor), and the inverses as they were before the last completed refresh (the drift
    over two refreshes)."""

    last_grad: torch.Tensor | None = None
    last_pre: torch.Tensor | None = None
    pre_versions: tuple[int, int] | None = None
    replaced: dict[str, torch.Tensor | None] = field(default_factory=dict)
    handled: set[str] = field(default_factory=set)
    previous: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})


class DriftMeter:
    """The drift of one stage's K-FAC layers. ``enabled`` False keeps only the bookkeeping of which factors
    a refresh has been through (replicas hold the same gradients and inverses: one measuring suffices)."""

    def __init__(self, names: list[str], enabled: bool) -> None:
        self.enabled = bool(enabled)
        self.state = {n: LayerDrift() for n in names}
        self.refresher: Refresher | None = None  # set by follow()
        self._drift: list[tuple[Any, ...]] = []  # (layer, change^2, change over two refreshes^2, norm^2), not taken

    def follow(self, refresher: Refresher) -> None:
        """Follow ``refresher``'s refreshes (one of its listeners) and read its inverses."""
        self.refresher = refresher
        refresher.listeners.append(self)

    def saw(self, name: str, g: torch.Tensor, pre: torch.Tensor, versions: tuple[int, int]) -> None:
        """The update preconditioned layer ``name``'s gradient ``g`` into ``pre`` with the inverses of
        ``versions`` refreshes: the next refresh's drift is measured on it (called only when
        :attr:`enabled`: ``g`` must be the meter's to keep)."""
        st = self.state[name]
        st.last_grad, st.last_pre, st.pre_versions = g, pre, versions

    def replacing(self, name: str, factor: str, old: torch.Tensor | None) -> None:
        """The inverse the refresh started from (a second inv of the same refresh keeps the first)."""
        st = self.state[name]
        if factor not in st.replaced:
            st.replaced[factor] = old

    def refreshed(self, name: str, factor: str) -> None:
        """``factor`` of layer ``name`` went through ``inv`` (inverted, or kept); once both have, the
        refresh is complete and its drift is measured (:meth:`_measure`)."""
        assert self.refresher is not None
        st = self.state[name]
        st.handled.add(factor)
        if st.handled >= set(FACTORS):
            if st.replaced:  # an inverse changed: a refresh (one that changed none does not count)
                self._measure(name, st)
                if self.enabled:  # the inverses before this refresh, for the next one's two-refresh drift
                    st.previous = {f: st.replaced.get(f, self.refresher.installed(name, f)) for f in FACTORS}
            st.replaced, st.handled = {}, set()

    def _measure(self, name: str, st: LayerDrift) -> None:
        """The refresh's drift of one layer: ``||P_new(G) - P_old(G)||^2``, ``||P_new(G) - P_older(G)||^2``
        and ``||P_new(G)||^2`` (kept as tensors, no host sync: :meth:`take` hands them on).

        ``G`` is the gradient this layer preconditioned last (the previous step's, clipped and, in fp16,
        unscaled): a real gradient of this model at nearly the current weights, the very thing the
        inverses are applied to, and there in a bubble, where the step's own gradient is not yet. The
        same ``G`` on every side: what moves is the curvature alone. ``P_old`` uses the inverses the
        refresh replaced (a factor kept for fp16 overflow or ``on_bad_factor: skip`` counts as
        unchanged): it is the preconditioned gradient of that step itself when that step used exactly
        those inverses, else it is computed; ``P_older`` uses those of the refresh before (None until
        there are some). So a refresh costs one to three preconditionings of a sample of the layer's
        gradient's rows or columns (:data:`pipefisher.kfac.factors.DRIFT_SAMPLE`, squares scaled up to the
        whole), in its inverse's label. Nothing is measured at a layer's first refresh (no old inverse) or before
        its first preconditioning.
        """
        assert self.refresher is not None
        new_a, new_b = self.refresher.installed(name, "A"), self.refresher.installed(name, "B")
        if not (self.enabled and st.last_grad is not None):
            return
        old_a, old_b = st.replaced.get("A", new_a), st.replaced.get("B", new_b)
        if old_a is None or old_b is None or new_a is None or new_b is None:
            return
        g = st.last_grad
        new = fx.sampled_precondition(g, new_a, new_b)  # a sample of the entries (fx.DRIFT_SAMPLE)
        done_a, done_b = self.refresher.inversions(name)
        before = (done_a - ("A" in st.replaced), done_b - ("B" in st.replaced))
        old = fx.sampled(st.last_pre) if st.pre_versions == before and st.last_pre is not None \
            else fx.sampled_precondition(g, old_a, old_b)
        older_a, older_b = st.previous["A"], st.previous["B"]
        older = None if older_a is None or older_b is None else fx.sampled_precondition(g, older_a, older_b)
        change, change2, norm = fx.drift_terms(new, old, older, scale=fx.drift_scale((g.shape[0], g.shape[1])))
        honest = [self.refresher.honest(name, f) for f in st.replaced]
        if all(h is not None for h in honest):  # every inverse it made may have been passed over: then the
            moved = torch.stack(honest).any()  # refresh changed nothing, and is no sample (NaN figures)
            norm = torch.where(moved, norm, torch.full_like(norm, math.nan))
        self._drift.append((name, change, change2, norm))

    def take(self) -> list[tuple[Any, ...]]:
        """The drift measured since the last call, per completed refresh of a layer: ``(layer,
        ||P_new(G) - P_old(G)||^2, ||P_new(G) - P_older(G)||^2 or None, ||P_new(G)||^2)`` as 0-dim tensors
        (read them where the runtime gathers anyway: :class:`pipefisher.runtime.train.drift_log.DriftLog`). A
        refresh whose every new inverse turned out dishonest (passed over on the device, its findings not
        read yet) changed nothing and is no sample: its ``||P_new(G)||^2`` is NaN, and the reader drops it."""
        out, self._drift = self._drift, []
        return out

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Per layer, what the next refresh's drift is measured with (a refresh can be half done)."""
        return {name: {"last_grad": st.last_grad, "last_pre": st.last_pre,
                       "pre_versions": list(st.pre_versions) if st.pre_versions is not None else None,
                       "replaced": dict(st.replaced), "handled": sorted(st.handled), "previous": dict(st.previous)}
                for name, st in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, st in self.state.items():
            s = state[name]
            st.last_grad, st.last_pre = s["last_grad"], s["last_pre"]
            versions = s["pre_versions"]
            st.pre_versions = (int(versions[0]), int(versions[1])) if versions is not None else None
            st.replaced = dict(s["replaced"])
            st.handled = set(s["handled"])
            st.previous = {f: s["previous"].get(f) for f in FACTORS}
