"""First-order optimizers as transformer trainers use them: parameter groups, AdamW, LAMB, Muon with
AdamW, warm-up then decay, global-norm clipping.

LAMB is written here: the published PipeFisher BERT runs used it, and no maintained library provides it
without a heavy dependency stack (timm needs a torchvision matching the torch build; torch-optimizer
has been unmaintained since 2021; torch itself has none).

Muon is torch's own (``torch.optim.Muon``, torch >= 2.9): this module only decides which parameters it
takes (:func:`muon_split`) and pairs it with AdamW for the rest (:class:`MuonWithAdamW`).

Everything here is per stage: each pipeline stage owns the optimizer of its own parameters. The only
collective is :func:`clip_grad_norm`'s all-reduce, so that every stage clips by the same global norm.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.errors import InputError
from pipefisher.kfac.layers import is_ignored
from pipefisher.runtime.job.config import LR_SCHEDULES, OptimConfig

NO_DECAY_MARKERS = ("LayerNorm",)
"""Substrings of parameter names that never take weight decay (besides names ending in ``bias``)."""


def no_decay(name: str, param: torch.Tensor | None = None) -> bool:
    """Whether a parameter is exempt from weight decay: biases, LayerNorm weights and, when ``param`` is
    given, every 1-D tensor (gains and offsets of any norm layer, whatever it is called).

    Decaying them only shrinks scales and offsets that the next layer would have to undo, and BERT's
    recipes exclude them. Without ``param`` only the name decides (names containing ``LayerNorm`` or
    ending in ``bias``); embeddings and weight matrices (2-D) always decay.
    """
    if name.endswith("bias") or any(m in name for m in NO_DECAY_MARKERS):
        return True
    return param is not None and param.ndim <= 1


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, in this order and each in model order: ``decay`` (``weight_decay``) and ``no_decay``
    (0, see :func:`no_decay`); empty groups are dropped.

    Each group carries a ``"group"`` label for readability (torch keeps extra keys and saves them in
    ``state_dict``). Frozen parameters are left out and a parameter met twice (tied weights) is kept
    once, since torch refuses a parameter in two groups.
    """
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (plain if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay), "group": "decay"},
              {"params": plain, "weight_decay": 0.0, "group": "no_decay"}]
    return [g for g in groups if g["params"]]


MUON_SINCE = "2.9"
"""The first torch release with ``torch.optim.Muon``."""


def muon_refusal() -> str | None:
    """Why this torch cannot run ``optim.name: muon`` (one line), or None when it can: it needs
    ``torch.optim.Muon`` with the ``adjust_lr_fn`` argument (:func:`make_muon` passes ``match_rms_adamw``)."""
    import inspect

    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and "adjust_lr_fn" in inspect.signature(muon).parameters:
        return None
    return (f"optim.name muon needs torch >= {MUON_SINCE} (torch.optim.Muon); this torch is {torch.__version__}: "
            f"pip install 'torch>={MUON_SINCE}', or choose another optim.name")


def check_optimizer(cfg: OptimConfig, where: str | os.PathLike[str] | None = None) -> None:
    """Refuse, before any worker starts, an optimizer this torch lacks (one line naming ``where``)."""
    if cfg.name == "muon" and (why := muon_refusal()):
        raise InputError(where, why)


def muon_split(named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig
               ) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """The rule of ``optim.name: muon``: (Muon's parameters, AdamW's), each in model order.

    Muon takes a trainable parameter when it is 2-D (a weight matrix: torch's Muon takes nothing else),
    ``cfg.muon_include`` is empty or names it, and ``cfg.muon_exclude`` does not. A pattern names a
    parameter as ``kfac.ignore`` names a module (:func:`pipefisher.kfac.layers.is_ignored`): it equals one
    of the dotted parts of its name (``embeddings`` names ``embeddings.word_embeddings.weight``) or is a
    dotted prefix of it (``encoder.layer.0``). The default exclusions are input embeddings and output
    heads (:data:`pipefisher.runtime.job.config.DEFAULT_MUON_EXCLUDE`), which Muon is not meant for;
    biases and norms are 1-D, so they always go to AdamW. Frozen parameters are left out and a
    parameter met twice (tied weights) is kept once, under its first name.
    """
    muon: list[tuple[str, nn.Parameter]] = []
    rest: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        takes = (p.ndim == 2 and (not cfg.muon_include or is_ignored(name, cfg.muon_include))
                 and not is_ignored(name, cfg.muon_exclude))
        (muon if takes else rest).append((name, p))
    return muon, rest


