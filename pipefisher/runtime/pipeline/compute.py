"""How a stage computes its forwards and backwards: mixed precision and activation recomputation.

``train.precision`` ``bf16`` / ``fp16``: every forward runs under ``torch.autocast`` in that dtype, so
matrix products run in it while weights, gradients and optimizer state stay float32. K-FAC keeps its
factors in float32: the inputs and output gradients it saves are cast to ``kfac.save_dtype`` (float32
by default) as they are saved, and the covariance, all-reduce and inverse work on those. Activations
and their gradients cross stage boundaries in the compute dtype (:func:`wire_dtype`), half the bytes of
float32. bfloat16 has float32's exponent, so gradients need no loss scaling; float16's narrow one
loses small gradients, so ``fp16`` scales the loss (:class:`LossScale`).

``train.recompute: layer``: each transformer block of a stage (:func:`blocks`) runs under
``torch.utils.checkpoint``, which keeps only the block's input after the forward and runs the block
again inside its backward. K-FAC must take each micro-batch's layer inputs once: the second run
happens under :meth:`pipefisher.kfac.KFAC.replaying`, which its forward hooks skip. The output
gradients (factor B) come from the backward, which runs once either way.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager

import torch
from torch import nn

if TYPE_CHECKING:
    from pipefisher.kfac import KFAC

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``train.precision`` -> the dtype forwards and backwards compute in."""


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"train.precision must be one of {', '.join(COMPUTE_DTYPES)}, not {precision!r}")
    return COMPUTE_DTYPES[precision]


def autocast(precision: str, device: torch.device) -> ContextManager[Any]:
    """The context a stage's forward runs in: nothing for fp32, else autocast to the compute dtype."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def wire_dtype(precision: str) -> torch.dtype:
    """The dtype of activations and gradients sent between stages: the compute dtype."""
    return compute_dtype(precision)


class LossScale:
    """Dynamic loss scaling for ``fp16``, one per worker, in agreement over the whole pipeline.

    The last stage starts each backward from ``scale`` instead of 1 (:meth:`root`), so every gradient
    of the step is ``scale`` times too large and small ones survive float16. K-FAC divides the output
    gradients it saves by the scale of their step. At the update the gradients are divided back
    (:meth:`unscale`); if any of them, on any stage, is not finite, the step's update is skipped and the
    scale halved, and after ``growth_interval`` finite steps in a row it is doubled (the policy of
    torch's ``GradScaler``, made to agree across the stages of a pipeline and kept in checkpoints).
    """

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval = float(scale), int(growth_interval)
        self.good_steps = 0  # finite steps since the last change of scale
        self.skipped = 0  # updates skipped for overflow over the run

    def root(self, out: torch.Tensor) -> torch.Tensor:
        """The gradient a last stage's backward starts from: the scale, in ``out``'s shape."""
        return torch.full_like(out, self.scale)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale: a backward from 1 through it (torch's ``PipelineStage``\\ s start
        the last stage's there) reaches the loss as :meth:`root`, the same numbers."""
        return loss * self.scale

    def unscale(self, params: list[nn.Parameter]) -> torch.Tensor | bool:
        """Divide the gradients by the scale; whether all of them are finite (on this worker), as a 0-dim
        bool tensor on their device (True without gradients): the caller reads it once, with its peers'."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return True
        torch._foreach_mul_(grads, 1.0 / self.scale)
        return torch.stack([torch.isfinite(g).all() for g in grads]).all()

    def update(self, finite: bool) -> None:
        """After the step's update: halve the scale on an overflow, double it after a long finite run."""
        if not finite:
            self.scale, self.good_steps = self.scale / 2, 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale, self.good_steps = self.scale * 2, 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = int(state["skipped"])


def blocks(stage: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stage's transformer blocks: every module held in an ``nn.ModuleList`` or ``nn.ModuleDict``
    that no other such container holds (``encoder.layer.3``, ``transformer.h.5``), by name."""
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found.extend((f"{path}.{key}", block) for key, block in child.named_children())
            else:
                walk(path, child)

    walk("", stage)
    return found


def recompute_blocks(stage: nn.Module, kfac: KFAC | None = None) -> list[str]:
    """Run each of ``stage``'s :func:`blocks` under activation checkpointing; returns their names.

    ``kfac`` (the stage's K-FAC, if any) is paused while a block is recomputed, so its inputs count
    once. The random state is restored for the second run (dropout draws the same masks), and so is
    autocast's. A stage with no blocks is refused: nothing would be recomputed.
    """
    from torch.utils.checkpoint import checkpoint

    found = blocks(stage)
    if not found:
        raise ValueError(f"train.recompute: layer needs transformer blocks in an nn.ModuleList or nn.ModuleDict; "
                         f"{type(stage).__name__} holds none")

    def contexts() -> tuple[ContextManager[Any], ContextManager[Any]]:
        return nullcontext(), (kfac.replaying() if kfac is not None else nullcontext())

    for _, block in found:
        if getattr(block, "_pipefisher_recomputed", False):
            continue
        plain = block.forward
        block.forward = functools.partial(_checkpointed, checkpoint, plain, contexts)  # type: ignore[method-assign]
        block._pipefisher_recomputed = True  # type: ignore[assignment]
    return [name for name, _ in found]


def _checkpointed(checkpoint: Any, forward: Any, contexts: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` under non-reentrant checkpointing (which passes keyword arguments through)."""
    if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
