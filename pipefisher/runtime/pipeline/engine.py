"""The pipeline engine: one forward or backward micro-batch per call, in a generator's order.

``forward()`` and ``backward()`` are exactly the runtime meaning of the ``call_forward`` and
``call_backward`` schedule labels: the next micro-batch, with its point-to-point receive and send.
Zero-bubble orders (ZB-H1, ZB-V) and DualPipeV split the backward: ``call_backward`` is then the B pass
(the input gradient, sent at once; :mod:`pipefisher.runtime.pipeline.split_backward`) and
``call_backward:weight`` the W pass of the oldest micro-batch whose B ran, from the graph kept in between.
DualPipeV's full backwards (a B and its own W, one fused call in torch) run here as that B pass with its
W pass right after it; its overlapped pairs as their forward, then that backward. Each chunk runs its
W passes in micro-batch order in every one of these orders, so "the oldest" is always the right one
(:func:`pipe_micro_batches` refuses an order where it would not be); outputs are sent as each call ends.
The gradients live in persistent flat buckets (:mod:`pipefisher.runtime.pipeline.buckets`): a stage
copy's all-reduce over its replicas starts as its last backward (or W pass) of the step ends, inside its
tail bubble, and :meth:`PipelineEngine.allreduce_gradients` waits for it at the end of the step.
Sends are asynchronous (waited for at the end of the step); receives block, under the process
group's timeout. ``prepost(label)`` posts a call's receives ahead of the call (the executor does it
before K-FAC work in a bubble): with gloo a send completes only once its receive is posted, so a
receive posted late holds the sender; the call then waits on the posted receive, under the same timeout.

The order of those calls on each device comes from the simulator's schedule generators
(:mod:`pipefisher.pipeline_orders`), the one definition of every pipeline order. A Chimera device runs
two pipes, each through its own :class:`PipelineEngine` (see :mod:`pipefisher.runtime.pipeline.copies`).
"""
from __future__ import annotations

import collections
import functools
import time
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pipefisher.pipeline_orders import DOWN, LOOP, PassKind, default_chunks, device_of_stage, generate, stage_on
from pipefisher.runtime.data.batches import MLMData, batch_seed
from pipefisher.runtime.job.config import PIPELINE_ORDERS
from pipefisher.runtime.job.dist import DistContext
from pipefisher.runtime.job.host import HostReads
from pipefisher.runtime.pipeline.buckets import DEFAULT_BUCKET_MB, GradientBuckets
from pipefisher.runtime.pipeline.compute import autocast, wire_dtype
from pipefisher.runtime.pipeline.contracts import EngineDefaults, ForwardCurvature, Span
from pipefisher.runtime.pipeline.labels import BACKWARD, FORWARD, WEIGHT, chunk_suffix, copy_suffix

_TAG_ACT, _TAG_GRAD, _TAG_SAMPLED_GRAD, _TAG_EVAL = 1, 2, 3, 4
_TAG_PIPE_STRIDE = 8  # the up pipe's tags: the same kinds, shifted, so the two pipes never mix
_TAG_CHUNK_STRIDE = 16  # interleaving: a boundary's tags shifted by its receiving chunk, so chunks never mix


def copy_label(kind: str, copy: int, interleaved: bool) -> str:
    """``call_forward`` / ``call_backward`` / ``call_backward:weight`` of a device's stage copy: its
    chunk's (``:chunk<j>``, interleaved and ZB-V) or its pipe's (``:up_pipe``, Chimera); copy 0 keeps
    the plain key."""
    return kind + copy_suffix(copy, interleaved)


def device_plan(kind: str, device: int, devices: int, num_micro_batches: int,
                chunks: int = 2) -> list[tuple[str, int, int]]:
    """``(label, copy, micro-batch)`` for every pipeline call of one device in one step.

    ``copy`` is the pipe (Chimera) or the chunk (interleaved, ``chunks`` per device; ZB-V, two) whose
    stage copy runs the call; zero-bubble orders add a W call (``call_backward:weight``) per B. Taken
    from the simulator's generator of ``kind`` (Chimera with the paper's equal forward and backward
    times), so the trainer, the profiler and the simulator run one and the same order.
    """
    if kind not in PIPELINE_ORDERS:
        raise ValueError(f"unknown pipeline order {kind!r} ({', '.join(PIPELINE_ORDERS)})")
    return list(_plans(kind, devices, num_micro_batches, device_chunks(kind, chunks))[device])


