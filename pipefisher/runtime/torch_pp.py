"""K-FAC in the bubbles of a ``torch.distributed.pipelining`` loop you already have (torchtitan style).

Your loop keeps its ``PipelineStage``\\ s, its torch schedule, its optimizer and its data; :func:`wrap`
attaches K-FAC to the stage modules and takes the schedule's place in the loop:

    from pipefisher.runtime import torch_pp

    stages = [PipelineStage(chunk, index, num_stages, device, group=pp_group) for ...]   # as before
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)          # as before
    pf = torch_pp.wrap(stages, schedule, folder="pf", kfac={"damping": 0.03}, optimizer=optimizer)
    for step in range(steps):
        losses = []
        pf.step(x, target=y, losses=losses)   # instead of schedule.step(...): gradients averaged and preconditioned
        optimizer.step()
        optimizer.zero_grad()

Every rank of the pipeline calls :meth:`KfacPipeline.step` with the same arguments it would give the
schedule's ``step``. Step 0 is a plain pipeline step (torch sets its stages up in it); the next
``profile_steps`` steps run all K-FAC work after the pipeline, every step, and are profiled (the
same timeline keys as ``pipefisher train --profile``); rank 0 then packs their median step with a
policy of :mod:`pipefisher.policies` (``target`` by default), checks it with ``pipefisher validate``'s
rules, writes it to ``folder`` (with the timelines: ``pipefisher plot`` and ``validate`` read them) and
every rank trains with it from the next step on: each K-FAC piece in its bubble, among torch's actions
(:mod:`pipefisher.runtime.pipeline.torch_engine`). After each step the gradients are those of the
schedule's ``step`` (averaged over micro-batches when the schedule's ``scale_grads``), preconditioned
with the latest K-FAC inverses (and, with ``kfac.kl_clip``, scaled as :class:`pipefisher.runtime.train.update.Updater`
scales them, at the learning rate of ``optimizer``'s first group).

With ``kfac.update`` ``momentum`` or ``soap``, K-FAC's layers are stepped as ``pipefisher train``'s
:class:`~pipefisher.runtime.train.update.Updater` steps them, by :attr:`KfacPipeline.kfac_optimizer`
(:func:`pipefisher.runtime.train.update.make_kfac_optimizer`), at the end of :meth:`KfacPipeline.step`; their
gradients are then cleared (``None``), so your ``optimizer.step()`` steps the other parameters only (torch's
optimizers skip a parameter without a gradient, weight decay included). Its learning rate follows
``optimizer``'s first group: ``soap`` steps at that rate (with that group's betas, eps and weight decay),
``momentum`` at ``kfac.lr`` times that rate over the group's initial one (its ``initial_lr``, which torch's
learning-rate schedulers set, else its rate at :func:`wrap`), as ``train`` runs both on one schedule.

K-FAC is built from the ``kfac`` settings as ``pipefisher train`` builds it
(:func:`pipefisher.runtime.train.update.kfac_from_config`); the schedule is packed, checked and saved,
with the same metadata as ``pipefisher run``'s, by :mod:`pipefisher.policies.packing`.

The schedule's order comes from the schedule object (its per-rank actions, or ``Schedule1F1B``'s
loop); its loss function and micro-batch count are kept. Data parallelism around the pipeline
(DDP/FSDP on the stage modules) is not supported: one pipeline, one replica.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping, Sequence

import torch.distributed as dist

from pipefisher.errors import InputError
from pipefisher.policies import DEFAULT_POLICY
from pipefisher.runtime.job.config import DataConfig, KfacConfig, config_from_dict, cov_limit
from pipefisher.runtime.pipeline import torch_api
from pipefisher.runtime.pipeline.buckets import GradientBuckets
from pipefisher.runtime.pipeline.copies import StageCopiesKFAC
from pipefisher.runtime.pipeline.executor import ScheduleExecutor, plain_step
from pipefisher.runtime.pipeline.torch_engine import TorchEngine
from pipefisher.runtime.train.profiler import Profiler, timeline_filename
from pipefisher.runtime.train.update import clip_kl, kfac_from_config, kfac_peak_lr, make_kfac_optimizer
from pipefisher.schedule.problem import DEFAULT_MARGIN
from pipefisher.schedule.timeline import UPDATE_KEY

__all__ = ["KfacPipeline", "check_folder", "kfac_settings", "schedule_file", "wrap"]


def wrap(stages: Sequence[Any], schedule: Any, *, folder: str, kfac: KfacConfig | Mapping[str, Any] | None = None,
         optimizer: Any = None, damping: float | None = None, ignore: Iterable[str] | None = None,
         profile_steps: int = 3, policy: str = DEFAULT_POLICY, margin: float = DEFAULT_MARGIN,
         name: str = "torch_pp", overwrite: bool = False) -> "KfacPipeline":
    """K-FAC for this rank's ``stages`` (torch ``PipelineStage``\\ s) run in ``schedule``'s order (see
    the module's docstring). ``folder`` gets the profiled timelines and the packed schedule (``name``
    prefixes their files); one that cannot be written, or that holds an earlier run's schedule (unless
    ``overwrite``), is refused now (:func:`check_folder`), not after the profiled steps. ``kfac``: K-FAC's
    settings, a run config's ``kfac`` section (:func:`kfac_settings`); ``damping`` and ``ignore``, where
    given, replace its ``kfac.damping`` and ``kfac.ignore``. ``optimizer``: your loop's optimizer, whose
    first group's learning rate ``kfac.kl_clip`` bounds the step at and ``kfac.update`` ``momentum`` and
    ``soap`` follow (needed with those only)."""
    settings = kfac_settings(kfac, damping=damping, ignore=ignore, optimizer=optimizer)
    settings = kfac_settings(settings, optimizer=optimizer, micro_batches=torch_api.micro_batches(schedule))
    check_folder(folder, name=name, overwrite=overwrite)
    return KfacPipeline(stages, schedule, folder=folder, kfac=settings, optimizer=optimizer,
                        profile_steps=profile_steps, policy=policy, margin=margin, name=name)


def kfac_settings(kfac: KfacConfig | Mapping[str, Any] | None = None, *, damping: float | None = None,
                  ignore: Iterable[str] | None = None, optimizer: Any = None,
                  micro_batches: int | None = None) -> KfacConfig:
    """The ``kfac`` settings :func:`wrap` builds K-FAC from, checked as a config file's ``kfac`` section is
    (:class:`InputError`, one line naming the key), and refused where a loop of your own cannot honour
    them: the true Fisher (its second, sampled-label backward sends its own gradients from stage to
    stage, which torch's schedules do not run), and ``kl_clip``, ``update`` ``momentum`` or ``soap`` without
    the ``optimizer`` whose learning rate they need (``soap``: one with Adam's ``betas`` and ``eps``).
    ``kfac.interval`` plays no part: the packed schedule refreshes once per cycle. ``micro_batches``: the
    torch schedule's, which ``kfac.cov_micro_batches`` is checked against (None: not known yet, not checked)."""
    values = dataclasses.asdict(kfac) if isinstance(kfac, KfacConfig) else dict(kfac or {})
    if damping is not None:
        values["damping"] = damping
    if ignore is not None:
        values["ignore"] = list(ignore)
    where = "torch_pp.wrap kfac"
    if micro_batches is None:  # any count of the config's is as good as another: the cap alone
        cap = values.get("cov_micro_batches")
        default = DataConfig().num_micro_batches
        micro_batches = max(cap, default) if isinstance(cap, int) and not isinstance(cap, bool) else default
    data = {"data": {"num_micro_batches": micro_batches}}
    settings = config_from_dict({"kfac": values, **data}, where).kfac
    if settings.fisher != "empirical":
        raise InputError(where, "kfac.fisher true needs a second backward of sampled labels sent from stage to "
                                "stage, which torch's pipeline schedules do not run: use fisher empirical "
                                "(or pipefisher train with pipeline.engine pipefisher)")
    if settings.update != "base" and optimizer is None:
        raise InputError(where, f"kfac.update {settings.update} steps K-FAC's layers at your optimizer's learning "
                                "rate: give wrap your optimizer (optimizer=...)")
    if settings.update == "soap":
        group = optimizer.param_groups[0]
        if "betas" not in group or "eps" not in group:
            raise InputError(where, f"kfac.update soap runs Adam with your optimizer's betas and eps, and "
                                    f"{type(optimizer).__name__} has none: use an Adam-type optimizer (Adam, AdamW) "
                                    "or kfac.update momentum")
    if settings.kl_clip > 0 and optimizer is None:
        raise InputError(where, f"kfac.kl_clip {settings.kl_clip:g} bounds the step at your optimizer's learning "
                                "rate: give wrap your optimizer (optimizer=...)")
    return settings


def schedule_file(folder: str, name: str = "torch_pp") -> str:
    """Where :func:`wrap` writes the schedule it packs."""
    return os.path.join(folder, f"{name}_schedule.pickle")


def check_folder(folder: str, *, name: str = "torch_pp", overwrite: bool = False,
                 options: tuple[str, str] = ("folder", "overwrite=True")) -> None:
    """Refuse (:class:`InputError`, one line) a ``folder`` :func:`wrap` could not write its files to, or
    one that holds the schedule an earlier run packed under ``name``: a second run would replace it
    without a word. ``options``: how the caller names the folder and the overwrite (a script's
    ``("--out", "--overwrite")``), for the line to say what to change."""
    from pipefisher.safe_io import check_out_folder  # the checks every output folder gets

    check_out_folder(folder, options[0])
    path = schedule_file(folder, name)
    if not overwrite and os.path.exists(path):
        raise InputError(path, f"exists: an earlier run packed this schedule, and this run would replace it; "
                               f"choose another {options[0]}, or {options[1]} to replace it")


class KfacPipeline:
    """This rank's stages, their K-FAC states and the torch engine that runs them (:func:`wrap`)."""

    def __init__(self, stages: Sequence[Any], schedule: Any, *, folder: str, kfac: KfacConfig, optimizer: Any,
                 profile_steps: int, policy: str, margin: float, name: str) -> None:
        torch_api.check_torch("pipefisher.runtime.torch_pp")
        if profile_steps < 2:
            raise InputError(None, "torch_pp.wrap: profile_steps must be at least 2 (the median step skips the first)")
        if not stages:
            raise InputError(None, "torch_pp.wrap: no stages")
        from pipefisher.policies import get_policy

        self.packer = get_policy(policy)  # refuses an unknown policy now, not after profiling
        self.folder, self.name, self.margin = folder, name, margin
        self.profile_steps = profile_steps
        ordered = sorted(stages, key=lambda st: st.stage_index)
        self.copies = dict(enumerate(ordered))  # copy j: this rank's j-th stage (chunk j)
        self.settings, self.optimizer = kfac, optimizer
        self.kfacs = {j: kfac_from_config(kfac, st.submod) for j, st in self.copies.items()}
        self.kfac = StageCopiesKFAC(self.kfacs, list(self.copies), interleaved=len(self.copies) > 1)
        self.kfac_optimizer: Any = None  # K-FAC's layers' own update (kfac.update momentum, soap), else yours
        self._initial_lr = 0.0
        if kfac.update != "base":
            group = optimizer.param_groups[0]
            self._initial_lr = float(group.get("initial_lr", group["lr"]))
            self.kfac_optimizer = make_kfac_optimizer(kfac, self.kfac, lr=float(group["lr"]),
                                                      betas=group.get("betas", ()), eps=group.get("eps", 0.0),
                                                      weight_decay=group.get("weight_decay", 0.0))
        device = ordered[0].device
        self.profiler = Profiler(False, device)  # on for the profiled steps only
        self.group = ordered[0].group
        params = {j: [p for p in st.submod.parameters() if p.requires_grad] for j, st in self.copies.items()}
        m = torch_api.micro_batches(schedule)
        self._inputs: tuple[tuple[Any, ...], dict[str, Any], Any] = ((), {}, None)
        self.engine = TorchEngine(self.copies, actions=torch_api.schedule_actions(schedule), micro_batches=m,
                                  loss_fn=torch_api.loss_function(schedule), inputs=lambda step: self._inputs,
                                  grads=GradientBuckets(params, None, 1), scale_grads=torch_api.scales_grads(schedule),
                                  span=self.profiler.span, kfacs=self.kfacs)
        self.rank = self.engine.rank
        self.executor: ScheduleExecutor | None = None
        self.schedule_path = schedule_file(folder, name)
        self.steps_done = 0

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any) -> None:
        """One training step: the pipeline over the whole batch (split into the schedule's micro-batches),
        K-FAC where this step puts it, gradients averaged and preconditioned; ``losses`` gets each
        micro-batch's loss on the rank holding the last stage."""
        k = self.steps_done
        self._inputs = (args, kwargs, target)
        if k == 0:  # torch sets its stages up (metadata, p2p) in its first step: nothing saved for K-FAC
            plain_step(self.engine, self.engine.labels, k, self.kfac, False, self._end_of_step, self.profiler.span)
        elif k <= self.profile_steps:
            if k == 1:
                self.profiler.enabled = True
                self.profiler.align(self.group)
            self.profiler.barrier(self.group)
            plain_step(self.engine, self.engine.labels, k, self.kfac, True, self._end_of_step, self.profiler.span)
            if k == self.profile_steps:
                self._pack()
        else:
            assert self.executor is not None
            self.executor.run_step(k - self.profile_steps)
        if losses is not None and self.engine.holds_last:
            losses.clear()
            losses.extend(self.engine.step_losses)
        self.steps_done = k + 1

    @property
    def cycle(self) -> int | None:
        """The packed schedule's K-FAC cycle k (None before it is packed)."""
        return None if self.executor is None else self.executor.cycle

    def _end_of_step(self) -> None:
        """Gradients averaged, preconditioned, (``kfac.kl_clip``) scaled and (``kfac.update`` ``momentum``,
        ``soap``) K-FAC's layers stepped, in the Updater's order; profiled as :data:`UPDATE_KEY`."""
        with self.profiler.span(UPDATE_KEY):
            self.engine.allreduce_gradients()
            self.kfac.precondition_all()
            lr = 0.0 if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])
            if self.kfac_optimizer is not None:  # on the first-order schedule, as Updater.set_step puts it
                scale = lr / self._initial_lr if self._initial_lr > 0 else 0.0
                lr = kfac_peak_lr(self.settings, self._initial_lr) * scale
                for group in self.kfac_optimizer.param_groups:
                    group["lr"] = lr
            if self.settings.kl_clip > 0:
                group = self.group if self.group is not None else dist.group.WORLD
                clip_kl(self.kfac, lr, self.settings.kl_clip, group)
            if self.kfac_optimizer is not None:
                self.kfac_optimizer.step()
                self.kfac_optimizer.zero_grad(set_to_none=True)  # your optimizer skips K-FAC's layers

    def _pack(self) -> None:
        """Timelines of every rank into ``folder``; rank 0 packs and validates; every rank gets the schedule."""
        os.makedirs(self.folder, exist_ok=True)
        self.profiler.write(self.folder, self.name, self.rank, cov_limit(self.settings.cov_micro_batches))
        self.profiler.enabled = False
        dist.barrier(group=self.group)
        nodes: list[Any] = [None]
        if self.rank == 0:
            nodes[0] = self._packed(dist.get_world_size(self.group))
        dist.broadcast_object_list(nodes, group_src=0, group=self.group)
        if isinstance(nodes[0], str):
            raise InputError(self.schedule_path, nodes[0])
        self.kfac.set_saving(True)
        self.executor = ScheduleExecutor(nodes[0][self.rank], self.engine, self.kfacs, self._end_of_step)

    def _packed(self, ranks: int) -> Any:
        """Rank 0: the schedule packed from every rank's profile, checked and saved; or why not (one line)."""
        from pipefisher.policies.packing import pack_job
        from pipefisher.schedule.timeline import load_job

        timelines = [os.path.join(self.folder, timeline_filename(self.name, r)) for r in range(ranks)]
        packing = pack_job(load_job(timelines), self.packer, self.margin)
        packing.save(self.schedule_path)
        return packing.problem or packing.schedule.to_file_data()

