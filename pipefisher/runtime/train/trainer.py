"""One worker's training loop: pipeline steps, first-order or naive K-FAC, progress, profiling.

Modes: ``first-order`` (pipeline, gradient all-reduce, optimizer), ``kfac`` (the same plus, every
``kfac.interval`` steps, all K-FAC work for every layer after the pipeline; gradients are
preconditioned with the latest inverses every step) and ``scheduled`` (step 0 as ``kfac``, then the
schedule file's cycle label by label, K-FAC work inside the pipeline's bubbles; see
:mod:`pipefisher.runtime.pipeline.executor`). Profiling runs ``kfac`` with a refresh every step, each step after a
barrier over the whole job, and writes one timeline per pipeline node (replica 0 of each stage): the
median of its steps, with the raw steps beside it (:meth:`pipefisher.runtime.train.profiler.Profiler.write`). Checkpoints (:mod:`pipefisher.runtime.train.checkpoint`)
are written every ``checkpoint_every`` steps and at the end; ``resume`` continues from one.
Every step ends with the update rule of :mod:`pipefisher.runtime.train.update` (learning-rate schedule,
clipping, preconditioning, KL-clip, optimizers); every ``eval_every`` steps the pipeline evaluates the
held-out batches (timed apart from training), and the run reports its peak memory.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from pipefisher.errors import first_line
from pipefisher.loop.drift import longest_cycle
from pipefisher.kfac.factors import BadFactorError
from pipefisher.pipeline_orders import UP
from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job import memory
from pipefisher.runtime.job.config import RunConfig, cov_limit
from pipefisher.runtime.job.dist import DistContext
from pipefisher.runtime.job.files import RunPaths
from pipefisher.runtime.job.host import HostReads
from pipefisher.runtime.job.options import TrainOptions
from pipefisher.runtime.job.process import Interrupted, StopRequest
from pipefisher.runtime.job.progress import phase
from pipefisher.runtime.pipeline.layout import loss_device, node_pipes
from pipefisher.runtime.train.evaluator import Evaluator
from pipefisher.runtime.train.metrics import Metrics
from pipefisher.runtime.train.profiler import Profiler
from pipefisher.runtime.train.worker import build_worker
from pipefisher.safe_io import dump_json_atomic

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A training step failed in communication (or compute) on this worker; says which and when."""


@dataclass
class WorkerResult:
    rank: int
    stage: int
    replica: int
    losses: list[float] = field(default_factory=list)  # last stage: mean over replicas, per step
    step_seconds: list[float] = field(default_factory=list)
    timeline_path: str | None = None
    # held-out loss after a step: (steps done, loss, training seconds so far); last stage only
    val: list[tuple[int, float, float]] = field(default_factory=list)
    peak_memory_bytes: int = 0  # this process, over the training steps
    base_memory_bytes: int = 0  # what it held as the steps began (the built model), on the peak's counter
    peak_saved_bytes: int = 0  # K-FAC inputs/output gradients waiting for their covariance piece
    # device-to-host reads per step (pipefisher.runtime.job.host): at most 1 on a step that logs nothing
    host_reads: list[int] = field(default_factory=list)
    # the reporting worker's run figures for a summary (Metrics.figures: every step, a resumed run's earlier too)
    figures: dict[str, list[float]] | None = None

    @property
    def peak_above_base_bytes(self) -> int:
        """The peak above what the process held as the steps began: what the steps themselves took. Never
        below 0: the kernel's resident-set counters are approximate (per-CPU batches), so on CPU a peak
        within a fraction of a MiB of the start can read a little below it; that is noise, shown as 0."""
        return max(0, self.peak_memory_bytes - self.base_memory_bytes)

    def median_step_seconds(self, skip: int = 1) -> float:
        times = self.step_seconds[skip:] or self.step_seconds
        return statistics.median(times)


