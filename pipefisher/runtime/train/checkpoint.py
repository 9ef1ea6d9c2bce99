"""Checkpoints: one file per worker plus a small manifest, written atomically; resume exactly.

Every part of a run that has state says so itself (:class:`Stateful`: ``state_dict`` /
``load_state_dict``), and a :class:`Checkpointer` saves and restores a dict of such components by name,
plus the manifest; it knows the job (config, mode, schedule digest, grid) and nothing of the loop around
it, so ``pipefisher train`` (:class:`~pipefisher.runtime.train.trainer.Trainer`) and a loop of your own
on the library API (:meth:`~pipefisher.runtime.train.worker.Worker.components`,
:meth:`~pipefisher.runtime.train.worker.Worker.checkpointer`) checkpoint the same way.

Layout of a checkpoint folder::

    checkpoint.json                         manifest: format, steps done, the step folder, mode, schedule
                                            digest, stages x replicas, the component names, config and
                                            fingerprint, the transformers config an export writes
                                            (``export_config``, Hugging Face builders), the tokenizer's
                                            kind (``tokenizer_kind``, :func:`tokenizer_kind`), and the
                                            loop's own keys (the trainer's: K-FAC cycle k of the job and of each node,
                                            the active schedule, ``lr_horizon``, the run's ``options``)
    tokenizer.json                          the run's tokenizer (text corpora), for ``pipefisher export``
    step-00000012/stage0-replica0.pt        one torch file per worker (stage, replica)
    step-00000012/stage1-replica0.pt

A worker file holds :data:`HEADER` (format, step, stage, replica, ...) and one entry per component. The
trainer's: ``model`` (the stage's parameters: both copies under Chimera, every chunk when interleaved;
what ``pipefisher export`` reads), ``optimizer`` (the optimizers), ``kfac`` (``{copy: state}``, each
K-FAC copy of the device, one part per component (:meth:`pipefisher.kfac.KFAC.state_dict`): factors,
inverses, pi scales, saving flag, saved micro-batches still waiting for their covariance pieces, and what
the next refresh's drift is measured with), ``loss_scale`` (fp16),
``data`` (the data position: the next step; every micro-batch is a pure function of (seed, step,
replica, index)), ``rng`` (torch's generators: dropout), ``loop`` (scheduled mode: the active schedule
and the step it began at, the open cycle's measurements, rank 0's scheduler) and ``drift`` (samples not
gathered yet).

Every worker writes its file through a temp file and a rename; after a barrier, rank 0 points the
manifest at the new step folder (also a rename) and removes older ones beyond the newest
``checkpoint.keep`` (1: only the newest), so a crash at any moment leaves the previous checkpoint whole.
Files are read with ``torch.load(weights_only=True)``: tensors and plain containers only, no code.
Format 3 (one entry per component) resumes format 3 only; ``pipefisher export`` reads formats 2 and 3.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from pipefisher.errors import InputError, first_line
from pipefisher.runtime.job.config import (DEFAULT_BUILDER, LATER_KEYS, SYNTHETIC, OptimConfig, current_builder,
                                          renamed_sections)
from pipefisher.safe_io import atomic_path, dump_json_atomic, load_json, write_atomic

if TYPE_CHECKING:
    from pipefisher.runtime.job.dist import DistContext

MANIFEST = "checkpoint.json"
TOKENIZER = "tokenizer.json"
"""The run's tokenizer, beside the manifest: what ``pipefisher export`` writes out with the model."""
OLD_BPE = "bpe-whitespace"
"""What ``data.tokenizer: bpe`` built before it meant byte-level BPE (manifests without ``tokenizer_kind``)."""
FORMAT = 3  # 2: running-average factors, damping schedule, optimizer pair; 3: one entry per component
EXPORTABLE = (2, FORMAT)
"""The formats ``pipefisher export`` reads: the model's tensors sit in every one of them alike."""
_VOLATILE = {("pipeline", "timeout_s"), ("pipeline", "grad_bucket_mb"), ("train", "recompute"), ("train", "loss_scale"),
             ("checkpoint", "keep"), ("checkpoint", "on_interrupt")}  # may change between a run and its resumption
