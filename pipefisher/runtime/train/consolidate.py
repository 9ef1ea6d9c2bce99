"""Weights out: one consolidated model from a checkpoint (``pipefisher export``).

A checkpoint holds one file per worker (:mod:`pipefisher.runtime.train.checkpoint`), each with its
device's stage copies: one stage, Chimera's two (``down.*``, ``up.*``), or an interleaved / ZB-V
device's chunks (``chunks.<j>.*``). Every stage keeps the whole model's module names, so replica 0's
files give the whole model once each stage is taken from one copy and the copy prefix dropped.

What is written: for the Hugging Face builders, the transformers model (``save_pretrained``,
safetensors, its config the one the checkpoint keeps) that ``AutoModelForMaskedLM`` /
``AutoModelForCausalLM.from_pretrained`` loads without pipefisher; for the built-in model, the
``BertForMaskedLM`` it is (:func:`pipefisher.runtime.models.bert.to_transformers`: ``model.safetensors``
and a transformers ``config.json`` that also records the run's model section, which
``model.pretrained`` reads back); for any other builder, ``model.safetensors`` (``model.pt`` without
safetensors) under the stages' names and a ``config.json`` with the run's model section and a note.
Every export also writes the run's tokenizer as a transformers tokenizer folder (``tokenizer.json``,
``tokenizer_config.json``; ``AutoTokenizer`` loads it) where the run had one (a text corpus); a
byte-level BPE one decodes ids back to the exact text, an older run's whitespace-split BPE (the
manifest's :func:`~pipefisher.runtime.train.checkpoint.tokenizer_kind`) does not, and the line says so.

All of it is written into a temp folder beside the output, then renamed into place, so a failed export
leaves no half model behind; into an existing folder (``--force``) only the files an export writes
(:data:`EXPORT_FILES`) are replaced, one rename each, and nothing else there is touched.

torch is imported inside the functions that need it: the command checks its paths first.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from pipefisher.errors import InputError, first_line
from pipefisher.runtime.job.config import DEFAULT_BUILDER, RunConfig, config_from_dict, current_builder
from pipefisher.runtime.job.files import RUN_CHECKPOINTS, RunPaths
from pipefisher.runtime.train.checkpoint import (EXPORTABLE, MANIFEST, OLD_BPE, TOKENIZER, rank_filename, read_manifest,
                                                 step_folder, tokenizer_kind)
from pipefisher.safe_io import dump_json_atomic

if TYPE_CHECKING:
    import torch

FORMAT_NOTE = ("pipefisher export of a {builder} model: model.{ext} is the state dict of the whole model "
               "(every stage's tensors under their module names), 'model' the run config's model section. "
               "Train from it with model.pretrained: <this folder>.")
BUILT_IN_NOTE = ("pipefisher export of the built-in model: a transformers BertForMaskedLM (one token type, whose "
                 "embedding is zero); 'model' is the run config's model section. Load it with "
                 "transformers.AutoModelForMaskedLM.from_pretrained(<this folder>), or train from it with "
                 "model.pretrained: <this folder>.")

EXPORT_FILES = re.compile(r"config\.json|generation_config\.json|model\.(safetensors|pt|safetensors\.index\.json)"
                          r"|model-\d+-of-\d+\.safetensors|tokenizer\.json|tokenizer_config\.json"
                          r"|special_tokens_map\.json")
"""The names an export writes (``save_pretrained``'s included, shards and all): what ``--force`` replaces
in an existing folder, and all it touches there."""
STEP_FOLDER = re.compile(r"step-\d{8}")


def find_checkpoint(path: str) -> str:
    """The checkpoint folder ``path`` names: itself (it holds the manifest), one step folder of it
    (``step-NNNNNNNN``, a checkpoint ``checkpoint.keep`` kept), or the one ``<run>_checkpoints`` folder of
    a ``pipefisher run --out`` folder; several runs there are refused."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if os.path.isfile(path):
        raise InputError(path, "is a file, not a checkpoint folder nor a run folder")
    if not os.path.isdir(path):
        raise InputError(path, "is not a checkpoint folder nor a run folder (no such folder)")
    parent = os.path.dirname(os.path.abspath(path))
    if STEP_FOLDER.fullmatch(os.path.basename(os.path.abspath(path))):
        if os.path.isfile(os.path.join(parent, MANIFEST)):
            return path
        raise InputError(path, f"is a step folder of a checkpoint, but {parent} holds no {MANIFEST}: pass the "
                               "checkpoint folder that does")
    runs = run_checkpoint_folders(path)
    if len(runs) == 1:
        return os.path.join(path, runs[0])
    if runs:
        raise InputError(path, f"holds the checkpoints of {len(runs)} runs ({', '.join(runs)}): pass one "
                               f"checkpoint folder, e.g. {os.path.join(path, runs[0])}")
    raise InputError(path, f"holds no checkpoint: no {MANIFEST} (pipefisher train --checkpoint-dir writes one) "
                           f"and no <run>{RUN_CHECKPOINTS} folder (pipefisher run --out writes one)")


def run_checkpoint_folders(folder: str) -> list[str]:
    """The ``<run>_checkpoints`` folders in a ``pipefisher run --out`` folder, sorted."""
    return sorted(e for e in os.listdir(folder) if e.endswith(RUN_CHECKPOINTS) and os.path.isdir(os.path.join(folder, e)))


def checkpoint_step(folder: str) -> tuple[str, dict[str, Any]]:
    """The checkpoint folder and its manifest for what :func:`find_checkpoint` found: a step folder
    stands for its parent's manifest pointed at that step."""
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return folder, read_manifest(folder, EXPORTABLE)
    parent = os.path.dirname(os.path.abspath(folder))
    man = dict(read_manifest(parent, EXPORTABLE))
    steps = int(os.path.basename(os.path.abspath(folder))[5:])
    man.update(folder=step_folder(steps), steps_done=steps)
    return parent, man


def check_out(out: str, force: bool, source: str) -> None:
    """Refuse, before any work, an output that is a file, a non-empty folder without ``force``, or one
    that holds the checkpoint (the export's files would mix with, or replace, what is exported)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(out, "is a file; --out needs a folder")
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if src == dst or src.startswith(dst.rstrip(os.sep) + os.sep):
        raise InputError(out, f"holds the checkpoint being exported ({source}); choose another --out")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise InputError(out, "is not empty; --force writes the export into it, replacing only the files an export "
                              "writes (config.json, model.safetensors, tokenizer.json, ...)")


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
            prefix = copy_prefix(cfg.pipeline.chunked, cfg.pipeline.order == "chimera", copy)
            out.update({k[len(prefix):]: v for k, v in state["model"].items() if k.startswith(prefix)})
    if len(taken) != cfg.pipeline.virtual_stages:
        raise InputError(sub, f"holds {len(taken)} of the {cfg.pipeline.virtual_stages} stages")
    return out


def _write_state(tmp: str, sub: str, cfg: RunConfig, state: dict[str, "torch.Tensor"], steps: int) -> str:
    """``model.safetensors`` (or ``model.pt``) and ``config.json`` in ``tmp``; what was written, in words.
    The built-in model's under transformers' names, with a transformers config beside the run's record."""
    import torch

    from pipefisher.runtime.models.bert import (CONFIG_FILE, WEIGHTS_FILES, PipelineStage, to_transformers,
                                                 transformers_config)

    built_in = cfg.model.builder == DEFAULT_BUILDER
    if built_in:  # the whole model's names and shapes, or the files were not it
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in PipelineStage(cfg.model, 0, 1).state_dict().items()}
        if want != {k: tuple(v.shape) for k, v in state.items()}:
            raise InputError(sub, "holds stage files that do not make up the built-in model of the run's config")
        state = to_transformers(state, cfg.model)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}  # no shared storage
    try:
        from safetensors.torch import save_file
    except ImportError:
        name = WEIGHTS_FILES[1]
        torch.save(tensors, os.path.join(tmp, name))
    else:
        name = WEIGHTS_FILES[0]
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
    record = {"model": cfg.to_dict()["model"], "run": cfg.name, "steps_done": steps}
    if built_in:
        dump_json_atomic(os.path.join(tmp, CONFIG_FILE),
                         {**transformers_config(cfg.model), "pipefisher": {"format": BUILT_IN_NOTE, **record}})
        return (f"a BertForMaskedLM in {name}, {len(tensors)} tensors (transformers.AutoModelForMaskedLM."
                "from_pretrained loads it; model.pretrained trains from it)")
    note = FORMAT_NOTE.format(builder=cfg.model.builder, ext=name.rsplit(".", 1)[1])
    dump_json_atomic(os.path.join(tmp, CONFIG_FILE), {"format": note, **record})
    return f"{name} and {CONFIG_FILE}, {len(tensors)} tensors (model.pretrained trains from the folder)"