class MuonWithAdamW:
    """torch's Muon on the hidden weight matrices and torch's AdamW on every other parameter, as one
    optimizer: what the trainer, the learning-rate schedule and checkpoints use of an optimizer.

    ``param_groups`` is one view of both optimizers' groups (Muon's first, labelled ``muon``; then
    AdamW's ``decay`` and ``no_decay``): setting a group's ``lr`` sets it in the optimizer that owns
    it. ``step`` and ``zero_grad`` go to both; ``state_dict`` holds both (``muon`` is None on a stage
    where no parameter is Muon's, e.g. a head-only stage). Muon's learning rate is scaled per matrix to
    match AdamW's update size (``adjust_lr_fn="match_rms_adamw"``, Liu et al. 2025, "Muon is Scalable
    for LLM Training"), so one peak ``lr`` serves both groups.
    """

    def __init__(self, muon: torch.optim.Optimizer | None, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Per-parameter state of both optimizers (parameters are never in both)."""
        return {p: st for o in self.optimizers for p, st in o.state.items()}

    def step(self, closure: Any = None) -> Any:
        """Both optimizers' steps (each under no_grad, as torch's are), after ``closure`` if given."""
        loss = None if closure is None else closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": None if self.muon is None else self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"muon", "adamw"} \
                or (state["muon"] is None) != (self.muon is None):
            raise ValueError("the saved optimizer state is not that of Muon with AdamW over these parameters")
        if self.muon is not None:
            self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def make_muon(cfg: OptimConfig, named_params: Iterable[tuple[str, nn.Parameter]]) -> MuonWithAdamW:
    """``optim.name: muon``: torch's Muon on :func:`muon_split`'s matrices (momentum ``cfg.muon_momentum``,
    Nesterov, decoupled weight decay ``cfg.weight_decay``), AdamW on the rest (:func:`param_groups`)."""
    check_optimizer(cfg)
    muon_named, rest = muon_split(named_params, cfg)
    muon = None
    if muon_named:
        muon = torch.optim.Muon([{"params": [p for _, p in muon_named], "group": "muon"}], lr=cfg.lr,
                                weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=True,
                                adjust_lr_fn="match_rms_adamw")
    groups = param_groups(rest, cfg.weight_decay) or [{"params": [], "weight_decay": 0.0, "group": "no_decay"}]
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(float(cfg.betas[0]), float(cfg.betas[1])), eps=cfg.eps)
    return MuonWithAdamW(muon, adamw)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2).

    Per parameter tensor ``p`` with gradient ``g`` at step ``t`` (1-based)::

        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t)           v_hat = v / (1 - b2^t)       (bias correction: applied)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p              (decoupled weight decay)
        r = ||p|| / ||u||   (1 where either norm is 0)                  (trust ratio, phi = identity)
        p = p - lr * r * u

    The trust ratio sets each tensor's step relative to its own size, which is what keeps very large
    batches stable. Bias correction follows the paper (Google's original BERT LAMB left it out). The
    trust ratio applies to every tensor, no-decay ones included; a zero tensor (a fresh bias) takes a
    plain Adam step of size ``lr``. The norms stay on the device (no host synchronisation), and the
    state is ``step`` (a float64 scalar, like torch's Adam), ``exp_avg`` and ``exp_avg_sq``, so a
    ``state_dict`` round trip continues bit-exactly.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if not lr > 0 or not eps > 0 or weight_decay < 0 or len(betas) != 2 \
                or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("Lamb needs lr > 0, eps > 0, weight_decay >= 0 and two betas in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])  # a CPU scalar: no device synchronisation
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(eps))
                if wd != 0:
                    update.add_(p, alpha=wd)
                w_norm = torch.linalg.vector_norm(p)
                u_norm = torch.linalg.vector_norm(update)
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update.mul_(ratio), alpha=-lr)
        return loss


def make_optimizer(cfg: OptimConfig, named_params: Iterable[tuple[str, nn.Parameter]]
                   ) -> torch.optim.Optimizer | MuonWithAdamW:
    """The configured optimizer over :func:`param_groups` (weight decay never on biases or norms).

    ``adamw``, ``lamb`` and ``muon``: decoupled weight decay (``p -= lr * wd * p`` beside the step);
    ``adam`` and ``sgd``: coupled L2 decay (``wd * p`` added to the gradient), as torch defines them,
    on the decay group only; ``muon``: :func:`make_muon`. With no trainable parameter (every one handed
    to K-FAC's own update) the optimizer holds one empty group, so setting learning rates and stepping
    still work.
    """
    if len(cfg.betas) != 2:
        raise ValueError(f"optim.betas must be two numbers, not {cfg.betas!r}")
    if cfg.name == "muon":
        return make_muon(cfg, named_params)
    groups = param_groups(named_params, cfg.weight_decay)
    if not groups:
        groups = [{"params": [], "weight_decay": 0.0, "group": "no_decay"}]
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, lr_schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at 0-based ``step``.

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step already moves,
    the last warm-up step reaches 1). Then, with ``progress = (step - warmup_steps) / (total_steps -
    warmup_steps)`` clamped to [0, 1]: ``constant`` stays 1; ``linear`` is ``1 - progress``; ``cosine``
    is ``(1 + cos(pi * progress)) / 2``, each mapped onto [``min_lr_ratio``, 1]. So the floor is
    reached at step ``total_steps`` and kept after it; with a run of N steps and ``total_steps = N``
    the last step (N - 1) still moves, as in the usual transformer schedules. ``warmup_steps >=
    total_steps`` decays at once after the warm-up.
    """
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {lr_schedule!r} (one of {', '.join(LR_SCHEDULES)})")
    if step < 0 or warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError("lr_factor needs step >= 0, warmup_steps >= 0 and min_lr_ratio in [0, 1]")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class LRSchedule:
    """Sets optimizers' learning rates for a step from :func:`lr_factor`.

    Stateless apart from the config (unlike torch's schedulers, which count calls), so a resumed run
    just applies its step. ``total_steps`` is where the decay ends: ``cfg.decay_steps`` when set,
    otherwise the given ``total_steps`` (the run's number of steps).
    """

    def __init__(self, cfg: OptimConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.total_steps = int(cfg.decay_steps or total_steps)

    def factor(self, step: int) -> float:
        c = self.cfg
        return lr_factor(step, warmup_steps=c.warmup_steps, total_steps=self.total_steps, lr_schedule=c.lr_schedule,
                         min_lr_ratio=c.min_lr_ratio)

    def apply(self, optimizer: torch.optim.Optimizer | MuonWithAdamW, step: int, peak_lr: float | None = None) -> float:
        """Set every group's lr to ``peak_lr * factor(step)`` (``peak_lr`` defaults to ``cfg.lr``; K-FAC's
        momentum update passes its own); returns that lr."""
        lr = (self.cfg.lr if peak_lr is None else float(peak_lr)) * self.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, group: Any = None,
                   share: float = 1.0) -> torch.Tensor:
    """Scale gradients by ``min(1, max_norm / (norm + 1e-6))`` where ``norm`` is their global L2 norm;
    returns the norm before clipping, a 0-dim float64 tensor on the device.

    With ``group`` (a process group: the stages of ONE pipeline) the sum of squares is all-reduced over
    it, so every stage clips by the norm of the whole model's gradient and the result equals clipping
    the unsplit model. Data-parallel replicas hold identical gradients after their all-reduce, so the
    pipeline is enough. Every rank of ``group`` must call this, with or without gradients. Squares are
    summed in float64 so the norm does not depend on how the model is split. A non-finite norm scales
    nothing and is returned: the caller decides (skip the step, stop). ``share`` weighs this rank's
    sum of squares before the all-reduce (1/2 where two devices hold a copy of every stage: Chimera).
    The factor is computed and applied on the device (a factor of 1 where nothing is clipped): the host
    never waits for the norm.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm needs max_norm > 0, not {max_norm}")
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        device = grads[0].device
    elif group is not None and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        sq += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).to(device).square()
    if group is not None:
        if share != 1.0:
            sq *= share
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    scale = torch.where(torch.isfinite(norm), torch.clamp(max_norm / (norm + 1e-6), max=1.0), torch.ones_like(norm))
    if grads:
        torch._foreach_mul_([g.detach() for g in grads], scale)
    return norm
