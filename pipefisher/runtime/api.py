"""The runtime as a library: this worker's stage(s), pipeline, K-FAC and update, for your own loop.

``pipefisher train`` is one loop around these names (:class:`pipefisher.runtime.trainer.Trainer`);
a loop of your own uses the same ones, so it trains exactly as ``pipefisher train`` does::

    from pipefisher.runtime import api

    cfg = api.RunConfig(...)                      # or api.load_config("my.yaml")
    ctx = api.init_context(cfg)                   # torchrun / env:// job, or one process
    worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=100)
    for step in range(100):
        loss = worker.step(step)                  # the mean loss on the last stage, else None
    api.shutdown(ctx)

The model comes from ``cfg.model.builder`` (``"package.module:function"``, a :data:`StageBuilder`);
every stage copy (both of Chimera's, every chunk of an interleaved device) is built by it. A stage is an ``nn.Module`` with ``is_first``,
``is_last``, ``hidden_size`` and ``forward(x, labels=None, sample=None)`` (see
:class:`pipefisher.runtime.model.PipelineStage`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.runtime.chimera import ChimeraEngine, KFACPair, StageChunks, StagePair
from pipefisher.runtime.config import RunConfig, load_config
from pipefisher.runtime.data import MLMData
from pipefisher.runtime.dist import DistContext, check_agreement, shutdown
from pipefisher.runtime.engine import PipelineEngine, pipe_micro_batches, pipeline_ops
from pipefisher.runtime.executor import (ScheduleExecutor, chunk_suffix, load_checked_schedule, node_pipes,
                                         schedule_digest)
from pipefisher.runtime.model import StageBuilder, load_builder, make_stage
from pipefisher.runtime.update import Updater, make_kfac
from pipefisher.sim.schedules import DOWN, UP
from pipefisher.timeline import STEP_KEY, UPDATE_KEY

__all__ = ["RunConfig", "load_config", "StageBuilder", "load_builder", "make_stage", "init_context",
           "build_stages", "build_worker", "Worker", "shutdown"]

MODES = ("first-order", "kfac", "scheduled")
Span = Callable[[str], ContextManager[Any]]


def init_context(cfg: RunConfig, agree_on: str = "") -> DistContext:
    """Join the job torchrun (or any env:// launcher) started, or run alone when there is none.

    Checks that every worker has the same config (and ``agree_on``: the launcher adds its options), so
    stages never train different setups.
    """
    from pipefisher.runtime.dist import init_from_env, single_process
    from pipefisher.runtime.launch import threads_per_worker, torchrun_env

    if torchrun_env() is not None:
        ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s,
                            chimera=cfg.pipeline.schedule == "chimera")
    else:
        if cfg.pipeline.stages != 1:
            raise ValueError("a pipeline of several stages needs several workers (pipefisher train "
                             "--nproc-per-node, or torchrun)")
        torch.set_num_threads(threads_per_worker(1))
        ctx = single_process()
    try:
        check_agreement(ctx, cfg.fingerprint() + agree_on)
    except BaseException:
        shutdown(ctx)
        raise
    return ctx


def build_stages(cfg: RunConfig, ctx: DistContext) -> dict[int, nn.Module]:
    """This device's stage copies by pipe (down: 0; Chimera's up pipe: 1) or by chunk (interleaved:
    chunk j is virtual stage ``d + j*D`` of ``D*v``), in canonical order (stage index, the order
    everything a Chimera pair does together follows), built by ``model.builder`` from the run seed
    and moved to ``ctx.device``."""
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
    (scheduled mode) walks the schedule file.
    """

    cfg: RunConfig
    ctx: DistContext
    mode: str
    data: MLMData
    copies: dict[int, nn.Module]
    stage: nn.Module
    engine: Any
    kfacs: dict[int, Any]
    kfac: Any
    updater: Updater
    ops: list[str]
    interval: int
    span: Span
    executor: ScheduleExecutor | None = None
    schedule_digest: str | None = None
    cycles: list[int] = field(default_factory=list)  # every node's K-FAC cycle (scheduled mode)
    schedule: list[list[list[str]]] | None = None  # the schedule file's labels (scheduled mode)

    def step(self, step: int) -> float | None:
        """Training step ``step`` (0, 1, ...): forward and backward over the step's micro-batches in the
        pipeline order, K-FAC work (every ``interval`` steps, or where the schedule puts it), gradient
        all-reduce and the update. Returns the step's loss, averaged over replicas, on the last stage
        (None elsewhere). Every worker of the job calls it with the same ``step``.
        """
        self.updater.set_step(step)
        if self.executor is not None and step >= 1:
            return self.mean_loss(self.executor.run_step(step))
        refresh = self.kfac is not None and (self.executor is not None or step % self.interval == 0)
        if self.kfac is not None:
            self.kfac.set_saving(refresh)
        self.engine.begin_step(step)
        with self.span(STEP_KEY):
            self.engine.run(self.ops)
            loss = self.engine.finish_step()
            if self.kfac is not None:
                if refresh:
                    self.kfac.update_curvature(span=self.span)
                self.kfac.clear_saved()
            self.end_of_step()
        if self.executor is not None:  # step 0 done: iteration 0 of the first cycle saves
            self.kfac.set_saving(True)
        return self.mean_loss(loss)

    def end_of_step(self) -> None:
        """The ``-- end --`` label: gradient all-reduce, then the update (:class:`Updater`). Profiled
        as one :data:`UPDATE_KEY` interval: work outside the pipeline that no bubble hides."""
        with self.span(UPDATE_KEY):
            self.engine.allreduce_gradients()
            self.updater.step(self.stage)

    def mean_loss(self, loss: float | None) -> float | None:
        """The step's loss over every replica of the last stage (and both pipes under Chimera, whose
        last stages sit on devices D - 1 and 0: one group)."""
        if loss is None or self.ctx.stage_group_size == 1:
            return loss
        t = torch.tensor([loss], device=self.ctx.device)
        dist.all_reduce(t, group=self.ctx.stage_group)
        return float(t) / self.ctx.grid.replicas

    def evaluate(self, batches: list[Any] | None = None) -> float | None:
        """Mean held-out loss (default: the data's validation batches) on the last stage, else None.
        Every worker calls it at the same point."""
        return self.engine.evaluate(self.data.validation_batches() if batches is None else batches)