LR_SCHEDULE_KEYS = (("optim", "lr"), ("optim", "warmup_steps"), ("optim", "lr_schedule"), ("optim", "decay_steps"),
                    ("optim", "min_lr_ratio"), ("kfac", "lr"))
"""The learning-rate schedule: a resumed run may change it on purpose (one line says what changed)."""


def _added_later() -> dict[tuple[str, str], Any]:
    """Config keys newer than some checkpoints, with the value a run had before the key existed."""
    return {("model", "builder"): DEFAULT_BUILDER, ("model", "options"): {}, ("data", "objective"): "mlm",
            ("model", "pretrained"): "", ("data", "builder"): "", ("data", "dataset"): "", ("data", "column"): "text",
            ("train", "precision"): "fp32", ("train", "loss_scale"): 65536.0, ("checkpoint", "keep"): 1,
            ("kfac", "refresh_pieces"): 1,
            **{("optim", key): _jsonable(getattr(OptimConfig(), key))
               for key in ("muon_momentum", "muon_include", "muon_exclude")},
            **{tuple(dotted.split(".", 1)): value for dotted, value in LATER_KEYS.items()}}


def step_folder(steps_done: int) -> str:
    return f"step-{steps_done:08d}"


def rank_filename(stage: int, replica: int) -> str:
    return f"stage{stage}-replica{replica}.pt"