class Trainer:
    """Builds this worker's stage, data, engine, K-FAC and optimizer, and runs the steps."""

    def __init__(self, cfg: RunConfig, ctx: DistContext, opts: TrainOptions, recorder: Any = None) -> None:
        self.cfg, self.ctx, self.opts = cfg, ctx, opts
        g = ctx.grid
        self.mode = opts.effective_mode  # its options checked by TrainOptions, the grid by build_worker
        self.interval = 1 if opts.profile else cfg.kfac.interval
        self.reporter = g.stage == loss_device(cfg) and g.replica == 0  # it holds the loss
        from pipefisher.runtime.data.sources import describe_source

        self._phase(f"loading data ({describe_source(cfg.data)})")
        self.data = MLMData(cfg.data, cfg.model.vocab_size)
        self.val_batches = self.data.validation_batches() if opts.evaluation.every else []
        self.profiler = Profiler(opts.profile, ctx.device)
        self._phase(f"building the model ({cfg.model.builder}, {cfg.model.num_layers} layers, hidden "
                    f"{cfg.model.hidden_size}, {g.stages} stage(s)) on {ctx.device}"
                    + (", with K-FAC" if self.mode != "first-order" else ""))
        # The library's composition (pipefisher.runtime.api): a user's own loop gets the same worker.
        host = HostReads()  # this worker's device-to-host reads: counted per step (WorkerResult.host_reads)
        if self.mode == "scheduled" and recorder is None:  # always-on measurement of scheduled steps
            from pipefisher.runtime.train.recorder import ClockRecorder

            recorder = ClockRecorder(g.stage, g.replica, cuda=ctx.device.type == "cuda", host=host)
        # the learning rate decays over the steps the first run defined, not a resumed run's --steps
        horizon = opts.steps
        if opts.checkpoint.resume:
            from pipefisher.runtime.train.checkpoint import lr_horizon, read_manifest

            horizon = lr_horizon(read_manifest(opts.checkpoint.resume), cfg, opts.steps)
        self.worker = build_worker(cfg, ctx, mode=self.mode, total_steps=horizon, schedule=opts.schedule,
                                   kfac_interval=self.interval, data=self.data, span=self.profiler.span,
                                   recorder=recorder,
                                   allow_schedule_mismatch=opts.allow_schedule_mismatch, host=host)
        w = self.worker
        self.stage, self.kfac, self.kfacs, self.engine = w.stage, w.kfac, w.kfacs, w.engine
        self.updater, self.ops, self.executor, self.host = w.updater, w.ops, w.executor, w.host
        self.schedule_digest = w.schedule_digest
        self.drift_log = None  # this worker's curvature drift samples (K-FAC modes), see pipefisher.loop.drift
        if self.kfacs:
            from pipefisher.runtime.train.drift_log import DriftLog

            self.drift_log = DriftLog(self.kfacs, node_pipes(cfg, g.stage), g.stage, host=host)
        self._refreshes: dict[int, Any] = {}  # kfac mode: the job's refreshes gathered so far, by step
        self.loop = self._schedule_loop() if self.executor is not None else None
        self.checkpointer = w.checkpointer()
        self.evaluator = Evaluator(self.engine, self.val_batches, opts.evaluation.every, opts.steps)
        self.start_step = 0
        self.stop = StopRequest(defer=False)  # while the steps run: run()'s, which may defer a stop
        if opts.checkpoint.resume:
            self._phase(f"loading the checkpoint in {opts.checkpoint.resume}")
            self.start_step = self.checkpointer.load(opts.checkpoint.resume, self.components())
        elif cfg.model.pretrained and self.reporter:  # said also without phase lines: what the run trains
            logger.info(f"model.pretrained: the model starts from the weights in {cfg.model.pretrained}")

    def _schedule_loop(self) -> Any:
        """The closed loop (:class:`pipefisher.runtime.train.adapt.ScheduleLoop`) of this worker."""
        from pipefisher.loop.closed_loop import Plan, make_scheduler
        from pipefisher.runtime.job.dist import check_agreement
        from pipefisher.runtime.pipeline.checks import check_schedule
        from pipefisher.runtime.train.adapt import ScheduleLoop
        from pipefisher.schedule.file import schedule_overlap

        cfg, ctx, opts, g = self.cfg, self.ctx, self.opts, self.ctx.grid
        assert opts.schedule is not None and self.worker.schedule is not None
        margin, timelines = schedule_plan_inputs(opts)

        def switch(new: Any, first_step: int) -> None:
            assert self.executor is not None
            say = g.replica == 0 and first_step > 1  # a switch during the run: the start lines said the old weight
            before = self._averaging_lines() if say else []
            self.executor.switch(new.data[g.stage], first_step)
            self.worker.cycles = new.cycles
            if say:
                for line in self._averaging_lines():
                    if line not in before:
                        logger.info(f"step {first_step}: {line}")

        data = self.worker.schedule
        if opts.adapt.enabled:  # one cycle length on every node, so that a new schedule can start on all at once
            from pipefisher.loop.closed_loop import equal_cycles

            data = equal_cycles(data)
        plan = Plan(data, f"schedule file {os.path.basename(opts.schedule)}", timelines, margin,
                    overlap=schedule_overlap(opts.schedule))
        if data != self.worker.schedule:
            check_schedule(data, cfg, g.replicas, overlap=plan.overlap)
            switch(plan, 1)
            if self.reporter and opts.log.progress:
                logger.info(f"--adapt: every node runs the job's K-FAC cycle k={max(plan.cycles)} (the "
                            "shorter ones idle through the rest), so that all can switch schedules at once")
        scheduler = None
        if g.rank == 0:
            scheduler = make_scheduler("adaptive" if opts.adapt.enabled else "static", plan, g.stages,
                                       **(adaptive_options(opts, margin) if opts.adapt.enabled else {}))
        prefix = opts.adapt.measure_prefix or (RunPaths(opts.log.out, self.cfg.name).prefix if opts.log.out else None)
        collective = None
        if ctx.distributed:
            def gather(obj: Any) -> list[Any]:
                out: list[Any] = [None] * g.world_size
                dist.all_gather_object(out, obj)
                return out

            def broadcast(obj: Any) -> Any:
                box = [obj]
                dist.broadcast_object_list(box, src=0)
                return box[0]
            collective = (gather, broadcast, dist.barrier)

        return ScheduleLoop(plan, node=g.stage, rank=g.rank, nodes=g.stages, scheduler=scheduler,
                            adapt=opts.adapt.enabled, prefix=prefix, collective=collective,
                            check=lambda new: check_schedule(new.data, cfg, g.replicas, overlap=new.overlap),
                            agree=lambda text: check_agreement(ctx, text), switch=switch,
                            echo=logger.info if self.reporter and opts.log.progress else None,
                            drift=self.drift_log.drain if self.drift_log is not None else None)

    def _kfac_where(self, pipe: int) -> str:
        """The stage (and chunk, or Chimera's up pipe) a K-FAC of this worker sits on, as its lines name it."""
        up = ("" if not pipe else f" (chunk {pipe})" if self.cfg.pipeline.chunked
              else " (up pipe)" if pipe == UP else "")
        return f"stage {node_pipes(self.cfg, self.ctx.grid.stage)[pipe]}{up}"

    def _averaging_lines(self) -> list[str]:
        """What each K-FAC of this worker says of its factors' running average (its weight a refresh
        follows the cycle: a switch to another cycle changes it)."""
        return [f"{self._kfac_where(p)}: {averaging}" for p, k in self.kfacs.items()
                if (averaging := k.averaging_line()) is not None]

    def _phase(self, what: str) -> None:
        """A start-up phase line from the reporting worker (the launcher relays it), unless --no-progress."""
        if self.reporter and self.opts.log.progress:
            phase(what)

    @property
    def refreshes(self) -> dict[int, Any]:
        """The job's curvature refreshes gathered so far (:class:`pipefisher.loop.drift.Refresh`), by the step
        each completed in: the closed loop's (scheduled mode, every gather), else those gathered at
        checkpoints and at the end (kfac mode). Every worker holds them."""
        return self.loop.refreshes if self.loop is not None else self._refreshes

    def _gather_drift(self) -> None:
        """kfac mode: every worker's drift samples to every worker, grouped by step (a collective: every
        worker calls it at the same point). Scheduled mode gathers them with its cycles."""
        if self.drift_log is None or self.loop is not None:
            return
        from pipefisher.loop.drift import refreshes

        mine = self.drift_log.drain()
        parts: list[Any] = [mine]
        if self.ctx.distributed:
            parts = [None] * self.ctx.grid.world_size
            dist.all_gather_object(parts, mine)
        self._refreshes.update((r.step, r) for r in refreshes(s for part in parts for s in part))

    @property
    def cycles(self) -> list[int]:
        """Every node's K-FAC cycle k of the schedule running now (scheduled mode), else empty."""
        return self.worker.cycles

    @property
    def cycle(self) -> int | None:
        """K-FAC cycle length k of this node's schedule (``scheduled`` mode), else None."""
        return None if self.executor is None else self.executor.cycle

    def train_step(self, step: int) -> Any:
        """One step; returns the loss (mean over replicas, a 0-dim tensor) on the last stage, else None.
        Profiling, a barrier over the whole job first: every node starts the step's ``start_end`` together,
        the common reference of the median step (:func:`pipefisher.schedule.timeline.median_step`)."""
        self.profiler.barrier(distributed=self.ctx.distributed)
        return self.worker.step(step)

    def _lost_message(self, step: int, err: BaseException) -> str:
        g = self.ctx.grid
        first = first_line(err)
        if not self.ctx.distributed:
            return f"step {step} failed: {first}"
        return (f"stage {g.stage} of replica {g.replica} (rank {g.rank}) failed at step {step}: {first}. "
                f"A peer died, stalled beyond the {self.cfg.pipeline.timeout_s:g} s timeout, or runs a "
                f"different pipeline")

    def components(self) -> dict[str, Any]:
        """What a checkpoint holds: the worker's components, the closed loop's (scheduled mode: the active
        schedule, its first step, the open cycle's measurements, rank 0's scheduler) and the drift samples
        not gathered yet (K-FAC modes)."""
        parts = self.worker.components()
        if self.loop is not None:
            parts["loop"] = self.loop
        if self.drift_log is not None:
            parts["drift"] = self.drift_log
        return parts

    def checkpoint(self, steps_done: int) -> str | None:
        """Write this worker's checkpoint after ``steps_done`` steps (collective: every worker calls it)."""
        if not self.opts.checkpoint.folder:
            return None
        from pipefisher.runtime.job.options import RUN_OPTIONS

        loop, cycles = self.loop, self.cycles
        manifest = {
            "schedule_path": self.opts.schedule,
            # the job's K-FAC cycle k (its longest node's, as the training header says), and each node's
            "cycle": max(cycles) if cycles else None, "node_cycles": list(cycles) or None,
            # the schedule running when it was written (another than the file's after an --adapt switch)
            "active_schedule": loop.plan.digest if loop is not None else None,
            "active_from_step": loop.first_step if loop is not None else None,
            # the step where the learning-rate decay ends: a resumed run keeps it (see checkpoint.lr_horizon)
            "lr_horizon": self.updater.schedule.total_steps,
            # how the run trains (pipefisher run --resume continues it so)
            "options": {k: v for k, v in self.opts.flags().items() if k in RUN_OPTIONS}}
        return self.checkpointer.save(self.opts.checkpoint.folder, steps_done, self.components(), manifest=manifest)

    def run(self) -> WorkerResult:
        """Train; the reporting worker keeps the ``tensorboard`` option's log open meanwhile (closed also
        on a failure or Ctrl-C). Returns once every worker of the job is done."""
        opts = self.opts
        self.metrics = Metrics(reporter=self.reporter, mode=self.mode, steps=opts.steps, first=self.start_step,
                               log_every=opts.log.every, progress=opts.log.progress, csv=opts.log.metrics,
                               tensorboard=opts.log.tensorboard, evaluates=self.evaluator.due,
                               overruns=lambda: self.loop.overruns if self.loop is not None else {},
                               refreshes=lambda: self.refreshes)
        # Ctrl-C or SIGTERM: with a checkpoint folder, a stop at the next step boundary, checkpointed there
        # (checkpoint.on_interrupt); else at once
        defer = bool(opts.checkpoint.folder) and self.cfg.checkpoint.on_interrupt
        try:
            with StopRequest(defer) as self.stop:
                result = self._run()
        finally:
            self.metrics.close()
        if self.ctx.distributed:
            # Every worker leaves together: one that ended its process group while a peer was still at
            # work (rank 0 writing the closed loop's files) aborted in gloo now and then at exit.
            dist.barrier()
        return result

    def _run(self) -> WorkerResult:
        """The training loop, top-down: each step, and at its logging steps (:meth:`Metrics.should_log`)
        the figures of the steps since the last one, read back from the device in one go, with the
        held-out evaluation when one is due; a checkpoint when one is due; then the run's end. The
        components beside it: :class:`Metrics` (CSV, TensorBoard, progress, loss lines),
        :class:`Evaluator`, the checkpointer (:meth:`checkpoint`) and the closed loop (``self.loop``)."""
        g, opts, metrics = self.ctx.grid, self.opts, self.metrics
        result = WorkerResult(g.rank, g.stage, g.replica)
        self._start(result)
        every, last = opts.checkpoint.every, opts.steps - 1
        unread: list[StepOutcome] = []  # steps whose loss and time are still on the device
        self.host.take()  # the reads before the first step are none of a step's
        try:
            with metrics.progress():
                for step in range(self.start_step, opts.steps):
                    cycle = max(self.cycles) if self.cycles else None  # the schedule this step runs
                    loss, clock = self._timed_step(step)
                    unread.append(StepOutcome(step, loss, clock, self.updater.lr, cycle))
                    metrics.stepped(step)
                    stop = step != last and self._stop_agreed(step)
                    save = (every and (step + 1) % every == 0 and step != last) or stop
                    if metrics.should_log(step) or save:
                        self._report(unread, result)
                    if save:
                        self._gather_drift()
                        self.checkpoint(step + 1)
                        metrics.flush()
                    if stop:
                        raise Interrupted(step + 1)
                    result.host_reads.append(self.host.take())
        except KeyboardInterrupt:  # Ctrl-C: say how far it got (the CLI turns it into one line)
            self._report(unread, result)  # the steps done are logged as they would have been
            metrics.write_csv()  # and kept: the metrics so far
            raise Interrupted(len(result.step_seconds) + self.start_step) from None
        result.val = self.evaluator.curve
        if self.kfac is not None:
            self.kfac.settle_all()  # no all-reduce left in flight when the process group goes
        result.peak_memory_bytes = memory.peak_bytes(self.ctx.device)
        result.peak_saved_bytes = self.kfac.peak_saved_bytes if self.kfac is not None else 0
        metrics.report_end(result.step_seconds, f"rank {g.rank}: stage {g.stage}, replica {g.replica}",
                           result.peak_memory_bytes, result.peak_saved_bytes if self.kfac is not None else None,
                           self.updater.scaler)
        if metrics.todo:
            self._gather_drift()
            self.checkpoint(opts.steps)
        if self.loop is not None:
            self._finish_loop()  # after the checkpoint: a resumed run gathers the open cycle as this one would
        metrics.log_late()
        if self.reporter and metrics.todo and self.refreshes:
            logger.info(drift_line(list(self.refreshes.values())))
        metrics.write_csv()
        result.figures = metrics.figures() if self.reporter else None
        self._write_outputs(result)
        return result

    def _stop_agreed(self, step: int) -> bool:
        """Whether the job stops after ``step``: asked on any worker (:class:`StopRequest`, a deferred Ctrl-C
        or SIGTERM), agreed on by all at this step boundary (a MAX all-reduce over the host), so that every
        worker stops and checkpoints at the same step. A dead peer fails it within the pipeline timeout."""
        if not self.stop.defer:
            return False
        if not self.ctx.distributed:
            return self.stop.requested
        flag = torch.tensor([int(self.stop.requested)])
        with self._failures(step):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.host_group)
        return bool(flag.item())

    def _start(self, result: WorkerResult) -> None:
        """Before the first step: the start lines, the memory baseline, the run's tokenizer."""
        g, opts, first = self.ctx.grid, self.opts, self.start_step
        self.stage.train()
        self.profiler.align(distributed=self.ctx.distributed)
        if self.reporter:
            extra = (f", K-FAC cycle k={max(self.cycles)} (per node: {', '.join(map(str, self.cycles))})"
                     if self.cycles else "")
            resumed = f", resuming after step {first - 1}" if first else ""
            logger.info(f"pipefisher train: mode {self.mode}, {g.stages} stage(s) x {g.replicas} replica(s), "
                        f"{self.cfg.pipeline.order}, {self.cfg.data.num_micro_batches} micro-batches, "
                        f"{opts.steps} steps on {self.ctx.device}{compute_line(self.cfg)}{extra}{resumed}")
        if g.replica == 0:  # each stage says what its K-FAC covers (every replica holds the same layers)
            for p, k in self.kfacs.items():
                logger.info(k.coverage.line(self._kfac_where(p)))
            for line in self._averaging_lines():
                logger.info(line)
        memory.reset_peak(self.ctx.device)
        result.base_memory_bytes = memory.peak_bytes(self.ctx.device)  # just reset: what it holds now
        if self.kfac is not None:
            self.kfac.reset_peak_saved()
        if opts.log.out is not None and self.reporter and self.data.corpus is not None:
            from pipefisher.runtime.data.corpus import save_tokenizer  # the run's vocabulary, from the start

            save_tokenizer(self.data.corpus, RunPaths(opts.log.out, self.cfg.name).tokenizer)
        if self.metrics.todo:
            self._phase("first step (compiles / warms up; later steps are faster, the bar's ETA follows)")

    @contextmanager
    def _failures(self, step: int) -> Iterator[None]:
        """A failure in a step's communication (or compute) as :class:`PeerLost`, naming the step; a bad
        factor keeps its own line, naming the layer."""
        try:
            yield
        except BadFactorError:
            raise
        except RuntimeError as err:
            raise PeerLost(self._lost_message(step, err)) from err

    def _timed_step(self, step: int) -> tuple[Any, Any]:
        """One training step with what follows it on the step path (drift samples, the closed loop's
        measurements): its loss (a 0-dim tensor on the last stage, else None) and its clock (seconds on
        CPU; on GPU a pair of CUDA events around it, read with the loss: no synchronize per step)."""
        cuda = self.ctx.device.type == "cuda"
        t0 = _cuda_event() if cuda else time.perf_counter()
        with self._failures(step):
            loss = self.train_step(step)
            if self.drift_log is not None:
                self.drift_log.take(step)  # tensors: read where the workers gather anyway
            if self.loop is not None and step >= 1:
                self.loop.after_step(step, self.executor.last_record)
        return loss, ((t0, _cuda_event()) if cuda else time.perf_counter() - t0)

    def _report(self, unread: list["StepOutcome"], result: WorkerResult) -> None:
        """The steps in ``unread`` as numbers (their losses in one read, their CUDA clocks after it), each
        through the evaluator and the metrics in order, into ``result``; ``unread`` empties."""
        if not unread:
            return
        losses = [u.loss for u in unread if u.loss is not None]
        values = iter(self.host.values(torch.stack([x.reshape(()).double() for x in losses])) if losses else [])
        for u in unread:
            loss = next(values) if u.loss is not None else None
            seconds = u.seconds(self.host)
            with self._failures(u.step):
                val = self.evaluator.after_step(u.step, seconds)
            self.metrics.record(u.step, loss=loss, val=val, lr=u.lr, seconds=seconds, cycle=u.cycle)
            result.step_seconds.append(seconds)
            if loss is not None:
                result.losses.append(loss)
        unread.clear()

    def _finish_loop(self) -> None:
        """The closed loop's end: its open cycle gathered, its files written, its cost line."""
        assert self.loop is not None
        self.loop.finish()
        self.loop.write_schedules()
        self.loop.write_measured()
        if self.reporter and self.metrics.todo:
            logger.info(f"closed loop ({'adaptive' if self.opts.adapt.enabled else 'static'} scheduler): "
                        f"{self.loop.cost_line()}"
                        + (f", final K-FAC cycle k={max(self.cycles)}" if self.opts.adapt.enabled else ""))

    def _write_outputs(self, result: WorkerResult) -> None:
        """With ``out``: the profiled timeline (replica 0 of each stage) and the losses JSON (reporting worker)."""
        opts, g, first = self.opts, self.ctx.grid, self.start_step
        if opts.log.out is None:
            return
        if opts.profile and g.replica == 0:
            result.timeline_path = self.profiler.write(opts.log.out, self.cfg.name, g.stage,
                                                       cov_limit(self.cfg.kfac.cov_micro_batches))
        if self.reporter:
            dump_json_atomic(RunPaths(opts.log.out, self.cfg.name).losses,
                             {"mode": self.mode, "losses": result.losses, "val": result.val,
                              "step_seconds": result.step_seconds, "options": opts.flags(),
                              "peak_memory_bytes": result.peak_memory_bytes,
                              "peak_saved_bytes": result.peak_saved_bytes,
                              "config": self.cfg.to_dict(), "first_step": first,
                              # the job's K-FAC cycle k (its longest node's), and each node's
                              "cycle": max(self.cycles) if self.cycles else None,
                              "node_cycles": self.cycles or None,
                              # scheduled mode: each schedule used from which step, and the loop's cost
                              "schedules": [{"step": sw.step, "digest": sw.plan.digest,
                                             "node_cycles": sw.plan.cycles, "reason": sw.plan.reason}
                                            for sw in self.loop.history] if self.loop else None,
                              "loop_seconds": {"gathers": self.loop.gather_seconds,
                                               "decisions": self.loop.decide_seconds} if self.loop else None,
                              # the curvature refreshes' drift, the job's figure and every layer's
                              "drift": [r.state() for _, r in sorted(self.refreshes.items())]})


