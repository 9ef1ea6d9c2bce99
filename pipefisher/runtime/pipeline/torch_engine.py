"""The torch engine (``pipeline.engine: torch``): the same stage modules, K-FAC and packed schedules,
run as torch ``PipelineStage``\\ s by torch's pipeline runtime.

Torch walks its lowered action list (:mod:`pipefisher.runtime.pipeline.torch_api`: the order of its
schedule class, with the sends and receives its lowering adds); every compute action comes to
:meth:`TorchEngine._run`, which first runs the K-FAC labels the packer placed before that call (in the
bubble: after the previous call's send was posted, before this call waits for its input), then the
call itself, through the label's bound call as the executor compiled it (so the recorder times it),
the compute inside the profiler's span under the same key as the own engine's. The labels after the
last call run after torch's step returns (the tail bubble). ``REDUCE_GRAD`` starts the stage copy's
gradient buckets' all-reduce (:mod:`pipefisher.runtime.pipeline.buckets`), as the own engine does at
its last backward; torch's DDP/FSDP path is never used. A full backward in an order that splits
backwards (DualPipeV's) is the B and W calls of pipefisher's order: the B call computes it, the W call
is done with it. Torch posts the sends of one action (a full backward, DualPipeV's overlapped pair)
when all of it has run, so K-FAC work packed between the calls of one action would hold the next
stage: it runs when that action has ended instead (:func:`after_whole_actions`).

``train.precision`` bf16 and fp16 compute as the own engine does: each stage under autocast,
activations and their gradients crossing stages in the wire dtype (:class:`LossStage`; the static
shapes torch is given say that dtype); fp16's last stage starts each backward from the loss scale.

The engine keeps the runtime's engine contract (:class:`pipefisher.runtime.pipeline.contracts.Engine`)
as the own engine does, with its own :meth:`TorchEngine.fold_iteration`, which the executor calls to hand
over a schedule iteration (torch posts its own receives: nothing is posted ahead); the rest of the
runtime does not know which engine runs. Held-out evaluation goes through the own engine given as
``evaluator`` (forward only, no schedule to share).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipefisher.pipeline_orders import PassKind, stage_on
from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job.dist import DistContext
from pipefisher.runtime.pipeline import torch_api
from pipefisher.runtime.pipeline.buckets import DEFAULT_BUCKET_MB, GradientBuckets
from pipefisher.runtime.pipeline.compute import autocast, wire_dtype
from pipefisher.runtime.pipeline.contracts import Engine, EngineDefaults, ForwardCurvature, Span
from pipefisher.runtime.pipeline.engine import logged_wait
from pipefisher.runtime.pipeline.labels import PIPELINE_CALLS, copy_suffix, parse_label
from pipefisher.schedule.format import START


class LossStage(nn.Module):
    """A stage module as torch's ``PipelineStage`` calls it: ``forward(x, labels)``, where only the
    last stage uses the labels (and returns the micro-batch's loss, pipefisher's stage protocol).

    ``precision`` (``train.precision``) is computed as the own engine computes it
    (:mod:`pipefisher.runtime.pipeline.compute`): the stage runs under its autocast, and a stage that is
    not the last returns its output in the wire dtype, which torch then sends as it is (the next stage's
    static input, and this stage's output gradient, have that dtype). The cast is in the graph, so the
    output gradient reaches the stage in the dtype of its output, as the own engine casts it."""

    def __init__(self, stage: nn.Module, precision: str = "fp32") -> None:
        super().__init__()
        self.stage = stage
        self.precision, self.wire = precision, wire_dtype(precision)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        with autocast(self.precision, x.device):
            out = self.stage(x, labels if self.stage.is_last else None)
        return out if self.stage.is_last else out.to(self.wire)


def after_whole_actions(segments: Sequence[Sequence[Any]], inside: set[int],
                        tail: Sequence[Any]) -> tuple[list[list[Any]], list[Any]]:
    """``segments[k]`` (the calls packed before pipeline call ``k``) with those packed inside one of
    torch's actions (``k`` in ``inside``: between an overlapped pair's halves, or a full backward's B
    and W) moved to when that action has ended, before the next call's own (or the ``tail``'s), in order.
    Torch sends an action's outputs only once all of it has run, so work there would hold the next
    stage; run later in the same bubble, it computes the same (its inputs are kept until the step ends)."""
    out: list[list[Any]] = []
    carry: list[Any] = []
    for k, segment in enumerate(segments):
        if k in inside:
            carry += segment
            out.append([])
        else:
            out.append(carry + list(segment))
            carry = []
    return out, carry + list(tail)


class TorchEngine(EngineDefaults):
    """One rank's torch ``PipelineStage``\\ s (``stages``: copy id -> stage; copy j is chunk j, labels
    ``:chunk<j>``, when there are several) run in torch's order by torch's runtime.

    ``actions`` are every rank's compute-only ``_Action`` lists (:func:`torch_api.torch_actions`, or a
    user's schedule's), lowered by torch; ``loss_fn(output, target)`` is the loss of one micro-batch;
    ``scale_grads`` divides the gradients by the micro-batch count at each stage's ``REDUCE_GRAD`` (a
    loss that is not already divided), before its buckets' all-reduce starts. ``inputs(step)`` gives a
    step's whole-batch ``(args, kwargs, target)``; ``kfacs`` (copy -> K-FAC state) close each forward
    (``end_forward``) as the own engine does; ``span`` is the profiler's; ``grads`` hold the copies'
    gradients; ``evaluator`` gives held-out losses (the own engine on the same modules); ``scaler``
    (fp16's ``LossScale``) scales the loss each last-stage backward starts from, as the own engine does.
    """

    def __init__(self, stages: Mapping[int, Any], *, actions: dict[int, list[Any]], micro_batches: int,
                 loss_fn: Callable[..., Any], inputs: Callable[[int], tuple[tuple[Any, ...], dict[str, Any], Any]],
                 grads: GradientBuckets, scale_grads: bool = False, span: Span | None = None,
                 kfacs: Mapping[int, ForwardCurvature] | None = None, evaluator: Engine | None = None,
                 scaler: Any = None) -> None:
        torch_api.check_torch()
        self.m, self.inputs, self.grads = micro_batches, inputs, grads
        self.kfacs = dict(kfacs or {})
        self.span: Span = span or (lambda key: contextlib.nullcontext())
        self.evaluator = evaluator
        self.stages = dict(stages)
        self.copy_of = {st.stage_index: j for j, st in self.stages.items()}
        self.suffix = {j: copy_suffix(j, len(stages) > 1) for j in stages}
        self.holds_last = any(st.is_last for st in self.stages.values())
        self.scale_grads = scale_grads
        self.runtime = torch_api.Runtime([self.stages[j] for j in sorted(self.stages)], micro_batches, loss_fn,
                                         actions, torch_api.Calls(run=self._run, reduce=self._reduce),
                                         scale_loss=None if scaler is None else scaler.scaled)
        self.rank = self.runtime.rank
        orders = torch_api.actions_order(actions)
        self.split = torch_api.splits(orders)
        self.order = orders[self.rank]
        self.inside = torch_api.inside_calls(actions[self.rank], self.split)
        self.labels = [label for cmp in self.order for label in self.labels_of(cmp)]
        self.cuda = next(iter(self.stages.values())).device.type == "cuda"
        self.step = 0
        self._wait_log: list[Any] | None = None
        self._segments: list[list[Callable[[], None]]] = []  # per compute: the calls that run before it
        self._calls: list[Callable[[], None]] = []  # per compute: its label's bound call
        self._pos = 0
        self._current: Any = None
        self._losses: list[torch.Tensor] = []

    def labels_of(self, c: torch_api.Compute) -> list[str]:
        """The schedule labels of torch's compute action ``c`` on this device: one, or a B and its W
        pass for a full backward in an order that splits backwards (:func:`torch_api.label_kinds`)."""
        return [PassKind(k).key + self.suffix[self.copy_of[c.stage]] for k in torch_api.label_kinds(c, self.split)]

    def check_plan(self, ops: Sequence[str], where: str = "the pipeline order") -> None:
        """Refuse pipeline calls that are not torch's compute actions of this rank, 1:1 in order."""
        if list(ops) != self.labels:
            at = next((i for i, (a, b) in enumerate(zip(ops, self.labels)) if a != b), min(len(ops), len(self.labels)))
            raise ValueError(f"torch engine: {where} on rank {self.rank} differs from torch's "
                             f"order at call {at}: {list(ops)[at:at + 3]} where torch runs {self.labels[at:at + 3]} "
                             f"({len(ops)} calls against torch's {len(self.labels)})")

    # -- the engine interface --------------------------------------------------------------------------

    def op(self, label: str) -> Callable[[], None]:
        if label not in self.labels:
            raise ValueError(f"label {label!r} is not a pipeline call of this device under the torch engine")
        return functools.partial(self._call, label)

    def run(self, ops: Sequence[str]) -> None:
        """One step's pipeline calls ``ops`` (this device's order), nothing between them."""
        self.check_plan(ops)
        self._run_step([[] for _ in ops], [self.op(label) for label in ops])

    def fold_iteration(self, labels: Sequence[str], calls: Sequence[Callable[[], None]]) -> list[Callable[[], None]]:
        """A schedule iteration's bound calls (one per label) as the executor runs them with this
        engine: the calls up to ``-- start --``, one call that runs torch's step with every other call
        before the pipeline call it precedes, then the calls after the last pipeline call."""
        kinds = [parse_label(label)[0] for label in labels]
        at = [i for i, k in enumerate(kinds) if k in PIPELINE_CALLS]
        if not at:
            return list(calls)
        self.check_plan([labels[i] for i in at], "the schedule iteration")
        start = kinds.index(START) + 1 if START in kinds[:at[0]] else 0
        bounds = [start - 1] + at
        segments = [list(calls[bounds[k] + 1:bounds[k + 1]]) for k in range(len(at))]
        segments, tail = after_whole_actions(segments, self.inside, list(calls[at[-1] + 1:]))
        pipeline = [calls[i] for i in at]
        return list(calls[:start]) + [functools.partial(self._run_step, segments, pipeline)] + tail

    def begin_step(self, step: int) -> None:
        if self._current is not None:
            raise RuntimeError("begin_step while the previous step still runs")
        self.step = step
        self._pos = 0
        self._losses = []
        for j in self.grads.copies:
            self.grads.attach(j)

    def finish_step(self) -> torch.Tensor | None:
        """The step's loss (sum of the micro-batch losses) on the device holding the last stage."""
        if self._pos != len(self.labels):
            raise RuntimeError(f"torch engine: the step ran {self._pos} of {len(self.labels)} pipeline calls")
        return sum(self._losses) if self.holds_last else None  # type: ignore[return-value]

    @property
    def step_losses(self) -> list[torch.Tensor]:
        """The last step's loss of every micro-batch (rank holding the last stage; else empty)."""
        return list(self._losses)

    def allreduce_gradients(self) -> None:
        self.grads.finish()

    def evaluate(self, batches: list[Any]) -> float | None:
        if self.evaluator is None:
            raise RuntimeError("the torch engine was built without an evaluator")
        return self.evaluator.evaluate(batches)

    def set_wait_log(self, log: list[Any] | None) -> None:
        self._wait_log = log

    # -- inside torch's step -----------------------------------------------------------------------

    def _run_step(self, segments: list[list[Callable[[], None]]], calls: list[Callable[[], None]]) -> None:
        self._segments, self._calls, self._pos = segments, calls, 0
        args, kwargs, target = self.inputs(self.step)
        losses: list[torch.Tensor] = []
        try:
            self.runtime.step(args, kwargs, target, losses)
        finally:
            self._current = None
        if self._pos != len(calls):
            raise RuntimeError(f"torch engine: torch's step ran {self._pos} of this device's {len(calls)} pipeline calls")
        self._losses = [x.detach() for x in losses]

    def _run(self, c: torch_api.Compute, do: Callable[..., None]) -> None:
        """Torch's next compute action: per label it stands for, the calls packed before that label,
        then the label's own bound call; the first label's call computes (a full backward's W label,
        when it has one, is done with it)."""
        for i, label in enumerate(self.labels_of(c)):
            k = self._pos
            if k >= len(self._calls):
                raise RuntimeError(f"torch engine: torch runs more compute actions than the {len(self._calls)} "
                                   "pipeline calls of this device's step")
            for call in self._segments[k]:
                call()
            self._current = (label, c, do if i == 0 else None)
            self._calls[k]()
            if self._current is not None:
                raise RuntimeError(f"torch engine: the call bound to {self.labels[k]!r} did not run it")
            self._pos = k + 1

    def _call(self, label: str) -> None:
        """A pipeline label's call: the compute torch is at, which must be this label's."""
        if self._current is None:
            raise RuntimeError(f"torch engine: {label!r} runs outside torch's step")
        expected, c, do = self._current
        if expected != label:
            raise RuntimeError(f"torch engine: {label!r} where torch runs {expected!r}")
        self._current = None
        if do is None:  # the W pass of a full backward, which computed it: profiled as an empty pass
            with self._around(label, c):
                return
        do(functools.partial(logged_wait, log=self._wait_log, cuda=self.cuda), self._around(label, c))

    @contextlib.contextmanager
    def _around(self, label: str, c: torch_api.Compute) -> Iterator[None]:
        with self.span(label):
            yield
            kfac = self.kfacs.get(self.copy_of[c.stage])
            if c.kind == PassKind.FORWARD.label and kfac is not None:
                kfac.end_forward()

    def _reduce(self, stage: int) -> None:
        if self.scale_grads:
            self.stages[self.copy_of[stage]].scale_grads(self.m)
        self.grads.ready(self.copy_of[stage])


def build_torch_engine(copies: Mapping[int, nn.Module], ctx: DistContext, data: MLMData, num_micro_batches: int, *,
                       kind: str, chunks: int, layout: str, span: Span | None = None,
                       kfacs: Mapping[int, ForwardCurvature] | None = None, evaluator: Engine | None = None,
                       grad_bucket_mb: float = DEFAULT_BUCKET_MB, precision: str = "fp32",
                       scaler: Any = None) -> TorchEngine:
    """The torch engine of a worker: its stage copies (built as for the own engine) as torch
    ``PipelineStage``\\ s with static shapes, in torch's order of pipeline order ``kind``, fed the
    step's micro-batches of ``data`` (torch splits the whole batch back into the same micro-batches);
    each micro-batch's loss divided by the micro-batch count, as the own engine does. ``precision``
    and ``scaler`` (``train.precision``, fp16's loss scale) as the own engine's: the stages compute
    under autocast and exchange activations and gradients in the wire dtype (:class:`LossStage`)."""
    torch_api.check_torch()
    g, c, m = ctx.grid, data.cfg, num_micro_batches
    chunked = len(copies) > 1
    virtual = g.stages * len(copies)
    stages = {}
    for j in sorted(copies):
        module = copies[j]
        s = stage_on(g.stage, j, g.stages, layout) if chunked else g.stage
        # example tensors for torch's static shapes; requires_grad marks what carries a gradient
        hidden = torch.empty(c.micro_batch_size, c.seq_len, module.hidden_size, device=ctx.device,
                             dtype=wire_dtype(precision), requires_grad=True)
        tokens = torch.zeros(c.micro_batch_size, c.seq_len, dtype=torch.long, device=ctx.device)
        out = torch.empty((), device=ctx.device, requires_grad=True) if module.is_last else hidden
        stages[j] = torch_api.make_stage(LossStage(module, precision), s, virtual, ctx.device, ctx.pipe_group,
                                         tokens if module.is_first else hidden, out)
    first = any(mod.is_first for mod in copies.values())
    last = any(mod.is_last for mod in copies.values())

    def inputs(step: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """A step's micro-batches, whole, where the first or the last stage needs them."""
        if not (first or last):
            return (), {}, None
        mbs = [data.micro_batch(step, g.replica, i) for i in range(m)]
        args = (torch.cat([mb.input_ids for mb in mbs]).to(ctx.device),) if first else ()
        labels = torch.cat([mb.labels for mb in mbs]).to(ctx.device) if last else None
        return args, ({"labels": labels} if labels is not None else {}), labels

    params = {j: [t for t in copies[j].parameters() if t.requires_grad] for j in sorted(copies)}
    grads = GradientBuckets(params, ctx.grad_group, ctx.stage_group_size, divisor=g.replicas,
                            bucket_bytes=int(grad_bucket_mb * 2**20))
    engine = TorchEngine(stages, actions=torch_api.torch_actions(kind, g.stages, m, chunks), micro_batches=m,
                         loss_fn=lambda out, target: out / m, inputs=inputs, grads=grads, span=span, kfacs=kfacs,
                         evaluator=evaluator, scaler=scaler)
    if engine.rank != g.stage:
        raise RuntimeError(f"torch engine: this worker is stage {g.stage} but rank {engine.rank} of its pipeline group")
    return engine
