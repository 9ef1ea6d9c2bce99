"""Chimera on one device: two stage copies, two pipes, one K-FAC state per copy.

Device ``d`` of a ``D``-stage Chimera job holds stage ``d`` of the down pipe and stage ``D - 1 - d``
of the up pipe (Li & Hoefler, SC'21). Each copy has its own parameters, K-FAC state and saved
micro-batches, and runs its own micro-batches through its own :class:`PipelineEngine`; the order of
their calls on the device is the simulator's Chimera order (:func:`pipefisher.runtime.engine.device_plan`).

The two copies of a stage (on devices ``s`` and ``D - 1 - s``) stay bit-identical: at ``-- end --``
their gradients are summed over the pair (and averaged over data-parallel replicas), and their
K-FAC factors are averaged over the same group by ``sync_kron`` before they are inverted. Everything
that talks to that group runs in one canonical order on both devices: the copies by stage index.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterator

from torch import nn

from pipefisher.runtime.dist import DistContext
from pipefisher.runtime.engine import PipelineEngine, average_gradients
from pipefisher.sim.schedules import DOWN, UP
from pipefisher.timeline import UP_SUFFIX

Span = Callable[[str], ContextManager[Any]]


def up_span(span: Span | None) -> Span:
    """The profiler's span for the up copy: every key gets the ``:up_pipe`` suffix of the format."""
    if span is None:
        return lambda key: nullcontext()
    return lambda key: span(key + UP_SUFFIX)


class StagePair(nn.Module):
    """The two stage copies of a Chimera device: ``down`` (stage d) and ``up`` (stage D - 1 - d).

    ``order`` lists the pipes in canonical order (:func:`pipefisher.runtime.executor.node_pipes`), the
    same on both devices of the pair: gradient buffers and naive K-FAC follow it.
    """

    def __init__(self, down: nn.Module, up: nn.Module, order: list[int]) -> None:
        super().__init__()
        self.down, self.up, self.order = down, up, order

    def copy(self, pipe: int) -> nn.Module:
        return self.up if pipe == UP else self.down


class KFACPair:
    """The K-FAC states of a device's two stage copies, seen as one by the trainer and the updater."""

    def __init__(self, kfacs: dict[int, Any], order: list[int]) -> None:
        self.kfacs, self.order = kfacs, order

    def __getitem__(self, pipe: int) -> Any:
        return self.kfacs[pipe]

    def _all(self) -> Iterator[Any]:
        return (self.kfacs[p] for p in self.order)

    def set_saving(self, on: bool) -> None:
        for k in self._all():
            k.set_saving(on)

    def update_curvature(self, span: Span | None = None) -> None:
        """Naive K-FAC of both copies, in canonical order (their syncs share one group)."""
        for p in self.order:
            self.kfacs[p].update_curvature(span=up_span(span) if p == UP else span)

    def clear_saved(self) -> None:
        for k in self._all():
            k.clear_saved()

    def settle_all(self) -> None:
        for k in self._all():
            k.settle_all()

    def reset_peak_saved(self) -> None:
        for k in self._all():
            k.reset_peak_saved()

    @property
    def peak_saved_bytes(self) -> int:
        """An upper bound: the two copies' high-water marks added."""
        return sum(k.peak_saved_bytes for k in self._all())

    def precondition_all(self) -> int:
        return sum(k.precondition_all() for k in self._all())

    @property
    def grad_dot_step(self) -> float:
        return sum(k.grad_dot_step for k in self._all())

    def scale_step(self, nu: float) -> None:
        for k in self._all():
            k.scale_step(nu)

    def parameters(self) -> list[nn.Parameter]:
        return [p for k in self._all() for p in k.parameters()]


class ChimeraEngine:
    """The pipeline calls of a Chimera device: each label to its pipe's engine, and the step's ends."""

    def __init__(self, pair: StagePair, ctx: DistContext, engines: dict[int, PipelineEngine]) -> None:
        self.pair, self.ctx, self.engines = pair, ctx, engines
        self.down = engines[DOWN]

    def op(self, label: str) -> Callable[[], None]:
        return self.engines[UP if label.endswith(UP_SUFFIX) else DOWN].op(label)

    def run(self, ops: list[str]) -> None:
        for label in ops:
            self.op(label)()

    def begin_step(self, step: int) -> None:
        for e in self.engines.values():
            e.begin_step(step)

    def finish_step(self) -> float | None:
        """Both pipes' sends waited for; the loss of the micro-batches whose last stage is here."""
        losses = [e.finish_step() for e in self.engines.values()]
        mine = [x for x in losses if x is not None]
        return sum(mine) if mine else None

    def allreduce_gradients(self) -> None:
        average_gradients([self.pair.copy(p) for p in self.pair.order], self.ctx)

    def evaluate(self, batches: list[Any]) -> float | None:
        """Held-out loss through the down pipe (the copies are identical, one pipe is enough)."""
        return self.down.evaluate(batches)
