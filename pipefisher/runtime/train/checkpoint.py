"""Checkpoints: one file per worker plus a small manifest, written atomically; resume exactly.

Layout of a checkpoint folder::

    checkpoint.json                         manifest: steps done, config, mode, schedule digest, layout,
                                            K-FAC cycle k of the job (``cycle``) and of each node, the
                                            step the learning rate decays to (``lr_horizon``), the
                                            transformers config an export writes (``export_config``,
                                            Hugging Face builders), the run's options (``options``)
    tokenizer.json                          the run's tokenizer (text corpora), for ``pipefisher export``
    step-00000012/stage0-replica0.pt        one torch file per worker (stage, replica)
    step-00000012/stage1-replica0.pt

Every worker writes its file through a temp file and a rename; after a barrier, rank 0 points the
manifest at the new step folder (also a rename) and removes older ones beyond the newest
``checkpoint.keep`` (1: only the newest), so a crash at any moment leaves the previous checkpoint whole. A worker file holds the stage's parameters (both stage copies
under Chimera, every chunk when interleaved), the optimizer state, the K-FAC state of each copy (factors, inverses, pi scales,
saving flag and any saved micro-batches still waiting for their covariance pieces, and what the next
refresh's drift is measured with: the gradient last preconditioned, its preconditioned gradient, the
inverses a half-done refresh replaced and those of the refresh before), the drift samples not gathered yet, the closed loop's
state in scheduled mode (the active schedule and the step it began at, the open cycle's measurements,
and on rank 0 the scheduler's window) and the torch random state (dropout). The data position is the
step number: every micro-batch is a pure function of (seed, step, replica, index), and the schedule
position is ``(step - first step) % k`` of the active schedule.

Files are read with ``torch.load(weights_only=True)``: tensors and plain containers only, no code.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

from pipefisher.errors import InputError, first_line
from pipefisher.runtime.job.config import DEFAULT_BUILDER, OptimConfig, current_builder
from pipefisher.safe_io import atomic_path, dump_json_atomic, load_json, write_atomic

if TYPE_CHECKING:
    from pipefisher.runtime.train.trainer import Trainer

MANIFEST = "checkpoint.json"
TOKENIZER = "tokenizer.json"
"""The run's tokenizer, beside the manifest: what ``pipefisher export`` writes out with the model."""
FORMAT = 2  # 2: running-average factors, damping schedule, optimizer pair
_VOLATILE = {("pipeline", "timeout_s"), ("train", "recompute"), ("train", "loss_scale"), ("checkpoint", "keep")}  # may change between a run and its resumption
LR_SCHEDULE_KEYS = (("optim", "lr"), ("optim", "warmup_steps"), ("optim", "schedule"), ("optim", "decay_steps"),
                    ("optim", "min_lr_ratio"), ("kfac", "lr"))
"""The learning-rate schedule: a resumed run may change it on purpose (one line says what changed)."""


def _added_later() -> dict[tuple[str, str], Any]:
    """Config keys newer than some checkpoints, with the value a run had before the key existed."""
    return {("model", "builder"): DEFAULT_BUILDER, ("model", "options"): {}, ("data", "objective"): "mlm",
            ("model", "pretrained"): "", ("data", "builder"): "", ("data", "dataset"): "", ("data", "column"): "text",
            ("train", "precision"): "fp32", ("train", "loss_scale"): 65536.0, ("checkpoint", "keep"): 1,
            **{("optim", key): _jsonable(getattr(OptimConfig(), key))
               for key in ("muon_momentum", "muon_include", "muon_exclude")}}


def step_folder(steps_done: int) -> str:
    return f"step-{steps_done:08d}"


def rank_filename(stage: int, replica: int) -> str:
    return f"stage{stage}-replica{replica}.pt"


