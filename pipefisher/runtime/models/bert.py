"""A BERT-style masked-language model, built directly as pipeline stages.

Module names follow the usual BERT layout (``encoder.layer.3.attention.self.query``) inside every stage,
so K-FAC keys and schedule labels name the same layer whichever stage holds it. Every parameter is
initialised from a generator seeded by the run seed and the parameter's full name, so a model split
into stages holds exactly the weights of the same model in one process. The decoder is not tied to
the word embeddings (they live on different stages).

The model is transformers' ``BertForMaskedLM`` without token types (:func:`transformers_config`,
:func:`to_transformers`), so ``pipefisher export`` writes it as a folder ``AutoModelForMaskedLM`` loads.

With ``model.pretrained`` the stage starts from the weights ``pipefisher export`` wrote
(:mod:`pipefisher.runtime.train.consolidate`): a folder holding ``config.json`` (the model section it was
trained with, under ``pipefisher``; ``model`` in older exports) and ``model.safetensors`` (or
``model.pt``), or such a weights file alone, under transformers' names or this module's. The run
config's model section must describe that model (:data:`PRETRAINED_KEYS`); a mismatch is refused in
one line naming the keys, rather than loading weights into a model of another shape.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pipefisher.errors import InputError, first_line
from pipefisher.runtime.job.config import ModelConfig, RunConfig
from pipefisher.runtime.models.builders import lm_loss, stage_layers
from pipefisher.safe_io import load_json

CONFIG_FILE = "config.json"
WEIGHTS_FILES = ("model.safetensors", "model.pt")
"""What ``pipefisher export`` writes for the built-in model: the state dict as safetensors (``model.pt``,
a ``torch.save`` of it, where safetensors is not installed) beside ``config.json``."""

PRETRAINED_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position",
                   "layer_norm_eps")
"""The ``model`` keys a pretrained model must agree with: its shape, and its norms' epsilon (the run
config stays the true description of the model it trains, which checkpoints and exports record)."""


HF_PREFIX = "bert."
"""transformers' ``BertForMaskedLM`` holds the embeddings and encoder under ``bert.``; ``cls`` is the same."""
HF_DECODER_BIAS = ("cls.predictions.decoder.bias", "cls.predictions.bias")
"""The decoder bias: here the decoder's own; transformers also has ``cls.predictions.bias``, tied to it
(both are written: the release this was tested with loads the decoder's own, older ones the other)."""
HF_TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"
"""transformers' token-type embeddings, which this model has not: one type whose row is zero adds nothing."""


