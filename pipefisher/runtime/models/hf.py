"""Hugging Face transformers models as pipeline stages: ``bert_mlm``, ``gpt2_clm`` and ``llama_clm``
stage builders.

Name one in a run config (``model.builder: pipefisher.runtime.models.hf:llama_clm``) to train a
transformers ``BertForMaskedLM``, ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (RMSNorm, rotary
positions, gated MLP, grouped-query attention with ``model.options.num_key_value_heads`` key/value
heads) with random initial weights (nothing is downloaded), shaped by the config's ``model`` section.
Each builder makes the whole model once, from a generator seeded by the run seed, and keeps only its
stage's contiguous run of transformer blocks (the split of
:func:`pipefisher.runtime.models.builders.stage_layers`), the embeddings on the first stage and the
head on the last. So a split model holds exactly the unsplit model's weights, and every module keeps
its transformers name (``bert.encoder.layer.3.attention.self.query``, ``transformer.h.3.mlp.c_fc``,
``model.layers.3.mlp.gate_proj``), so K-FAC keys and schedule labels name the same layer whichever
stage holds it. Building the whole model in every process costs its memory for a moment: fine for
models that fit in one process.

The output layer is *not* tied to the input embeddings (transformers ties them by default): they live
on different stages, so each has its own weights. transformers is imported inside the builders only,
so the rest of pipefisher never needs it.

``model.pretrained`` names a local folder ``save_pretrained`` wrote (``pipefisher export`` writes one
too): the whole model is loaded from it with ``from_pretrained(folder, local_files_only=True)`` (the
hub is never contacted) instead of a random init, then split as above. The run config's ``model``
section must describe it (:data:`pipefisher.runtime.models.bert.PRETRAINED_KEYS`: shape and norm
epsilon; Llama's key/value heads too), else one line names the folder and the differing keys;
``model.dropout`` is the run's. A model saved with tied embeddings loads with the output layer a copy
of the word embeddings, so both stages start equal to the saved model; every weight must be in the
folder (none starts random).
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from pipefisher.errors import InputError, install_hint
from pipefisher.runtime.job.config import ModelConfig, RunConfig
from pipefisher.runtime.models.bert import CONFIG_FILE, check_pretrained
from pipefisher.runtime.models.builders import lm_loss, stage_layers
from pipefisher.safe_io import load_json

MISSING_TRANSFORMERS = "the Hugging Face models need transformers: " + install_hint("hf")
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


KINDS = {"bert": "BertForMaskedLM", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
"""Each model kind's transformers class."""

CONFIG_CLASSES = {"bert": "BertConfig", "gpt2": "GPT2Config", "llama": "LlamaConfig"}
"""Each model kind's transformers config class."""

BUILDER_KINDS = {f"{__name__}:bert_mlm": "bert", f"{__name__}:gpt2_clm": "gpt2", f"{__name__}:llama_clm": "llama"}
"""``model.builder`` -> the kind of model it builds (what ``pipefisher export`` rebuilds)."""

AUTO_CLASSES = {"bert": "AutoModelForMaskedLM", "gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM"}
"""The transformers auto class that loads each kind's export."""


def key_value_heads(model: ModelConfig) -> int:
    """Llama's key/value heads: ``model.options.num_key_value_heads`` (grouped-query attention), else
    ``model.num_heads`` (plain multi-head attention); a count that does not divide the heads is refused."""
    kv = model.options.get("num_key_value_heads", model.num_heads)
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or model.num_heads % kv:
        raise InputError(None, f"model.options.num_key_value_heads must be a positive integer that divides "
                               f"model.num_heads ({model.num_heads}), not {kv!r}")
    return kv


def _special_ids() -> dict[str, int]:
    """The run vocabulary's special tokens as transformers configs name them (pad, and for causal
    models bos/eos: ``[CLS]`` and the ``[SEP]`` that ends every document)."""
    from pipefisher.runtime.job.config import SPECIAL_TOKENS

    return {"pad_token_id": SPECIAL_TOKENS.index("[PAD]"), "bos_token_id": SPECIAL_TOKENS.index("[CLS]"),
            "eos_token_id": SPECIAL_TOKENS.index("[SEP]")}


