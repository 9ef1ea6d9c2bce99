"""A device's stage copies: Chimera's two (one per pipe), or the chunks of interleaved 1F1B and ZB-V,
one K-FAC state each; :class:`StageCopiesKFAC` and :class:`StageCopiesEngine` serve every layout.

Device ``d`` of a ``D``-stage Chimera job holds stage ``d`` of the down pipe and stage ``D - 1 - d``
of the up pipe (Li & Hoefler, SC'21). Each copy has its own parameters, K-FAC state and saved
micro-batches, and runs its own micro-batches through its own :class:`PipelineEngine`; the order of
their calls on the device is the simulator's Chimera order (:func:`pipefisher.runtime.pipeline.engine.device_plan`).

The two copies of a stage (on devices ``s`` and ``D - 1 - s``) stay bit-identical: their gradients
are summed over the pair (buckets started in canonical order as each copy's last backward ends, waited
for at ``-- end --``: :mod:`pipefisher.runtime.pipeline.buckets`) (and averaged over data-parallel replicas), and their
K-FAC factors are averaged over the same group by ``sync_kron`` before they are inverted. Everything
that talks to that group runs in one canonical order on both devices: the copies by stage index.

Interleaved 1F1B (and ZB-V) holds ``v`` copies keyed by chunk instead: chunk ``j`` of device ``d`` is
virtual stage ``d + j*D`` (:class:`StageChunks`; ZB-V's chunk 1 is stage ``2D - 1 - d``), with its own
engine, K-FAC state, saved micro-batches and ``:chunk<j>`` profiler keys; the same
:class:`StageCopiesKFAC` and :class:`StageCopiesEngine` route the work by copy id. Each chunk is a
distinct stage, so gradients and factors average over the replicas only.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from pipefisher.pipeline_orders import DOWN, UP
from pipefisher.runtime.job.dist import DistContext
from pipefisher.runtime.pipeline.buckets import GradientBuckets
from pipefisher.runtime.pipeline.contracts import Curvature, EngineDefaults, Span
from pipefisher.runtime.pipeline.engine import PipelineEngine
from pipefisher.runtime.pipeline.labels import copy_suffix, parse_label

if TYPE_CHECKING:
    from pipefisher.kfac.layers import Bases, LayerState


def suffix_span(span: Span | None, suffix: str) -> Span:
    """The profiler's span for one copy: every key gets the copy's suffix (``:up_pipe``, ``:chunk<j>``)."""
    if span is None:
        return lambda key: nullcontext()
    if not suffix:
        return span
    return lambda key: span(key + suffix)


def label_copy(label: str) -> int:
    """The copy a pipeline label runs on: 1 for ``:up_pipe``, j for ``:chunk<j>``, else 0."""
    return parse_label(label).copy


def copy_prefix(chunked: bool, chimera: bool, copy: int) -> str:
    """Where stage copy ``copy`` of a device sits in the state dict of its :class:`StageChunks`
    (``chunks.<j>.``, interleaved and ZB-V) or :class:`StagePair` (``down.`` / ``up.``, Chimera); a
    device with one stage keeps the stage's own names."""
    if chunked:
        return f"chunks.{copy}."
    if chimera:
        return "up." if copy == UP else "down."
    return ""


class StagePair(nn.Module):
    """The two stage copies of a Chimera device: ``down`` (stage d) and ``up`` (stage D - 1 - d).

    ``order`` lists the pipes in canonical order (:func:`pipefisher.runtime.pipeline.layout.node_pipes`), the
    same on both devices of the pair: gradient buffers and naive K-FAC follow it.
    """

    def __init__(self, down: nn.Module, up: nn.Module, order: list[int]) -> None:
        super().__init__()
        self.down, self.up, self.order = down, up, order

    def copy(self, pipe: int) -> nn.Module:
        return self.up if pipe == UP else self.down