def _tokenizer(folder: str) -> str | None:
    """The run's tokenizer JSON: kept in the checkpoint folder, else (checkpoints written before it was
    kept there) the ``<run>_tokenizer.json`` of the ``pipefisher run`` folder around it; None if none."""
    candidates = [os.path.join(folder, TOKENIZER)]
    base = os.path.basename(os.path.normpath(folder))
    if base.endswith(RUN_CHECKPOINTS):
        candidates.append(RunPaths(os.path.dirname(os.path.abspath(folder)), base[: -len(RUN_CHECKPOINTS)]).tokenizer)
    for path in candidates:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    return None


def _readable(tmp: str) -> None:
    """The exported files with the mode a plain write gives (``0666`` less the umask): some writers
    (safetensors) make theirs private, unlike the rest of the folder."""
    mask = os.umask(0)
    os.umask(mask)
    for entry in os.listdir(tmp):
        os.chmod(os.path.join(tmp, entry), 0o666 & ~mask)


def _replace(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` to ``out``: renamed whole where ``out`` does not exist; else the files
    an export writes (:data:`EXPORT_FILES`) that are in ``out`` are removed and the new ones renamed in,
    leaving every other file there as it was."""
    if not os.path.isdir(out):
        os.rename(tmp, out)
        return
    for entry in os.listdir(out):
        if EXPORT_FILES.fullmatch(entry) and os.path.isfile(os.path.join(out, entry)):
            os.remove(os.path.join(out, entry))
    for entry in os.listdir(tmp):
        os.replace(os.path.join(tmp, entry), os.path.join(out, entry))


def export(path: str, out: str, force: bool = False) -> str:
    """Write the model of the checkpoint ``path`` (or of the one run in the run folder ``path``, or of
    the kept step folder ``path``) and the run's tokenizer to ``out``; returns the line saying what was
    written."""
    from pipefisher.runtime.data.corpus import write_transformers_tokenizer

    found = find_checkpoint(path)
    check_out(out, force, found)
    folder, man = checkpoint_step(found)
    raw = man.get("config")
    if not isinstance(raw, dict):
        raise InputError(os.path.join(folder, MANIFEST), "holds no run config")
    cfg = config_from_dict(raw, os.path.join(folder, MANIFEST), notice=False)  # a record: old names read silently
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
        config = man.get("export_config") if isinstance(man.get("export_config"), dict) else None
        what = (export_pretrained(cfg.model, kind, state, tmp, config) if kind
                else _write_state(tmp, sub, cfg, state, steps))
        tokenizer = _tokenizer(folder)
        if tokenizer is not None:
            write_transformers_tokenizer(tokenizer, tmp, causal=cfg.data.objective == "clm",
                                         max_length=cfg.model.max_position)
            what += "; its tokenizer (transformers.AutoTokenizer loads it" + (
                "; the whitespace-split BPE of older runs: decoding drops spaces and newlines)"
                if tokenizer_kind(man) == OLD_BPE else ")")
        else:
            what += "; no tokenizer (the run trained on token ids, or its checkpoint keeps none)"
        _readable(tmp)
        _replace(tmp, out)
    except OSError as err:
        raise InputError(out, f"cannot be written ({err.strerror or err})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (f"wrote {os.path.normpath(out)}: {what}; run '{cfg.name}' after {steps} step{'' if steps == 1 else 's'}, "
            f"from {os.path.normpath(sub)}")