def device_chunks(kind: str, chunks: int = 2) -> int:
    """Model chunks per device of pipeline order ``kind``: ``chunks`` when interleaved, 2 for ZB-V and
    DualPipeV (their V), else 1."""
    return chunks if kind == "interleaved" else default_chunks(kind)


def splits_backward(kind: str) -> bool:
    """Whether pipeline order ``kind`` splits each backward into a B and a W pass (zero-bubble orders and
    DualPipeV), as its generator says (on 2 devices and 4 micro-batches, a shape every order takes)."""
    return generate(kind, 2, 4, device_chunks(kind)).split_backward


@functools.lru_cache(maxsize=64)
def _plans(kind: str, devices: int, num_micro_batches: int,
           chunks: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Every device's plan at once (Chimera's list scheduling orders all devices together)."""
    order = generate(kind, devices, num_micro_batches, chunks)
    inter = order.chunks > 1
    return tuple(tuple((copy_label(PassKind(op.kind).key, op.chunk if inter else op.pipe, inter),
                        op.chunk if inter else op.pipe, op.micro_batch)
                       for op in ops) for ops in order.devices)


def pipeline_ops(kind: str, stage: int, num_stages: int, num_micro_batches: int, chunks: int = 2) -> list[str]:
    """The labels of one device's pipeline calls in one step (:func:`device_plan`).

    GPipe: all forwards, then all backwards. 1F1B: ``num_stages - stage - 1`` warm-up forwards, then
    alternate one forward and one backward, then the remaining backwards. Chimera: both pipes, as
    the simulator's list scheduling orders them. ZB-H1, ZB-V: B passes as ``call_backward``, each with
    its W pass (``call_backward:weight``) where the order defers it.
    """
    return [label for label, _, _ in device_plan(kind, stage, num_stages, num_micro_batches, chunks)]


def pipe_micro_batches(kind: str, device: int, devices: int, num_micro_batches: int,
                       chunks: int = 2) -> dict[int, list[int]]:
    """Per pipe, the micro-batches this device runs, in forward order; refuses a plan whose backwards
    do not follow the forwards' order on a pipe (each engine keeps its in-flight micro-batches FIFO)."""
    out: dict[int, list[int]] = {}
    backs: dict[int, list[int]] = {}
    weights: dict[int, list[int]] = {}
    for label, pipe, mb in device_plan(kind, device, devices, num_micro_batches, chunks):
        which = out if label.startswith(FORWARD) else weights if label.startswith(WEIGHT) else backs
        which.setdefault(pipe, []).append(mb)
    for pipe, order in out.items():
        if backs.get(pipe) != order:
            raise ValueError(f"{kind}: device {device} runs the backwards of pipe {pipe} out of forward order")
        if weights and weights.get(pipe) != order:
            raise ValueError(f"{kind}: device {device} runs the weight passes of pipe {pipe} out of forward order")
    return out


