"""Language-model batches: random windows of a tokenized text corpus, plus fixed held-out batches.

``data.objective`` decides what a window becomes: ``mlm`` masks it as BERT does (labels at the
predicted positions), ``clm`` keeps the inputs whole and labels every position with the next token
(the last position has none). Both take the same windows from the same seeds.

Every training micro-batch is a pure function of (seed, step, replica, micro-batch index), so the first
stage (which needs the tokens) and the last stage (which needs the labels) make the same batch on their
own and nothing but activations and gradients crosses the pipeline. Validation batches come from the
held-out text with a generator that ignores the seed, so every run on a corpus is judged on the same
batches. The corpus (:mod:`pipefisher.runtime.data.corpus`) is local text; nothing is downloaded.
``data.text: synthetic`` gives seeded Zipf tokens instead, for unit tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefisher.runtime.data.corpus import SPECIAL_TOKENS, Corpus, check_corpus, load_corpus
from pipefisher.runtime.job.config import SYNTHETIC, DataConfig
from pipefisher.runtime.models.builders import IGNORE_INDEX

PAD, UNK, CLS, SEP, MASK = range(5)
NUM_SPECIAL = 5
assert SPECIAL_TOKENS[MASK] == "[MASK]" and len(SPECIAL_TOKENS) == NUM_SPECIAL

MASK_SHARE, RANDOM_SHARE = 0.8, 0.1
"""Of the predicted positions: 80 % shown as [MASK], 10 % as a random token, the rest unchanged (BERT)."""
VALIDATION_SEED = 0x5EED_0F_7E57
"""Seeds the validation batches' generator: fixed, so they do not depend on ``data.seed``."""


def batch_seed(seed: int, step: int, replica: int, index: int) -> int:
    """The seed of micro-batch ``index`` of ``step`` on ``replica``: everything random about a
    micro-batch (its text, its masking, the true Fisher's sampled labels) derives from it."""
    return (seed * 1_000_003 + step) * 65_537 + replica * 1_021 + index + 1


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # (batch, seq) int64; mlm: predicted positions masked as in BERT
    labels: torch.Tensor  # (batch, seq) int64, IGNORE_INDEX where nothing is predicted


@dataclass
class DataPosition:
    """Where a run is in its data: the step whose micro-batches come next. Nothing else is needed to
    continue the very same stream, since every micro-batch is a pure function of (seed, step, replica,
    index); a checkpoint saves it as a component of its own."""

    step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


class MLMData:
    """Makes the micro-batches of a run: from ``corpus`` if given, else ``load_corpus(cfg, vocab_size)``.

    The name is historical: ``cfg.objective`` picks masked-LM or causal-LM batches.
    """

    def __init__(self, cfg: DataConfig, vocab_size: int, corpus: Corpus | None = None) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size
        self.corpus: Corpus | None = None
        self._validation: list[MicroBatch] | None = None
        if cfg.text == SYNTHETIC:
            # A fixed Zipf-like unigram distribution over the ordinary tokens.
            ranks = torch.arange(1, vocab_size - NUM_SPECIAL + 1, dtype=torch.float64)
            self._unigram = (1.0 / ranks) / (1.0 / ranks).sum()
            self.token_limit = vocab_size
        else:
            self.corpus = corpus if corpus is not None else load_corpus(cfg, vocab_size)
            check_corpus(self.corpus, cfg)
            if self.corpus.vocab_size > vocab_size:
                raise ValueError(f"the corpus tokenizer has {self.corpus.vocab_size} tokens, "
                                 f"more than model.vocab_size = {vocab_size}")
            # Random replacements come from the tokenizer's own ordinary tokens.
            self.token_limit = max(self.corpus.vocab_size, NUM_SPECIAL + 1)

    def micro_batch(self, step: int, replica: int, index: int) -> MicroBatch:
        c = self.cfg
        g = torch.Generator().manual_seed(batch_seed(c.seed, step, replica, index))
        shape = (c.micro_batch_size, c.seq_len)
        if self.corpus is None:
            tokens = self._synthetic(g, shape)
        else:
            train = self.corpus.train
            starts = torch.randint(0, len(train) - c.seq_len + 1, (c.micro_batch_size,), generator=g)
            tokens = self._windows(train, starts)
        return self._mask(tokens, g)

    def validation_batches(self) -> list[MicroBatch]:
        """``data.val_batches`` held-out micro-batches, the same for every seed and pipeline mode.

        Their ``val_batches * micro_batch_size`` windows start at evenly spaced points of the held-out
        ids (first window at the start, last at the end), so they cover the held-out text evenly.
        """
        if self._validation is None:
            c = self.cfg
            g = torch.Generator().manual_seed(VALIDATION_SEED)
            shape = (c.micro_batch_size, c.seq_len)
            if self.corpus is None:
                self._validation = [self._mask(self._synthetic(g, shape), g) for _ in range(c.val_batches)]
            else:
                val = self.corpus.val
                count = c.val_batches * c.micro_batch_size
                starts = torch.linspace(0, len(val) - c.seq_len, count, dtype=torch.float64).round().long()
                self._validation = [
                    self._mask(self._windows(val, part), g) for part in starts.split(c.micro_batch_size)]
        return list(self._validation)

    def _windows(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """(len(starts), seq_len) windows of ``ids`` beginning at ``starts``."""
        return ids[starts[:, None] + torch.arange(self.cfg.seq_len)]

    def _mask(self, tokens: torch.Tensor, g: torch.Generator) -> MicroBatch:
        """BERT masking: ``mask_prob`` of positions predicted (one at least per sequence); under
        ``clm`` the inputs unchanged and the next token as every position's label."""
        if self.cfg.objective == "clm":
            labels = torch.full_like(tokens, IGNORE_INDEX)
            labels[:, :-1] = tokens[:, 1:]
            return MicroBatch(tokens, labels)
        predicted = torch.rand(tokens.shape, generator=g) < self.cfg.mask_prob
        predicted[:, 0] |= ~predicted.any(dim=1)
        labels = torch.where(predicted, tokens, torch.full_like(tokens, IGNORE_INDEX))
        how = torch.rand(tokens.shape, generator=g)
        noise = torch.randint(NUM_SPECIAL, self.token_limit, tokens.shape, generator=g)
        inputs = torch.where(predicted & (how < MASK_SHARE), torch.full_like(tokens, MASK), tokens)
        swap = predicted & (how >= MASK_SHARE) & (how < MASK_SHARE + RANDOM_SHARE)
        inputs = torch.where(swap, noise, inputs)
        return MicroBatch(inputs, labels)

    def _synthetic(self, g: torch.Generator, shape: tuple[int, int]) -> torch.Tensor:
        """Zipf-distributed tokens whose second half repeats the first: learnable by unigram and copy."""
        b, t = shape
        half = (t + 1) // 2
        first = torch.multinomial(self._unigram, b * half, replacement=True, generator=g).view(b, half)
        first = first + NUM_SPECIAL
        return torch.cat([first, first], dim=1)[:, :t].contiguous()
