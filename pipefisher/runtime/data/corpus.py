"""Corpora for language-model training: documents tokenized, split, cached.

Where the documents come from (text files, a ``data.builder`` function, a ``data.dataset`` of local
files) and which are held out is :mod:`pipefisher.runtime.data.sources`; this module turns them into
ids. Text documents get a subword tokenizer (HF ``tokenizers``: byte-level BPE, WordPiece, or the
older whitespace-split BPE; special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` at ids 0..4) trained on
the training documents only, so held-out text is truly unseen. Byte-level BPE sees the text as it is
written, newlines and indentation included, and decodes back to it exactly. Token-id documents are
used as they are (no tokenizer): every id must lie in ``[0, model.vocab_size)``, and ids 0..4 mean the
special tokens above. Either way each document is followed by ``[SEP]``.

Building is seconds (tokenizer training and encoding); the result is cached under
``$PIPEFISHER_CACHE`` (default ``~/.cache/pipefisher``) in ``corpus-<key>/`` where the key hashes what
the documents depend on (the files' paths, sizes and modification times; a builder's name and its
documents' digest; a dataset's files, format and column) and the tokenizer settings, so every worker of
every run on the same documents loads the same ids in well under a second. Cache files are written
atomically, so workers that build the same corpus at once are safe (they write identical bytes).

Torch and ``tokenizers`` are imported only inside the functions that need them.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from pipefisher.errors import InputError
from pipefisher.runtime.data.sources import IDS, TEXT, Documents, open_source, source_error
from pipefisher.runtime.job.config import SPECIAL_TOKENS, TOKENIZERS, DataConfig
from pipefisher.safe_io import atomic_path, write_atomic

if TYPE_CHECKING:
    import torch

SEP_ID = SPECIAL_TOKENS.index("[SEP]")
FORMAT = 3  # 3: data.tokenizer bpe is byte-level BPE (2: whitespace-split, now bpe-whitespace)
"""Bump when the cached files or the way they are built change: old caches are then ignored."""

_PIECE_CHARS = 1 << 16
_BATCH_PIECES = 256
_CUT = re.compile(r"\S\n(?=\S)")


def _alphabet(texts: Sequence[str], limit: int) -> list[str]:
    """The ``limit`` most frequent non-space characters, ties broken by the character itself."""
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(text)
    chars = sorted((c for c in counts if not c.isspace()), key=lambda c: (-counts[c], c))
    return chars[:limit]


def _byte_alphabet(texts: Sequence[str], vocab_size: int) -> list[str]:
    """Byte-level BPE's alphabet: all 256 bytes' tokens when they fit in half the vocabulary (so any
    text encodes without ``[UNK]``), else the most frequent bytes of ``texts`` (:func:`_alphabet`)."""
    from tokenizers import pre_tokenizers

    limit = (vocab_size - len(SPECIAL_TOKENS)) // 2
    every = pre_tokenizers.ByteLevel.alphabet()
    if limit >= len(every):
        return sorted(every)
    as_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # one byte, one character
    return _alphabet([piece for text in texts for piece, _ in as_bytes.pre_tokenize_str(text)], max(1, limit))


def train_tokenizer(texts: Sequence[str], kind: str, vocab_size: int) -> str:
    """Train a tokenizer of a kind in :data:`TOKENIZERS` of at most ``vocab_size`` tokens; its JSON.

    ``bpe`` is byte-level (GPT-2's pre-tokenizer and decoder, no prefix space): spaces, tabs and
    newlines are tokens like any other, so decoding gives the text back exactly. ``bpe-whitespace``
    splits on whitespace and punctuation first (``Whitespace``) and drops the whitespace; WordPiece
    splits like BERT (``BertPreTokenizer``). Text is kept as written (no lower-casing). The alphabet is
    capped so the rest is left for merges: byte-level BPE's as :func:`_byte_alphabet` says, the others'
    at the most frequent characters, at most 256 and at most half the vocabulary (a third for
    WordPiece, which also needs a ``##`` form of each); rarer characters become ``[UNK]``.

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
    limit = max(1, min(256, (vocab_size - len(SPECIAL_TOKENS)) // (3 if kind == "wordpiece" else 2)))
    alphabet = _byte_alphabet(texts, vocab_size) if kind == "bpe" else _alphabet(texts, limit)
    special = list(SPECIAL_TOKENS)
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        make = trainers.BpeTrainer
    elif kind == "bpe-whitespace":
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
    """Chunks cut after a newline between two non-space characters: every pre-tokenizer splits there
    alone (byte-level BPE's runs of whitespace would differ at a blank line or an indent), so ids do not
    change."""
    start = 0
    while start < len(text):
        cut = _CUT.search(text, start + _PIECE_CHARS)
        end = len(text) if cut is None else cut.end()
        yield text[start:end]
        start = end


def _encode(tokenizer_json: str, texts: Sequence[str]) -> "torch.Tensor":
    """All texts' ids concatenated, each text followed by ``[SEP]``: 1-D int64.

    Long texts are cut into pieces after a newline and short ones batched together; either way the ids
    are those of encoding each text whole."""
    from array import array

    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # a literal "[SEP]" in the text is text, not the separator
    ids = array("q")
    batch: list[str] = []
    ends: list[bool] = []  # whether batch[i] is the last piece of its text

    def flush() -> None:
        for enc, end in zip(tok.encode_batch_fast(batch, add_special_tokens=False), ends):
            ids.extend(enc.ids)
            if end:
                ids.append(SEP_ID)
        batch.clear()
        ends.clear()

    for text in texts:
        pieces = list(_pieces(text)) or [""]
        batch.extend(pieces)
        ends.extend([False] * (len(pieces) - 1) + [True])
        if len(batch) >= _BATCH_PIECES:
            flush()
    flush()
    if not ids:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(ids, dtype=torch.int64).clone()


def _join_ids(docs: Sequence[Any]) -> "torch.Tensor":
    """Token-id documents (int64 arrays) concatenated, each followed by ``[SEP]``: 1-D int64."""
    import numpy as np
    import torch

    sep = np.array([SEP_ID], dtype=np.int64)
    parts = [part for doc in docs for part in (doc, sep)]
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: training and held-out ids and the tokenizer that made them."""

    train: "torch.Tensor"  # 1-D int64, training documents concatenated, each followed by [SEP]
    val: "torch.Tensor"  # 1-D int64, held-out documents the same way
    tokenizer_json: str  # "": the documents were token ids (no tokenizer)
    files: int  # text files (data.text) or documents (data.builder, data.dataset)
    key: str
    vocab_size: int
    """The ids' range: the tokenizer's vocabulary (at most ``model.vocab_size``; a small corpus gives
    fewer), or ``model.vocab_size`` for token-id documents."""


def _tokenizer_vocab_size(tokenizer_json: str) -> int:
    return len(json.loads(tokenizer_json)["model"]["vocab"])


def default_cache_dir() -> str:
    return os.environ.get("PIPEFISHER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pipefisher")


def corpus_key(identity: dict[str, Any], vocab_size: int, tokenizer: str, val_fraction: float) -> str:
    """Hash of what the cached ids depend on: the source's identity (see
    :attr:`pipefisher.runtime.data.sources.Source.identity`) and the tokenizer settings."""
    try:
        from importlib.metadata import version

        tokenizers_version = version("tokenizers")
    except Exception:  # noqa: BLE001 - a missing version only weakens the key
        tokenizers_version = "?"
    blob = json.dumps({"format": FORMAT, "source": identity, "vocab_size": vocab_size, "tokenizer": tokenizer,
                       "val_fraction": val_fraction, "tokenizers": tokenizers_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _load_cached(folder: str, key: str) -> Corpus | None:
    import torch

    try:
        data = torch.load(os.path.join(folder, "tokens.pt"), weights_only=True)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
            return None
        tokenizer_json = ""
        if data["kind"] == TEXT:
            with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
                tokenizer_json = f.read()
        return Corpus(data["train"].long(), data["val"].long(), tokenizer_json, int(data["documents"]), key,
                      int(data["vocab_size"]))
    except Exception:  # noqa: BLE001 - missing or damaged cache: rebuild it
        return None


def _save_cached(folder: str, corpus: Corpus) -> None:
    import torch

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise InputError(folder, f"cannot be created ({err.strerror or err})") from None
    if corpus.tokenizer_json:
        write_atomic(os.path.join(folder, "tokenizer.json"), corpus.tokenizer_json)
    with atomic_path(os.path.join(folder, "tokens.pt")) as tmp:  # last: its presence means complete
        with open(tmp, "wb") as f:  # a file object, so the archive does not name the temp file
            torch.save({"format": FORMAT, "key": corpus.key, "kind": TEXT if corpus.tokenizer_json else IDS,
                        "documents": corpus.files, "vocab_size": corpus.vocab_size,
                        "train": corpus.train.to(torch.int32), "val": corpus.val.to(torch.int32)}, f)


def build_corpus(docs: Documents, cfg: DataConfig, vocab_size: int, key: str = "") -> Corpus:
    """Text: train the tokenizer on the training documents only, and encode both sides. Token ids:
    check they fit ``vocab_size`` and join them. No cache."""
    if docs.kind == IDS:
        for doc in docs.train + docs.val:
            bad = doc[(doc < 0) | (doc >= vocab_size)]
            if len(bad):
                raise source_error(cfg, f"token id {int(bad[0])} is outside [0, model.vocab_size = {vocab_size})")
        return Corpus(_join_ids(docs.train), _join_ids(docs.val), "", docs.count, key, vocab_size)
    tokenizer_json = train_tokenizer(docs.train, cfg.tokenizer, vocab_size)
    return Corpus(_encode(tokenizer_json, docs.train), _encode(tokenizer_json, docs.val), tokenizer_json,
                  docs.count, key, _tokenizer_vocab_size(tokenizer_json))


def load_corpus(cfg: DataConfig, vocab_size: int, cache_dir: str | None = None,
                on_build: Callable[[str], None] | None = None) -> Corpus:
    """The corpus ``cfg`` names (:func:`pipefisher.runtime.data.sources.open_source`) for a
    ``vocab_size`` model, from the cache or built and cached; ``on_build(what)`` is called before a
    build (not when the cache has it), ``what`` saying what is built, for a phase line.

    ``cache_dir`` defaults to ``$PIPEFISHER_CACHE`` or ``~/.cache/pipefisher``. Too short a corpus is an
    :class:`~pipefisher.errors.InputError` (see :func:`check_corpus`).
    """
    cache_dir = cache_dir or default_cache_dir()
    source = open_source(cfg, cache_dir)
    key = corpus_key(source.identity, vocab_size, cfg.tokenizer, cfg.val_fraction)
    folder = os.path.join(cache_dir, f"corpus-{key}")
    corpus = _load_cached(folder, key)
    if corpus is None:
        docs = source.read(cfg.val_fraction)
        if on_build is not None:
            on_build("token ids" if docs.kind == IDS else "tokenizer and token ids")
        corpus = build_corpus(docs, cfg, vocab_size, key)
        _save_cached(folder, corpus)
    check_corpus(corpus, cfg)
    return corpus


def check_corpus(corpus: Corpus, cfg: DataConfig) -> None:
    """The training ids must hold one ``cfg.seq_len`` window, and so must the held-out ids when
    ``cfg.val_batches`` > 0: otherwise :class:`~pipefisher.errors.InputError` naming the source."""
    if len(corpus.train) < cfg.seq_len:
        raise source_error(cfg, f"training text is {len(corpus.train)} tokens, shorter than one sequence "
                                f"(data.seq_len = {cfg.seq_len})")
    if cfg.val_batches > 0 and len(corpus.val) < cfg.seq_len:
        more = "add files" if not (cfg.builder or cfg.dataset) else "add documents"
        raise source_error(cfg, f"held-out text is {len(corpus.val)} tokens, shorter than one sequence "
                                f"(data.seq_len = {cfg.seq_len}); {more} or raise data.val_fraction")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A transformers tokenizer folder: the tokenizer as trained, and its config naming the special tokens."""


def write_transformers_tokenizer(tokenizer_json: str, folder: str | os.PathLike[str], *, causal: bool,
                                 max_length: int) -> None:
    """The run's tokenizer as a folder ``transformers.AutoTokenizer.from_pretrained`` loads (a
    ``PreTrainedTokenizerFast``): :data:`TOKENIZER_FILES`, the special tokens at ids 0..4 named as
    transformers names them, and for a ``causal`` model ``[CLS]``/``[SEP]`` as its bos/eos (every
    document ends with ``[SEP]``). No transformers needed to write it."""
    pad, unk, cls, sep, mask = SPECIAL_TOKENS
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                              "pad_token": pad, "unk_token": unk, "cls_token": cls, "sep_token": sep,
                              "mask_token": mask, "clean_up_tokenization_spaces": False}
    if causal:
        config.update(bos_token=cls, eos_token=sep)
    write_atomic(os.path.join(folder, TOKENIZER_FILES[0]), tokenizer_json)
    write_atomic(os.path.join(folder, TOKENIZER_FILES[1]), json.dumps(config, indent=2) + "\n")


def save_tokenizer(corpus: Corpus, path: str | os.PathLike[str]) -> None:
    """Write the tokenizer JSON (atomically), so a run folder records the vocabulary its ids mean. A
    corpus of token ids has no tokenizer: nothing is written."""
    if corpus.tokenizer_json:
        write_atomic(path, corpus.tokenizer_json)