class PipelineEngine(EngineDefaults):
    """Runs one stage's part of each step's pipeline, on one pipe (an
    :class:`~pipefisher.runtime.pipeline.contracts.Engine`).

    ``stage`` is any module keeping the stage protocol (``is_first``, ``is_last``, ``hidden_size``,
    ``forward(x, labels=None, sample=None)``; see :func:`pipefisher.runtime.models.builders.make_stage`).

    The loss of every micro-batch is divided by the number of micro-batches of the step (both pipes
    together under Chimera), so the gradients of a step are those of the mean loss over the step's
    batch (then averaged over replicas).

    ``pipe`` is 0 (down) or 1 (Chimera's up pipe, whose stage ``s`` sits on device ``D - 1 - s``:
    activations flow towards lower ranks); ``micro_batches`` are the step's micro-batch indices this
    pipe runs, in forward order (default: all of them). ``chunk`` makes this engine chunk j of its
    device, virtual stage ``stage_on(d, j, D, layout)`` (:mod:`pipefisher.pipeline_orders`): interleaved
    (``layout`` loop), device 0's chunk j receives from device D-1's chunk j-1 and device D-1's chunk j
    sends to device 0's chunk j+1; in ZB-V's V, device D-1's chunk 0 hands its output to its own chunk 1
    through ``local`` (a :class:`LocalLink` the device's engines share), and chunk 1 flows back towards
    device 0. Every boundary has its own tags; the keys are ``call_forward:chunk<j>`` /
    ``call_backward:chunk<j>`` (plain for chunk 0). ``split`` (zero-bubble orders) splits each backward
    into its B pass and a later W pass (:meth:`weight`). ``precision`` (``train.precision``) is the
    compute dtype of the stage's forwards (autocast) and of what crosses its boundaries
    (:mod:`pipefisher.runtime.pipeline.compute`); ``scaler`` (fp16, a ``LossScale``) is what the last
    stage's backwards start from instead of 1. ``grad_bucket_mb`` bounds each gradient bucket
    (``pipeline.grad_bucket_mb``); a device with several copies shares one set of buckets
    (:meth:`share_buckets`).

    With a true-Fisher ``kfac`` that saves the micro-batch, the last stage also computes the loss
    against labels sampled from its predictions, and every stage runs a second backward of that loss
    (input and layer-output gradients only, no weight gradients) before the real one: its layer-output
    gradients build factor B, and its input gradient travels to the previous stage beside the real one.
    ``host`` counts the held-out losses' reads (:mod:`pipefisher.runtime.job.host`; None: a counter of its own).
    """

    def __init__(self, stage: torch.nn.Module, ctx: DistContext, data: MLMData, num_micro_batches: int,
                 span: Span | None = None, kfac: ForwardCurvature | None = None, *, pipe: int = DOWN,
                 micro_batches: Sequence[int] | None = None, chunk: int | None = None,
                 layout: str = LOOP, split: bool = False, local: "LocalLink | None" = None,
                 precision: str = "fp32", scaler: Any = None, grad_bucket_mb: float = DEFAULT_BUCKET_MB,
                 host: HostReads | None = None) -> None:
        self.stage, self.ctx, self.data = stage, ctx, data
        self.host = host if host is not None else HostReads()
        self.precision, self.scaler = precision, scaler
        self.wire = wire_dtype(precision)  # activations and gradients between stages
        self.split = split
        if split:  # only zero-bubble orders need it (and torch >= 2.4)
            from pipefisher.runtime.pipeline.split_backward import backward_input
            self._backward_input = backward_input
        self.local = local if local is not None else LocalLink()
        self._params = [p for p in stage.parameters() if p.requires_grad]
        self.grad_bucket_mb = grad_bucket_mb
        self.grads = GradientBuckets({0: self._params}, ctx.grad_group, ctx.stage_group_size,
                                     divisor=ctx.grid.replicas, bucket_bytes=int(grad_bucket_mb * 2**20))
        self.grad_copy = 0  # this engine's copy among self.grads'
        self.kfac = kfac
        self.num_micro_batches = num_micro_batches
        self.micro_batches = list(range(num_micro_batches) if micro_batches is None else micro_batches)
        self.pipe, self.chunk = pipe, chunk
        self.span: Span = span or (lambda key: nullcontext())
        g = ctx.grid
        if chunk is None:
            self.forward_key, self.backward_key = copy_label(FORWARD, pipe, False), copy_label(BACKWARD, pipe, False)
            self.weight_key = copy_label(WEIGHT, pipe, False)
            step = 1 if pipe == DOWN else -1  # the up pipe's next stage is the previous device
            self.prev_rank = None if stage.is_first else g.rank - step
            self.next_rank = None if stage.is_last else g.rank + step
            shift = shift_out = _TAG_PIPE_STRIDE * pipe
        else:
            # Chunk j of device d is virtual stage s: it reads from the device holding s - 1 and sends
            # to the one holding s + 1; the boundary into stage s is tagged by the chunk s belongs to.
            D = g.stages
            s = stage_on(g.stage, chunk, D, layout)
            suffix = chunk_suffix(chunk)
            self.forward_key, self.backward_key, self.weight_key = FORWARD + suffix, BACKWARD + suffix, WEIGHT + suffix
            self.prev_rank = None if stage.is_first else g.rank_of(device_of_stage(s - 1, D, layout), g.replica)
            self.next_rank = None if stage.is_last else g.rank_of(device_of_stage(s + 1, D, layout), g.replica)
            shift = _TAG_CHUNK_STRIDE * (s // D)  # tags of the boundary into this copy
            shift_out = _TAG_CHUNK_STRIDE * ((s + 1) // D)  # into the next copy
        self._in, self._out = shift, shift_out  # tag shifts of the boundaries with prev_rank / next_rank
        c, h = data.cfg, stage.hidden_size
        self.act_shape = (c.micro_batch_size, c.seq_len, h)
        self.step = 0
        self._next_fwd = self._next_bwd = self._next_w = 0
        self._stash: collections.deque = collections.deque()
        self._weights: collections.deque[Any] = collections.deque()  # DeferredWeights: B ran, W not yet (split)
        self._sends: list[tuple[Any, torch.Tensor]] = []
        # receives posted ahead of their call (prepost): (src, tag) -> (buffer, irecv work); at most one
        # per (src, tag), the oldest outstanding receive of that pair, so FIFO matching is unchanged
        self._posted: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
        self.posted_ahead = 0  # receives posted by prepost over the engine's life (a diagnostic)
        self.losses: list[torch.Tensor] = []
        self._wait_log: list[Any] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def begin_step(self, step: int) -> None:
        if self._stash or self._sends or self._posted or self._weights:
            raise RuntimeError("begin_step while the previous step still has micro-batches in flight")
        self.step = step
        self._next_fwd = self._next_bwd = self._next_w = 0
        self.losses = []
        self.grads.attach(self.grad_copy)

    def share_buckets(self, grads: GradientBuckets, copy: int) -> None:
        """Keep this engine's gradients in ``grads`` (a device's stage copies together), as copy ``copy``."""
        self.grads, self.grad_copy = grads, copy

    def _last_backward_done(self) -> bool:
        """Whether this step's last backward of this copy (zero-bubble: its last W pass) has run."""
        done = self._next_w if self.split else self._next_bwd
        return done == len(self.micro_batches)

    # -- one label each ------------------------------------------------------------------------------

    def forward(self) -> None:
        """The next forward micro-batch: receive (not first stage), compute, send (not last stage)."""
        if self._next_fwd >= len(self.micro_batches):
            raise RuntimeError(f"{self.forward_key}: all {len(self.micro_batches)} micro-batches already ran forward")
        i = self.micro_batches[self._next_fwd]
        self._next_fwd += 1
        dev = self.ctx.device
        labels = None
        if self.is_first or self.is_last:
            mb = self.data.micro_batch(self.step, self.ctx.grid.replica, i)
            labels = mb.labels.to(dev) if self.is_last else None
        if self.is_first:
            x = mb.input_ids.to(dev)
        else:
            x = self._recv(self.prev_rank, _TAG_ACT + self._in)
            x.requires_grad_(True)
        sampled = None
        # whether this micro-batch's backward runs the true-Fisher backward (kfac.take_forward() not
        # None): it then receives a sampled-label gradient too, which prepost must know beforehand
        two_grads = self.kfac is not None and bool(self.kfac.samples_labels)
        with self.span(self.forward_key):
            with autocast(self.precision, dev):
                if self.is_last and self.kfac is not None and self.kfac.samples_labels:
                    out, sampled = self.stage(x, labels, sample=self._sampling_generator(i))
                    sampled = sampled / self.num_micro_batches
                else:
                    out = self.stage(x, labels)
            if self.is_last:
                out = out / self.num_micro_batches
                self.losses.append(out.detach())
            else:
                self._send(out.detach(), self.next_rank, _TAG_ACT + self._out)
            if self.kfac is not None:
                self.kfac.end_forward()
        self._stash.append((x, out, sampled, two_grads))

    def _sampling_generator(self, index: int) -> torch.Generator:
        """Labels for the true Fisher, a pure function of (seed, step, replica, micro-batch)."""
        seed = batch_seed(self.data.cfg.seed, self.step, self.ctx.grid.replica, index)
        return torch.Generator().manual_seed(seed * 31 + 7)  # a stream apart from the batch's own

    def backward(self) -> None:
        """The next backward micro-batch (oldest first): receive the output gradient, backprop, send."""
        if not self._stash:
            raise RuntimeError(f"{self.backward_key}: no forward micro-batch is waiting for its backward")
        self._next_bwd += 1
        x, out, sampled, _ = self._stash.popleft()
        outputs = self.kfac.take_forward() if self.kfac is not None else None
        # receives in the order the next stage sends: the sampled-label gradient first (backends that
        # match by order alone, NCCL, would otherwise swap the two), then the real one
        seed_grad = grad = None
        if not self.is_last:
            if outputs is not None:
                seed_grad = self._recv(self.next_rank, _TAG_SAMPLED_GRAD + self._out)
            grad = self._recv(self.next_rank, _TAG_GRAD + self._out).to(out.dtype)
        elif self.scaler is not None:
            grad = self.scaler.root(out)
        with self.span(self.backward_key):
            if outputs is not None:
                self._sampled_backward(x, out, sampled, outputs, seed_grad)
            if self.split:  # the B pass: the input gradient now, the weight gradients at the W label
                grads, deferred = self._backward_input([out], [grad], [] if self.is_first else [x], self._params)
                self._weights.append(deferred)
                gx = grads[0] if grads else None
            else:
                out.backward(grad)
                gx = None if self.is_first else x.grad
            if not self.is_first:
                self._send(gx if gx is not None else torch.zeros_like(x), self.prev_rank, _TAG_GRAD + self._in)
        if self._last_backward_done():  # the copy's gradients are final: all-reduce them in its tail bubble
            self.grads.ready(self.grad_copy)

    def weight(self) -> None:
        """The next W pass (oldest B pass first): that micro-batch's weight gradients, added into
        ``.grad``; no communication (zero-bubble orders only)."""
        if not self._weights:
            raise RuntimeError(f"{self.weight_key}: no B pass is waiting for its weight pass")
        deferred = self._weights.popleft()
        self._next_w += 1
        with self.span(self.weight_key):
            deferred.run()
        if self._last_backward_done():
            self.grads.ready(self.grad_copy)

    def _sampled_backward(self, x: torch.Tensor, out: torch.Tensor, sampled: torch.Tensor | None,
                          outputs: list[tuple[Any, torch.Tensor]], seed_grad: torch.Tensor | None) -> None:
        """True Fisher: gradients of the sampled-label loss w.r.t. the K-FAC layers' outputs (and x);
        ``seed_grad`` is the next stage's sampled-label gradient (None on the last stage)."""
        if self.is_last:
            assert sampled is not None, "the last stage sampled no labels for a saved micro-batch"
            root = sampled
            seed_grad = None if self.scaler is None else self.scaler.root(sampled)
        else:
            assert seed_grad is not None
            root, seed_grad = out, seed_grad.to(out.dtype)
        targets = [o for _, o in outputs] + ([] if self.is_first else [x])
        if not targets:
            return
        grads = torch.autograd.grad(root, targets, grad_outputs=seed_grad, retain_graph=True, allow_unused=True)
        self.kfac.save_outgrads(outputs, grads[:len(outputs)])
        if not self.is_first:
            gx = grads[-1] if grads[-1] is not None else torch.zeros_like(x)
            self._send(gx, self.prev_rank, _TAG_SAMPLED_GRAD + self._in)

    def receives(self, label: str) -> list[tuple[int, int]]:
        """``(src, tag)`` of every receive the call ``label`` would post if it ran now, in its order:
        a forward's activation, a backward's sampled-label (true Fisher) then real output gradient;
        none on the first stage's forwards, the last stage's backwards, a weight pass, or a call that
        cannot run."""
        self.op(label)  # refuses a label of another pipe or chunk
        if label == self.weight_key:
            return []
        if label == self.forward_key:
            if self.is_first or self._next_fwd >= len(self.micro_batches):
                return []
            assert self.prev_rank is not None
            return [(self.prev_rank, _TAG_ACT + self._in)]
        if self.is_last or not self._stash:
            return []
        assert self.next_rank is not None
        two_grads = self._stash[0][3]
        return ([(self.next_rank, _TAG_SAMPLED_GRAD + self._out)] if two_grads else []) + \
            [(self.next_rank, _TAG_GRAD + self._out)]

    def prepost(self, label: str) -> int:
        """Post now, as irecvs, the receives the call ``label`` will make; returns how many it posted.

        With gloo a send completes only once its receive is posted: a receive posted late (after
        K-FAC work in a bubble) holds the sender, then still pays the transfer. Each receive goes into
        the buffer the call will use and is the one the call would post (same peer, tag, shape, dtype,
        group); the call waits on it instead of posting its own. Messages between two ranks keep
        their order: a pair (src, tag) is matched first in, first out, and only the oldest receive of a
        pair is ever posted ahead (a pair already posted is left alone). Nothing to receive: a no-op.
        """
        n = 0
        for key in self.receives(label):
            if key in self._posted or key[0] == self.ctx.grid.rank:  # a hand-off on this device: no wait
                continue
            src, tag = key
            buf = torch.empty(self.act_shape, device=self.ctx.device, dtype=self.wire)
            self._posted[key] = (buf, dist.irecv(buf, src, tag=tag))
            n += 1
        self.posted_ahead += n
        return n

    def drop_preposted(self) -> int:
        """Forget every receive posted ahead and not taken (a failed step); returns how many.

        torch offers no cancel of a posted receive; the handles are released (gloo then drops the
        receive), and the step cannot go on: the run is failing, its process group goes down with it.
        """
        n = len(self._posted)
        self._posted.clear()
        return n

    def op(self, label: str) -> Callable[[], None]:
        """The call a ``call_forward`` / ``call_backward`` label stands for on this engine."""
        if label == self.forward_key:
            return self.forward
        if label == self.backward_key:
            return self.backward
        if label == self.weight_key and self.split:
            return self.weight
        raise ValueError(f"label {label!r} is not a pipeline call of this engine's pipe"
                         + (" (weight passes need a zero-bubble pipeline order)" if label == self.weight_key else ""))

    def run(self, ops: Sequence[str]) -> None:
        for label in ops:
            self.op(label)()

    def finish_step(self) -> torch.Tensor | None:
        """Wait for outstanding sends; the step's loss (sum of micro-batch losses) on the last stage, as a
        0-dim tensor on the device (reading it would make the host wait: :mod:`pipefisher.runtime.job.host`)."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        if self._posted:
            left = sorted(self._posted)
            self.drop_preposted()
            raise RuntimeError(f"receive(s) posted ahead but taken by no call of the step: (src, tag) {left}")
        if self._stash:
            raise RuntimeError(f"{len(self._stash)} micro-batches ran forward but not backward")
        if self._weights:
            n = len(self._weights)
            self._weights.clear()
            raise RuntimeError(f"{n} micro-batches ran their B pass but not their weight pass")
        return sum(self.losses) if self.is_last else None  # type: ignore[return-value]

    @torch.no_grad()
    def evaluate(self, batches: list[Any]) -> float | None:
        """Mean loss over held-out micro-batches, forward only through the pipeline (dropout off).

        Every stage of a replica must call it at the same point; the last stage returns the loss,
        averaged over the data-parallel replicas (each evaluates the same batches), the others None.
        Nothing is saved for K-FAC (no gradients are enabled).
        """
        total = sum(self.evaluate_batch(mb) for mb in batches)
        return self.replica_mean(total / len(batches)) if self.is_last and batches else None

    @torch.no_grad()
    def evaluate_batch(self, mb: Any) -> float:
        """One held-out micro-batch through this copy (dropout off): its loss on the last stage, else 0."""
        if self._stash or self._sends or self._posted or self._weights:
            raise RuntimeError("evaluate while a training step still has micro-batches in flight")
        was_training = self.stage.training
        self.stage.eval()
        dev = self.ctx.device
        try:
            x = mb.input_ids.to(dev) if self.is_first else self._recv(self.prev_rank, _TAG_EVAL + self._in)
            with autocast(self.precision, dev):
                out = self.stage(x, mb.labels.to(dev) if self.is_last else None)
            if self.is_last:
                return self.host.value(out)
            out = out.to(self.wire)
            if self.next_rank == self.ctx.grid.rank:
                self.local.put(_TAG_EVAL + self._out, out)
            else:
                dist.send(out.contiguous(), self.next_rank, tag=_TAG_EVAL + self._out)
            return 0.0
        finally:
            self.stage.train(was_training)

    def replica_mean(self, value: float) -> float:
        """``value`` averaged over the data-parallel replicas of this stage."""
        grid = self.ctx.grid
        if grid.replicas == 1:
            return value
        loss = torch.tensor([value], device=self.ctx.device)
        dist.all_reduce(loss, group=self.ctx.dp_group)
        return self.host.value(loss / grid.replicas)

    def allreduce_gradients(self) -> None:
        """Gradients averaged over the stage's data-parallel group: waits for the buckets' all-reduces
        started at the copy's last backward (starts any not started yet)."""
        self.grads.finish()

    # -- point to point ------------------------------------------------------------------------------

    def _send(self, t: torch.Tensor, dst: int | None, tag: int) -> None:
        assert dst is not None
        t = t.to(self.wire)
        if dst == self.ctx.grid.rank:  # ZB-V's turn: to this device's other chunk
            self.local.put(tag, t)
            return
        t = t.contiguous()
        self._sends.append((dist.isend(t, dst, tag=tag), t))

    def _recv(self, src: int | None, tag: int) -> torch.Tensor:
        """The next message of (src, tag): its receive posted ahead (:meth:`prepost`) waited for, else
        posted and waited for now. Either wait is the call's wait in the wait log."""
        assert src is not None
        if src == self.ctx.grid.rank:
            return self.local.take(tag)
        posted = self._posted.pop((src, tag), None)
        wait: Callable[[], Any]
        if posted is None:
            buf = torch.empty(self.act_shape, device=self.ctx.device, dtype=self.wire)
            wait = functools.partial(dist.recv, buf, src, tag=tag)
        else:
            buf, work = posted
            wait = work.wait  # no timeout argument: the process group's timeout, as dist.recv's
        logged_wait(wait, self._wait_log, self.ctx.device.type == "cuda")
        return buf

    def set_wait_log(self, log: list[Any] | None) -> None:
        """Append every receive's wait (seconds on CPU, a CUDA event pair on GPU) to ``log`` (None: off)."""
        self._wait_log = log



def logged_wait(wait: Callable[[], Any], log: list[Any] | None, cuda: bool) -> None:
    """Run a receive's ``wait``, its time appended to ``log`` (None: untimed): seconds on CPU, a
    CUDA event pair on GPU (read at the end of the step, so the host does not wait here)."""
    if log is None:
        wait()
    elif cuda:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        wait()
        after.record()
        log.append((before, after))
    else:
        t0 = time.perf_counter()
        wait()
        log.append(time.perf_counter() - t0)


class LocalLink:
    """What one stage copy of a device hands another on the same device: ZB-V's turn of the V, where
    device D-1's chunk 0 feeds its own chunk 1 and gets its gradient back. A queue per tag, first in,
    first out, like point-to-point messages; a process group cannot send to its own rank."""

    def __init__(self) -> None:
        self._queues: dict[int, collections.deque] = {}

    def put(self, tag: int, t: torch.Tensor) -> None:
        self._queues.setdefault(tag, collections.deque()).append(t.detach())

    def take(self, tag: int) -> torch.Tensor:
        queue = self._queues.get(tag)
        if not queue:
            raise RuntimeError(f"a stage copy of this device waits for a hand-off (tag {tag}) its other copy "
                               "has not made: the pipeline order runs them out of turn")
        return queue.popleft()
