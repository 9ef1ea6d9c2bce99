"""Run configuration read from YAML: model shape, pipeline layout, data, optimizer and K-FAC settings.

Plain dataclasses (no torch), so the CLI can check a config before any worker starts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipefisher.errors import InputError

DEFAULT_KFAC_IGNORE = ("embeddings", "LayerNorm", "cls")
"""Substrings of module names K-FAC leaves alone: embeddings, norms and the prediction head."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the BERT-style masked-language model."""

    vocab_size: int = 100
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    max_position: int = 64
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from: seeded synthetic tokens, or a local text file with a simple vocabulary."""

    seq_len: int = 16
    micro_batch_size: int = 4
    num_micro_batches: int = 4
    mask_prob: float = 0.15
    seed: int = 0
    text_file: str | None = None


@dataclass(frozen=True)
class OptimConfig:
    """First-order optimizer that takes the (possibly preconditioned) gradients."""

    name: str = "sgd"  # sgd | adam
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0


@dataclass(frozen=True)
class KfacConfig:
    """K-FAC: damping, curvature refresh interval (in steps), and which modules to skip."""

    damping: float = 1e-3
    interval: int = 1
    ignore: tuple[str, ...] = DEFAULT_KFAC_IGNORE


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline layout. ``stages`` x data-parallel replicas = world size; replicas are inferred."""

    stages: int = 2
    schedule: str = "1f1b"  # gpipe | 1f1b
    timeout_s: float = 60.0


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    kfac: KfacConfig = field(default_factory=KfacConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def replace(self, **sections: Mapping[str, Any]) -> "RunConfig":
        """A copy with some fields of some sections changed, e.g. ``replace(pipeline={"stages": 4})``."""
        changes = {}
        for name, values in sections.items():
            if name == "name":
                changes[name] = values
                continue
            changes[name] = dataclasses.replace(getattr(self, name), **values)
        out = dataclasses.replace(self, **changes)
        check_config(out, None)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Short hash that every worker compares at start-up, so stages never run different setups."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "kfac": KfacConfig,
             "pipeline": PipelineConfig}


def config_from_dict(raw: Any, path: str | os.PathLike[str] | None = None) -> RunConfig:
    """Build and check a :class:`RunConfig`; unknown keys and bad values are :class:`InputError`."""
    if not isinstance(raw, Mapping):
        raise InputError(path, "config must be a mapping of sections (model, data, optim, kfac, pipeline)")
    unknown = set(raw) - set(_SECTIONS) - {"name"}
    if unknown:
        raise InputError(path, f"unknown config section(s): {', '.join(sorted(map(str, unknown)))}")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name) or {}
        if not isinstance(values, Mapping):
            raise InputError(path, f"section '{name}' must be a mapping")
        known = {f.name: f for f in dataclasses.fields(cls)}
        bad = set(values) - set(known)
        if bad:
            raise InputError(path, f"unknown key(s) in '{name}': {', '.join(sorted(map(str, bad)))}")
        kwargs = {}
        for key, value in values.items():
            default = getattr(cls(), key)
            if isinstance(default, tuple):
                if not isinstance(value, (list, tuple)):
                    raise InputError(path, f"{name}.{key} must be a list")
                value = tuple(str(v) for v in value)
            elif isinstance(default, bool) or default is None or isinstance(default, str):
                pass
            elif isinstance(default, int) and not isinstance(value, bool) and isinstance(value, int):
                pass
            elif isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = float(value)
            else:
                raise InputError(path, f"{name}.{key} must be a {type(default).__name__}, not {value!r}")
            kwargs[key] = value
        sections[name] = cls(**kwargs)
    cfg = RunConfig(name=str(raw.get("name", "run")), **sections)
    check_config(cfg, path)
    return cfg


def check_config(cfg: RunConfig, path: str | os.PathLike[str] | None) -> None:
    m, d, p = cfg.model, cfg.data, cfg.pipeline
    problems = []
    if m.hidden_size % m.num_heads:
        problems.append("model.hidden_size must be a multiple of model.num_heads")
    if min(m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size) < 1:
        problems.append("model sizes must be positive")
    if m.vocab_size < 8:
        problems.append("model.vocab_size must be at least 8 (special tokens)")
    if d.seq_len > m.max_position:
        problems.append("data.seq_len must not exceed model.max_position")
    if min(d.seq_len, d.micro_batch_size, d.num_micro_batches) < 1:
        problems.append("data sizes must be positive")
    if not 0.0 < d.mask_prob <= 1.0:
        problems.append("data.mask_prob must be in (0, 1]")
    if p.schedule not in ("gpipe", "1f1b"):
        problems.append("pipeline.schedule must be 'gpipe' or '1f1b'")
    if not 1 <= p.stages <= m.num_layers:
        problems.append("pipeline.stages must be between 1 and model.num_layers")
    if p.timeout_s <= 0:
        problems.append("pipeline.timeout_s must be positive")
    if cfg.optim.name not in ("sgd", "adam"):
        problems.append("optim.name must be 'sgd' or 'adam'")
    if cfg.kfac.interval < 1 or cfg.kfac.damping <= 0:
        problems.append("kfac.interval must be >= 1 and kfac.damping > 0")
    if problems:
        raise InputError(path, "; ".join(problems))


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read a YAML config file."""
    import yaml

    from pipefisher.safe_io import read_bytes

    data = read_bytes(path)
    try:
        raw = yaml.safe_load(data)
    except yaml.YAMLError as err:
        raise InputError(path, f"is not valid YAML ({err})") from None
    return config_from_dict(raw, path)
