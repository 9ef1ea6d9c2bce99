"""Reading pickles without running their code, writing files so they are never half-written, and
checking an output path before the work that writes it (a typo in it then costs nothing).

Profiles and schedule files are pickles, and unpickling can call any importable function. Every pickle
this project reads goes through :func:`load_pickle`, which admits plain containers, strings and numbers,
plus the three numpy helpers a pickled numpy scalar needs (checked to build numbers only).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from pipefisher.errors import InputError

_NUMERIC_DTYPE_KINDS = frozenset("biuf")  # bool, signed, unsigned, float


def _safe_dtype(spec: Any, *args: Any) -> Any:
    import numpy as np

    if not isinstance(spec, str):
        raise pickle.UnpicklingError(f"numpy dtype {spec!r} is not a plain type name")
    dtype = np.dtype(spec)
    if dtype.kind not in _NUMERIC_DTYPE_KINDS:
        raise pickle.UnpicklingError(f"numpy dtype {spec!r} is not numeric")
    return dtype


def _safe_scalar(dtype: Any, data: Any = None) -> Any:
    import numpy as np

    if not isinstance(dtype, np.dtype) or dtype.kind not in _NUMERIC_DTYPE_KINDS:
        raise pickle.UnpicklingError("numpy scalar of a non-numeric type")
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise pickle.UnpicklingError("numpy scalar with malformed data")
    return np.frombuffer(data, dtype=dtype)[0]


def _safe_codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles store bytes as ``_codecs.encode(str, 'latin1')``.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("unexpected bytes encoding")
    return text.encode("latin1")


_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    ("numpy", "dtype"): _safe_dtype,
    ("numpy.core.multiarray", "scalar"): _safe_scalar,
    ("numpy._core.multiarray", "scalar"): _safe_scalar,
    ("_codecs", "encode"): _safe_codecs_encode,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not plain data") from None


def loads_restricted(data: bytes) -> Any:
    """Unpickle ``data`` admitting only plain data; raises :class:`pickle.UnpicklingError` otherwise."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, "is a directory, not a file") from None
    except OSError as err:
        raise InputError(path, f"cannot be read ({err.strerror or err})") from None


def load_pickle(path: str | os.PathLike[str]) -> Any:
    """Load a pickle file through the restricted unpickler; every failure is an :class:`InputError`."""
    data = read_bytes(path)
    if not data:
        raise InputError(path, "is empty, not a pickle")
    try:
        return loads_restricted(data)
    except pickle.UnpicklingError as err:
        msg = str(err)
        if "not plain data" in msg or "numpy" in msg or "encoding" in msg:
            raise InputError(path, f"refused: the pickle {msg}") from None
        raise InputError(path, f"is not a valid pickle ({msg})") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError,
            OverflowError, UnicodeDecodeError):
        raise InputError(path, "is truncated or not a pickle") from None


def load_json(path: str | os.PathLike[str]) -> Any:
    data = read_bytes(path)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(path, f"is not valid JSON ({err})") from None


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file; a syntax error is one :class:`InputError` line with where and what, not the
    parser's multi-line report with a caret."""
    import yaml

    data = read_bytes(path)
    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as err:
        raise InputError(path, f"is not valid YAML: {yaml_problem(err)}") from None


def yaml_problem(err: Exception) -> str:
    """A YAML parser error in one line: ``line L, column C: problem`` (1-based, as editors count), with
    the construct it was inside and where that starts (an unclosed bracket is found at the end)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return " ".join(str(err).split())  # a reader error (bad bytes): its reason and position
    said = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, at = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and at is not None and (at.line, at.column) != (mark.line, mark.column):
        said += f" ({context} from line {at.line + 1}, column {at.column + 1})"
    return said


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temp path beside ``path``; on success it is renamed over ``path``, on failure removed.

    For writers that want a file name rather than bytes (matplotlib's ``savefig``, say): readers never
    see half a file, and a failed write leaves the old file as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(path, "cannot be written: its folder does not exist")
    name, suffix = os.path.splitext(os.path.basename(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=f".tmp{suffix}")
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plain open() would honour the umask
    except OSError as err:
        raise InputError(path, f"cannot be written ({err.strerror or err})") from None
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise InputError(path, f"cannot be written ({err.strerror or err})") from None
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename."""
    payload = data.encode() if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())


def dump_pickle_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    write_atomic(path, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def dump_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


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
