"""Weights out: one consolidated model from a checkpoint (``pipefisher export``).

A checkpoint holds one file per worker (:mod:`pipefisher.runtime.train.checkpoint`), each with its
device's stage copies: one stage, Chimera's two (``down.*``, ``up.*``), or an interleaved / ZB-V
device's chunks (``chunks.<j>.*``). Every stage keeps the whole model's module names, so replica 0's
files give the whole model once each stage is taken from one copy and the copy prefix dropped.

What is written: for the Hugging Face builders, the transformers model (``save_pretrained``,
safetensors) that ``AutoModelForMaskedLM`` / ``AutoModelForCausalLM.from_pretrained`` loads without
pipefisher; for any other builder (the built-in model first), ``model.safetensors`` (``model.pt``
without safetensors) and a ``config.json`` with the run's model section and a note on loading it,
which ``model.pretrained`` of the built-in model reads back. Either is written into a temp folder
beside the output and renamed into place, so a failed export leaves no half model behind.

torch is imported inside the functions that need it: the command checks its paths first.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from pipefisher.errors import InputError, first_line
from pipefisher.runtime.job.config import DEFAULT_BUILDER, RunConfig, config_from_dict, current_builder
from pipefisher.runtime.train.checkpoint import MANIFEST, rank_filename, read_manifest
from pipefisher.safe_io import dump_json_atomic

if TYPE_CHECKING:
    import torch

RUN_CHECKPOINTS = "_checkpoints"
"""The suffix of the checkpoint folder ``pipefisher run --out DIR`` writes for each run (``<run>_checkpoints``)."""

FORMAT_NOTE = ("pipefisher export of a {builder} model: model.{ext} is the state dict of the whole model "
               "(every stage's tensors under their module names), 'model' the run config's model section. "
               "Train from it with model.pretrained: <this folder>; load it with "
               "PipelineStage(ModelConfig(**model), 0, 1).load_state_dict(safetensors.torch.load_file(...)).")


def find_checkpoint(path: str) -> str:
    """The checkpoint folder ``path`` names: itself (it holds the manifest), or the one
    ``<run>_checkpoints`` folder of a ``pipefisher run --out`` folder; several runs there are refused."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        raise InputError(path, "is not a checkpoint folder nor a run folder (no such folder)")
    runs = sorted(e for e in os.listdir(path)
                  if e.endswith(RUN_CHECKPOINTS) and os.path.isdir(os.path.join(path, e)))
    if len(runs) == 1:
        return os.path.join(path, runs[0])
    if runs:
        raise InputError(path, f"holds the checkpoints of {len(runs)} runs ({', '.join(runs)}): pass one "
                               f"checkpoint folder, e.g. {os.path.join(path, runs[0])}")
    raise InputError(path, f"holds no checkpoint: no {MANIFEST} (pipefisher train --checkpoint-dir writes one) "
                           f"and no <run>{RUN_CHECKPOINTS} folder (pipefisher run --out writes one)")


