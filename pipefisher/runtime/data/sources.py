"""Where a corpus's documents come from, and which of them are held out.

Three sources, picked by :class:`~pipefisher.runtime.job.config.DataConfig`:

* **text files** (``data.text``: ``stdlib``, a file, a folder or a glob): one document per file. Files
  go to the held-out side by a hash of their paths (relative to the corpus root), so adding a file never
  moves another; a single file is cut instead, its last ``val_fraction`` held out.
* **a builder** (``data.builder: "package.module:function"``): ``function(data_config)`` is called with
  the run's :class:`DataConfig` (``data.text`` and the other keys are there for it to read) and returns
  an iterable of documents: strings, or sequences of int token ids (one kind for all). It runs in every
  worker process, so it must return the same documents every time; their digest keys the cache.
* **a dataset** (``data.dataset``: ``text``, ``json`` or ``parquet``): the local files ``data.text``
  names, read by Hugging Face ``datasets`` (an optional extra, imported only here), one document per row
  of ``data.column`` (the ``text`` format: per line). The hub is never contacted.

Builder and dataset documents go to the held-out side by a hash of their content (sha1, so the same in
every process and run): a document's side depends on itself only, and copies of one text never sit on
both sides. Either way at least one document is on each side (the one hashed nearest the cut moves over);
a single document is cut like a single file. ``None``, empty and whitespace-only documents are dropped.

Opening a source (:func:`open_source`) is cheap where it can be (files are listed and stat'ed), so the
cache key (:attr:`Source.identity`) is known before anything is read; :meth:`Source.read` then gives
the split documents. Nothing here imports torch or ``datasets`` at import time.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from pipefisher.errors import InputError, described, install_hint
from pipefisher.runtime.job.config import STDLIB, SYNTHETIC, DataConfig

TEXT, IDS = "text", "ids"
"""The kinds of documents: strings (a tokenizer is trained on them) or int64 token-id arrays (used as
they are)."""

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py"})
"""Files a folder always contributes; any other file is taken only if it looks like UTF-8 text."""
DATASET_SUFFIXES = {"json": frozenset({".json", ".jsonl"}), "parquet": frozenset({".parquet"})}
"""The files a folder contributes to a ``json`` / ``parquet`` dataset (``text``: as for text files)."""
MISSING_DATASETS = "data.dataset needs Hugging Face datasets: " + install_hint("datasets")
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_SNIFF_BYTES = 8192


# -- files -------------------------------------------------------------------------------------------

def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _looks_like_text(path: str) -> bool:
    """No NUL byte and valid UTF-8 in the first 8 KiB (a character cut at the end is allowed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        return len(head) == _SNIFF_BYTES and err.start >= len(head) - 3
    return True


def _walk(root: str, skip: frozenset[str], keep: Callable[[str], bool]) -> list[str]:
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        for name in names:
            path = os.path.join(folder, name)
            if not name.startswith(".") and os.path.isfile(path) and keep(path):
                out.append(path)
    return sorted(out)


def stdlib_root() -> str:
    return os.path.abspath(sysconfig.get_paths()["stdlib"])


def corpus_root(text: str) -> str:
    """The folder that split hashes are taken relative to: stable when files are added or removed.

    ``stdlib``: the standard library folder; a folder: itself; a glob: the folder before its first
    wildcard; a file: its folder.
    """
    if text == STDLIB:
        return stdlib_root()
    path = os.path.abspath(os.path.expanduser(text))
    if _is_glob(text):
        parts = path.split(os.sep)
        first = next(i for i, p in enumerate(parts) if _is_glob(p))
        return os.sep.join(parts[:first]) or os.sep
    return path if os.path.isdir(path) else os.path.dirname(path)


def corpus_files(text: str, dataset: str = "") -> list[str]:
    """The files of a corpus, sorted absolute paths.

    ``stdlib``: the ``.py`` files under the standard library, without ``site-packages`` and the test
    folders (``test``, ``tests``, ``idlelib/idle_test``). A file: itself. A folder: recursively, every
    file ending in ``.txt .md .rst .py`` plus any other file whose first 8 KiB are UTF-8 without NUL
    bytes; hidden files and folders (``.git``) are skipped. A glob (``*?[``, ``**`` recursive): every
    file it matches. Nothing found is an :class:`InputError` naming ``text``.

    With ``dataset`` ``json`` or ``parquet`` (:data:`DATASET_SUFFIXES`), a folder gives the files of
    that format and a file is taken without looking inside (the reader judges it).
    """
    if text == STDLIB:
        files = _walk(stdlib_root(), _STDLIB_SKIP, lambda p: p.endswith(".py"))
        if not files:
            raise InputError(stdlib_root(), "has no Python source files (is the standard library installed?)")
        return files
    path = os.path.abspath(os.path.expanduser(text))
    if _is_glob(text):
        files = sorted(os.path.abspath(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise InputError(text, "matches no files")
        return files
    suffixes = DATASET_SUFFIXES.get(dataset)
    if os.path.isdir(path):
        if suffixes is None:
            files = _walk(path, frozenset(),
                          lambda p: os.path.splitext(p)[1].lower() in TEXT_SUFFIXES or _looks_like_text(p))
        else:
            files = _walk(path, frozenset(), lambda p: os.path.splitext(p)[1].lower() in suffixes)
        if not files:
            kind = "text" if suffixes is None else " / ".join(sorted(suffixes))
            raise InputError(text, f"has no {kind} files")
        return files
    if os.path.isfile(path):
        if suffixes is None and not _looks_like_text(path):
            raise InputError(text, "is not a UTF-8 text file")
        return [path]
    raise InputError(text, "no such file or folder")


def file_stats(files: Sequence[str]) -> list[list[Any]]:
    """``[real path, size, mtime_ns]`` of each file: a cache key over them changes when any file does."""
    stats = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError as err:
            raise InputError(f, f"cannot be read ({err.strerror or err})") from None
        stats.append([os.path.realpath(f), st.st_size, st.st_mtime_ns])
    return stats


def _hash_fraction(data: bytes) -> float:
    """Where ``data``'s sha1 falls in [0, 1): the same in every process, unlike ``hash()``."""
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "big") / 2.0**64


def _held_out(hashes: Sequence[float], val_fraction: float) -> set[int]:
    """The indices whose hash is below ``val_fraction``; with two or more items, each side gets one at
    least (the item hashed nearest the cut moves over, ties by index)."""
    every = range(len(hashes))
    val = {i for i in every if hashes[i] < val_fraction}
    if not val:
        val = {min(every, key=lambda i: (hashes[i], i))}
    elif len(val) == len(hashes):
        val.remove(max(every, key=lambda i: (hashes[i], i)))
    return val


def split_files(files: Sequence[str], val_fraction: float,
                root: str | None = None) -> tuple[list[str], list[str]]:
    """(training, held-out) files: a file is held out when the sha1 of its path relative to ``root``
    (default: the files' common folder) falls in the lowest ``val_fraction`` of the hash range.

    So a file's side depends on its own path only, and adding files never moves others. With two or
    more files each side gets at least one (the file whose hash is nearest the cut moves over when a
    side would be empty). A single file is on both sides: its text is then cut (:func:`split_documents`).
    """
    files = list(files)
    if len(files) <= 1:
        return files, list(files)
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    rel = [os.path.relpath(os.path.abspath(f), root).replace(os.sep, "/") for f in files]
    val = _held_out([_hash_fraction(r.encode()) for r in rel], val_fraction)
    return [f for i, f in enumerate(files) if i not in val], [f for i, f in enumerate(files) if i in val]


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as err:
        raise InputError(path, f"cannot be read ({err.strerror or err})") from None


# -- documents ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Documents:
    """A corpus's documents, split: strings (``kind`` :data:`TEXT`) or 1-D int64 arrays (:data:`IDS`)."""

    train: list[Any]
    val: list[Any]
    kind: str
    count: int  # files (text files) or documents (builder, dataset), before the split


def describe_source(cfg: DataConfig) -> str:
    """Where ``cfg``'s documents come from, for a phase line: ``the 'stdlib' corpus``, ``the text files of
    'corpus/'``, ``the json dataset 'corpus/*.jsonl'``, ``the documents of data.builder 'mydocs:documents'``,
    ``synthetic tokens``."""
    if cfg.builder:
        return f"the documents of data.builder {cfg.builder!r}"
    if cfg.dataset:
        return f"the {cfg.dataset} dataset {cfg.text!r}"
    if cfg.text == STDLIB:
        return "the 'stdlib' corpus, the standard library's source files"
    if cfg.text == SYNTHETIC:
        return "synthetic tokens"
    return f"the text files of {cfg.text!r}"


def source_error(cfg: DataConfig, problem: str) -> InputError:
    """A one-line refusal naming where ``cfg``'s documents come from: the builder, or what ``data.text``
    names (the files of a text corpus or of a dataset)."""
    if cfg.builder:
        return InputError(None, f"data.builder {cfg.builder!r}: {problem}")
    return InputError(cfg.text, problem)


def _as_ids(item: Any) -> np.ndarray | None:
    """``item`` as a 1-D int64 array if it is a sequence of ints (a list, a tuple, a numpy array, a
    CPU tensor), else None."""
    if isinstance(item, (bytes, bytearray, dict)):
        return None
    try:
        arr = np.asarray(item)
    except Exception:  # noqa: BLE001 - not array-like: refused by the caller
        return None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return None
    return arr.astype(np.int64, copy=False)


def as_documents(items: Iterable[Any], cfg: DataConfig, empty: str,
                 unit: str = "document") -> tuple[str, list[Any]]:
    """(kind, documents) from a builder's or a dataset column's values, or a one-line refusal.

    Strings are text documents; sequences of ints token-id documents (int64 arrays); one kind for all.
    ``None``, empty and whitespace-only documents are dropped; nothing left is refused with ``empty``.
    Refusals name a document as ``unit`` and its index (a dataset's: ``column 'text', row``).
    """
    docs: list[Any] = []
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if item is None:
            continue
        if isinstance(item, str):
            first.setdefault(TEXT, i)
            if item.strip():
                docs.append(item)
            continue
        ids = _as_ids(item)
        if ids is None:
            raise source_error(cfg, f"{unit} {i} is of type {type(item).__name__}, not a str or a sequence "
                                    "of int token ids")
        first.setdefault(IDS, i)
        if ids.size:
            docs.append(ids)
        if len(first) > 1:
            break
    if len(first) > 1:
        raise source_error(cfg, f"mixes strings ({unit} {first[TEXT]}) and token ids ({unit} {first[IDS]}): "
                                "all documents must be of one kind")
    if not docs:
        raise source_error(cfg, empty)
    return next(iter(first)), docs


def _doc_bytes(doc: Any) -> bytes:
    if isinstance(doc, str):
        return doc.encode("utf-8", "surrogatepass")
    return np.ascontiguousarray(doc, dtype="<i8").tobytes()


def documents_digest(kind: str, docs: Sequence[Any]) -> str:
    """sha256 of the documents, in order, and their kind: what a builder's cached ids depend on."""
    h = hashlib.sha256(kind.encode())
    for doc in docs:
        data = _doc_bytes(doc)
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def _cut(doc: Any, val_fraction: float) -> tuple[Any, Any]:
    """A single document's (start, held-out end): its last ``val_fraction`` of characters or ids."""
    cut = len(doc) - int(round(len(doc) * val_fraction))
    return doc[:cut], doc[cut:]


def split_documents(docs: Sequence[Any], kind: str, val_fraction: float) -> Documents:
    """Held out: the documents whose content's sha1 falls in the lowest ``val_fraction`` of the hash
    range (at least one per side; a single document is cut, its end held out)."""
    if len(docs) == 1:
        train, val = _cut(docs[0], val_fraction)
        return Documents([train], [val], kind, 1)
    held = _held_out([_hash_fraction(_doc_bytes(d)) for d in docs], val_fraction)
    return Documents([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held],
                     kind, len(docs))


# -- sources -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a run's documents come from, opened but not yet read.

    ``identity`` (JSON) is everything the documents depend on, for the cache key; ``read(val_fraction)``
    reads them and splits them into training and held-out.
    """

    identity: dict[str, Any]
    read: Callable[[float], Documents]


def open_source(cfg: DataConfig, cache_dir: str) -> Source:
    """The source ``cfg`` names: ``data.builder`` (called now: its documents' digest is the key),
    ``data.dataset`` (the files listed; read on :meth:`Source.read`, with the ``datasets`` cache under
    ``cache_dir``), else the text files of ``data.text``."""
    if cfg.builder:
        return _builder_source(cfg)
    if cfg.dataset:
        return _dataset_source(cfg, cache_dir)
    return _files_source(cfg.text)


def _files_source(text: str) -> Source:
    files, root = corpus_files(text), corpus_root(text)

    def read(val_fraction: float) -> Documents:
        if len(files) == 1:
            return split_documents([_read(files[0])], TEXT, val_fraction)
        train, val = split_files(files, val_fraction, root)
        return Documents([_read(f) for f in train], [_read(f) for f in val], TEXT, len(files))

    return Source({"root": os.path.realpath(root), "files": file_stats(files)}, read)


def _builder_source(cfg: DataConfig) -> Source:
    from pipefisher.runtime.models.builders import load_builder  # imports torch: the runtime's own path

    fn = load_builder(cfg.builder, None, key="data.builder")
    try:
        result = fn(cfg)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's function failed: say how, on one line
        raise source_error(cfg, f"failed: {described(err)}") from None
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise source_error(cfg, f"returned a {type(result).__name__}, not an iterable of documents "
                                "(a list of strings, say)")
    try:
        items = list(result)  # a generator runs here
    except Exception as err:  # noqa: BLE001
        raise source_error(cfg, f"failed: {described(err)}") from None
    kind, docs = as_documents(items, cfg, "returned no documents")
    identity = {"builder": cfg.builder, "kind": kind, "documents": documents_digest(kind, docs)}
    return Source(identity, lambda val_fraction: split_documents(docs, kind, val_fraction))


def _dataset_source(cfg: DataConfig, cache_dir: str) -> Source:
    files = corpus_files(cfg.text, cfg.dataset)

    def read(val_fraction: float) -> Documents:
        kind, docs = as_documents(_load_column(cfg, files, cache_dir), cfg,
                                  f"column {cfg.column!r} of the {cfg.dataset} dataset holds no text",
                                  f"column {cfg.column!r}, row")
        return split_documents(docs, kind, val_fraction)

    identity = {"dataset": cfg.dataset, "column": cfg.column, "files": file_stats(files)}
    return Source(identity, read)


def _load_column(cfg: DataConfig, files: list[str], cache_dir: str) -> list[Any]:
    """Column ``data.column`` of ``datasets.load_dataset(data.dataset, data_files=files)``, with its Arrow
    cache under ``cache_dir/datasets``. Offline (``datasets.config.HF_HUB_OFFLINE``), with its progress
    bars and logging quiet, for the call only: the settings are put back after it."""
    try:
        import datasets
    except ImportError:
        raise InputError(None, MISSING_DATASETS) from None
    config, logging = datasets.config, datasets.logging
    saved = (config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE, datasets.is_progress_bar_enabled(),
             logging.get_verbosity())
    config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True  # local files only, whatever imported it first
    datasets.disable_progress_bar()
    logging.set_verbosity(logging.CRITICAL)  # a bad file is said once, below, not logged on the way
    try:
        table = datasets.load_dataset(cfg.dataset, data_files=files, split="train",
                                      cache_dir=os.path.join(cache_dir, "datasets"))
    except Exception as err:  # noqa: BLE001 - a file that is not of the format: one line naming the files
        while err.__cause__ is not None:  # datasets wraps the reader's error, which says what is wrong
            err = err.__cause__  # type: ignore[assignment]
        raise source_error(cfg, f"cannot be read as a {cfg.dataset} dataset ({described(err)})") from None
    finally:
        config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE = saved[:2]
        if saved[2]:
            datasets.enable_progress_bar()
        logging.set_verbosity(saved[3])
    if cfg.column not in table.column_names:
        raise source_error(cfg, f"the {cfg.dataset} dataset has no column {cfg.column!r} (its columns: "
                                f"{', '.join(table.column_names) or 'none'}); set data.column")
    return table.data.column(cfg.column).to_pylist()