def transformers_config(model: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` keys of the transformers ``BertForMaskedLM`` that computes what this model
    does: one token type (its embedding zero), exact GELU, untied output layer."""
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_heads, "intermediate_size": model.intermediate_size,
            "hidden_act": "gelu", "hidden_dropout_prob": model.dropout, "attention_probs_dropout_prob": model.dropout,
            "max_position_embeddings": model.max_position, "type_vocab_size": 1, "initializer_range": model.init_std,
            "layer_norm_eps": model.layer_norm_eps, "pad_token_id": 0, "tie_word_embeddings": False}


def to_transformers(state: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's state dict under transformers' ``BertForMaskedLM`` names (with its zero token-type row)."""
    out = {HF_TOKEN_TYPES: torch.zeros(1, model.hidden_size)}
    for name, t in state.items():
        out[name if name.startswith("cls.") else HF_PREFIX + name] = t
    out[HF_DECODER_BIAS[1]] = state[HF_DECODER_BIAS[0]]
    return out


def from_transformers(state: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A state dict under transformers' names (:func:`to_transformers`) under this module's; one under
    this module's names is returned as it is. A token-type row that is not zero is refused: this model
    has no token types, and dropping the row would change what the model computes."""
    if not any(k.startswith(HF_PREFIX) for k in state):
        return dict(state)
    types = state.get(HF_TOKEN_TYPES)
    if types is not None and (types.shape[0] != 1 or bool(types.any())):
        raise InputError(where, "model.pretrained: holds token-type embeddings that are not zero; the built-in "
                                "model has no token types (train it with model.builder "
                                "pipefisher.runtime.models.hf:bert_mlm instead)")
    out = {name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name: t for name, t in state.items()
           if name not in (HF_TOKEN_TYPES, HF_DECODER_BIAS[1])}
    if HF_DECODER_BIAS[0] not in out and HF_DECODER_BIAS[1] in state:
        out[HF_DECODER_BIAS[0]] = state[HF_DECODER_BIAS[1]]
    return out


def build_stage(cfg: RunConfig, index: int, num_stages: int, seed: int) -> nn.Module:
    """The built-in stage builder (the default ``model.builder``): stage ``index`` of the BERT-style model,
    from ``model.pretrained``'s weights when it names some."""
    stage = PipelineStage(cfg.model, index, num_stages, seed=seed)
    if cfg.model.pretrained:
        load_pretrained(stage, cfg.model)
    return stage


def check_pretrained(where: str, theirs: Mapping[str, Any], model: ModelConfig) -> None:
    """Refuse in one line (naming ``where`` and every differing key) a pretrained model whose
    :data:`PRETRAINED_KEYS` (``theirs``) differ from the run config's ``model`` section."""
    diff = [f"{key} {theirs.get(key)!r} there, {getattr(model, key)!r} in the run config"
            for key in PRETRAINED_KEYS if theirs.get(key) != getattr(model, key)]
    if diff:
        raise InputError(where, f"model.pretrained holds a model that the run config's model section does not "
                                f"describe: {'; '.join(diff)} (set those keys in the config's model section)")


def pretrained_weights(model: ModelConfig) -> str:
    """The weights file ``model.pretrained`` names: itself, or the one in the export folder it names
    (whose ``config.json`` is checked against ``model`` first)."""
    path = model.pretrained
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise InputError(path, "model.pretrained: no such file or folder (a folder pipefisher export wrote)")
    raw = load_json(os.path.join(path, CONFIG_FILE)) if os.path.isfile(os.path.join(path, CONFIG_FILE)) else None
    if isinstance(raw, dict) and isinstance(raw.get("pipefisher"), dict):
        raw = raw["pipefisher"]  # an export that transformers loads too: pipefisher's record under its own key
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        hint = (f"; it holds a transformers {kind} model: train it with a model.builder of "
                f"pipefisher.runtime.models.hf" if kind else "")
        raise InputError(path, f"model.pretrained: holds no {CONFIG_FILE} of a model pipefisher export wrote{hint}")
    check_pretrained(path, raw["model"], model)
    for name in WEIGHTS_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise InputError(path, f"model.pretrained: holds neither {' nor '.join(WEIGHTS_FILES)}")


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file, else from a ``torch.save`` file (tensors only, no code)."""
    try:
        if path.endswith(".safetensors"):
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise InputError(path, "model.pretrained: reading .safetensors needs safetensors "
                                       "(pip install safetensors)") from None
            out = load_file(path)
        else:
            out = torch.load(path, map_location="cpu", weights_only=True)
    except InputError:
        raise
    except Exception as err:  # a damaged file, or one that is no state dict
        raise InputError(path, f"model.pretrained: is not a readable weights file ({first_line(err)})") from None
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise InputError(path, "model.pretrained: holds no state dict (a mapping of names to tensors)")
    return out


def load_pretrained(stage: nn.Module, model: ModelConfig) -> None:
    """Fill ``stage`` with its tensors from ``model.pretrained`` (every stage takes its own names from
    the one file). Built on the meta device (the builder check), it checks the config only."""
    path = pretrained_weights(model)
    own = stage.state_dict()
    if any(t.is_meta for t in own.values()):
        return
    found = from_transformers(read_weights(path), path)
    missing = [k for k in own if k not in found]
    wrong = [k for k in own if k in found and found[k].shape != own[k].shape]
    if missing or wrong:
        what = (f"lacks {len(missing)} of this stage's tensors ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''})" if missing else
                f"holds {wrong[0]} of shape {tuple(found[wrong[0]].shape)}, not {tuple(own[wrong[0]].shape)}")
        raise InputError(path, f"model.pretrained: {what}: not weights of this model")
    stage.load_state_dict({k: found[k] for k in own})


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