def hf_config(model: ModelConfig, kind: str) -> Any:
    """The transformers config (``kind``: one of :data:`KINDS`) for the run config's ``model`` section.

    Word embeddings and output layer are untied (they live on different stages); SDPA attention. The
    special token ids are the run vocabulary's (:func:`_special_ids`), so an export generates and pads
    with the tokens its tokenizer has.
    """
    tf = _transformers()
    common = dict(vocab_size=model.vocab_size, initializer_range=model.init_std, tie_word_embeddings=False,
                  **_dropout(model, kind))
    ids = _special_ids()
    if kind == "bert":
        cfg = tf.BertConfig(hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                            num_attention_heads=model.num_heads, intermediate_size=model.intermediate_size,
                            max_position_embeddings=model.max_position, layer_norm_eps=model.layer_norm_eps,
                            pad_token_id=ids["pad_token_id"], **common)
    elif kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_heads,
                            n_inner=model.intermediate_size, n_positions=model.max_position,
                            layer_norm_epsilon=model.layer_norm_eps, **ids, **common)
    else:
        theta = model.options.get("rope_theta", 10000.0)
        cfg = tf.LlamaConfig(hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                             num_attention_heads=model.num_heads, num_key_value_heads=key_value_heads(model),
                             intermediate_size=model.intermediate_size, max_position_embeddings=model.max_position,
                             rms_norm_eps=model.layer_norm_eps,
                             rope_parameters={"rope_type": "default", "rope_theta": float(theta)}, **ids, **common)
    cfg._attn_implementation = "sdpa"
    return cfg


def _dropout(model: ModelConfig, kind: str) -> dict[str, float]:
    """The transformers config keys of ``model.dropout`` for ``kind`` (the run's, pretrained or not)."""
    if kind == "bert":
        return dict(hidden_dropout_prob=model.dropout, attention_probs_dropout_prob=model.dropout)
    if kind == "gpt2":
        return dict(resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout)
    if kind == "llama":
        return dict(attention_dropout=model.dropout)  # Llama has no other dropout
    raise ValueError(f"unknown Hugging Face model kind {kind!r}")


def _shape(cfg: Any, kind: str) -> dict[str, Any]:
    """A transformers config's :data:`pipefisher.runtime.models.bert.PRETRAINED_KEYS`, as the run config names them."""
    inner = (cfg.n_inner or 4 * cfg.n_embd) if kind == "gpt2" else cfg.intermediate_size
    eps = {"bert": "layer_norm_eps", "gpt2": "layer_norm_epsilon", "llama": "rms_norm_eps"}[kind]
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads, "intermediate_size": inner,
            "max_position": cfg.max_position_embeddings, "layer_norm_eps": getattr(cfg, eps)}


def pretrained_config(model: ModelConfig, kind: str) -> Any:
    """The transformers config in the ``model.pretrained`` folder, checked against the run config's
    ``model`` section (one-line :class:`InputError` naming the folder otherwise), with the run's dropout."""
    tf = _transformers()
    folder = model.pretrained
    where = f"model.pretrained (model.builder for {KINDS[kind]})"
    if not os.path.isdir(folder):
        raise InputError(folder, f"{where}: no such folder (a folder save_pretrained wrote)")
    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        raise InputError(folder, f"{where}: holds no {CONFIG_FILE} (not a folder save_pretrained wrote)")
    raw = load_json(os.path.join(folder, CONFIG_FILE))
    found = raw.get("model_type") if isinstance(raw, dict) else None
    if found != kind:
        held = f"a {found} model" if found else f"no transformers model ({CONFIG_FILE} names no model_type)"
        raise InputError(folder, f"{where}: holds {held}, not a {kind} one")
    cfg = getattr(tf, CONFIG_CLASSES[kind]).from_pretrained(folder, local_files_only=True)
    check_pretrained(folder, _shape(cfg, kind), model)
    if kind == "llama" and cfg.num_key_value_heads != key_value_heads(model):
        raise InputError(folder, f"model.pretrained holds a model that the run config's model section does not "
                                 f"describe: num_key_value_heads {cfg.num_key_value_heads!r} there, "
                                 f"{key_value_heads(model)!r} in the run config (set model.options.num_key_value_heads)")
    for key, value in _dropout(model, kind).items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "sdpa"
    return cfg


def export_config(model: ModelConfig) -> dict[str, Any] | None:
    """The transformers config an export of this run writes (the pretrained folder's, where the run
    started from one), as a dict a checkpoint keeps: so the export needs neither the folder nor the
    working folder the run started in. None for builders other than these."""
    kind = BUILDER_KINDS.get(model.builder)
    if kind is None:
        return None
    cfg = pretrained_config(model, kind) if model.pretrained else hf_config(model, kind)
    return cfg.to_dict()


@contextmanager
def _quiet(tf: Any) -> Iterator[None]:
    """transformers without its progress bars and load report (every worker would print them; what
    matters in the report, missing weights, is refused by the caller in one line)."""
    verbosity, bars = tf.logging.get_verbosity(), tf.utils.logging.is_progress_bar_enabled()
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        tf.logging.set_verbosity(verbosity)
        if bars:
            tf.utils.logging.enable_progress_bar()


