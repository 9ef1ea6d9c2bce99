"""The pipeline executor: one forward or backward micro-batch per call, GPipe or 1F1B order.

``forward()`` and ``backward()`` are exactly the runtime meaning of the ``call_forward`` and
``call_backward`` schedule labels: the next micro-batch, with its point-to-point receive and send.
Sends are asynchronous (waited for at the end of the step); receives block, under the process
group's timeout.
"""
from __future__ import annotations

import collections
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from pipefisher.runtime.data import MLMData, batch_seed
from pipefisher.runtime.dist import DistContext
from pipefisher.runtime.model import PipelineStage

FORWARD, BACKWARD = "call_forward", "call_backward"
_TAG_ACT, _TAG_GRAD, _TAG_SAMPLED_GRAD, _TAG_EVAL = 1, 2, 3, 4
Span = Callable[[str], ContextManager[Any]]


def pipeline_ops(kind: str, stage: int, num_stages: int, num_micro_batches: int) -> list[str]:
    """The order of forward and backward calls of one stage in one step.

    GPipe: all forwards, then all backwards. 1F1B: ``num_stages - stage - 1`` warm-up forwards, then
    alternate one forward and one backward, then the remaining backwards.
    """
    m = num_micro_batches
    if kind == "gpipe":
        return [FORWARD] * m + [BACKWARD] * m
    if kind == "1f1b":
        warm = min(num_stages - stage - 1, m)
        return [FORWARD] * warm + [FORWARD, BACKWARD] * (m - warm) + [BACKWARD] * warm
    raise ValueError(f"unknown pipeline schedule {kind!r} (gpipe or 1f1b)")


