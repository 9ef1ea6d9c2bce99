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


def check_out_file(path: str | os.PathLike[str] | None, option: str) -> None:
    """Refuse an output file whose folder does not exist or cannot be written, or that is a folder."""
    if path is None:
        return
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(path, f"is a folder; {option} needs a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise InputError(path, f"cannot be written: {os.path.normpath(folder)} is a file, not a folder ({option})")
    if not os.path.isdir(folder):
        raise InputError(path, f"cannot be written: its folder does not exist ({option})")
    if not os.access(folder, os.W_OK | os.X_OK) or not _can_create_in(folder):
        raise InputError(path, f"cannot be written: its folder is not writable ({option})")


def check_out_folder(path: str | os.PathLike[str], option: str) -> None:
    """Refuse an output folder that is a file, or that cannot be created or written; creates nothing."""
    path = os.fspath(path)
    here = os.path.abspath(path)
    while not os.path.exists(here):  # the nearest existing ancestor is where makedirs starts
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    if not os.path.isdir(here):
        if here == os.path.abspath(path):
            raise InputError(path, f"is a file; {option} needs a folder")
        raise InputError(path, f"cannot be created ({option}): {os.path.normpath(here)} is a file")
    if not os.access(here, os.W_OK | os.X_OK) or not _can_create_in(here):
        if here == os.path.abspath(path):
            raise InputError(path, f"is not writable ({option})")
        raise InputError(path, f"cannot be created ({option}): {os.path.normpath(here)} is not writable")


def _can_create_in(folder: str) -> bool:
    """Whether a file can really be created in ``folder``: ``os.access`` says yes to root everywhere, and
    to read-only or virtual file systems (``/proc``) where every write fails; a probe file tells."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".pipefisher-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_profile_folder(folder: str | os.PathLike[str], name: str, rename: str = "--set name=NEW") -> None:
    """Refuse to profile into a folder that already holds node timelines under the same name: writing
    would replace them without a word (and a half-replaced set mixes two runs)."""
    from pipefisher.timeline import node_file_prefix  # the one definition of the node files' names

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