def _config_for_compare(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as a resumption compares it: volatile keys left out, keys an older manifest lacks
    read as the value they stand for, keys under their old names under their new ones (so checkpoints from
    before a key existed or was renamed still resume)."""
    cfg = renamed_sections(cfg, notice=False)
    out = {sec: ({k: v for k, v in vals.items() if (sec, k) not in _VOLATILE and (sec, k) not in LR_SCHEDULE_KEYS}
                 if isinstance(vals, dict) else vals)
           for sec, vals in cfg.items()}
    for (sec, key), value in _added_later().items():
        if out.get(sec) is None:  # a whole section newer than the manifest
            out[sec] = {}
        if isinstance(out.get(sec), dict):
            out[sec].setdefault(key, value)
    if isinstance(out.get("model"), dict):
        out["model"]["builder"] = current_builder(out["model"].get("builder"))
    return out


def _differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for sec in sorted(set(a) | set(b)):
        x, y = a.get(sec), b.get(sec)
        if isinstance(x, dict) and isinstance(y, dict):
            out += [f"{sec}.{k}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        elif x != y:
            out.append(sec)
    return out


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=list))


# ----------------------------------------------------------------------------------------------------
# Stateful components


@runtime_checkable
class Stateful(Protocol):
    """A part of a run with state of its own: ``state_dict()`` says what it is (tensors and plain
    containers, so that ``torch.load(weights_only=True)`` reads it back), ``load_state_dict`` restores it."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


HEADER = ("format", "steps_done", "stage", "replica", "stages", "replicas", "fingerprint", "mode", "schedule")
"""The keys of a worker file that say where it belongs; every other key is a component's state."""


def check_components(components: Mapping[str, Any]) -> None:
    """Refuse (``TypeError``, one line) a component that cannot save and restore itself, or whose name
    is not a string or is one of the file's own keys (:data:`HEADER`)."""
    for name, part in components.items():
        if not isinstance(name, str) or name in HEADER:
            raise TypeError(f"checkpoint component name {name!r}: use a string other than {', '.join(HEADER)}")
        _check_stateful(name, part)


def _check_stateful(name: Any, part: Any) -> None:
    if not isinstance(part, Stateful):
        raise TypeError(f"checkpoint component '{name}' ({type(part).__name__}) has no state_dict() and "
                        "load_state_dict(): give it both, or leave it out of the checkpoint")


class StateGroup:
    """Several components saved as one ``{key: state}`` entry (each K-FAC copy of a device by copy id)."""

    def __init__(self, parts: Mapping[Any, Any]) -> None:
        self.parts = dict(parts)
        for key, part in self.parts.items():
            _check_stateful(key, part)

    def state_dict(self) -> dict[Any, Any]:
        return {key: part.state_dict() for key, part in self.parts.items()}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        if set(state) != set(self.parts):
            raise ValueError(f"state of {sorted(state)}, this run has {sorted(self.parts)}")
        for key, part in self.parts.items():
            part.load_state_dict(state[key])


class TorchRNG:
    """torch's global random generators (dropout draws from them): the CPU one, and the device's on CUDA."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", device) == "cuda"

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if self.cuda else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(state["cpu"])
        if self.cuda and state["cuda"] is not None:
            torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------------
# Writing

def _export_config(cfg: Any) -> dict[str, Any] | None:
    """The transformers config of a Hugging Face builder's model (:func:`pipefisher.runtime.models.hf.export_config`)."""
    from pipefisher.runtime.models.hf import BUILDER_KINDS, export_config

    return _jsonable(export_config(cfg.model)) if cfg.model.builder in BUILDER_KINDS else None


def stale_steps(folder: str, steps_done: int, keep: int) -> list[str]:
    """The step folders in ``folder`` to remove once the checkpoint of ``steps_done`` is complete: all
    but the newest ``keep`` of those up to it (a newer one, of a run that went further, is never touched)."""
    steps = sorted((int(e[5:]), e) for e in os.listdir(folder)
                   if e.startswith("step-") and e[5:].isdigit() and int(e[5:]) <= steps_done)
    return [e for _, e in steps[:-keep]]


# ----------------------------------------------------------------------------------------------------
# Reading


def check_exists(folder: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint folder that does not exist, in one line: cheap, so ``train --resume`` says it
    before torch loads and before it makes its output folders (a mistyped one would become empty)."""
    if not os.path.isdir(folder):
        raise InputError(folder, "does not exist (no such folder, so no checkpoint to resume from)")


def read_manifest(folder: str | os.PathLike[str], formats: tuple[int, ...] = (FORMAT,)) -> dict[str, Any]:
    """The manifest in ``folder``, refused in one line unless written in one of ``formats`` (resuming
    needs the current one; an older one is named with what to do)."""
    folder = os.fspath(folder)
    check_exists(folder)
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise InputError(folder, f"holds no checkpoint ({MANIFEST} is missing)")
    data = load_json(path)
    written = data.get("format") if isinstance(data, dict) else None
    if written in formats:
        return data
    if isinstance(written, int) and 0 < written < FORMAT:
        raise InputError(path, f"was written in checkpoint format {written} by an earlier pipefisher, this one "
                               f"resumes format {FORMAT} only: finish that run with the pipefisher that wrote it, or "
                               "pipefisher export it and start a new run from the export (model.pretrained)")
    raise InputError(path, f"is not a pipefisher checkpoint manifest of format {FORMAT}")


def tokenizer_kind(man: Mapping[str, Any]) -> str:
    """The kind of tokenizer (``data.tokenizer``) the manifest's run had: recorded as ``tokenizer_kind``
    since ``bpe`` means byte-level BPE; before, ``bpe`` was the whitespace-split BPE (:data:`OLD_BPE`).
    Synthetic tokens have no tokenizer: their setting is taken as it reads."""
    if "tokenizer_kind" in man:
        return str(man["tokenizer_kind"])
    data = (man.get("config") or {}).get("data") or {}
    said = str(data.get("tokenizer", "bpe"))
    return OLD_BPE if said == "bpe" and data.get("text") != SYNTHETIC else said


def check_resume_config(folder: str | os.PathLike[str], cfg: Any) -> dict[str, Any]:
    """Refuse (:class:`InputError`) resuming the checkpoint in ``folder`` with a config that differs from
    its run's in more than a resume may change, naming each key that differs (with both values) and what
    may change; its manifest otherwise. Checked first, so that the refusal says this real reason rather
    than what the other config breaks next (its schedule's metadata, say). The run's tokenizer is the
    one it had (:func:`tokenizer_kind`): the ids the model learnt are that tokenizer's."""
    folder = os.fspath(folder)
    man = read_manifest(folder)
    mine, theirs = _config_for_compare(_jsonable(cfg.to_dict())), _config_for_compare(man.get("config") or {})
    if isinstance(theirs.get("data"), dict):
        theirs["data"]["tokenizer"] = tokenizer_kind(man)
    if mine != theirs:
        def value(cfg: dict[str, Any], key: str) -> Any:
            sec, _, name = key.partition(".")
            part = cfg.get(sec)
            return (part.get(name) if isinstance(part, dict) else None) if name else part

        keys = _differing_keys(mine, theirs)
        diff = "; ".join(f"{k}: {value(theirs, k)} there, {value(mine, k)} here" for k in keys)
        if "data.tokenizer" in keys:
            kind = theirs["data"]["tokenizer"]
            older = " (the whitespace-split BPE of older runs)" if kind == OLD_BPE else ""
            how = f"its run's tokenizer was {kind}{older}: --set data.tokenizer={kind} resumes it"
        else:
            may = ", ".join(f"{sec}.{key}" for sec, key in (*LR_SCHEDULE_KEYS, *sorted(_VOLATILE)))
            how = (f"a resumed run may change only its learning-rate schedule and run-time settings ({may}): "
                   "resume with the run's config, or start a new run with this one")
        raise InputError(folder, f"was written by a run with another config (differs in {diff}); {how}")
    return man


def check_resumable(folder: str | os.PathLike[str], cfg: Any, mode: str, schedule: str | None,
                    stages: int, replicas: int) -> dict[str, Any]:
    """Refuse (:class:`InputError`) a checkpoint that another job wrote; its manifest otherwise.

    ``schedule`` is the digest of the schedule the new run uses (None unless ``scheduled``).
    """
    folder = os.fspath(folder)
    man = check_resume_config(folder, cfg)
    if man.get("mode") != mode:
        raise InputError(folder, f"was written in mode '{man.get('mode')}', this run is '{mode}'")
    if man.get("schedule") != schedule:
        raise InputError(folder, "was written with another schedule file (its labels differ)")
    if (man.get("stages"), man.get("replicas")) != (stages, replicas):
        raise InputError(folder, f"was written by {man.get('stages')} stage(s) x {man.get('replicas')} "
                                 f"replica(s); this run has {stages} x {replicas}")
    sub = os.path.join(folder, str(man.get("folder")))
    missing = [rank_filename(s, r) for r in range(replicas) for s in range(stages)
               if not os.path.exists(os.path.join(sub, rank_filename(s, r)))]
    if missing:
        raise InputError(sub, f"is incomplete: {', '.join(missing)} missing")
    return man


def nothing_left(folder: str | os.PathLike[str], steps: int) -> str | None:
    """The line to print when resuming from ``folder`` up to ``steps`` total steps has nothing to train
    (else None); refuses ``steps`` below those done, which reads like "this many more" (it is the total)."""
    folder = os.fspath(folder)
    done = int(read_manifest(folder).get("steps_done") or 0)
    if steps < done:
        raise InputError(folder, f"holds a checkpoint with {done} steps done, but --steps is {steps}: --steps counts "
                                 f"every step, those done included (--steps {done + steps} trains {steps} more)")
    if steps == done:
        return f"nothing to do: the checkpoint in {os.path.normpath(folder)} has {done} steps done, --steps is {steps}"
    return None


def lr_schedule_changes(man: dict[str, Any], cfg: Any) -> list[str]:
    """What a resumed run changes in the learning-rate schedule (:data:`LR_SCHEDULE_KEYS`), as
    ``optim.decay_steps 0 -> 100``; empty when it continues the checkpoint's run's schedule."""
    theirs, mine = renamed_sections(man.get("config") or {}, notice=False), _jsonable(cfg.to_dict())
    return [f"{sec}.{key} {theirs[sec][key]} -> {mine[sec][key]}" for sec, key in LR_SCHEDULE_KEYS
            if isinstance(theirs.get(sec), dict) and key in theirs[sec] and theirs[sec][key] != mine[sec][key]]


def lr_horizon(man: dict[str, Any], cfg: Any, steps: int) -> int:
    """The step where a resumed run's learning-rate decay ends: the one the checkpoint's run decayed to
    (its ``optim.decay_steps``, else its ``--steps``), so that ``--steps`` growing on resume does not move
    the schedule under the run; a changed ``optim.decay_steps`` sets a new one (0: this run's ``--steps``).
    Checkpoints written before the horizon was recorded decay to this run's ``--steps``, as they did."""
    recorded = man.get("lr_horizon")
    theirs = ((man.get("config") or {}).get("optim") or {}).get("decay_steps", 0)
    if recorded is None or cfg.optim.decay_steps != theirs:
        return int(cfg.optim.decay_steps or steps)
    return int(recorded)


def resume_note(folder: str | os.PathLike[str], cfg: Any, steps: int, past_decay: bool = False) -> str | None:
    """The line a resumed run prints about its learning-rate schedule, or None when there is nothing to say:
    what the user changed on purpose, or (``past_decay``) that the steps past the first run's decay keep
    its final rate. Without ``past_decay`` such steps are refused (:class:`InputError`), with the fix:
    they would train at the decayed rate (0 by default), which is rarely what more steps are for."""
    man = read_manifest(folder)
    changes = lr_schedule_changes(man, cfg)
    horizon = lr_horizon(man, cfg, steps)
    if changes:
        return (f"resuming with another learning-rate schedule than the checkpoint's run: {', '.join(changes)} "
                f"(decay to step {horizon})")
    o = cfg.optim
    if man.get("lr_horizon") is None or steps <= horizon or o.lr_schedule == "constant":
        return None
    final = f"{o.min_lr_ratio * o.lr:g} (optim.min_lr_ratio x optim.lr)"
    if not past_decay:
        raise InputError(os.fspath(folder), f"holds a run whose {o.lr_schedule} learning-rate schedule decayed to step "
                                            f"{horizon}: --steps {steps} would train steps {horizon}-{steps - 1} at "
                                            f"its final rate {final}; --set optim.decay_steps={steps} decays over all "
                                            f"{steps} steps instead, --past-decay trains them at the final rate")
    return (f"resuming: the learning rate keeps the schedule of the checkpoint's run, which decayed to step "
            f"{horizon}; steps {horizon}-{steps - 1} run at its final rate {final} (--past-decay)")


@dataclass
class Checkpointer:
    """Saves and restores a dict of stateful components (:class:`Stateful`) of one worker of a job, plus
    the job's manifest; knows the job (its config, mode, schedule and grid) and nothing of the loop around it.

    ``ctx`` is the worker's :class:`~pipefisher.runtime.job.dist.DistContext`, ``schedule`` the digest of
    the schedule file (scheduled mode, else None). Every worker of the job calls :meth:`save` and
    :meth:`load` with the same component names, at the same point. ``tokenizer``: the run's tokenizer
    (JSON; text corpora), written beside the manifest for ``pipefisher export``."""

    ctx: "DistContext"
    cfg: Any  # RunConfig
    mode: str
    schedule: str | None = None
    tokenizer: str | None = None

    def save(self, folder: str, steps_done: int, components: Mapping[str, Any], *,
             manifest: Mapping[str, Any] | None = None) -> str:
        """Write this worker's file after ``steps_done`` steps (collective); returns its path. ``manifest``:
        the loop's own keys for the manifest (rank 0's)."""
        import torch
        import torch.distributed as dist

        check_components(components)
        g = self.ctx.grid
        sub = os.path.join(folder, step_folder(steps_done))
        os.makedirs(sub, exist_ok=True)
        state = {"format": FORMAT, "steps_done": steps_done, "stage": g.stage, "replica": g.replica,
                 "stages": g.stages, "replicas": g.replicas, "fingerprint": self.cfg.fingerprint(),
                 "mode": self.mode, "schedule": self.schedule,
                 **{name: part.state_dict() for name, part in components.items()}}
        path = os.path.join(sub, rank_filename(g.stage, g.replica))
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
        if self.ctx.distributed:
            dist.barrier()  # every part is on disk before the manifest points at it
        if g.rank == 0:
            if self.tokenizer:  # the vocabulary the ids mean, for pipefisher export
                write_atomic(os.path.join(folder, TOKENIZER), self.tokenizer)
            dump_json_atomic(os.path.join(folder, MANIFEST), {
                **(manifest or {}),  # the loop's own keys first: the job's below are the checkpointer's
                "format": FORMAT, "steps_done": steps_done, "folder": step_folder(steps_done),
                "mode": self.mode, "schedule": self.schedule, "stages": g.stages, "replicas": g.replicas,
                "components": sorted(components),
                "fingerprint": self.cfg.fingerprint(), "config": _jsonable(self.cfg.to_dict()),
                "tokenizer_kind": self.cfg.data.tokenizer,  # what data.tokenizer meant (see tokenizer_kind)
                # what an export writes as the transformers config: it needs no pretrained folder then
                "export_config": _export_config(self.cfg)})
            for entry in stale_steps(folder, steps_done, self.cfg.checkpoint.keep):
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
        if self.ctx.distributed:
            # the manifest is written before any worker goes on: one that resumes from this folder right
            # away (a driver's next run) must not find it missing, or an older one being swept
            dist.barrier()
        return path

    def load(self, folder: str, components: Mapping[str, Any]) -> int:
        """Restore every component from ``folder`` (refused in one line, :class:`InputError`, when another
        job wrote it or it lacks one of them; state it holds for other components is left unread);
        returns the steps done, the next step to run."""
        import torch

        check_components(components)
        g = self.ctx.grid
        man = check_resumable(folder, self.cfg, self.mode, self.schedule, g.stages, g.replicas)
        path = os.path.join(folder, str(man["folder"]), rank_filename(g.stage, g.replica))
        try:
            with open(path, "rb") as f:
                state = torch.load(f, map_location=self.ctx.device, weights_only=True)
        except OSError as err:
            raise InputError(path, f"cannot be read ({err.strerror or err})") from None
        except Exception as err:  # unpickling refused or a damaged file
            raise InputError(path, f"is not a readable checkpoint ({first_line(err)})") from None
        if not isinstance(state, dict) or state.get("steps_done") != man["steps_done"] \
                or (state.get("stage"), state.get("replica")) != (g.stage, g.replica):
            raise InputError(path, "does not match the manifest (another step, stage or replica)")
        missing = [name for name in components if name not in state]
        if missing:
            saved = ", ".join(sorted(set(state) - set(HEADER)))
            raise InputError(path, f"holds no state of {', '.join(missing)} (its run did not save "
                                   f"{'it' if len(missing) == 1 else 'them'}; it saved {saved})")
        for name, part in components.items():
            try:
                part.load_state_dict(state[name])
            except (ValueError, KeyError, TypeError, RuntimeError) as err:
                raise InputError(path, f"holds {name} state that does not fit this run ({first_line(err)})") from None
        return int(man["steps_done"])