def build_worker(cfg: RunConfig, ctx: DistContext, *, mode: str = "first-order", total_steps: int,
                 schedule: str | None = None, kfac_interval: int | None = None, data: MLMData | None = None,
                 span: Span | None = None, warn: Callable[[str], None] | None = None,
                 recorder: Any = None, allow_schedule_mismatch: bool = False) -> Worker:
    """Everything this worker runs, composed as ``pipefisher train`` composes it.

    ``mode``: ``first-order``, ``kfac`` (naive K-FAC every ``kfac_interval`` steps, default
    ``kfac.interval``) or ``scheduled`` (with ``schedule``, a schedule file: checked against this job
    on every worker before anything runs). ``total_steps`` ends the learning-rate schedule when
    ``optim.decay_steps`` is 0. ``span`` times named work (the profiler's); ``warn`` gets K-FAC's
    warnings; ``recorder`` (scheduled mode, :mod:`pipefisher.runtime.recorder`) times every label;
    ``allow_schedule_mismatch`` trains a schedule whose metadata says it was packed for another job
    (:func:`pipefisher.runtime.executor.check_packed_for`). Seeds torch's global generator per worker (dropout), so runs repeat.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if (mode == "scheduled") != (schedule is not None):
        raise ValueError("mode 'scheduled' and a schedule file go together")
    g, m = ctx.grid, cfg.data.num_micro_batches
    if g.stages != cfg.pipeline.stages:
        raise ValueError(f"the grid has {g.stages} stages but the config asks for {cfg.pipeline.stages}")
    chimera = cfg.pipeline.schedule == "chimera"
    if ctx.chimera != chimera:
        raise ValueError("the process groups were set up for another pipeline schedule than the config's")
    data = data if data is not None else MLMData(cfg.data, cfg.model.vocab_size)
    span = span or (lambda key: _nothing())
    interleaved = cfg.pipeline.schedule == "interleaved"
    v = cfg.pipeline.chunks
    copies = build_stages(cfg, ctx)
    index = node_pipes(cfg, g.stage)
    kfacs: dict[int, Any] = {}
    if mode != "first-order":
        for p, copy in copies.items():
            what = (f" (chunk {p})" if interleaved else " (up pipe)") if p else ""
            where = f"stage {index[p]}" + what + f" replica {g.replica}"
            say = (lambda msg, where=where: warn(f"{where}: {msg}")) if warn is not None else None
            kfacs[p] = make_kfac(cfg, copy, dp_group=ctx.stage_group, dp_size=ctx.stage_group_size, warn=say)
    plan = pipe_micro_batches(cfg.pipeline.schedule, g.stage, g.stages, m, v)
    if interleaved:  # one engine per chunk, on the down pipe; its own keys carry ``:chunk<j>``
        engines = {j: PipelineEngine(copies[j], ctx, data, m, span=span, kfac=kfacs.get(j),
                                     micro_batches=plan[j], chunk=j) for j in plan}
    else:
        engines = {p: PipelineEngine(copies[p], ctx, data, m, span=span, kfac=kfacs.get(p), pipe=p,
                                     micro_batches=plan[p]) for p in plan}
    if interleaved:
        stage: nn.Module = StageChunks([copies[j] for j in range(v)])
        kfac: Any = KFACPair(kfacs, list(index), {j: chunk_suffix(j) for j in index}) if kfacs else None
        engine: Any = ChimeraEngine(stage, ctx, engines)
    elif chimera:
        stage = StagePair(copies[DOWN], copies[UP], list(index))
        kfac = KFACPair(kfacs, list(index)) if kfacs else None
        engine = ChimeraEngine(stage, ctx, engines)
    else:
        stage, kfac, engine = copies[DOWN], kfacs.get(DOWN), engines[DOWN]
    updater = Updater(cfg, stage, kfac, cfg.optim.decay_steps or total_steps,
                      pipe_group=ctx.pipe_group, copies=2 if chimera else 1, span=span)
    worker = Worker(cfg, ctx, mode, data, copies, stage, engine, kfacs, kfac, updater,
                    pipeline_ops(cfg.pipeline.schedule, g.stage, g.stages, m, v),
                    kfac_interval or cfg.kfac.interval, span)
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
