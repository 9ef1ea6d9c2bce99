"""One worker's drift samples (:class:`pipefisher.runtime.train.drift_log.DriftLog`): filed per step as the
K-FAC copies measured them, read as numbers only when drained, each with its distances to the layer's two
refreshes before, and kept whole through a checkpoint."""
from __future__ import annotations

import torch

from pipefisher.loop.drift import DriftSample
from pipefisher.runtime.train.drift_log import DriftLog


class _Measured:
    """A K-FAC copy's :meth:`take_drift`: the next measurements handed over once."""

    def __init__(self) -> None:
        self.next: list[tuple] = []

    def take_drift(self) -> list[tuple]:
        out, self.next = self.next, []
        return out


def _refresh(kfac: _Measured, change: float, change2: float | None) -> None:
    kfac.next = [("fc", torch.tensor(change), None if change2 is None else torch.tensor(change2), torch.tensor(4.0))]


def test_samples_are_filed_per_step_with_their_lags_and_drained_as_numbers():
    down, up = _Measured(), _Measured()
    log = DriftLog({0: down, 1: up}, {0: 0, 1: 1}, node=0)  # a Chimera pair: stages 0 and 1 on node 0
    for step in (4, 8, 12):
        _refresh(down, 1.0, None if step < 12 else 2.0)
        if step == 8:
            _refresh(up, 3.0, None)
        log.take(step)
        assert all(isinstance(x, torch.Tensor) for entry in log.pending for x in entry[2:3])  # nothing read yet
    samples = log.drain()
    assert samples == [DriftSample(4, 0, "0/fc", 1.0, None, 4.0, None), DriftSample(8, 0, "0/fc", 1.0, None, 4.0, None),
                       DriftSample(8, 0, "1/fc", 3.0, None, 4.0, None), DriftSample(12, 0, "0/fc", 1.0, 2.0, 4.0, (4, 8))]
    assert log.drain() == []


def test_a_checkpoint_keeps_what_is_not_gathered_and_when_each_layer_was_refreshed():
    kfac = _Measured()
    log = DriftLog({0: kfac}, {0: 0}, node=0)
    for step in (3, 6):
        _refresh(kfac, 1.0, None)
        log.take(step)
    restored = DriftLog({0: kfac}, {0: 0}, node=0)
    restored.load_state_dict(log.state_dict())
    for each in (log, restored):
        _refresh(kfac, 1.0, 2.0)
        each.take(9)
    assert restored.drain() == log.drain() and log.drain() == []
