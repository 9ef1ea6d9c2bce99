"""Check where a command will write BEFORE it does any work, so a typo in an output path costs nothing.

Every writer is atomic (:mod:`pipefisher.safe_io`) and refuses a missing folder anyway, but only after
the packing, simulating or reporting has run (and printed); these checks move that refusal to the start.
A training run also never writes over an earlier run's outputs (:func:`check_fresh_outputs`): a second
run into the same ``--out``, ``--metrics``, ``--tensorboard`` or ``--checkpoint-dir`` is refused in one
line saying what to choose instead, unless it continues that run (``--resume``).
"""
from __future__ import annotations

import os

from pipefisher.errors import InputError
from pipefisher.safe_io import check_out_file, check_out_folder

__all__ = ["check_fresh_outputs", "check_out_file", "check_out_folder", "check_profile_folder"]


def check_profile_folder(folder: str | os.PathLike[str], name: str, rename: str = "--set name=NEW") -> None:
    """Refuse to profile into a folder that already holds node timelines under the same name: writing
    would replace them without a word (and a half-replaced set mixes two runs)."""
    from pipefisher.schedule.timeline import node_file_prefix  # the one definition of the node files' names

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return
    found = sorted(f for f in os.listdir(folder) if node_file_prefix(f) == name)
    if found:
        raise InputError(folder, f"already holds timelines of a profile named '{name}' ({found[0]}, "
                                 f"{len(found)} file(s)); profiling again would overwrite them: choose another "
                                 f"name ({rename}) or remove them first")


def check_fresh_outputs(*, out: str | None = None, name: str = "", metrics: str | None = None,
                        tensorboard: str | None = None, checkpoints: str | None = None) -> None:
    """Refuse outputs that hold an earlier run's: ``out`` with files of a run named ``name``
    (``<name>_...``), an existing ``metrics`` file, a ``tensorboard`` folder with event files (the two
    runs' curves would interleave in one TensorBoard run), a ``checkpoints`` folder with a checkpoint.
    A run that continues one (``--resume``) skips this check: those are its own outputs."""
    from pipefisher.runtime.train.checkpoint import MANIFEST  # plain Python: no torch
    from pipefisher.runtime.train.tensorboard import holds_run

    if out and os.path.isdir(out):
        held = sorted(e for e in os.listdir(out) if e.startswith(f"{name}_"))
        if held:
            raise InputError(out, f"already holds the files of a run named '{name}' ({held[0]}, {len(held)} in all); "
                                  f"a second run would overwrite them: choose another --out, or another name "
                                  f"(--set name=NEW), or continue that run with --resume")
    if metrics and os.path.isfile(metrics):
        raise InputError(metrics, "already exists: a second run would overwrite its rows (--metrics); choose another "
                                  "file or remove it (a run continued with --resume keeps the earlier rows)")
    if tensorboard and holds_run(tensorboard):
        where = os.path.normpath(tensorboard)
        raise InputError(tensorboard, f"already holds a TensorBoard run; a second run's curves would interleave "
                                      f"with it (--tensorboard): give each run its own folder, e.g. --tensorboard "
                                      f"{os.path.join(where, 'run2')} (tensorboard --logdir {where} shows all), "
                                      "or continue that run with --resume")
    if checkpoints and os.path.isfile(os.path.join(checkpoints, MANIFEST)):
        raise InputError(checkpoints, "already holds a checkpoint (--checkpoint-dir): --resume "
                                      f"{os.path.normpath(checkpoints)} continues that run; choose another folder "
                                      "or remove it to start anew")

