"""Text corpora for masked-LM training: find the files, split them, train a subword tokenizer, cache ids.

A corpus is named by ``data.text``: ``stdlib`` (the Python standard library's ``.py`` files, on every
machine with Python, so runs need no download), a file, a folder or a glob. Files are split into
training and held-out text by a hash of their paths, so adding a file never moves another between the
splits. The tokenizer (HF ``tokenizers``: BPE or WordPiece, special tokens ``[PAD] [UNK] [CLS] [SEP]
[MASK]`` at ids 0..4) is trained on the training files only, so held-out text is truly unseen.

Building is seconds (tokenizer training and encoding); the result is cached under
``$PIPEFISHER_CACHE`` (default ``~/.cache/pipefisher``) in ``corpus-<key>/`` where the key hashes the
files' paths, sizes and modification times and the tokenizer settings, so every worker of every run on
the same text loads the same ids in well under a second. Cache files are written atomically, so workers
that build the same corpus at once are safe (they write identical bytes).

Torch and ``tokenizers`` are imported only inside the functions that need them.
"""
from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from pipefisher.errors import InputError
from pipefisher.runtime.job.config import STDLIB, DataConfig
from pipefisher.safe_io import atomic_path, write_atomic

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""In id order: these are ``data.PAD, UNK, CLS, SEP, MASK``."""
TOKENIZERS = ("bpe", "wordpiece")
FORMAT = 1
"""Bump when the cached files or the way they are built change: old caches are then ignored."""

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py"})
"""Files a folder always contributes; any other file is taken only if it looks like UTF-8 text."""
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_SNIFF_BYTES = 8192
_PIECE_CHARS = 1 << 16


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


def corpus_files(text: str) -> list[str]:
    """The files of a corpus, sorted absolute paths.

    ``stdlib``: the ``.py`` files under the standard library, without ``site-packages`` and the test
    folders (``test``, ``tests``, ``idlelib/idle_test``). A file: itself. A folder: recursively, every
    file ending in ``.txt .md .rst .py`` plus any other file whose first 8 KiB are UTF-8 without NUL
    bytes; hidden files and folders (``.git``) are skipped. A glob (``*?[``, ``**`` recursive): every
    file it matches. Nothing found is an :class:`InputError` naming ``text``.
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
    if os.path.isdir(path):
        files = _walk(path, frozenset(),
                      lambda p: os.path.splitext(p)[1].lower() in TEXT_SUFFIXES or _looks_like_text(p))
        if not files:
            raise InputError(text, "has no text files")
        return files
    if os.path.isfile(path):
        if not _looks_like_text(path):
            raise InputError(text, "is not a UTF-8 text file")
        return [path]
    raise InputError(text, "no such file or folder")


def _split_hash(path: str, root: str) -> float:
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    return int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big") / 2.0**64


def split_files(files: Sequence[str], val_fraction: float,
                root: str | None = None) -> tuple[list[str], list[str]]:
    """(training, held-out) files: a file is held out when the sha1 of its path relative to ``root``
    (default: the files' common folder) falls in the lowest ``val_fraction`` of the hash range.

    So a file's side depends on its own path only, and adding files never moves others. With two or
    more files each side gets at least one (the file whose hash is nearest the cut moves over when a
    side would be empty). A single file is on both sides: :func:`load_corpus` then splits its text,
    holding out the last ``val_fraction`` of its characters.
    """
    files = list(files)
    if len(files) <= 1:
        return files, list(files)
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    h = {f: _split_hash(os.path.abspath(f), root) for f in files}
    val = [f for f in files if h[f] < val_fraction]
    if not val:
        val = [min(files, key=lambda f: (h[f], f))]
    elif len(val) == len(files):
        val.remove(max(files, key=lambda f: (h[f], f)))
    held = set(val)
    return [f for f in files if f not in held], val


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as err:
        raise InputError(path, f"cannot be read ({err.strerror or err})") from None


def _alphabet(texts: Sequence[str], limit: int) -> list[str]:
    """The ``limit`` most frequent non-space characters, ties broken by the character itself."""
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(text)
    chars = sorted((c for c in counts if not c.isspace()), key=lambda c: (-counts[c], c))
    return chars[:limit]


def train_tokenizer(texts: Sequence[str], kind: str, vocab_size: int) -> str:
    """Train a ``bpe`` or ``wordpiece`` tokenizer of at most ``vocab_size`` tokens; its JSON.

    BPE splits on whitespace and punctuation first (``Whitespace``), WordPiece like BERT
    (``BertPreTokenizer``). Text is kept as written (no lower-casing). The alphabet is capped (the most
    frequent characters, at most 256 and at most half the vocabulary for BPE, a third for WordPiece,
    which also needs a ``##`` form of each) so the rest is left for merges; rarer characters become
    ``[UNK]``.

    Deterministic for the same texts, which matters because workers that build a corpus at once must
    agree on its ids. The trainer alone is not: it breaks ties by token ids, and WordPiece numbers the
    ``##`` forms in hash-map order. So the alphabet is chosen here (ties by character) and, for
    WordPiece, the ``##`` forms are handed in as extra special tokens in a fixed order, which fixes every
    id; they are then dropped from the added tokens, leaving ordinary vocabulary entries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {kind!r}: one of {', '.join(TOKENIZERS)}")
    texts = list(texts)
    limit = max(1, min(256, (vocab_size - len(SPECIAL_TOKENS)) // (2 if kind == "bpe" else 3)))
    alphabet = _alphabet(texts, limit)
    special = list(SPECIAL_TOKENS)
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        make = trainers.BpeTrainer
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        make = trainers.WordPieceTrainer
        special += [f"##{c}" for c in alphabet]
    trainer = make(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                   limit_alphabet=max(1, len(alphabet)), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    raw = json.loads(tok.to_str())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    tokenizer_json = json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
    tok = Tokenizer.from_str(tokenizer_json)
    if tok.get_vocab_size() > vocab_size:  # the alphabet cap should prevent this
        raise RuntimeError(f"{kind} tokenizer has {tok.get_vocab_size()} tokens, more than {vocab_size}")
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:  # the trainer's contract; checked because ids 0..4 are hard-wired
            raise RuntimeError(f"tokenizer put {name} at id {tok.token_to_id(name)}, not {i}")
    return tokenizer_json


def _pieces(text: str) -> Iterator[str]:
    """Chunks cut after a newline: both pre-tokenizers split at whitespace, so ids do not change."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + _PIECE_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _encode(tokenizer_json: str, texts: Sequence[str]) -> "torch.Tensor":
    """All texts' ids concatenated, each text followed by ``[SEP]``: 1-D int64."""
    from array import array

    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # a literal "[SEP]" in the text is text, not the separator
    sep = SPECIAL_TOKENS.index("[SEP]")
    ids = array("q")
    batch: list[str] = []

    def flush() -> None:
        for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
            ids.extend(enc.ids)
        batch.clear()

    for text in texts:
        for piece in _pieces(text):
            batch.append(piece)
            if len(batch) >= 64:
                flush()
        flush()
        ids.append(sep)
    if not ids:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(ids, dtype=torch.int64).clone()


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: training and held-out ids and the tokenizer that made them."""

    train: "torch.Tensor"  # 1-D int64, training files concatenated, each followed by [SEP]
    val: "torch.Tensor"  # 1-D int64, held-out text the same way
    tokenizer_json: str
    files: int
    key: str

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (at most ``model.vocab_size``; a small corpus gives fewer)."""
        return len(json.loads(self.tokenizer_json)["model"]["vocab"])


def default_cache_dir() -> str:
    return os.environ.get("PIPEFISHER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pipefisher")


def corpus_key(files: Sequence[str], root: str, vocab_size: int, tokenizer: str, val_fraction: float) -> str:
    """Hash of what the cached ids depend on; any file's size or mtime changing gives a new key."""
    try:
        from importlib.metadata import version

        tokenizers_version = version("tokenizers")
    except Exception:  # noqa: BLE001 - a missing version only weakens the key
        tokenizers_version = "?"
    stats = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError as err:
            raise InputError(f, f"cannot be read ({err.strerror or err})") from None
        stats.append([os.path.realpath(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format": FORMAT, "root": os.path.realpath(root), "files": stats,
                       "vocab_size": vocab_size, "tokenizer": tokenizer, "val_fraction": val_fraction,
                       "tokenizers": tokenizers_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _load_cached(folder: str, key: str, files: int) -> Corpus | None:
    import torch

    tok_path, ids_path = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokens.pt")
    try:
        with open(tok_path, encoding="utf-8") as f:
            tokenizer_json = f.read()
        data = torch.load(ids_path, weights_only=True)
    except Exception:  # noqa: BLE001 - missing or damaged cache: rebuild it
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        return None
    return Corpus(data["train"].long(), data["val"].long(), tokenizer_json, files, key)


def build_corpus(files: Sequence[str], root: str, vocab_size: int, tokenizer: str,
                 val_fraction: float, key: str = "") -> Corpus:
    """Split, train the tokenizer on the training text only, and encode both sides (no cache)."""
    train_files, val_files = split_files(files, val_fraction, root)
    if len(files) == 1:
        text = _read(files[0])
        cut = len(text) - int(round(len(text) * val_fraction))
        train_texts, val_texts = [text[:cut]], [text[cut:]]
    else:
        train_texts, val_texts = [_read(f) for f in train_files], [_read(f) for f in val_files]
    tokenizer_json = train_tokenizer(train_texts, tokenizer, vocab_size)
    return Corpus(_encode(tokenizer_json, train_texts), _encode(tokenizer_json, val_texts),
                  tokenizer_json, len(files), key)


def load_corpus(cfg: DataConfig, vocab_size: int, cache_dir: str | None = None) -> Corpus:
    """The corpus ``cfg.text`` tokenized for a ``vocab_size`` model, from the cache or built and cached.

    ``cache_dir`` defaults to ``$PIPEFISHER_CACHE`` or ``~/.cache/pipefisher``. Too short a corpus is an
    :class:`InputError` (see :func:`check_corpus`).
    """
    import torch

    files = corpus_files(cfg.text)
    root = corpus_root(cfg.text)
    key = corpus_key(files, root, vocab_size, cfg.tokenizer, cfg.val_fraction)
    folder = os.path.join(cache_dir or default_cache_dir(), f"corpus-{key}")
    corpus = _load_cached(folder, key, len(files))
    if corpus is None:
        corpus = build_corpus(files, root, vocab_size, cfg.tokenizer, cfg.val_fraction, key)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise InputError(folder, f"cannot be created ({err.strerror or err})") from None
        write_atomic(os.path.join(folder, "tokenizer.json"), corpus.tokenizer_json)
        with atomic_path(os.path.join(folder, "tokens.pt")) as tmp:  # last: its presence means complete
            with open(tmp, "wb") as f:  # a file object, so the archive does not name the temp file
                torch.save({"format": FORMAT, "key": key, "train": corpus.train.to(torch.int32),
                            "val": corpus.val.to(torch.int32)}, f)
    check_corpus(corpus, cfg)
    return corpus


def check_corpus(corpus: Corpus, cfg: DataConfig) -> None:
    """The training ids must hold one ``cfg.seq_len`` window, and so must the held-out ids when
    ``cfg.val_batches`` > 0: otherwise :class:`InputError` naming ``cfg.text``."""
    if len(corpus.train) < cfg.seq_len:
        raise InputError(cfg.text, f"training text is {len(corpus.train)} tokens, shorter than one sequence "
                                   f"(data.seq_len = {cfg.seq_len})")
    if cfg.val_batches > 0 and len(corpus.val) < cfg.seq_len:
        raise InputError(cfg.text, f"held-out text is {len(corpus.val)} tokens, shorter than one sequence "
                                   f"(data.seq_len = {cfg.seq_len}); add files or raise data.val_fraction")


def save_tokenizer(corpus: Corpus, path: str | os.PathLike[str]) -> None:
    """Write the tokenizer JSON (atomically), so a run folder records the vocabulary its ids mean."""
    write_atomic(path, corpus.tokenizer_json)