class StageChunks(nn.Module):
    """The ``v`` stage copies of an interleaved device, by chunk (chunk j: virtual stage d + j*D)."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.order = list(range(len(chunks)))

    def copy(self, chunk: int) -> nn.Module:
        return self.chunks[chunk]


class StageCopiesKFAC:
    """The K-FAC states of a device's stage copies (Chimera's two pipes, or the chunks of interleaved
    1F1B and ZB-V: ``interleaved``), seen as one by the trainer and the updater (a
    :class:`~pipefisher.runtime.pipeline.contracts.Curvature` made of the copies'); each copy's profiler
    keys carry its label suffix (:func:`pipefisher.runtime.pipeline.labels.copy_suffix`)."""

    def __init__(self, kfacs: Mapping[int, Curvature], order: list[int], interleaved: bool = False) -> None:
        self.kfacs, self.order = kfacs, order
        self.suffixes = {p: copy_suffix(p, interleaved) for p in kfacs}

    def __getitem__(self, copy: int) -> Curvature:
        return self.kfacs[copy]

    def _all(self) -> Iterator[Curvature]:
        return (self.kfacs[p] for p in self.order)

    def set_saving(self, on: bool) -> None:
        for k in self._all():
            k.set_saving(on)

    def update_curvature(self, span: Span | None = None) -> None:
        """Naive K-FAC of every copy, in canonical order (a Chimera pair's syncs share one group)."""
        for p in self.order:
            suffix = self.suffixes.get(p, "")
            self.kfacs[p].update_curvature(span=suffix_span(span, suffix) if suffix else span)

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
        """An upper bound: the copies' high-water marks added."""
        return sum(k.peak_saved_bytes for k in self._all())

    def precondition_all(self) -> int:
        return sum(k.precondition_all() for k in self._all())

    @property
    def grad_dot_step(self) -> torch.Tensor:
        return sum(k.grad_dot_step for k in self._all())  # type: ignore[return-value]

    def scale_step(self, nu: torch.Tensor | float) -> None:
        for k in self._all():
            k.scale_step(nu)

    def layer_states(self) -> list[LayerState]:
        """Every copy's K-FAC layers, copies in canonical order (:class:`pipefisher.kfac.layers.LayerStates`)."""
        return [st for k in self._all() for st in k.layer_states()]

    def eigenbases(self) -> list[Bases]:
        """Every copy's installed bases, in :meth:`layer_states`' order."""
        return [b for k in self._all() for b in k.eigenbases()]

    def on_refresh(self, call: Callable[[LayerState, Bases], None]) -> None:
        """``call(layer, bases)`` after every refresh of a factor of any copy."""
        for k in self._all():
            k.on_refresh(call)

    def parameters(self) -> list[nn.Parameter]:
        return [p for k in self._all() for p in k.parameters()]


class StageCopiesEngine(EngineDefaults):
    """The pipeline calls of a device with several stage copies (Chimera's pipes, the chunks of
    interleaved 1F1B and ZB-V): each label to its copy's engine, and the step's ends (an
    :class:`~pipefisher.runtime.pipeline.contracts.Engine`). The copies' gradients
    share one set of buckets, in canonical order; under Chimera (whose pair runs different labels) they are
    started in that order too."""

    def __init__(self, copies: StagePair | StageChunks, ctx: DistContext, engines: dict[int, PipelineEngine]) -> None:
        self.copies, self.ctx, self.engines = copies, ctx, engines
        self.down = engines[DOWN]
        params = {p: [t for t in copies.copy(p).parameters() if t.requires_grad] for p in copies.order}
        self.grads = GradientBuckets(params, ctx.grad_group, ctx.stage_group_size, divisor=ctx.grid.replicas,
                                     bucket_bytes=int(self.down.grad_bucket_mb * 2**20), ordered=ctx.chimera)
        for p, e in engines.items():
            e.share_buckets(self.grads, p)

    def op(self, label: str) -> Callable[[], None]:
        copy = label_copy(label)
        if copy not in self.engines:
            raise ValueError(f"label {label!r} names a stage copy this device does not hold")
        return self.engines[copy].op(label)

    def run(self, ops: list[str]) -> None:
        for label in ops:
            self.op(label)()

    def prepost(self, label: str) -> int:
        """Post ahead the receives of the call ``label`` on its copy's engine
        (:meth:`PipelineEngine.prepost`); each copy's receives have their own tags."""
        self.op(label)
        return self.engines[label_copy(label)].prepost(label)

    def drop_preposted(self) -> int:
        return sum(e.drop_preposted() for e in self.engines.values())

    @property
    def posted_ahead(self) -> int:
        return sum(e.posted_ahead for e in self.engines.values())

    def begin_step(self, step: int) -> None:
        for e in self.engines.values():
            e.begin_step(step)

    def set_wait_log(self, log: list[Any] | None) -> None:
        """Every copy's receive waits into one log (see :meth:`PipelineEngine.set_wait_log`)."""
        for e in self.engines.values():
            e.set_wait_log(log)

    def finish_step(self) -> torch.Tensor | None:
        """Every copy's sends waited for; the loss of the micro-batches whose last stage is here (a 0-dim
        tensor on the device)."""
        losses = [e.finish_step() for e in self.engines.values()]
        mine = [x.double() for x in losses if x is not None]  # added as the numbers they are
        return sum(mine) if mine else None  # type: ignore[return-value]

    def allreduce_gradients(self) -> None:
        """Every copy's gradients averaged over its replicas (:meth:`PipelineEngine.allreduce_gradients`)."""
        self.grads.finish()

    def evaluate(self, batches: list[Any]) -> float | None:
        """Held-out loss through the down pipe (the copies are identical, one pipe is enough); when
        interleaved, each batch through every chunk in turn (the whole model)."""
        if not isinstance(self.copies, StageChunks):
            return self.down.evaluate(batches)
        engines = [self.engines[j] for j in self.copies.order]
        total = sum(e.evaluate_batch(mb) for mb in batches for e in engines)
        last = engines[-1]
        return last.replica_mean(total / len(batches)) if last.is_last and batches else None