@dataclass(frozen=True)
class StepOutcome:
    """A step trained, its figures not read back yet: its loss (a 0-dim tensor on the stage holding it,
    else None) and its clock (seconds, or a pair of CUDA events), with the learning rate and K-FAC cycle
    it ran with."""

    step: int
    loss: Any
    clock: Any
    lr: float
    cycle: int | None

    def seconds(self, host: HostReads) -> float:
        """The step's seconds: on GPU from its events, which the loss read before has waited for (the
        end event of the last step read: synchronized here, once, counted in the worker's ``host``)."""
        if not isinstance(self.clock, tuple):
            return self.clock
        start, end = self.clock
        if not end.query():
            host.wait(end)
        return start.elapsed_time(end) / 1e3


def _cuda_event() -> Any:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def drift_line(refreshes: list[Any]) -> str:
    """The run's curvature drift in one line: how many refreshes, their drift and aging (medians, last)."""
    rs = sorted(refreshes, key=lambda r: r.step)
    ages = [r.aging for r in rs if r.aging is not None]
    aged = f"; aging median {statistics.median(ages):.3f}, last {ages[-1]:.3f}" if ages else ""
    return (f"curvature drift over {len(rs)} refresh(es): median {statistics.median(r.drift for r in rs):.3f}, "
            f"last {rs[-1].drift:.3f}{aged} (see pipefisher.loop.drift)")


