"""The optimizer side of a step's ``-- end --``: clip, precondition, KL-clip, first-order steps.

One definition, used by the trainer and by the tests' single-process replay, so "the scheduled run
equals a replay of its labels" compares the same update rule.

Order, every step (after the data-parallel gradient all-reduce):

0. ``train.precision: fp16``: the gradients are divided by the loss scale; if any gradient of any
   stage is not finite, the step's update is skipped (gradients cleared) and the scale halved;
1. the learning rates of this step (warm-up, then the schedule) are set;
2. ``optim.clip_norm``: gradients are clipped by their global norm over the whole pipeline;
3. K-FAC layers with inverses get ``B^-1 G A^-1`` in place of their gradients;
4. ``kfac.kl_clip``: the preconditioned gradients are scaled so the step's predicted KL change stays
   under the bound (summed over the whole pipeline, so every stage uses the same factor);
5. ``kfac.update: base`` - the first-order optimizer (AdamW, LAMB, ...) steps every parameter, the
   preconditioned ones included; ``kfac.update: momentum`` - the K-FAC layers take a heavy-ball
   momentum step with their own learning rate ``kfac.lr``, ``kfac.update: soap`` - Adam in their
   eigenbases (:class:`EigenbasisAdam`), every other parameter the first-order optimizer (K-FAC's
   optimizer steps first, inside the profile's ``precondition`` span: the two share no parameter).

Why ``base`` is the default: measured on the bundled real-text benchmark's model, the preconditioned
gradient fed to AdamW left the unigram plateau (held-out loss about 6.3) by step 100, while the momentum update (with
KL-clip 1e-3 and 1e-2, learning rates 0.1 and 0.3) stayed on it as long as AdamW alone; the published
PipeFisher and KAISA BERT runs also feed K-FAC's gradient to the base optimizer (LAMB).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.kfac import KFAC
from pipefisher.kfac.eigenbasis import EigenbasisAdam
from pipefisher.kfac.factors import kl_clip_scale
from pipefisher.kfac.layers import DTYPES
from pipefisher.runtime.job.config import KfacConfig, RunConfig, check_pieces_resolved, cov_limit
from pipefisher.runtime.job.host import HostReads
from pipefisher.runtime.pipeline.contracts import Curvature, Span
from pipefisher.runtime.train.optim import LRSchedule, clip_grad_norm, make_optimizer
from pipefisher.schedule.timeline import PRECONDITION_KEY


class Updater:
    """Owns the optimizers of one stage and applies the update rule above.

    ``pipe_group`` is the process group of this replica's pipeline (all its stages), over which the
    global gradient norm and the KL-clip sum are all-reduced; None in one process. ``copies``: how
    many devices of the pipeline hold each stage (2 under Chimera), so each copy contributes its share
    of those sums and every stage counts once. ``span`` (the profiler's) times what K-FAC adds to every
    step's update as :data:`PRECONDITION_KEY`: the preconditioning, the KL-clip and K-FAC's own optimizer
    (``kfac.update: momentum, soap``: under ``soap`` the whole of K-FAC's end-of-step work, Adam in the
    eigenbases; the plan's first-order step is the profiled update without it, ``pipefisher.cost.objective``). ``kfac``: the stage's K-FAC (all its
    copies as one), or None. ``host`` reads fp16's overflow flag (the worker's counter,
    :mod:`pipefisher.runtime.job.host`; None: a counter of its own).
    """

    def __init__(self, cfg: RunConfig, stage: nn.Module, kfac: Curvature | None, total_steps: int,
                 pipe_group: Any = None, copies: int = 1, span: Span | None = None, scaler: Any = None,
                 host: HostReads | None = None) -> None:
        self.cfg, self.kfac, self.pipe_group = cfg, kfac, pipe_group
        self.host = host if host is not None else HostReads()
        self.scaler = scaler  # fp16's LossScale (pipefisher.runtime.pipeline.compute), else None
        self.span = span or (lambda key: nullcontext())
        self.share = 1.0 / copies
        self.schedule = LRSchedule(cfg.optim, total_steps)
        own = kfac is not None and cfg.kfac.update in ("momentum", "soap")
        kfac_ids = {id(p) for p in kfac.parameters()} if own else set()
        named = [(n, p) for n, p in stage.named_parameters() if id(p) not in kfac_ids]
        self.optimizer = make_optimizer(cfg.optim, named)
        o = cfg.optim
        self.kfac_optimizer = make_kfac_optimizer(cfg.kfac, kfac, lr=o.lr, betas=o.betas, eps=o.eps,
                                             weight_decay=o.weight_decay) if own else None
        self.device = next(stage.parameters()).device

    @property
    def lr(self) -> float:
        """The first-order learning rate of the current step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_step(self, step: int) -> None:
        """Learning rates of training step ``step`` (0-based); a resumed run just calls it again."""
        self.schedule.apply(self.optimizer, step)
        if self.kfac_optimizer is not None:
            self.schedule.apply(self.kfac_optimizer, step, peak_lr=kfac_peak_lr(self.cfg.kfac, self.cfg.optim.lr))

    def step(self, stage: nn.Module) -> None:
        """Steps 0 and 2-5 above on ``stage``'s gradients, then clear them. Reads nothing back from the
        device but fp16's overflow flag, which decides whether the optimizer steps (the step's one read,
        through the worker's :class:`~pipefisher.runtime.job.host.HostReads`, which brings whatever waits for
        a read along)."""
        o, k = self.cfg.optim, self.cfg.kfac
        if self.scaler is not None:
            finite = torch.as_tensor(self.scaler.unscale(list(stage.parameters())), device=self.device)
            overflow = (~finite).to(torch.float32).reshape(1)
            if self.pipe_group is not None:  # every stage skips, or none (replicas hold the same gradients)
                dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.pipe_group)
            skip = self.host.flag(overflow)
            self.scaler.update(not skip)
            if skip:
                self._clear()
                return
        if o.clip_norm > 0:
            clip_grad_norm(stage.parameters(), o.clip_norm, group=self.pipe_group, share=self.share)
        if self.kfac is not None:
            with self.span(PRECONDITION_KEY):  # all of K-FAC's share of the update: what first-order does not pay
                self.kfac.precondition_all()
                if k.kl_clip > 0:
                    lr = (self.kfac_optimizer.param_groups[0]["lr"] if self.kfac_optimizer is not None else self.lr)
                    clip_kl(self.kfac, lr, k.kl_clip, self.pipe_group, self.share)
                if self.kfac_optimizer is not None:  # its own parameters: none of the first-order optimizer's
                    self.kfac_optimizer.step()
        self.optimizer.step()
        self._clear()

    def _clear(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.kfac_optimizer is not None:
            self.kfac_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """The optimizers' state (K-FAC's own SGD too, with ``kfac.update: momentum``); the learning rate
        is a function of the step, and fp16's loss scale is a component of its own."""
        return {"optimizer": self.optimizer.state_dict(),
                "kfac_optimizer": None if self.kfac_optimizer is None else self.kfac_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.kfac_optimizer is not None:
            self.kfac_optimizer.load_state_dict(state["kfac_optimizer"])


def make_kfac_optimizer(k: KfacConfig, kfac: Curvature, *, lr: float, betas: Sequence[float], eps: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer that steps K-FAC's layers under ``kfac.update`` ``momentum`` or ``soap`` (step 5 above),
    for :class:`Updater` and :mod:`pipefisher.runtime.torch_pp`: ``soap`` - Adam in the layers' eigenbases
    (:class:`EigenbasisAdam`) with the first-order optimizer's ``lr``, ``betas``, ``eps`` and
    ``weight_decay``, and ``kfac.nesterov``; ``momentum`` - heavy-ball SGD at ``kfac.lr`` with ``kfac.momentum``."""
    if k.update == "soap":
        return EigenbasisAdam(kfac, lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps,
                              weight_decay=weight_decay, basis_block=k.basis_block,
                              rotation_dtype=DTYPES[k.rotation_dtype], nesterov=k.nesterov)
    if k.update == "momentum":
        return torch.optim.SGD(kfac.parameters(), lr=k.lr, momentum=k.momentum)
    raise ValueError(f"kfac.update {k.update} steps K-FAC's layers with the first-order optimizer")


def kfac_peak_lr(k: KfacConfig, lr: float) -> float:
    """The learning rate of :func:`make_kfac_optimizer`'s optimizer where the first-order one's is ``lr``
    (both follow one schedule): ``soap`` steps at ``lr`` itself, ``momentum`` at its own ``kfac.lr``."""
    return lr if k.update == "soap" else k.lr


def clip_kl(kfac: Curvature, lr: float, bound: float, group: Any = None, share: float = 1.0) -> None:
    """Step 4 above: scale the preconditioned gradients so the step's predicted KL change (at learning
    rate ``lr``), summed over the pipeline's process ``group`` (None: one process), stays under
    ``bound``; every stage then uses the same factor. ``share``: this device's share of each stage it
    holds (1/2 under Chimera's two copies), so every stage counts once. The sum stays on the device."""
    total = kfac.grad_dot_step * share
    if group is not None:
        t = total.reshape(1).clone()
        dist.all_reduce(t, group=group)
        total = t[0]
    kfac.scale_step(kl_clip_scale(total, lr, bound))


def make_kfac(cfg: RunConfig, stage: nn.Module, *, dp_group: Any = None, dp_size: int = 1,
              warn: Any = None, drift: bool = True, host: HostReads | None = None) -> KFAC:
    """The stage's K-FAC as the run config says (:func:`kfac_from_config`, its loss divided over the
    config's micro-batches), so trainer and replay build the same one."""
    return kfac_from_config(cfg.kfac, stage, loss_scale=cfg.data.num_micro_batches, dp_group=dp_group,
                            dp_size=dp_size, warn=warn, drift=drift, host=host)


def kfac_from_config(k: KfacConfig, module: nn.Module, *, loss_scale: float = 1.0, dp_group: Any = None,
                     dp_size: int = 1, warn: Any = None, drift: bool = True, host: HostReads | None = None) -> KFAC:
    """``module``'s K-FAC as a config's ``kfac`` section says: the one construction from the config, for
    ``pipefisher train`` (:func:`make_kfac`) and :func:`pipefisher.runtime.torch_pp.wrap`.
    ``loss_scale``: what the loss of a micro-batch was divided by (the output gradients K-FAC sees
    are that much smaller). ``drift``: measure the curvature drift at refreshes (replica 0 does:
    replicas measure the same). ``host``: the worker's counter, which reads its inverses' checks with
    the worker's next read (None: each read at once)."""
    check_pieces_resolved(k, None, "a worker")  # pipefisher run resolves best before its workers start
    soap = k.update == "soap"  # its refreshes keep eigenbases: check_config refuses kfac.inverse: eigen with it
    return KFAC(module, damping=k.damping, damping_min=k.damping_min or None, damping_decay=k.damping_decay,
                ignore=k.ignore, loss_scale=loss_scale, dp_group=dp_group, dp_size=dp_size,
                factor_decay=k.factor_decay, inverse="eigenbasis" if soap else k.inverse, inverse_dtype=k.inverse_dtype,
                on_bad_factor=k.on_bad_factor, save_dtype=k.save_dtype, fisher=k.fisher, warn=warn,
                cov_stride=k.cov_stride, drift=drift and not soap, refresh_pieces=k.refresh_pieces, host=host,
                cov_micro_batches=cov_limit(k.cov_micro_batches), basis_block=k.basis_block,
                factor_decay_per_step=k.factor_decay_per_step)
