"""Check where a command will write BEFORE it does any work, so a typo in an output path costs nothing.

Every writer is atomic (:mod:`pipefisher.safe_io`) and refuses a missing folder anyway, but only after
the packing, simulating or reporting has run (and printed); these checks move that refusal to the start.
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
    if not os.path.isdir(folder):
        raise InputError(path, f"cannot be written: its folder does not exist ({option})")
    if not os.access(folder, os.W_OK | os.X_OK):
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
        raise InputError(path, f"cannot be created ({option}): {os.path.normpath(here)} is a file")
    if not os.access(here, os.W_OK | os.X_OK):
        if here == os.path.abspath(path):
            raise InputError(path, f"is not writable ({option})")
        raise InputError(path, f"cannot be created ({option}): {os.path.normpath(here)} is not writable")