def compute_line(cfg: RunConfig) -> str:
    """How steps compute, for the start line: nothing for the defaults (fp32, every activation kept)."""
    t = cfg.train
    return ((f", {t.precision} autocast" if t.precision != "fp32" else "")
            + (", each block recomputed in its backward" if t.recompute == "layer" else ""))


def adaptive_options(opts: TrainOptions, margin: float) -> dict[str, Any]:
    """What the run's options say to :class:`pipefisher.loop.closed_loop.AdaptiveScheduler` (``--adapt``): its
    policy and room margin, its window and tie, the staleness curve, whether the drift rule sets k, and
    whether its re-packs may overlap cycles."""
    return {"policy": opts.adapt.policy, "margin": margin, "window": opts.adapt.window, "q": opts.adapt.quantile,
            "tie": opts.adapt.tie, "aging_low": opts.adapt.aging_low, "aging_high": opts.adapt.aging_high,
            "max_cycle": opts.adapt.max_cycle or longest_cycle(opts.steps), "staleness": opts.adapt.staleness_curve,
            "drift": opts.adapt.drift, "overlap": opts.adapt.overlap}


def schedule_plan_inputs(opts: TrainOptions) -> tuple[float, list[dict[str, Any]] | None]:
    """The room rule's margin and the profile (per-node timeline dicts) a schedule file was packed from:
    the options' where given, else what its metadata records (:func:`pipefisher.schedule.file.save_schedule`)."""
    from pipefisher.schedule.file import schedule_margin, schedule_timelines
    from pipefisher.schedule.problem import DEFAULT_MARGIN
    from pipefisher.schedule.timeline import read_node_file

    assert opts.schedule is not None
    margin = opts.adapt.margin if opts.adapt.margin is not None else (schedule_margin(opts.schedule) or DEFAULT_MARGIN)
    paths = list(opts.adapt.schedule_timelines) if opts.adapt.schedule_timelines else schedule_timelines(opts.schedule)
    if not paths or not all(os.path.exists(p) for p in paths):
        return margin, None
    return margin, [read_node_file(p) for p in paths]
