"""Stage builders a test config names (``tests._own_builders:...``): a user's own tiny model, and bad ones."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MixerStage(nn.Module):
    """A tiny token-wise MLP stage: embeddings first, a residual MLP per layer, a head and loss last."""

    def __init__(self, cfg: Any, index: int, num_stages: int, seed: int) -> None:
        super().__init__()
        m = cfg.model
        torch.manual_seed(seed * 101 + index)
        self.is_first, self.is_last, self.hidden_size = index == 0, index == num_stages - 1, m.hidden_size
        width = int(m.options.get("width", m.intermediate_size))
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size) if self.is_first else None
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(m.hidden_size, width), nn.GELU(),
                                                nn.Linear(width, m.hidden_size)) for _ in range(2))
        self.head = nn.Linear(m.hidden_size, m.vocab_size) if self.is_last else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        h = self.embed(x) if self.embed is not None else x
        for mlp in self.mlps:
            h = h + mlp(h)
        if self.head is None:
            return h
        logits = self.head(h)
        if labels is None:
            return logits
        keep = labels.reshape(-1) != -100
        logits = logits.reshape(-1, logits.shape[-1])[keep]
        loss = F.cross_entropy(logits, labels.reshape(-1)[keep])
        if sample is None:
            return loss
        with torch.no_grad():
            drawn = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=sample).squeeze(1)
        return loss, F.cross_entropy(logits, drawn)


def build(cfg: Any, index: int, num_stages: int, seed: int) -> nn.Module:
    return MixerStage(cfg, index, num_stages, seed)


def build_plain_module(cfg: Any, index: int, num_stages: int, seed: int) -> nn.Module:
    """Lacks the stage protocol's attributes."""
    return nn.Linear(4, 4)


NOT_A_FUNCTION = 3
