"""One worker's share of the job, built from a run config: its stage copies, pipeline engine, K-FAC,
update rule and (scheduled mode) schedule executor, and :meth:`Worker.step`, one training step.

``pipefisher train`` is one loop around :func:`build_worker` (:class:`pipefisher.runtime.train.trainer.Trainer`);
a loop of your own uses the same names through the library API (:mod:`pipefisher.runtime.api`), so it
trains exactly as ``pipefisher train`` does. Every stage copy (both of Chimera's, every chunk of an
interleaved device) is built by ``cfg.model.builder`` (:mod:`pipefisher.runtime.models.builders`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.pipeline_orders import DOWN, UP, layout_of
from pipefisher.runtime.data.batches import DataPosition, MLMData
from pipefisher.runtime.job.config import RunConfig
from pipefisher.runtime.job.dist import DistContext, check_agreement
from pipefisher.kfac import KFAC
from pipefisher.runtime.job.host import HostReads
from pipefisher.runtime.job.options import check_mode
from pipefisher.runtime.models.builders import make_stage
from pipefisher.runtime.pipeline.checks import load_checked_schedule
from pipefisher.runtime.pipeline.compute import LossScale, recompute_blocks
from pipefisher.runtime.pipeline.contracts import Curvature, Engine, Span
from pipefisher.runtime.pipeline.copies import StageChunks, StageCopiesEngine, StageCopiesKFAC, StagePair
from pipefisher.runtime.pipeline.engine import (LocalLink, PipelineEngine, pipe_micro_batches, pipeline_ops,
                                                splits_backward)
from pipefisher.runtime.pipeline.executor import ScheduleExecutor, plain_step
from pipefisher.runtime.pipeline.layout import node_pipes
from pipefisher.runtime.train.checkpoint import Checkpointer, StateGroup, TorchRNG
from pipefisher.runtime.train.update import Updater, make_kfac
from pipefisher.schedule.file import schedule_digest
from pipefisher.schedule.timeline import UPDATE_KEY

logger = logging.getLogger(__name__)

def check_options(mode: str, schedule: str | None, cfg: RunConfig | None = None,
                  ctx: DistContext | None = None) -> None:
    """How a worker is asked to train (:class:`ValueError`: a caller's mistake, not the user's, whom the
    CLI answers first): the mode and schedule as :class:`~pipefisher.runtime.job.options.TrainOptions`
    checks them (:func:`~pipefisher.runtime.job.options.check_mode`), and, given both ``cfg`` and ``ctx``,
    process groups set up for ``cfg``'s stages and pipeline order. :func:`build_worker` checks its
    arguments with it."""
    check_mode(mode, schedule)
    if cfg is None or ctx is None:
        return
    if ctx.grid.stages != cfg.pipeline.stages:
        raise ValueError(f"the grid has {ctx.grid.stages} stages but the config asks for {cfg.pipeline.stages}")
    if ctx.chimera != (cfg.pipeline.order == "chimera"):
        raise ValueError("the process groups were set up for another pipeline order than the config's")


def build_stages(cfg: RunConfig, ctx: DistContext) -> dict[int, nn.Module]:
    """This device's stage copies by pipe (down: 0; Chimera's up pipe: 1) or by chunk (interleaved:
    chunk j is virtual stage ``d + j*D`` of ``D*v``; ZB-V: stages ``d`` and ``2D - 1 - d``), in
    canonical order (stage index, the order everything a Chimera pair does together follows), built by
    ``model.builder`` from the run seed and moved to ``ctx.device``."""
    g = ctx.grid
    n = cfg.pipeline.virtual_stages
    return {p: make_stage(cfg, s, n).to(ctx.device) for p, s in node_pipes(cfg, g.stage).items()}


@dataclass
class Worker:
    """One worker's share of the job, and :meth:`step`, one training step of it.

    ``stage`` is the device's stage (a :class:`StagePair` under Chimera), ``copies`` its copies by
    pipe; ``engine`` runs the pipeline order ``ops`` with point-to-point sends and the gradient
    all-reduce; ``kfac`` (None in first-order mode) and ``kfacs`` (by pipe) hold K-FAC;
    ``updater`` the learning-rate schedule, clipping, preconditioning and optimizers; ``executor``
    (scheduled mode) walks the schedule file. ``host`` counts the worker's device-to-host reads
    (:mod:`pipefisher.runtime.job.host`): its engine, K-FAC and updater read through it, no other worker.
    """

    cfg: RunConfig
    ctx: DistContext
    mode: str
    data: MLMData
    copies: dict[int, nn.Module]
    stage: nn.Module
    engine: Engine
    kfacs: dict[int, KFAC]
    kfac: Curvature | None
    updater: Updater
    ops: list[str]
    interval: int
    span: Span
    executor: ScheduleExecutor | None = None
    schedule_digest: str | None = None
    cycles: list[int] = field(default_factory=list)  # every node's K-FAC cycle (scheduled mode)
    schedule: list[list[list[str]]] | None = None  # the schedule file's labels (scheduled mode)
    position: DataPosition = field(default_factory=DataPosition)  # the next step's micro-batches
    host: HostReads = field(default_factory=HostReads)  # this worker's device-to-host reads

    def step(self, step: int) -> torch.Tensor | None:
        """Training step ``step`` (0, 1, ...): forward and backward over the step's micro-batches in the
        pipeline order, K-FAC work (every ``interval`` steps, or where the schedule puts it), gradient
        all-reduce and the update. Returns the step's loss, averaged over replicas, on the last stage
        (None elsewhere), as a 0-dim tensor on the device: ``float(loss)`` makes the host wait for the
        device, so a loop reads it where it reports (``pipefisher train`` at its logging steps). Every
        worker of the job calls it with the same ``step``.

        The step reads nothing back from the device but fp16's overflow flag (whether the optimizer
        steps). The checks of K-FAC's inverses wait, on the device, for the next read
        (:attr:`host`): fp16's flag, else at the latest the start of the next step.
        """
        if self.updater.scaler is None:  # fp16 reads its flag in this step anyway, and what waits with it
            self.host.settle()  # what the last step left to check (bad K-FAC factors), if nothing read it since
        self.updater.set_step(step)
        self.position.step = step + 1  # where a checkpoint after this step resumes
        if self.executor is not None and step >= 1:
            return self.mean_loss(self.executor.run_step(step))
        refresh = self.kfac is not None and (self.executor is not None or step % self.interval == 0)
        loss = plain_step(self.engine, self.ops, step, self.kfac, refresh, self.end_of_step, self.span)
        if self.executor is not None:  # step 0 done: iteration 0 of the first cycle saves
            self.kfac.set_saving(True)
        return self.mean_loss(loss)

    def end_of_step(self) -> None:
        """The ``-- end --`` label: gradient all-reduce, then the update (:class:`Updater`). Profiled
        as one :data:`UPDATE_KEY` interval: work outside the pipeline that no bubble hides."""
        with self.span(UPDATE_KEY):
            self.engine.allreduce_gradients()
            self.updater.step(self.stage)

    def components(self) -> dict[str, Any]:
        """This worker's state by name, for :meth:`checkpointer`: the stage copies' parameters (``model``,
        what ``pipefisher export`` reads), the optimizers, each K-FAC copy (``{copy: state}``), fp16's loss
        scale, the data position and torch's random generators (dropout)."""
        parts: dict[str, Any] = {"model": self.stage, "optimizer": self.updater}
        if self.kfacs:
            parts["kfac"] = StateGroup(self.kfacs)
        if self.updater.scaler is not None:
            parts["loss_scale"] = self.updater.scaler
        parts["data"] = self.position
        parts["rng"] = TorchRNG(self.ctx.device)
        return parts

    def checkpointer(self) -> Checkpointer:
        """Saves and restores :meth:`components` (and any of the loop's own) for this worker's job."""
        corpus = self.data.corpus
        return Checkpointer(self.ctx, self.cfg, self.mode, self.schedule_digest,
                            tokenizer=corpus.tokenizer_json if corpus is not None else None)

    def mean_loss(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        """The step's loss over every replica of the last stage (and both pipes under Chimera, whose
        last stages sit on devices D - 1 and 0: one group), still on the device. The sum travels in
        float32 and is divided in float64, the numbers a read of each would give."""
        if loss is None or self.ctx.stage_group_size == 1:
            return loss
        t = loss.detach().to(torch.float32, copy=True).reshape(1)  # the engine's stays as it is
        dist.all_reduce(t, group=self.ctx.stage_group)
        return t.double()[0] / self.ctx.grid.replicas

    def evaluate(self, batches: list[Any] | None = None) -> float | None:
        """Mean held-out loss (default: the data's validation batches) on the last stage, else None.
        Every worker calls it at the same point."""
        return self.engine.evaluate(self.data.validation_batches() if batches is None else batches)


def build_worker(cfg: RunConfig, ctx: DistContext, *, mode: str = "first-order", total_steps: int,
                 schedule: str | None = None, kfac_interval: int | None = None, data: MLMData | None = None,
                 span: Span | None = None, warn: Callable[[str], None] | None = None,
                 recorder: Any = None, allow_schedule_mismatch: bool = False,
                 host: HostReads | None = None) -> Worker:
    """Everything this worker runs, composed as ``pipefisher train`` composes it.

    ``mode``: ``first-order``, ``kfac`` (naive K-FAC every ``kfac_interval`` steps, default
    ``kfac.interval``) or ``scheduled`` (with ``schedule``, a schedule file: checked against this job
    on every worker before anything runs). ``total_steps`` ends the learning-rate schedule when
    ``optim.decay_steps`` is 0. ``span`` times named work (the profiler's); ``warn`` gets K-FAC's
    warnings, each naming its stage (default: a warning of this module's logger, shown by the CLI);
    ``recorder`` (scheduled mode, :mod:`pipefisher.runtime.train.recorder`) times every label;
    ``allow_schedule_mismatch`` trains a schedule whose metadata says it was packed for another job
    (:func:`pipefisher.runtime.pipeline.checks.check_packed_for`); ``host`` counts the worker's
    device-to-host reads (None: a new counter, :attr:`Worker.host`). Seeds torch's global generator per
    worker (dropout), so runs repeat.
    """
    check_options(mode, schedule, cfg, ctx)
    host = host if host is not None else HostReads()
    g, m = ctx.grid, cfg.data.num_micro_batches
    chimera = cfg.pipeline.order == "chimera"
    data = data if data is not None else MLMData(cfg.data, cfg.model.vocab_size)
    span = span or (lambda key: _nothing())
    interleaved = cfg.pipeline.chunked  # the copies are model chunks (interleaved, ZB-V)
    v = cfg.pipeline.chunks
    copies = build_stages(cfg, ctx)
    index = node_pipes(cfg, g.stage)
    kfacs: dict[int, KFAC] = {}
    if mode != "first-order":
        for p, copy in copies.items():
            what = (f" (chunk {p})" if interleaved else " (up pipe)") if p else ""
            where = f"stage {index[p]}" + what + f" replica {g.replica}"
            say = warn or logger.warning
            kfacs[p] = make_kfac(cfg, copy, dp_group=ctx.stage_group, dp_size=ctx.stage_group_size,
                                 warn=lambda msg, where=where, say=say: say(f"{where}: {msg}"),
                                 drift=g.replica == 0, host=host)  # every replica would measure the same drift
    scaler = LossScale(cfg.train.loss_scale) if cfg.train.precision == "fp16" else None
    for k in kfacs.values():
        k.grad_scaler = scaler
        k.refresh_every(kfac_interval or cfg.kfac.interval)  # a schedule's executor says its cycle instead
    if cfg.train.recompute == "layer":  # after K-FAC's hooks exist: a recomputed block pauses them
        for p, copy in copies.items():
            recompute_blocks(copy, kfacs.get(p))
    plan = pipe_micro_batches(cfg.pipeline.order, g.stage, g.stages, m, v)
    split = splits_backward(cfg.pipeline.order)  # zero-bubble: B and W passes apart
    if interleaved:  # one engine per chunk, on the down pipe; its own keys carry ``:chunk<j>``
        local = LocalLink()  # ZB-V's turn: device D-1's chunk 0 feeds its own chunk 1
        engines = {j: PipelineEngine(copies[j], ctx, data, m, span=span, kfac=kfacs.get(j), micro_batches=plan[j],
                                     chunk=j, layout=layout_of(cfg.pipeline.order), split=split, local=local,
                                     precision=cfg.train.precision, scaler=scaler,
                                     grad_bucket_mb=cfg.pipeline.grad_bucket_mb, host=host)
                   for j in plan}
    else:
        engines = {p: PipelineEngine(copies[p], ctx, data, m, span=span, kfac=kfacs.get(p), pipe=p,
                                     micro_batches=plan[p], split=split, precision=cfg.train.precision,
                                     scaler=scaler, grad_bucket_mb=cfg.pipeline.grad_bucket_mb, host=host)
                   for p in plan}
    if interleaved:
        stage: nn.Module = StageChunks([copies[j] for j in range(v)])
        kfac: Curvature | None = StageCopiesKFAC(kfacs, list(index), interleaved=True) if kfacs else None
        engine: Engine = StageCopiesEngine(stage, ctx, engines)
    elif chimera:
        stage = StagePair(copies[DOWN], copies[UP], list(index))
        kfac = StageCopiesKFAC(kfacs, list(index)) if kfacs else None
        engine = StageCopiesEngine(stage, ctx, engines)
    else:
        stage, kfac, engine = copies[DOWN], kfacs.get(DOWN), engines[DOWN]
    if cfg.pipeline.engine == "torch":  # the same copies and K-FAC, run by torch.distributed.pipelining
        from pipefisher.runtime.pipeline.torch_engine import build_torch_engine

        engine = build_torch_engine(copies, ctx, data, m, kind=cfg.pipeline.order, chunks=v,
                             layout=layout_of(cfg.pipeline.order), span=span, kfacs=kfacs, evaluator=engine,
                             grad_bucket_mb=cfg.pipeline.grad_bucket_mb, precision=cfg.train.precision,
                             scaler=scaler)
    updater = Updater(cfg, stage, kfac, cfg.optim.decay_steps or total_steps,
                      pipe_group=ctx.pipe_group, copies=2 if chimera else 1, span=span, scaler=scaler, host=host)
    worker = Worker(cfg, ctx, mode, data, copies, stage, engine, kfacs, kfac, updater,
                    pipeline_ops(cfg.pipeline.order, g.stage, g.stages, m, v),
                    kfac_interval or cfg.kfac.interval, span, host=host)
    if schedule is not None:
        # Every worker checks every node, so a bad schedule stops all of them before step 0.
        nodes = load_checked_schedule(schedule, cfg, g.replicas, allow_schedule_mismatch)
        worker.schedule, worker.schedule_digest = nodes, schedule_digest(nodes)
        worker.cycles = [len(node) for node in nodes]
        check_agreement(ctx, f"schedule {worker.schedule_digest}")  # the same file on every host
        worker.executor = ScheduleExecutor(nodes[g.stage], engine, kfacs, worker.end_of_step, recorder=recorder)
    # Dropout draws from torch's global generator: seed it per worker, so that a run is repeatable
    # and a resumed run (which restores the generator) continues the very same stream.
    torch.manual_seed((cfg.data.seed * 1_000_003 + g.rank) * 7_919 + 17)
    return worker


def _nothing() -> ContextManager[Any]:
    from contextlib import nullcontext

    return nullcontext()
