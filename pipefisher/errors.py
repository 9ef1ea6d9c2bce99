"""The one error type users see: a file and what is wrong with it, printed as a single line."""
from __future__ import annotations

import os


class InputError(Exception):
    """Bad input a user can fix. The CLI prints ``str(err)`` and exits 2, without a traceback."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str) -> None:
        self.path = None if path is None else os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)