def _untie(out: nn.Module, kind: str) -> nn.Module:
    """The output layer a copy of the word embeddings where they are one tensor (they live on different
    stages); BERT's decoder bias tied to ``cls.predictions.bias``, as transformers has it."""
    emb, head = out.get_input_embeddings(), out.get_output_embeddings()
    if head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone())
    out.config.tie_word_embeddings = False
    if kind == "bert":
        out.cls.predictions.decoder.bias = out.cls.predictions.bias
    return out


def pretrained_model(model: ModelConfig, kind: str) -> nn.Module:
    """The whole transformers model in the ``model.pretrained`` folder, untied (:func:`_untie`).

    On the meta device (the builder check before any worker starts) ``from_pretrained`` cannot run: the
    config is checked and the model built empty from it, which is all that check needs."""
    tf = _transformers()
    config = pretrained_config(model, kind)
    cls = getattr(tf, KINDS[kind])
    if torch.empty(0).device.type == "meta":
        return _untie(cls(config), kind)
    with _quiet(tf):
        out, info = cls.from_pretrained(model.pretrained, config=config, local_files_only=True,
                                        dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
    filled = {"cls.predictions.decoder.bias"} if kind == "bert" else set()  # tied to cls.predictions.bias
    missing = sorted(set(info["missing_keys"]) - filled)
    if missing:
        raise InputError(model.pretrained, f"model.pretrained: lacks {len(missing)} weight(s) of a {KINDS[kind]} "
                                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), "
                                           "which would start random")
    return _untie(out, kind)


def full_model(model: ModelConfig, kind: str, seed: int) -> nn.Module:
    """The unsplit transformers model, initialised by transformers' own init under ``torch.manual_seed(seed)``,
    or loaded from ``model.pretrained`` (:func:`pretrained_model`).

    The global RNG is forked, so building it leaves the caller's random state as it was. BERT's
    decoder bias stays tied to ``cls.predictions.bias`` (both on the last stage), as transformers does.
    """
    tf = _transformers()
    with torch.random.fork_rng(devices=[]):
        if model.pretrained:
            return pretrained_model(model, kind)
        torch.manual_seed(seed)
        # untying the embeddings unties BERT's decoder bias too; _untie keeps it as HF has it
        return _untie(getattr(tf, KINDS[kind])(hf_config(model, kind)), kind)


def export_model(model: ModelConfig, kind: str, state: dict[str, torch.Tensor],
                 config: dict[str, Any] | None = None) -> nn.Module:
    """The whole transformers model holding ``state`` (every stage's tensors), to ``save_pretrained``:
    ``config`` (the dict :func:`export_config` gave when the run's checkpoint was written), else the
    run's config (the pretrained folder's, where the run started from one, which must then still be
    there: checkpoints written before the config was kept), embeddings untied. BERT's decoder bias is
    left its own tensor here (untied, transformers keeps it apart), so that the saved file holds it:
    saving drops a tied copy, and ``from_pretrained`` of an untied model would miss it."""
    tf = _transformers()
    if config is not None:
        hf_cfg = getattr(tf, CONFIG_CLASSES[kind]).from_dict(config)
    else:
        if model.pretrained and not os.path.isdir(model.pretrained):
            raise InputError(model.pretrained, "model.pretrained of the run: no such folder; this checkpoint keeps no "
                                               "model config (written before checkpoints kept it), so the export "
                                               "takes it from that folder: restore it, or run the export where the "
                                               "run ran")
        hf_cfg = pretrained_config(model, kind) if model.pretrained else hf_config(model, kind)
    hf_cfg.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        out = getattr(tf, KINDS[kind])(hf_cfg)
    out.load_state_dict(state, strict=True)
    return out


def export_pretrained(model: ModelConfig, kind: str, state: dict[str, torch.Tensor], folder: str,
                      config: dict[str, Any] | None = None) -> str:
    """``save_pretrained`` (safetensors) of :func:`export_model` into ``folder``; what it wrote, in words."""
    tf = _transformers()
    with _quiet(tf):
        export_model(model, kind, state, config).save_pretrained(folder, safe_serialization=True)
    return f"a {KINDS[kind]} in safetensors (transformers.{AUTO_CLASSES[kind]}.from_pretrained loads it)"


