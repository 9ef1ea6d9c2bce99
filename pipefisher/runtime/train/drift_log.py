"""One worker's drift samples, from its K-FAC copies to the gathers (see :mod:`pipefisher.loop.drift`).

K-FAC measures a layer's drift inside its refresh's ``inv`` label and keeps the result as tensors.
:meth:`DriftLog.take` files them after every step under that step, still as tensors: reading them would
make the host wait for the device on the step path. They become numbers in :meth:`DriftLog.drain`,
where the runtime gathers anyway (the closed loop's per-cycle gather, a checkpoint, the run's end), all
in one transfer.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from pipefisher.kfac import KFAC
from pipefisher.loop.drift import DriftSample
from pipefisher.runtime.job.host import HostReads


_LATER = object()  # a sample's lags, known when its figures are read


class DriftLog:
    """Drift samples of one worker's K-FAC copies (``kfacs``: copy -> K-FAC; ``stages``: copy -> the
    stage index it holds), not gathered yet. ``node``: this worker's pipeline node; ``host``: the
    worker's counter, which reads them (None: a counter of its own)."""

    def __init__(self, kfacs: Mapping[int, KFAC], stages: Mapping[int, int], node: int,
                 host: HostReads | None = None) -> None:
        self.kfacs, self.stages, self.node = dict(kfacs), dict(stages), node
        self.host = host if host is not None else HostReads()
        self.pending: list[tuple[Any, ...]] = []  # step, layer, change, change2, norm (tensors, floats or None)
        self.refreshed: dict[str, list[int]] = {}  # layer -> the steps of its last two refreshes measured

    def take(self, step: int) -> None:
        """File what the K-FAC copies measured during training step ``step`` (no host sync; the lags are
        known once the figures are read: a sample whose figures say it is none takes no place in them)."""
        for p, kfac in self.kfacs.items():
            for name, change, change2, norm in kfac.take_drift():
                self.pending.append((step, f"{self.stages[p]}/{name}", change, change2, norm, _LATER))

    def _lags(self, layer: str, step: int) -> tuple[int, int] | None:
        """Steps from the layer's two refreshes before to this one (None until both are known)."""
        before = self.refreshed.get(layer, [])
        self.refreshed[layer] = (before + [step])[-2:]
        return (step - before[-1], step - before[-2]) if len(before) == 2 else None

    def drain(self) -> list[DriftSample]:
        """Every sample not gathered yet, as numbers (one device-to-host transfer), and forget them."""
        pending, self.pending = self.pending, []
        tensors = [t for entry in pending for t in entry[2:] if isinstance(t, torch.Tensor)]
        values = iter(self.host.values(torch.stack([t.detach().float().reshape(()) for t in tensors]))) if tensors \
            else iter(())

        def num(x: Any) -> float | None:  # in the order the tensors were stacked
            return float(next(values)) if isinstance(x, torch.Tensor) else None if x is None else float(x)
        out = []
        for step, layer, change, change2, norm, lags in pending:
            c, c2, n = num(change), num(change2), num(norm)
            assert c is not None and n is not None
            if math.isnan(n):  # K-FAC's mark of a refresh that changed nothing after all: no sample
                continue
            out.append(DriftSample(step, self.node, layer, c, c2, n,
                                   self._lags(layer, step) if lags is _LATER else lags))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The samples not gathered yet (a checkpoint can fall in the middle of a cycle), as numbers, and
        when each layer was refreshed last."""
        samples = self.drain()
        self.pending = [(s.step, s.layer, s.change, s.change2, s.norm, s.lags) for s in samples]
        return {"pending": [s.state() for s in samples], "refreshed": {k: list(v) for k, v in self.refreshed.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = [(s.step, s.layer, s.change, s.change2, s.norm, s.lags)
                        for s in map(DriftSample.from_state, state.get("pending", []))]
        self.refreshed = {str(k): [int(x) for x in v] for k, v in state.get("refreshed", {}).items()}
