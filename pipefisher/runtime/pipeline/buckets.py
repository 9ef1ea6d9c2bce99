"""A device's gradients in persistent flat buckets, all-reduced in its tail bubble.

Every trainable parameter of a device's stage copies has its ``.grad`` pointed at a view of a flat
bucket before the copy's first backward of a step (:meth:`GradientBuckets.attach`), so autograd and the
zero-bubble W passes add their gradients straight into it: nothing is concatenated or copied back.
The buckets are allocated once, on the first step, and bounded in size (``pipeline.grad_bucket_mb``).
As soon as a copy's last backward of the step ends (zero-bubble orders: its last W pass), its buckets'
all-reduces are started (``async_op=True``, gloo and NCCL alike), so they run in the copy's tail bubble
while the device goes on with the K-FAC work packed there; :meth:`GradientBuckets.finish` waits for
them where the gradients are needed (``-- end --``, before clipping, preconditioning and the optimizer)
and divides them by the data-parallel replica count.

Every member of a group must start the same buckets in the same order. The replicas of one device run
the same labels, so they reach each copy's last backward in the same order, and start its buckets there.
The two devices of a Chimera pair run different labels: their copies' buckets are started in canonical
(stage index) order (``ordered``), on a group of their own (``DistContext.grad_group``), so they never
interleave differently with the pair's K-FAC factor all-reduces on the stage group.

The sum is the one the single flat all-reduce gave, element by element: bit-identical over two members
(a + b either way round); over more, the backend's reduction order, which may move the last bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.runtime.job.config import PipelineConfig

DEFAULT_BUCKET_MB = PipelineConfig.grad_bucket_mb
"""``pipeline.grad_bucket_mb``'s default (25): large enough that a bucket's all-reduce is
bandwidth-bound, small enough that the first ones finish while the others are still on the wire."""

Reduce = Callable[..., Any]  # dist.all_reduce's signature: (tensor, group=..., async_op=True) -> work


def plan_buckets(sizes: Sequence[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices, one list per bucket: a bucket holds one dtype and at most
    ``bucket_bytes`` (a parameter larger than that gets a bucket of its own)."""
    out: list[list[int]] = []
    used, dtype = 0, None
    for i, (numel, dt) in enumerate(sizes):
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        if not out or dt != dtype or used + nbytes > bucket_bytes:
            out.append([])
            used, dtype = 0, dt
        out[-1].append(i)
        used += nbytes
    return out


@dataclass
class Bucket:
    """One flat buffer and the parameters whose ``.grad`` are views of it, in order."""

    flat: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    work: Any = None  # the all-reduce in flight, between start and finish

    @classmethod
    def allocate(cls, params: list[nn.Parameter]) -> "Bucket":
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(flat, params, views)

    def attach(self) -> None:
        """Point every parameter's ``.grad`` at its view: zeros where it had none, its gradient where it
        had another tensor (the optimizer cleared it to None, or someone replaced it)."""
        if all(p.grad is None for p in self.params):
            self.flat.zero_()
            for p, v in zip(self.params, self.views):
                p.grad = v
            return
        for p, v in zip(self.params, self.views):
            g = p.grad
            if g is not None and g.data_ptr() == v.data_ptr():
                continue
            if g is None:
                v.zero_()
            else:
                v.copy_(g)
            p.grad = v

    def detached(self) -> list[str]:
        """Indices of parameters whose ``.grad`` is no longer their view (as strings, for an error)."""
        return [str(i) for i, (p, v) in enumerate(zip(self.params, self.views))
                if p.grad is None or p.grad.data_ptr() != v.data_ptr()]


@dataclass
class GradientBuckets:
    """The buckets of a device's stage copies (``copies``: copy id -> its trainable parameters, in
    canonical order), all-reduced over ``group`` (``members`` ranks, nothing to do with one) and divided
    by ``divisor`` (the data-parallel replica count: under Chimera the group also holds the stage's
    copy on the mirror device, and the two pipes' gradients, each of its own micro-batches already divided
    by the step's micro-batch count, add up to the replica's). ``ordered``: start the copies in canonical order
    (Chimera's pair); otherwise each as it is ready. ``reduce`` is :func:`torch.distributed.all_reduce`
    (a test may record its calls instead)."""

    copies: Mapping[int, Sequence[nn.Parameter]]
    group: Any
    members: int
    divisor: int = 1
    bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20)
    ordered: bool = False
    reduce: Reduce = dist.all_reduce
    started: list[int] = field(default_factory=list)  # copies started this step, in order (a diagnostic)
    _buckets: dict[int, list[Bucket]] = field(default_factory=dict)
    _ready: set[int] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.members > 1

    def buckets(self, copy: int) -> list[Bucket]:
        """Copy ``copy``'s buckets, allocated on first use (the parameters are where they will stay)."""
        if copy not in self._buckets:
            params = [p for p in self.copies[copy] if p.requires_grad]
            plan = plan_buckets([(p.numel(), p.dtype) for p in params], self.bucket_bytes)
            self._buckets[copy] = [Bucket.allocate([params[i] for i in idx]) for idx in plan]
        return self._buckets[copy]

    def attach(self, copy: int) -> None:
        """Before copy ``copy``'s first backward of a step: its gradients into their views."""
        if not self.active:
            return
        if copy in self.started:
            raise RuntimeError("a step begins while the previous step's gradient all-reduce is in flight "
                               "(its end of step, allreduce_gradients, did not run)")
        for b in self.buckets(copy):
            b.attach()

    def ready(self, copy: int) -> None:
        """Copy ``copy``'s last backward of the step has ended: start its buckets' all-reduces (in
        canonical order when ``ordered``: with every copy before it that is ready)."""
        if not self.active:
            return
        self._ready.add(copy)
        if not self.ordered:
            self._start(copy)
            return
        for c in self.copies:
            if c in self.started:
                continue
            if c not in self._ready:
                break
            self._start(c)

    def _start(self, copy: int) -> None:
        for b in self.buckets(copy):
            b.attach()  # a gradient replaced since the step began goes back into its view
            b.work = self.reduce(b.flat, group=self.group, async_op=True)
        self.started.append(copy)

    def finish(self) -> None:
        """Start every copy not yet started (canonical order), wait for every bucket, divide by the
        replica count: each parameter's ``.grad`` is then the gradient averaged over the replicas."""
        if not self.active:
            return
        for c in self.copies:
            if c not in self.started:
                self._start(c)
        for c in self.started:
            for b in self._buckets[c]:
                b.work.wait()
                b.work = None
                lost = b.detached()
                if lost:
                    raise RuntimeError(f"stage copy {c}: the gradients of parameters {', '.join(lost)} of a bucket "
                                       "were replaced while its all-reduce was in flight")
                if self.divisor > 1:
                    b.flat /= self.divisor
        self.started, self._ready = [], set()

    def storage(self) -> list[int]:
        """The data pointers of every allocated bucket (a test checks they stay put across steps)."""
        return [b.flat.data_ptr() for c in sorted(self._buckets) for b in self._buckets[c]]
