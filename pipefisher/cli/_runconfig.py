"""The run config of ``pipefisher train`` and ``pipefisher run``, read and checked before torch loads.

One place for what both commands do with ``--config``, ``--set`` and the pipeline options: a mistake in
any of them, a ``model.pretrained`` folder or a data file that is not there, is one line and exit 2
within a fraction of a second, not after torch has loaded and the corpus was prepared. Paths in the
config are made absolute here, so every record of the run (checkpoint manifest, ``<run>_config.yaml``)
means the same files from any working folder. Nothing here imports torch.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from pipefisher.cli._common import require_runtime
from pipefisher.errors import InputError
from pipefisher.runtime.job.config import (STDLIB, SYNTHETIC, RunConfig, apply_overrides, check_pieces_resolved,
                                           load_config)

PIPELINE_OPTIONS = {"stages": "--stages", "order": "--order", "timeout_s": "--timeout", "chunks": "--chunks"}
"""The options that override ``pipeline.*`` keys (the same on ``train`` and ``run``), by key."""


def with_options(cfg: RunConfig, pipeline: Mapping[str, Any], interval: int | None = None) -> RunConfig:
    """``cfg`` with the ``pipeline.*`` options given (None: not given) and ``--interval``; a combination
    the checks refuse names those options (``--order zb-v --chunks 3: ...``), which caused it."""
    given = {k: v for k, v in pipeline.items() if v is not None}
    if not given and not interval:
        return cfg
    try:
        return cfg.replace(pipeline=given, kfac={"interval": interval} if interval else {})
    except InputError as err:
        named = [f"{PIPELINE_OPTIONS[k]} {v}" for k, v in given.items()] + ([f"--interval {interval}"] if interval else [])
        raise InputError(" ".join(named), err.problem) from None


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``model.pretrained`` as an absolute path: the run's records then name the folder the run read,
    wherever they are read from (``pipefisher export`` in another folder, a resumed run)."""
    if cfg.model.pretrained and not os.path.isabs(cfg.model.pretrained):
        return cfg.replace(model={"pretrained": os.path.abspath(os.path.expanduser(cfg.model.pretrained))})
    return cfg


def check_sources(cfg: RunConfig) -> None:
    """Refuse a ``model.pretrained`` that is not there, and a ``data.text`` (text files or a dataset's
    files) that names none, before torch loads. A ``data.builder`` is the workers' to call."""
    if cfg.model.pretrained and not os.path.exists(cfg.model.pretrained):
        raise InputError(cfg.model.pretrained, "model.pretrained: no such file or folder (a folder save_pretrained "
                                               "or pipefisher export wrote)")
    d = cfg.data
    if d.builder or d.text in (STDLIB, SYNTHETIC):
        return
    from pipefisher.runtime.data.sources import corpus_files  # numpy, no torch

    try:
        corpus_files(d.text, d.dataset)
    except InputError as err:
        raise InputError(err.path, f"data.text: {err.problem}") from None


def read_run_config(config_path: str, overrides: tuple[str, ...], command: str, pipeline: Mapping[str, Any],
                    interval: int | None = None) -> RunConfig:
    """The config ``command`` runs: the file, ``--set`` overrides, the pipeline options; checked, its
    paths absolute and its sources there (:func:`check_sources`); the ``tokenizers`` package where it
    reads text."""
    cfg = with_options(apply_overrides(load_config(config_path), overrides, config_path), pipeline, interval)
    if command != "run":  # run profiles each count and keeps one; the others take the count of a profile
        check_pieces_resolved(cfg.kfac, config_path, f"pipefisher {command}")
    if cfg.data.text != SYNTHETIC:
        require_runtime(command, ("tokenizers",))  # real text is tokenized by the tokenizers package
    cfg = absolute_paths(cfg)
    check_sources(cfg)
    return cfg
