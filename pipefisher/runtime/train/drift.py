"""One worker's drift samples, from its K-FAC copies to the gathers (see :mod:`pipefisher.drift`).

K-FAC measures a layer's drift inside its refresh's ``inv`` label and keeps the result as tensors.
:meth:`DriftLog.take` files them after every step under that step, still as tensors: reading them would
make the host wait for the device on the step path. They become numbers in :meth:`DriftLog.drain`,
where the runtime gathers anyway (the closed loop's per-cycle gather, a checkpoint, the run's end), all
in one transfer.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from pipefisher.drift import DriftSample


class DriftLog:
    """Drift samples of one worker's K-FAC copies (``kfacs``: copy -> K-FAC; ``stages``: copy -> the
    stage index it holds), not gathered yet. ``node``: this worker's pipeline node."""

    def __init__(self, kfacs: Mapping[int, Any], stages: Mapping[int, int], node: int) -> None:
        self.kfacs, self.stages, self.node = dict(kfacs), dict(stages), node
        self.pending: list[tuple[int, str, Any, Any]] = []  # step, layer, change, norm (tensors or floats)

    def take(self, step: int) -> None:
        """File what the K-FAC copies measured during training step ``step`` (no host sync)."""
        for p, kfac in self.kfacs.items():
            for name, change, norm in kfac.take_drift():
                self.pending.append((step, f"{self.stages[p]}/{name}", change, norm))

    def drain(self) -> list[DriftSample]:
        """Every sample not gathered yet, as numbers (one device-to-host transfer), and forget them."""
        pending, self.pending = self.pending, []
        tensors = [t for _, _, c, n in pending for t in (c, n) if isinstance(t, torch.Tensor)]
        values = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()) if tensors \
            else iter(())

        def num(x: Any) -> float:
            return float(next(values)) if isinstance(x, torch.Tensor) else float(x)
        out = []
        for step, layer, change, norm in pending:
            c = num(change)
            out.append(DriftSample(step, self.node, layer, c, num(norm)))
        return out

    def state_dict(self) -> list[list[Any]]:
        """The samples not gathered yet (a checkpoint can fall in the middle of a cycle), as numbers."""
        samples = self.drain()
        self.pending = [(s.step, s.layer, s.change, s.norm) for s in samples]
        return [s.state() for s in samples]

    def load_state_dict(self, state: list[list[Any]]) -> None:
        self.pending = [(s.step, s.layer, s.change, s.norm) for s in map(DriftSample.from_state, state)]