def _config_for_compare(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as a resumption compares it: volatile keys left out, keys an older manifest lacks
    read as the value they stand for (so checkpoints from before a key existed still resume)."""
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
# K-FAC state


def kfac_state(kfac: Any) -> dict[str, Any]:
    kfac.settle_all()
    layers = {}
    for name, st in kfac.layers.items():
        layers[name] = {
            "sums": dict(st.sums), "counts": dict(st.counts), "inverses": dict(st.inverses),
            "last_pi": st.last_pi,
            "running": dict(st.running), "inversions": dict(st.inversions), "skipped": st.skipped,
            "synced": dict(st.synced),
            "inputs": list(st.inputs), "outgrads": list(st.outgrads),
            # the drift's (KFAC._measure_drift): a refresh can be half done at a checkpoint
            "last_grad": st.last_grad, "last_pre": st.last_pre,
            "pre_versions": list(st.pre_versions) if st.pre_versions is not None else None,
            "replaced": dict(st.replaced), "handled": sorted(st.handled), "previous": dict(st.previous),
        }
    return {"saving": kfac.saving, "layers": layers}


def load_kfac_state(kfac: Any, state: dict[str, Any], path: str) -> None:
    layers = state["layers"]
    if set(layers) != set(kfac.layers):
        raise InputError(path, "holds K-FAC state of other modules than this stage's")
    kfac.set_saving(bool(state["saving"]))
    for name, st in kfac.layers.items():
        s = layers[name]
        st.sums = {f: s["sums"][f] for f in "AB"}
        st.counts = {f: int(s["counts"][f]) for f in "AB"}
        st.inverses = {f: s["inverses"][f] for f in "AB"}
        st.last_pi = s["last_pi"]
        st.running = {f: s["running"][f] for f in "AB"}
        st.inversions = {f: int(s["inversions"][f]) for f in "AB"}
        st.skipped = int(s["skipped"])
        st.synced = {f: bool(s.get("synced", {}).get(f, False)) for f in "AB"}
        st.inputs.clear()
        st.inputs.extend(s["inputs"])
        st.outgrads.clear()
        st.outgrads.extend(s["outgrads"])
        st.last_grad, st.last_pre = s.get("last_grad"), s.get("last_pre")  # absent: written before drift
        versions = s.get("pre_versions")
        st.pre_versions = (int(versions[0]), int(versions[1])) if versions is not None else None
        st.replaced = {f: t for f, t in (s.get("replaced") or {}).items()}
        st.handled = set(s.get("handled") or ())
        st.previous = {f: (s.get("previous") or {}).get(f) for f in "AB"}
    kfac.recount_saved()


# ----------------------------------------------------------------------------------------------------
# Writing

RUN_OPTIONS = ("adapt", "adapt_policy", "margin", "eval_every", "checkpoint_every", "log_every", "tensorboard")
"""The training options a manifest records (``options``): what ``pipefisher run --resume`` runs again."""


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


def save_checkpoint(folder: str, trainer: "Trainer", steps_done: int) -> str:
    """Write this worker's part after ``steps_done`` steps; every worker of the job must call it."""
    import torch
    import torch.distributed as dist

    g = trainer.ctx.grid
    sub = os.path.join(folder, step_folder(steps_done))
    os.makedirs(sub, exist_ok=True)
    state = {
        "format": FORMAT,
        "steps_done": steps_done,
        "fingerprint": trainer.cfg.fingerprint(),
        "mode": trainer.mode,
        "schedule": trainer.schedule_digest,
        "stage": g.stage, "replica": g.replica, "stages": g.stages, "replicas": g.replicas,
        "model": trainer.stage.state_dict(),
        "optimizer": trainer.updater.state_dict(),
        "kfac": kfac_state(trainer.kfacs[0]) if trainer.kfacs else None,
        "kfac_up": kfac_state(trainer.kfacs[1]) if 1 in trainer.kfacs else None,  # Chimera's up copy
        # every copy by id (interleaving's chunks 2, 3, ... have no slot above)
        "kfac_copies": {p: kfac_state(k) for p, k in trainer.kfacs.items() if p >= 2} or None,
        # the closed loop: the active schedule, its first step, open measurements, the scheduler (rank 0)
        "loop": trainer.loop.state_dict() if getattr(trainer, "loop", None) is not None else None,
        # drift measured and not gathered yet (the open cycle's, in scheduled mode)
        "drift": trainer.drift_log.state_dict() if getattr(trainer, "drift_log", None) is not None else None,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if trainer.ctx.device.type == "cuda" else None,
    }
    path = os.path.join(sub, rank_filename(g.stage, g.replica))
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    if trainer.ctx.distributed:
        dist.barrier()  # every part is on disk before the manifest points at it
    if g.rank == 0:
        corpus = getattr(trainer.data, "corpus", None)
        if corpus is not None and corpus.tokenizer_json:  # the vocabulary the ids mean, for pipefisher export
            write_atomic(os.path.join(folder, TOKENIZER), corpus.tokenizer_json)
        dump_json_atomic(os.path.join(folder, MANIFEST), {
            "format": FORMAT,
            "steps_done": steps_done,
            "folder": step_folder(steps_done),
            "mode": trainer.mode,
            "schedule": trainer.schedule_digest,
            "schedule_path": trainer.opts.schedule,
            # the job's K-FAC cycle k (its longest node's, as the training header says), and each node's
            "cycle": max(trainer.cycles) if trainer.cycles else None,
            "node_cycles": list(trainer.cycles) or None,
            # the schedule running when it was written (another than the file's after an --adapt switch)
            "active_schedule": trainer.loop.plan.digest if getattr(trainer, "loop", None) is not None else None,
            "active_from_step": trainer.loop.first_step if getattr(trainer, "loop", None) is not None else None,
            "stages": g.stages,
            "replicas": g.replicas,
            # the step where the learning-rate decay ends: a resumed run keeps it (see lr_horizon)
            "lr_horizon": trainer.updater.schedule.total_steps,
            "fingerprint": trainer.cfg.fingerprint(),
            "config": _jsonable(trainer.cfg.to_dict()),
            # what an export writes as the transformers config: it needs no pretrained folder then
            "export_config": _export_config(trainer.cfg),
            # how the run trains (pipefisher run --resume continues it so)
            "options": {k: getattr(trainer.opts, k) for k in RUN_OPTIONS},
        })
        for entry in stale_steps(folder, steps_done, trainer.cfg.checkpoint.keep):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    if trainer.ctx.distributed:
        # the manifest is written before any worker goes on: one that resumes from this folder right
        # away (a driver's next run) must not find it missing, or an older one being swept
        dist.barrier()
    return path


# ----------------------------------------------------------------------------------------------------
# Reading


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise InputError(folder, "is not a checkpoint folder (no such folder)")
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise InputError(folder, f"holds no checkpoint ({MANIFEST} is missing)")
    data = load_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(path, f"is not a pipefisher checkpoint manifest of format {FORMAT}")
    return data


def check_resumable(folder: str | os.PathLike[str], cfg: Any, mode: str, schedule: str | None,
                    stages: int, replicas: int) -> dict[str, Any]:
    """Refuse (:class:`InputError`) a checkpoint that another job wrote; its manifest otherwise.

    ``schedule`` is the digest of the schedule the new run uses (None unless ``scheduled``).
    """
    folder = os.fspath(folder)
    man = read_manifest(folder)
    mine, theirs = _config_for_compare(_jsonable(cfg.to_dict())), _config_for_compare(man.get("config") or {})
    if mine != theirs:
        diff = _differing_keys(mine, theirs)
        raise InputError(folder, f"was written by a run with another config (differs in {', '.join(diff)})")
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
    theirs, mine = man.get("config") or {}, _jsonable(cfg.to_dict())
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
    if man.get("lr_horizon") is None or steps <= horizon or o.schedule == "constant":
        return None
    final = f"{o.min_lr_ratio * o.lr:g} (optim.min_lr_ratio x optim.lr)"
    if not past_decay:
        raise InputError(os.fspath(folder), f"holds a run whose {o.schedule} learning-rate schedule decayed to step "
                                            f"{horizon}: --steps {steps} would train steps {horizon}-{steps - 1} at "
                                            f"its final rate {final}; --set optim.decay_steps={steps} decays over all "
                                            f"{steps} steps instead, --past-decay trains them at the final rate")
    return (f"resuming: the learning rate keeps the schedule of the checkpoint's run, which decayed to step "
            f"{horizon}; steps {horizon}-{steps - 1} run at its final rate {final} (--past-decay)")


def load_checkpoint(folder: str, trainer: "Trainer") -> int:
    """Restore this worker from ``folder``; returns the number of steps done (the next step to run)."""
    import torch

    g = trainer.ctx.grid
    man = check_resumable(folder, trainer.cfg, trainer.mode, trainer.schedule_digest, g.stages, g.replicas)
    path = os.path.join(folder, str(man["folder"]), rank_filename(g.stage, g.replica))
    try:
        with open(path, "rb") as f:
            state = torch.load(f, map_location=trainer.ctx.device, weights_only=True)
    except OSError as err:
        raise InputError(path, f"cannot be read ({err.strerror or err})") from None
    except Exception as err:  # unpickling refused or a damaged file
        raise InputError(path, f"is not a readable checkpoint ({first_line(err)})") from None
    if not isinstance(state, dict) or state.get("steps_done") != man["steps_done"] \
            or (state.get("stage"), state.get("replica")) != (g.stage, g.replica):
        raise InputError(path, "does not match the manifest (another step, stage or replica)")
    trainer.stage.load_state_dict(state["model"])
    trainer.updater.load_state_dict(state["optimizer"])
    for pipe, kfac in trainer.kfacs.items():
        saved = (state.get("kfac_copies") or {}).get(pipe) if pipe >= 2 else state.get("kfac_up" if pipe else "kfac")
        if saved is None:
            raise InputError(path, "holds no K-FAC state" + (f" of stage copy {pipe}" if pipe else ""))
        load_kfac_state(kfac, saved, path)
    if getattr(trainer, "loop", None) is not None and state.get("loop") is not None:
        trainer.loop.load_state_dict(state["loop"])  # the schedule that was running, from where it began
    if getattr(trainer, "drift_log", None) is not None and state.get("drift") is not None:
        trainer.drift_log.load_state_dict(state["drift"])
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and trainer.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"])
    return int(man["steps_done"])