class PipelineEngine:
    """Runs one stage's part of each step's pipeline.

    The loss of every micro-batch is divided by the number of micro-batches, so the gradients of a
    step are those of the mean loss over the step's batch (then averaged over replicas).

    With a true-Fisher ``kfac`` that saves the micro-batch, the last stage also computes the loss
    against labels sampled from its predictions, and every stage runs a second backward of that loss
    (input and layer-output gradients only, no weight gradients) before the real one: its layer-output
    gradients build factor B, and its input gradient travels to the previous stage beside the real one.
    """

    def __init__(self, stage: PipelineStage, ctx: DistContext, data: MLMData, num_micro_batches: int,
                 span: Span | None = None, kfac: Any = None) -> None:
        self.stage, self.ctx, self.data = stage, ctx, data
        self.kfac = kfac
        self.num_micro_batches = num_micro_batches
        self.span: Span = span or (lambda key: nullcontext())
        c, h = data.cfg, stage.hidden_size
        self.act_shape = (c.micro_batch_size, c.seq_len, h)
        self.step = 0
        self._next_fwd = self._next_bwd = 0
        self._stash: collections.deque = collections.deque()
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def begin_step(self, step: int) -> None:
        if self._stash or self._sends:
            raise RuntimeError("begin_step while the previous step still has micro-batches in flight")
        self.step = step
        self._next_fwd = self._next_bwd = 0
        self.losses = []

    # -- one label each ------------------------------------------------------------------------------

    def forward(self) -> None:
        """The next forward micro-batch: receive (not first stage), compute, send (not last stage)."""
        i = self._next_fwd
        if i >= self.num_micro_batches:
            raise RuntimeError(f"call_forward: all {self.num_micro_batches} micro-batches already ran forward")
        self._next_fwd += 1
        dev = self.ctx.device
        labels = None
        if self.is_first or self.is_last:
            mb = self.data.micro_batch(self.step, self.ctx.grid.replica, i)
            labels = mb.labels.to(dev) if self.is_last else None
        if self.is_first:
            x = mb.input_ids.to(dev)
        else:
            x = self._recv(self.ctx.grid.prev_rank, _TAG_ACT)
            x.requires_grad_(True)
        sampled = None
        with self.span(FORWARD):
            if self.is_last and self.kfac is not None and self.kfac.samples_labels:
                out, sampled = self.stage(x, labels, sample=self._sampling_generator(i))
                sampled = sampled / self.num_micro_batches
            else:
                out = self.stage(x, labels)
            if self.is_last:
                out = out / self.num_micro_batches
                self.losses.append(out.detach())
            else:
                self._send(out.detach(), self.ctx.grid.next_rank, _TAG_ACT)
            if self.kfac is not None:
                self.kfac.end_forward()
        self._stash.append((x, out, sampled))

    def _sampling_generator(self, index: int) -> torch.Generator:
        """Labels for the true Fisher, a pure function of (seed, step, replica, micro-batch)."""
        seed = batch_seed(self.data.cfg.seed, self.step, self.ctx.grid.replica, index)
        return torch.Generator().manual_seed(seed * 31 + 7)  # a stream apart from the batch's own

    def backward(self) -> None:
        """The next backward micro-batch (oldest first): receive the output gradient, backprop, send."""
        if not self._stash:
            raise RuntimeError("call_backward: no forward micro-batch is waiting for its backward")
        self._next_bwd += 1
        x, out, sampled = self._stash.popleft()
        grad = None if self.is_last else self._recv(self.ctx.grid.next_rank, _TAG_GRAD)
        outputs = self.kfac.take_forward() if self.kfac is not None else None
        with self.span(BACKWARD):
            if outputs is not None:
                self._sampled_backward(x, out, sampled, outputs)
            out.backward(grad)
            if not self.is_first:
                self._send(x.grad, self.ctx.grid.prev_rank, _TAG_GRAD)

    def _sampled_backward(self, x: torch.Tensor, out: torch.Tensor, sampled: torch.Tensor | None,
                          outputs: list[tuple[Any, torch.Tensor]]) -> None:
        """True Fisher: gradients of the sampled-label loss w.r.t. the K-FAC layers' outputs (and x)."""
        if self.is_last:
            assert sampled is not None, "the last stage sampled no labels for a saved micro-batch"
            root, seed_grad = sampled, None
        else:
            root, seed_grad = out, self._recv(self.ctx.grid.next_rank, _TAG_SAMPLED_GRAD)
        targets = [o for _, o in outputs] + ([] if self.is_first else [x])
        if not targets:
            return
        grads = torch.autograd.grad(root, targets, grad_outputs=seed_grad, retain_graph=True, allow_unused=True)
        self.kfac.save_outgrads(outputs, grads[:len(outputs)])
        if not self.is_first:
            gx = grads[-1] if grads[-1] is not None else torch.zeros_like(x)
            self._send(gx, self.ctx.grid.prev_rank, _TAG_SAMPLED_GRAD)

    def run(self, ops: list[str], between: Callable[[str], None] | None = None) -> None:
        for op in ops:
            (self.forward if op == FORWARD else self.backward)()
            if between is not None:
                between(op)

    def finish_step(self) -> float | None:
        """Wait for outstanding sends; the step's loss (sum of micro-batch losses) on the last stage."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        if self._stash:
            raise RuntimeError(f"{len(self._stash)} micro-batches ran forward but not backward")
        return float(sum(self.losses)) if self.is_last else None

    @torch.no_grad()
    def evaluate(self, batches: list[Any]) -> float | None:
        """Mean loss over held-out micro-batches, forward only through the pipeline (dropout off).

        Every stage of a replica must call it at the same point; the last stage returns the loss,
        averaged over the data-parallel replicas (each evaluates the same batches), the others None.
        Nothing is saved for K-FAC (no gradients are enabled).
        """
        if self._stash or self._sends:
            raise RuntimeError("evaluate while a training step still has micro-batches in flight")
        was_training = self.stage.training
        self.stage.eval()
        dev, grid = self.ctx.device, self.ctx.grid
        total = 0.0
        try:
            for mb in batches:
                x = mb.input_ids.to(dev) if self.is_first else self._recv(grid.prev_rank, _TAG_EVAL)
                out = self.stage(x, mb.labels.to(dev) if self.is_last else None)
                if self.is_last:
                    total += float(out)
                else:
                    dist.send(out.contiguous(), grid.next_rank, tag=_TAG_EVAL)
        finally:
            self.stage.train(was_training)
        if not self.is_last or not batches:
            return None
        loss = torch.tensor([total / len(batches)], device=dev)
        if grid.replicas > 1:
            dist.all_reduce(loss, group=self.ctx.dp_group)
            loss /= grid.replicas
        return float(loss)

    def allreduce_gradients(self) -> None:
        """Average gradients over the stage's data-parallel group (one flat buffer)."""
        if self.ctx.grid.replicas == 1:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.ctx.dp_group)
        flat /= self.ctx.grid.replicas
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            chunk = flat[offset:offset + n].view_as(g)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n

    # -- point to point ------------------------------------------------------------------------------

    def _send(self, t: torch.Tensor, dst: int | None, tag: int) -> None:
        assert dst is not None
        t = t.contiguous()
        self._sends.append((dist.isend(t, dst, tag=tag), t))

    def _recv(self, src: int | None, tag: int) -> torch.Tensor:
        assert src is not None
        buf = torch.empty(self.act_shape, device=self.ctx.device)
        dist.recv(buf, src, tag=tag)
        return buf

