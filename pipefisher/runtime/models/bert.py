"""A BERT-style masked-language model, built directly as pipeline stages.

Module names follow the usual BERT layout (``encoder.layer.3.attention.self.query``) inside every stage,
so K-FAC keys and schedule labels name the same layer whichever stage holds it. Every parameter is
initialised from a generator seeded by the run seed and the parameter's full name, so a model split
into stages holds exactly the weights of the same model in one process. The decoder is not tied to
the word embeddings (they live on different stages).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipefisher.runtime.job.config import ModelConfig, RunConfig
from pipefisher.runtime.models.builders import lm_loss, stage_layers


def build_stage(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """The built-in stage builder (the default ``model.builder``): stage ``index`` of the BERT-style model."""
    return PipelineStage(cfg.model, index, num_stages, seed=seed)


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