def check_out(out: str, force: bool, source: str) -> None:
    """Refuse, before any work, an output that is a file, a non-empty folder without ``force``, or one
    that holds the checkpoint (replacing it would delete what is exported)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(out, "is a file; --out needs a folder")
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if src == dst or src.startswith(dst.rstrip(os.sep) + os.sep):
        raise InputError(out, f"holds the checkpoint being exported ({source}); choose another --out")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise InputError(out, "is not empty; --force replaces its contents with the exported model")


def merged_state(folder: str, man: dict[str, Any], cfg: RunConfig) -> dict[str, "torch.Tensor"]:
    """The whole model's tensors from replica 0's worker files of the manifest's step: every stage
    from one copy (Chimera's two copies of a stage are equal), the copy prefix dropped."""
    import torch

    from pipefisher.runtime.pipeline.copies import copy_prefix
    from pipefisher.runtime.pipeline.layout import node_pipes

    sub = os.path.join(folder, str(man.get("folder")))
    stages = int(man.get("stages") or 0)
    files = [os.path.join(sub, rank_filename(d, 0)) for d in range(stages)]
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if not stages or missing:
        raise InputError(sub, f"is incomplete: {', '.join(missing) or 'no stage file'} missing")
    out: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for device, path in enumerate(files):
        try:
            with open(path, "rb") as f:
                state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # unreadable, unpickling refused, or a damaged file
            raise InputError(path, f"is not a readable checkpoint file ({first_line(err)})") from None
        placed = tuple(state.get(k) for k in ("steps_done", "stage", "replica")) if isinstance(state, dict) else None
        if placed != (man.get("steps_done"), device, 0) or not isinstance(state.get("model"), dict):
            raise InputError(path, "does not match the manifest (another step, stage or replica)")
        for copy, stage in node_pipes(cfg, device).items():
            if stage in taken:
                continue
            taken.add(stage)
            prefix = copy_prefix(cfg.pipeline.chunked, cfg.pipeline.schedule == "chimera", copy)
            out.update({k[len(prefix):]: v for k, v in state["model"].items() if k.startswith(prefix)})
    if len(taken) != cfg.pipeline.virtual_stages:
        raise InputError(sub, f"holds {len(taken)} of the {cfg.pipeline.virtual_stages} stages")
    return out


def _write_state(tmp: str, sub: str, cfg: RunConfig, state: dict[str, "torch.Tensor"], steps: int) -> str:
    """``model.safetensors`` (or ``model.pt``) and ``config.json`` in ``tmp``; what was written, in words."""
    import torch

    from pipefisher.runtime.models.bert import CONFIG_FILE, WEIGHTS_FILES, PipelineStage

    if cfg.model.builder == DEFAULT_BUILDER:  # the whole model's names and shapes, or the files were not it
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in PipelineStage(cfg.model, 0, 1).state_dict().items()}
        if want != {k: tuple(v.shape) for k, v in state.items()}:
            raise InputError(sub, "holds stage files that do not make up the built-in model of the run's config")
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}  # no shared storage
    try:
        from safetensors.torch import save_file
    except ImportError:
        name = WEIGHTS_FILES[1]
        torch.save(tensors, os.path.join(tmp, name))
    else:
        name = WEIGHTS_FILES[0]
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
    note = FORMAT_NOTE.format(builder=cfg.model.builder, ext=name.rsplit(".", 1)[1])
    dump_json_atomic(os.path.join(tmp, CONFIG_FILE),
                     {"format": note, "model": cfg.to_dict()["model"], "run": cfg.name, "steps_done": steps})
    return f"{name} and {CONFIG_FILE}, {len(tensors)} tensors (model.pretrained trains from the folder)"


def _replace(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` to ``out``, replacing what is there (checked by :func:`check_out`)."""
    if not os.path.isdir(out):
        os.rename(tmp, out)
        return
    old = tempfile.mkdtemp(dir=os.path.dirname(tmp), prefix=os.path.basename(tmp) + ".old-")
    os.rename(out, os.path.join(old, "out"))
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def export(path: str, out: str, force: bool = False) -> str:
    """Write the model of the checkpoint ``path`` (or of the one run in the run folder ``path``) to
    ``out``; returns the line saying what was written."""
    folder = find_checkpoint(path)
    check_out(out, force, folder)
    man = read_manifest(folder)
    raw = man.get("config")
    if not isinstance(raw, dict):
        raise InputError(os.path.join(folder, MANIFEST), "holds no run config")
    cfg = config_from_dict(raw, os.path.join(folder, MANIFEST))
    cfg = cfg.replace(model={"builder": current_builder(cfg.model.builder)})  # an older name of a built-in one
    state = merged_state(folder, man, cfg)
    steps = int(man.get("steps_done") or 0)
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out))}.export-")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700; a plain mkdir would honour the umask
    except OSError as err:
        raise InputError(out, f"cannot be written ({err.strerror or err})") from None
    sub = os.path.join(folder, str(man.get("folder")))
    try:
        from pipefisher.runtime.models.hf import BUILDER_KINDS, export_pretrained

        kind = BUILDER_KINDS.get(cfg.model.builder)
        what = export_pretrained(cfg.model, kind, state, tmp) if kind else _write_state(tmp, sub, cfg, state, steps)
        _replace(tmp, out)
    except OSError as err:
        raise InputError(out, f"cannot be written ({err.strerror or err})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (f"wrote {os.path.normpath(out)}: {what}; run '{cfg.name}' after {steps} step{'' if steps == 1 else 's'}, "
            f"from {os.path.normpath(sub)}")
