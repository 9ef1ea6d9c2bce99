"""What a stage builder is and how the runtime gets its stages: ``model.builder`` names a function
``build(cfg, index, num_stages, seed) -> stage``; the stage protocol; the language-model loss every stage
ends with.

Every stage copy the runtime holds is made through :func:`make_stage`, built-in model or not; the
built-in BERT (:mod:`pipefisher.runtime.models.bert`) and the Hugging Face builders
(:mod:`pipefisher.runtime.models.hf`) are builders like any other.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipefisher.errors import InputError, described
from pipefisher.runtime.job.config import RunConfig

IGNORE_INDEX = -100

StageBuilder = Callable[[RunConfig, int, int, int], nn.Module]
"""``build(cfg, index, num_stages, seed) -> stage``: what ``model.builder`` names (see :func:`pipefisher.runtime.models.bert.build_stage`)."""

STAGE_ATTRIBUTES = ("is_first", "is_last", "hidden_size")
"""What the runtime reads off a stage besides ``forward(x, labels=None, sample=None)``."""


def load_builder(spec: str, where: str | os.PathLike[str] | None = None,
                 key: str = "model.builder") -> StageBuilder:
    """The function ``"package.module:function"`` names, or an :class:`InputError` (one line, ``where``,
    naming the config ``key`` that gave ``spec``: ``data.builder`` loads its function here too).

    The module is imported as ``python -m`` would, so a module in the current directory works from
    ``pipefisher train`` too (console scripts do not put the current directory on the path).
    """
    module_name, _, func_name = spec.partition(":")
    what = f"{key} {spec!r}"
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name) or os.getcwd() in sys.path:
                raise
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = f"module {err.name!r} not found" if err.name else str(err)
        raise InputError(where, f"{what}: cannot import {module_name!r} ({missing})") from None
    except Exception as err:  # the user's module failed while importing: say how, on one line
        raise InputError(where, f"{what}: importing {module_name!r} failed: {described(err)}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise InputError(where, f"{what}: module {module_name!r} has no function {func_name!r}")
    return func


def check_stage(stage: Any, spec: str, index: int, num_stages: int,
                where: str | os.PathLike[str] | None = None) -> nn.Module:
    """``stage`` if it keeps the stage protocol (an ``nn.Module`` with :data:`STAGE_ATTRIBUTES` that
    agree with its place in the pipeline), else an :class:`InputError` naming the builder."""
    what = f"model.builder {spec!r}: stage {index} of {num_stages}"
    if not isinstance(stage, nn.Module):
        raise InputError(where, f"{what} is a {type(stage).__name__}, not a torch.nn.Module")
    missing = [a for a in STAGE_ATTRIBUTES if not hasattr(stage, a)]
    if missing:
        raise InputError(where, f"{what} lacks the stage attribute(s) {', '.join(missing)} "
                                f"(a stage has {', '.join(STAGE_ATTRIBUTES)} and forward(x, labels=None, sample=None))")
    if (bool(stage.is_first), bool(stage.is_last)) != (index == 0, index == num_stages - 1):
        raise InputError(where, f"{what} says is_first={stage.is_first}, is_last={stage.is_last}")
    if not isinstance(stage.hidden_size, int) or stage.hidden_size < 1:
        raise InputError(where, f"{what} has hidden_size {stage.hidden_size!r}, not a positive int")
    return stage


def make_stage(cfg: RunConfig, index: int, num_stages: int, seed: int | None = None,
               where: str | os.PathLike[str] | None = None) -> nn.Module:
    """Stage ``index`` of ``num_stages`` from ``cfg``'s ``model.builder`` (seed: ``data.seed``), checked.

    Every stage copy the runtime holds (both Chimera copies included) is made here.
    """
    spec = cfg.model.builder
    builder = load_builder(spec, where)
    stage = builder(cfg, index, num_stages, cfg.data.seed if seed is None else seed)
    return check_stage(stage, spec, index, num_stages, where)


def check_builder(cfg: RunConfig, where: str | os.PathLike[str] | None = None) -> None:
    """Refuse, before any worker starts, a ``model.builder`` that does not import or whose stages lack
    the protocol (one line naming ``where``, the config file). The stages are built on torch's "meta"
    device (no memory); a builder that cannot build there is left to the workers' own check."""
    load_builder(cfg.model.builder, where)
    stages = cfg.pipeline.stages
    with torch.random.fork_rng(devices=[]):
        for index in range(stages):
            try:
                with torch.device("meta"):
                    stage = load_builder(cfg.model.builder, where)(cfg, index, stages, cfg.data.seed)
            except InputError:
                raise  # the builder's own one-line refusal (e.g. a missing optional extra): say it here
            except Exception:
                return
            check_stage(stage, cfg.model.builder, index, stages, where)


def lm_loss(head: Any, h: torch.Tensor, labels: torch.Tensor, sample: torch.Generator | None = None) -> Any:
    """Mean cross-entropy over the positions with a label (``IGNORE_INDEX`` elsewhere), the head run on
    those only (the others' logits would be thrown away); with ``sample`` (true-Fisher K-FAC), also the
    loss against labels drawn from the model's own predictive distribution. Every language-model stage
    ends with it, built-in or a builder's."""
    keep = labels.reshape(-1) != IGNORE_INDEX
    logits = head(h.reshape(-1, h.shape[-1])[keep])
    loss = F.cross_entropy(logits, labels.reshape(-1)[keep])
    if sample is None:
        return loss
    with torch.no_grad():
        probs = torch.softmax(logits.float(), dim=-1)
        drawn = torch.multinomial(probs.cpu(), 1, generator=sample).squeeze(1).to(logits.device)
    return loss, F.cross_entropy(logits, drawn)


def stage_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Split layer indices into ``num_stages`` contiguous runs, earlier stages taking any extra layer."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out
