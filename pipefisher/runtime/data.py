"""Masked-LM batches: seeded synthetic tokens by default, or windows of a local text file.

Every micro-batch is a pure function of (seed, step, replica, micro-batch index), so the first stage
(which needs the tokens) and the last stage (which needs the labels) make the same batch on their own
and nothing but activations and gradients crosses the pipeline. Nothing is downloaded.
"""
from __future__ import annotations

import collections
import os
import re
from dataclasses import dataclass

import torch

from pipefisher.errors import InputError
from pipefisher.runtime.config import DataConfig
from pipefisher.runtime.model import IGNORE_INDEX

PAD, UNK, CLS, SEP, MASK = range(5)
NUM_SPECIAL = 5


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # (batch, seq) int64, masked positions replaced by MASK
    labels: torch.Tensor  # (batch, seq) int64, IGNORE_INDEX where nothing is predicted


class TextVocab:
    """Whitespace words, lower-cased; the ``vocab_size - 5`` most frequent get ids, the rest UNK."""

    def __init__(self, path: str, vocab_size: int) -> None:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                words = re.findall(r"\w+|[^\w\s]", f.read().lower())
        except OSError as err:
            raise InputError(path, f"cannot be read ({err.strerror or err})") from None
        if not words:
            raise InputError(path, "has no words to train on")
        common = collections.Counter(words).most_common(vocab_size - NUM_SPECIAL)
        self.ids = {w: i + NUM_SPECIAL for i, (w, _) in enumerate(common)}
        self.tokens = torch.tensor([self.ids.get(w, UNK) for w in words], dtype=torch.long)


class MLMData:
    """Makes the micro-batches of a run."""

    def __init__(self, cfg: DataConfig, vocab_size: int) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size
        self.text = TextVocab(os.fspath(cfg.text_file), vocab_size) if cfg.text_file else None
        if self.text is not None and len(self.text.tokens) < cfg.seq_len:
            raise InputError(cfg.text_file, f"is shorter than one sequence ({cfg.seq_len} words)")
        # A fixed Zipf-like unigram distribution over the ordinary tokens.
        ranks = torch.arange(1, vocab_size - NUM_SPECIAL + 1, dtype=torch.float64)
        self._unigram = (1.0 / ranks) / (1.0 / ranks).sum()

    def micro_batch(self, step: int, replica: int, index: int) -> MicroBatch:
        c = self.cfg
        g = torch.Generator().manual_seed(
            (c.seed * 1_000_003 + step) * 65_537 + replica * 1_021 + index + 1)
        shape = (c.micro_batch_size, c.seq_len)
        tokens = self._text_tokens(g, shape) if self.text is not None else self._synthetic(g, shape)
        masked = torch.rand(shape, generator=g) < c.mask_prob
        masked[:, 0] |= ~masked.any(dim=1)  # every sequence predicts at least one token
        labels = torch.where(masked, tokens, torch.full_like(tokens, IGNORE_INDEX))
        inputs = torch.where(masked, torch.full_like(tokens, MASK), tokens)
        return MicroBatch(inputs, labels)

    def _synthetic(self, g: torch.Generator, shape: tuple[int, int]) -> torch.Tensor:
        """Zipf-distributed tokens whose second half repeats the first: learnable by unigram and copy."""
        b, t = shape
        half = (t + 1) // 2
        first = torch.multinomial(self._unigram, b * half, replacement=True, generator=g).view(b, half)
        first = first + NUM_SPECIAL
        return torch.cat([first, first], dim=1)[:, :t].contiguous()

    def _text_tokens(self, g: torch.Generator, shape: tuple[int, int]) -> torch.Tensor:
        assert self.text is not None
        b, t = shape
        starts = torch.randint(0, len(self.text.tokens) - t + 1, (b,), generator=g)
        return torch.stack([self.text.tokens[s:s + t] for s in starts.tolist()])