def positions(x: torch.Tensor) -> torch.Tensor:
    """The position ids of a micro-batch of fixed-length windows: ``0 .. seq_len - 1``, one row."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def causal_mask(config: Any, h: torch.Tensor, pos: torch.Tensor) -> Any:
    """The causal mask transformers' decoder blocks take, as their models make it without a cache or an
    attention mask (every window is full length, no padding). The (absent) cache goes by position: 5.24
    renamed that argument ``past_key_values`` -> ``cache`` and warns on the old name."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config, h, None, None, position_ids=pos)


class _Stage(nn.Module):
    """What every builder's stages share: the pipeline-stage protocol's attributes."""

    def __init__(self, model: ModelConfig, index: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage {index} of {num_stages}")
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layer_ids = stage_layers(model.num_layers, num_stages)[index]
        self.hidden_size, self.vocab_size = model.hidden_size, model.vocab_size

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's head: hidden states to vocabulary logits."""
        raise NotImplementedError

    def _end(self, h: torch.Tensor, labels: torch.Tensor | None, sample: torch.Generator | None) -> Any:
        """What the stage returns after its blocks: the hidden states, or on the last stage the logits (no
        ``labels``) or the mean loss (``(loss, sampled_loss)`` with ``sample``, :func:`lm_loss`)."""
        if not self.is_last:
            return h
        if labels is None:
            return self._head(h)
        return lm_loss(self._head, h, labels, sample)


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

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.cls(h)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        """Hidden states (not the last stage), logits (last, no labels), the mean MLM loss, or
        ``(loss, sampled_loss)`` with ``sample`` (see :class:`pipefisher.runtime.models.bert.PipelineStage`)."""
        from transformers.masking_utils import create_bidirectional_mask

        h = self.bert.embeddings(input_ids=x) if self.bert.embeddings is not None else x
        # No padding (fixed-length windows): the mask BertModel would make without an attention_mask.
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=None)
        for layer in self.bert.encoder.layer.values():
            h = layer(h, mask, None, encoder_attention_mask=None)  # no cache: named neither way (causal_mask)
        return self._end(h, labels, sample)


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
        # As GPT2Model.forward (transformers 5.23) does without a cache or an attention mask.
        pos = positions(x)
        if self.is_first:
            t = self.transformer
            h = t.drop(t.wte(x) + t.wpe(pos))
        else:
            h = x
        mask = causal_mask(self.config, h, pos)
        for block in self.transformer.h.values():
            h = block(h, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=pos)
        return self._end(h, labels, sample)


class LlamaStage(_Stage):
    """A run of ``LlamaForCausalLM``'s decoder layers; ``model.embed_tokens`` on the first stage,
    ``model.norm`` and the (untied) ``lm_head`` on the last; every stage its own copy of
    ``model.rotary_emb`` (buffers only, not saved), since each layer takes the rotary angles as input."""

    def __init__(self, model: ModelConfig, index: int, num_stages: int, seed: int) -> None:
        super().__init__(model, index, num_stages)
        full = full_model(model, "llama", seed)
        self.config = full.config
        m = full.model
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = m.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): m.layers[i] for i in self.layer_ids})
        self.model.rotary_emb = m.rotary_emb
        if self.is_last:
            self.model.norm = m.norm
        self.lm_head = full.lm_head if self.is_last else None

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        """Hidden states, logits, or the mean causal-LM loss of labels that are already the next tokens
        (as :class:`GPT2Stage`); as ``LlamaModel.forward`` (transformers 5.23) without a cache or mask."""
        pos = positions(x)
        h = self.model.embed_tokens(x) if self.is_first else x
        mask = causal_mask(self.config, h, pos)
        angles = self.model.rotary_emb(h, position_ids=pos)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_ids=pos, use_cache=False, position_embeddings=angles)
        return self._end(h, labels, sample)


def bert_mlm(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """Stage builder: stage ``index`` of a transformers ``BertForMaskedLM`` split into ``num_stages``."""
    return BertStage(cfg.model, index, num_stages, seed)


def gpt2_clm(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """Stage builder: stage ``index`` of a transformers ``GPT2LMHeadModel`` (``lm_head`` untied from
    ``wte``) split into ``num_stages``; train it with ``data.objective: clm``."""
    return GPT2Stage(cfg.model, index, num_stages, seed)


def llama_clm(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """Stage builder: stage ``index`` of a transformers ``LlamaForCausalLM`` (``lm_head`` untied from
    ``model.embed_tokens``) split into ``num_stages``; ``model.options``: ``num_key_value_heads``
    (grouped-query attention; default ``model.num_heads``) and ``rope_theta`` (default 10000); train
    it with ``data.objective: clm``."""
    return LlamaStage(cfg.model, index, num_stages, seed)
