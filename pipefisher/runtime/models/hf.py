"""Hugging Face transformers models as pipeline stages: ``bert_mlm`` and ``gpt2_clm`` stage builders.

Name one in a run config (``model.builder: pipefisher.runtime.models.hf:gpt2_clm``) to train a transformers
``BertForMaskedLM`` or ``GPT2LMHeadModel`` with random initial weights (nothing is downloaded), shaped by
the config's ``model`` section. Each builder makes the whole model once, from a generator seeded by the
run seed, and keeps only its stage's contiguous run of transformer blocks (the split of
:func:`pipefisher.runtime.models.builders.stage_layers`), the embeddings on the first stage and the head on the
last. So a split model holds exactly the unsplit model's weights, and every module keeps its
transformers name (``bert.encoder.layer.3.attention.self.query``, ``transformer.h.3.mlp.c_fc``), so
K-FAC keys and schedule labels name the same layer whichever stage holds it. Building the whole model
in every process costs its memory for a moment: fine for models that fit in one process.

The output layer is *not* tied to the input embeddings (transformers ties them by default): they live
on different stages, so each has its own weights. transformers is imported inside the builders only,
so the rest of pipefisher never needs it.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pipefisher.errors import InputError
from pipefisher.runtime.job.config import ModelConfig, RunConfig
from pipefisher.runtime.models.builders import lm_loss, stage_layers

MISSING_TRANSFORMERS = ("the Hugging Face models need transformers: pip install 'pipefisher[hf]' "
                        "(or -e '.[hf]' in a clone)")
MIN_TRANSFORMERS = (5, 23)
"""The stages call transformers' blocks and mask helpers as its models do; their signatures change
between releases (5.0's masks took ``input_embeds`` and ``cache_position``), so older ones are refused."""


def _transformers() -> Any:
    """The transformers package, or a one-line :class:`InputError` saying how to install or upgrade it."""
    try:
        import transformers
    except ImportError:
        raise InputError(None, MISSING_TRANSFORMERS) from None
    found = tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    if found < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise InputError(None, f"the Hugging Face models need transformers>={need}, found "
                               f"{transformers.__version__}: pip install -U 'pipefisher[hf]'")
    return transformers


def hf_config(model: ModelConfig, kind: str) -> Any:
    """The transformers config (``kind``: ``bert`` or ``gpt2``) for the run config's ``model`` section.

    Word embeddings and output layer are untied (they live on different stages); SDPA attention.
    """
    tf = _transformers()
    common = dict(vocab_size=model.vocab_size, initializer_range=model.init_std, tie_word_embeddings=False)
    if kind == "bert":
        cfg = tf.BertConfig(hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                            num_attention_heads=model.num_heads, intermediate_size=model.intermediate_size,
                            max_position_embeddings=model.max_position, hidden_dropout_prob=model.dropout,
                            attention_probs_dropout_prob=model.dropout, layer_norm_eps=model.layer_norm_eps,
                            **common)
    elif kind == "gpt2":
        # bos/eos inside the vocabulary (GPT-2's default 50256 is not in a small one); unused here.
        cfg = tf.GPT2Config(n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_heads,
                            n_inner=model.intermediate_size, n_positions=model.max_position,
                            resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout,
                            layer_norm_epsilon=model.layer_norm_eps, bos_token_id=0, eos_token_id=0, **common)
    else:
        raise ValueError(f"unknown Hugging Face model kind {kind!r}")
    cfg._attn_implementation = "sdpa"
    return cfg


def full_model(model: ModelConfig, kind: str, seed: int) -> nn.Module:
    """The unsplit transformers model, initialised by transformers' own init under ``torch.manual_seed(seed)``.

    The global RNG is forked, so building it leaves the caller's random state as it was. BERT's
    decoder bias stays tied to ``cls.predictions.bias`` (both on the last stage), as transformers does.
    """
    tf = _transformers()
    config = hf_config(model, kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "bert":
            out = tf.BertForMaskedLM(config)
            head = out.cls.predictions
            head.decoder.bias = head.bias  # untying the embeddings unties this too; keep it as HF has it
        else:
            out = tf.GPT2LMHeadModel(config)
    return out


class _Stage(nn.Module):
    """What both builders' stages share: the pipeline-stage protocol's attributes."""

    def __init__(self, model: ModelConfig, index: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage {index} of {num_stages}")
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layer_ids = stage_layers(model.num_layers, num_stages)[index]
        self.hidden_size, self.vocab_size = model.hidden_size, model.vocab_size


class BertStage(_Stage):
    """A run of ``BertForMaskedLM``'s encoder layers; ``bert.embeddings`` on the first stage, ``cls`` on the last."""

    def __init__(self, model: ModelConfig, index: int, num_stages: int, seed: int) -> None:
        super().__init__(model, index, num_stages)
        full = full_model(model, "bert", seed)
        self.config = full.config
        self.bert = nn.Module()
        self.bert.embeddings = full.bert.embeddings if self.is_first else None
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleDict({str(i): full.bert.encoder.layer[i] for i in self.layer_ids})
        self.cls = full.cls if self.is_last else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        """Hidden states (not the last stage), logits (last, no labels), the mean MLM loss, or
        ``(loss, sampled_loss)`` with ``sample`` (see :class:`pipefisher.runtime.models.bert.PipelineStage`)."""
        from transformers.masking_utils import create_bidirectional_mask

        h = self.bert.embeddings(input_ids=x) if self.bert.embeddings is not None else x
        # No padding (fixed-length windows): the mask BertModel would make without an attention_mask.
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=None)
        for layer in self.bert.encoder.layer.values():
            h = layer(h, mask, None, encoder_attention_mask=None, past_key_values=None)
        if self.cls is None:
            return h
        if labels is None:
            return self.cls(h)
        return lm_loss(self.cls, h, labels, sample)


class GPT2Stage(_Stage):
    """A run of ``GPT2LMHeadModel``'s blocks; ``transformer.wte``/``wpe``/``drop`` on the first stage,
    ``transformer.ln_f`` and the (untied) ``lm_head`` on the last."""

    def __init__(self, model: ModelConfig, index: int, num_stages: int, seed: int) -> None:
        super().__init__(model, index, num_stages)
        full = full_model(model, "gpt2", seed)
        self.config = full.config
        t = full.transformer
        self.transformer = nn.Module()
        if self.is_first:
            self.transformer.wte, self.transformer.wpe, self.transformer.drop = t.wte, t.wpe, t.drop
        self.transformer.h = nn.ModuleDict({str(i): t.h[i] for i in self.layer_ids})
        if self.is_last:
            self.transformer.ln_f = t.ln_f
        self.lm_head = full.lm_head if self.is_last else None

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(h))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        """Hidden states, logits, or the mean causal-LM loss; ``labels`` are already the next tokens
        (``data.objective: clm``), so they are not shifted again. ``sample``: as in the built-in model."""
        from transformers.masking_utils import create_causal_mask

        # As GPT2Model.forward (transformers 5.23) does without a cache or an attention mask.
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.is_first:
            t = self.transformer
            h = t.drop(t.wte(x) + t.wpe(pos))
        else:
            h = x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        for block in self.transformer.h.values():
            h = block(h, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=pos)
        if not self.is_last:
            return h
        if labels is None:
            return self._head(h)
        return lm_loss(self._head, h, labels, sample)


def bert_mlm(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """Stage builder: stage ``index`` of a transformers ``BertForMaskedLM`` split into ``num_stages``."""
    return BertStage(cfg.model, index, num_stages, seed)


def gpt2_clm(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """Stage builder: stage ``index`` of a transformers ``GPT2LMHeadModel`` (``lm_head`` untied from
    ``wte``) split into ``num_stages``; train it with ``data.objective: clm``."""
    return GPT2Stage(cfg.model, index, num_stages, seed)
