"""The one error type users see: a file and what is wrong with it, printed as a single line."""
from __future__ import annotations

import os


class InputError(Exception):
    """Bad input a user can fix. The CLI prints ``str(err)`` and exits 2, without a traceback."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str) -> None:
        self.path = None if path is None else os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it says nothing: what a
    caught error contributes to a one-line :class:`InputError`."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def described(err: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone when it says nothing), for an error whose
    kind tells the user something (a user's module or function failed)."""
    text = str(err).strip()
    return type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")


def install_hint(extra: str) -> str:
    """How to install one of the package's extras, as every missing-extra message says it: from a
    registry, and in a clone with the constraints file that pins what set-up and CI test against."""
    return f"pip install 'pipefisher[{extra}]' (in a clone: pip install -c constraints.txt -e '.[{extra}]')"


def renamed_notice(old: str, new: str, where: str | None = None) -> None:
    """One line on stderr saying that ``old`` (a config key, an option) is read as its new name ``new``:
    old configs, scripts and records keep working, and the user learns the new name."""
    import sys

    print(f"note: {where + ': ' if where else ''}{old} is now {new} (the old name still works)", file=sys.stderr)
