"""A BERT-style masked-language model, built directly as pipeline stages.

Module names follow the usual BERT layout (``encoder.layer.3.attention.self.query``) inside every stage,
so K-FAC keys and schedule labels name the same layer whichever stage holds it. Every parameter is
initialised from a generator seeded by the run seed and the parameter's full name, so a model split
into stages holds exactly the weights of the same model in one process. The decoder is not tied to
the word embeddings (they live on different stages).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipefisher.errors import InputError
from pipefisher.runtime.config import DEFAULT_BUILDER, ModelConfig, RunConfig

IGNORE_INDEX = -100

StageBuilder = Callable[[RunConfig, int, int, int], nn.Module]
"""``build(cfg, index, num_stages, seed) -> stage``: what ``model.builder`` names (see :func:`build_stage`)."""

STAGE_ATTRIBUTES = ("is_first", "is_last", "hidden_size")
"""What the runtime reads off a stage besides ``forward(x, labels=None, sample=None)``."""


def build_stage(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """The built-in stage builder (the default ``model.builder``): stage ``index`` of the BERT-style model."""
    return PipelineStage(cfg.model, index, num_stages, seed=seed)


def load_builder(spec: str, where: str | os.PathLike[str] | None = None) -> StageBuilder:
    """The function ``"package.module:function"`` names, or an :class:`InputError` (one line, ``where``).

    The module is imported as ``python -m`` would, so a module in the current directory works from
    ``pipefisher train`` too (console scripts do not put the current directory on the path).
    """
    if spec == DEFAULT_BUILDER:
        return build_stage
    module_name, _, func_name = spec.partition(":")
    what = f"model.builder {spec!r}"
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
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise InputError(where, f"{what}: importing {module_name!r} failed: {type(err).__name__}"
                                + (f": {first}" if first else "")) from None
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


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.word_embeddings(input_ids) + self.position_embeddings(pos)[None]
        return self.dropout(self.LayerNorm(h))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout_p = cfg.dropout
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

        q, k, v = heads(self.query(h)), heads(self.key(h)), heads(self.value(h))
        p = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return out.transpose(1, 2).reshape(b, t, d)


class DenseResidualNorm(nn.Module):
    """``LayerNorm(residual + dropout(dense(x)))``, BERT's sub-layer output block."""

    def __init__(self, d_in: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseResidualNorm(cfg.hidden_size, cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(h), h)


class Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(h))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseResidualNorm(cfg.intermediate_size, cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attention(h)
        return self.output(self.intermediate(h), h)


class PredictionHead(nn.Module):
    """``cls.predictions``: transform (dense, GELU, norm) then a decoder to vocabulary logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.transform = nn.Module()
        self.transform.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.transform.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.transform.LayerNorm(F.gelu(self.transform.dense(h)))
        return self.decoder(h)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        super().__init__()
        self.layer = nn.ModuleDict({str(i): EncoderLayer(cfg) for i in layer_ids})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layer.values():
            h = layer(h)
        return h


class Cls(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.predictions = PredictionHead(cfg)


class PipelineStage(nn.Module):
    """One pipeline stage: embeddings on the first, a run of encoder layers, the head and loss on the last.

    ``forward(x, labels)`` takes token ids on the first stage and hidden states elsewhere; the last
    stage returns the mean masked-LM loss over the micro-batch, the others the hidden states.
    """

    def __init__(self, cfg: ModelConfig, index: int, num_stages: int, seed: int = 0) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layer_ids = stage_layers(cfg.num_layers, num_stages)[index]
        self.embeddings = Embeddings(cfg) if self.is_first else None
        self.encoder = Encoder(cfg, self.layer_ids)
        self.cls = Cls(cfg) if self.is_last else None
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.hidden_size
        init_parameters(self, seed, cfg.init_std)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        """Hidden states (not the last stage), logits (last stage, no labels), or the mean masked-LM loss.

        The head runs on the predicted positions only (the others' logits would be thrown away).
        With ``sample`` (last stage, true-Fisher K-FAC) it returns ``(loss, sampled_loss)``: the second
        is the same mean loss against labels drawn from the model's own predictive distribution.
        """
        h = self.embeddings(x) if self.embeddings is not None else x
        h = self.encoder(h)
        if self.cls is None:
            return h
        if labels is None:
            return self.cls.predictions(h)
        return lm_loss(self.cls.predictions, h, labels, sample)


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


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, std: float) -> None:
    """BERT init (normal weights, zero biases, unit norms), each tensor seeded by its own name."""
    for name, p in module.named_parameters():
        if p.is_meta:  # built on the meta device for its layout only: nothing to fill
            continue
        if name.endswith("bias"):
            p.zero_()
        elif "LayerNorm" in name:
            p.fill_(1.0)
        else:
            g = torch.Generator().manual_seed(_name_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=g) * std)


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

