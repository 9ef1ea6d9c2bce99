"""Text corpora, tokenizers and masked-LM batches, on small corpora each test writes itself."""
from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.runtime.data import corpus as corpus_mod
from pipefisher.runtime.data.batches import CLS, MASK, NUM_SPECIAL, PAD, SEP, UNK, MLMData
from pipefisher.runtime.data.corpus import SPECIAL_TOKENS, load_corpus, save_tokenizer, train_tokenizer
from pipefisher.runtime.data.sources import corpus_files, corpus_root, split_files
from pipefisher.runtime.job.config import TOKENIZERS, DataConfig
from pipefisher.runtime.models.builders import IGNORE_INDEX

WORDS = ("the cat sat on a mat while dogs ran past small houses near green hills and rivers "
         "under bright skies every morning people walked slowly toward busy markets").split()
HELD_OUT_WORD = "quokkaquagga"  # only in held-out files
TRAIN_WORD = "wombatwallaby"  # only in training files, as often: shows the vocabulary is big enough


def prose(seed: int, lines: int = 60) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(12)) + " .\n" for _ in range(lines))


def write_folder(root: Path, n: int = 8) -> Path:
    """``n`` text files (two in a subfolder, one ``.md``), a binary file and a hidden file."""
    folder = root / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(n):
        name = f"sub/doc{i}.txt" if i < 2 else f"doc{i}.md" if i == 2 else f"doc{i}.txt"
        (folder / name).write_text(prose(i))
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (folder / ".hidden.txt").write_text(prose(99))
    return folder


def data_cfg(text: str | os.PathLike[str], **kw) -> DataConfig:
    return DataConfig(**{"text": os.fspath(text), "seq_len": 16, "micro_batch_size": 4,
                         "val_fraction": 0.25, "val_batches": 3, **kw})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A folder corpus with a word only in held-out files, loaded through the cache."""
    root = tmp_path_factory.mktemp("data")
    folder = write_folder(root)
    files = corpus_files(str(folder))
    train, val = split_files(files, 0.25, corpus_root(str(folder)))
    assert train and val
    for f in train[:1]:
        Path(f).write_text(Path(f).read_text() + f" {TRAIN_WORD}" * 30 + "\n")
    for f in val:
        Path(f).write_text(Path(f).read_text() + f" {HELD_OUT_WORD}" * 30 + "\n")
    cfg = data_cfg(folder)
    return cfg, load_corpus(cfg, 300, str(root / "cache")), train, val


def vocab_of(tokenizer_json: str) -> dict[str, int]:
    return json.loads(tokenizer_json)["model"]["vocab"]


def is_a_token(tokenizer_json: str, word: str) -> bool:
    """Whether ``word`` after a space is one token (byte-level BPE's tokens carry the space, ``Ġword``)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_str(tokenizer_json).encode(f" {word}", add_special_tokens=False).ids) == 1


def test_corpus_files_of_a_folder_a_glob_and_a_file(tmp_path):
    folder = write_folder(tmp_path)
    files = corpus_files(str(folder))
    assert files == sorted(files) and all(os.path.isabs(f) for f in files)
    assert [os.path.relpath(f, folder) for f in files] == [
        "doc2.md", "doc3.txt", "doc4.txt", "doc5.txt", "doc6.txt", "doc7.txt",
        os.path.join("sub", "doc0.txt"), os.path.join("sub", "doc1.txt")]  # no binary, no hidden file
    assert corpus_files(str(folder / "*.txt")) == [str(folder / f"doc{i}.txt") for i in range(3, 8)]
    assert corpus_files(str(folder / "**" / "doc[01].txt")) == [str(folder / "sub" / f"doc{i}.txt")
                                                                 for i in range(2)]
    assert corpus_files(str(folder / "doc3.txt")) == [str(folder / "doc3.txt")]
    assert corpus_root(str(folder / "sub" / "*.txt")) == str(folder / "sub")


def test_stdlib_corpus_is_the_standard_library_source():
    files = corpus_files("stdlib")
    stdlib = sysconfig.get_paths()["stdlib"]
    assert len(files) > 100 and all(f.endswith(".py") and f.startswith(stdlib) for f in files)
    parts = {p for f in files for p in os.path.relpath(f, stdlib).split(os.sep)[:-1]}
    assert not parts & {"site-packages", "test", "tests", "idle_test"}


def test_split_is_by_file_and_stable(tmp_path):
    names = [f"f{i:02d}.txt" for i in range(20)]
    files = [str(tmp_path / n) for n in names]
    train, val = split_files(files, 0.25, str(tmp_path))
    assert val and train and sorted(train + val) == sorted(files) and not set(train) & set(val)
    more_train, more_val = split_files(files + [str(tmp_path / "new.txt")], 0.25, str(tmp_path))
    assert set(val) <= set(more_val) and set(train) <= set(more_train)  # nobody moved
    # The hash is of the path relative to the root: the same files elsewhere split the same way.
    elsewhere = [str(tmp_path / "moved" / n) for n in names]
    assert [os.path.basename(f) for f in split_files(elsewhere, 0.25, str(tmp_path / "moved"))[1]] == \
        [os.path.basename(f) for f in val]
    # Each side gets a file even when the fraction would leave one empty; one file is on both sides.
    assert all(len(side) == 1 for side in split_files(files[:2], 1e-9))
    assert all(len(side) == 1 for side in split_files(files[:2], 1 - 1e-9))
    assert split_files(files[:1], 0.25) == (files[:1], files[:1])


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_tokenizer_has_the_special_ids_and_is_deterministic(kind):
    texts = [prose(i) for i in range(4)]
    one = train_tokenizer(texts, kind, 200)
    assert train_tokenizer(texts, kind, 200) == one
    vocab = vocab_of(one)
    assert [vocab[t] for t in SPECIAL_TOKENS] == [PAD, UNK, CLS, SEP, MASK] == list(range(NUM_SPECIAL))
    assert len(vocab) <= 200 and is_a_token(one, "morning")


CODE = ["def foo(x):\n    return x + 1\n\n\nclass Bar:\n\tdef baz(self):\n\t\treturn 'héllo'  # ✓\n" * 40,
        "import os\n\n\n    \nif __name__ == '__main__':\n    print(os.sep)\n\n" * 40]
ANY_TEXT = ["def foo(x):\n    return x + 1\n", "héllo wörld ✓ 日本", "\t", "\n\n", "  two  spaces \n\t\n",
            "\r\n\x00\x7f\U0001f600", "[SEP] [MASK] as text", ""]


def test_byte_level_bpe_gives_any_text_back_exactly():
    """Newlines, indents, tabs and characters the corpus never had: every byte has its token (the
    alphabet is all 256 bytes once they fit in half the vocabulary), and the decoder puts them back."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(train_tokenizer(CODE, "bpe", 600))
    tok.encode_special_tokens = True  # as the corpus encodes: "[SEP]" in text is text
    for text in ANY_TEXT + CODE:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert UNK not in ids and tok.decode(ids, skip_special_tokens=False) == text, repr(text)
    assert is_a_token(tok.to_str(), "return")  # merges: words are tokens, not bytes
    # the older whitespace-split BPE loses the layout: what byte-level BPE is for
    old = Tokenizer.from_str(train_tokenizer(CODE, "bpe-whitespace", 600))
    assert old.decode(old.encode(ANY_TEXT[0]).ids) != ANY_TEXT[0]


def test_the_model_sees_the_texts_newlines_and_indents(tmp_path, monkeypatch):
    """The corpus's ids are the documents as written: decoded document by document they are the files'
    text again, also when long texts are encoded in pieces (cut where no pre-tokenizer's split moves)."""
    from tokenizers import Tokenizer

    folder = tmp_path / "code"
    folder.mkdir()
    for i, text in enumerate(CODE * 2):
        (folder / f"m{i}.py").write_text(text[i:])
    monkeypatch.setattr(corpus_mod, "_PIECE_CHARS", 7)  # many cuts: at blank lines and indents too
    cfg = data_cfg(folder, val_fraction=0.25)
    corpus = load_corpus(cfg, 600, str(tmp_path / "cache"))
    tok = Tokenizer.from_str(corpus.tokenizer_json)
    train, _ = split_files(corpus_files(str(folder)), 0.25, corpus_root(str(folder)))
    ids = corpus.train.tolist()
    docs, start = [], 0
    for end in [i for i, t in enumerate(ids) if t == SEP]:
        docs.append(ids[start:end])
        start = end + 1
    assert [tok.decode(d) for d in docs] == [Path(f).read_text() for f in train]
    assert docs[0] == tok.encode(Path(train[0]).read_text()).ids  # the pieces' ids are the whole text's


def test_held_out_files_never_reach_the_tokenizer(built):
    cfg, corpus, train, val = built
    assert is_a_token(corpus.tokenizer_json, TRAIN_WORD) and is_a_token(corpus.tokenizer_json, "markets")
    assert not is_a_token(corpus.tokenizer_json, HELD_OUT_WORD)
    assert corpus.files == len(train) + len(val) == 8
    assert corpus.train.dtype == corpus.val.dtype == torch.int64 and corpus.train.dim() == 1
    # Each file ends with [SEP]; nothing else in the prose makes one.
    assert int((corpus.train == SEP).sum()) == len(train) and int((corpus.val == SEP).sum()) == len(val)
    assert int(corpus.train[-1]) == SEP and int(corpus.train.max()) < corpus.vocab_size <= 300


def test_held_out_text_of_a_single_file_is_its_end(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text(prose(0, 300) + f"{HELD_OUT_WORD} " * 20)
    corpus = load_corpus(data_cfg(path, val_fraction=0.1), 300, str(tmp_path / "cache"))
    assert HELD_OUT_WORD not in vocab_of(corpus.tokenizer_json)
    share = len(corpus.val) / (len(corpus.train) + len(corpus.val))
    assert 0.05 < share < 0.2


def test_cache_hits_and_rebuilds_when_a_file_changes(tmp_path, monkeypatch):
    folder = write_folder(tmp_path, n=4)
    cfg, cache = data_cfg(folder), str(tmp_path / "cache")
    first = load_corpus(cfg, 200, cache)
    assert sorted(os.listdir(os.path.join(cache, f"corpus-{first.key}"))) == ["tokenizer.json", "tokens.pt"]

    def no_training(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(corpus_mod, "train_tokenizer", no_training)
    again = load_corpus(cfg, 200, cache)
    assert again.key == first.key and again.tokenizer_json == first.tokenizer_json
    assert torch.equal(again.train, first.train) and torch.equal(again.val, first.val)
    assert load_corpus(cfg, 200, cache).train.dtype == torch.int64
    monkeypatch.undo()

    victim = folder / "doc3.txt"
    victim.write_text(victim.read_text() + prose(42))
    changed = load_corpus(cfg, 200, cache)
    assert changed.key != first.key
    assert len(changed.train) + len(changed.val) > len(first.train) + len(first.val)
    assert load_corpus(data_cfg(folder, tokenizer="wordpiece"), 200, cache).key != changed.key

    # A damaged cache file is rebuilt, not trusted.
    Path(cache, f"corpus-{changed.key}", "tokens.pt").write_bytes(b"garbage")
    assert torch.equal(load_corpus(cfg, 200, cache).train, changed.train)


def test_workers_building_one_corpus_at_once_agree(tmp_path):
    """Two builders racing on one cache folder get the same ids, and the cache holds them."""
    from concurrent.futures import ThreadPoolExecutor

    cfg, cache = data_cfg(write_folder(tmp_path, n=5), tokenizer="wordpiece"), str(tmp_path / "cache")
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: load_corpus(cfg, 200, cache), range(2))
    c = load_corpus(cfg, 200, cache)
    assert a.tokenizer_json == b.tokenizer_json == c.tokenizer_json
    assert torch.equal(a.train, b.train) and torch.equal(a.train, c.train) and torch.equal(a.val, c.val)
    assert not [n for n in os.listdir(os.path.join(cache, f"corpus-{a.key}")) if n.startswith(".")]


def test_cache_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEFISHER_CACHE", str(tmp_path / "envcache"))
    corpus = load_corpus(data_cfg(write_folder(tmp_path, n=3)), 200)
    assert os.path.isfile(tmp_path / "envcache" / f"corpus-{corpus.key}" / "tokens.pt")
    save_tokenizer(corpus, tmp_path / "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.token_to_id("[MASK]") == MASK and tok.encode("the cat").ids


def test_micro_batches_are_pure_functions_of_seed_step_replica_index(built):
    cfg, corpus, _, _ = built
    a, b = MLMData(cfg, 300, corpus), MLMData(cfg, 300, corpus)
    x = a.micro_batch(3, 1, 2)
    assert x.input_ids.shape == x.labels.shape == (cfg.micro_batch_size, cfg.seq_len)
    assert x.input_ids.dtype == x.labels.dtype == torch.int64
    y = b.micro_batch(3, 1, 2)
    assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
    for other in (a.micro_batch(4, 1, 2), a.micro_batch(3, 0, 2), a.micro_batch(3, 1, 3),
                  MLMData(DataConfig(**{**cfg.__dict__, "seed": 1}), 300, corpus).micro_batch(3, 1, 2)):
        assert not torch.equal(x.labels, other.labels)


def test_masking_follows_bert(built):
    cfg, corpus, _, _ = built
    cfg = DataConfig(**{**cfg.__dict__, "micro_batch_size": 64, "seq_len": 32})
    data = MLMData(cfg, 300, corpus)
    batches = [data.micro_batch(s, 0, 0) for s in range(8)]
    inputs = torch.cat([mb.input_ids for mb in batches])
    labels = torch.cat([mb.labels for mb in batches])
    predicted = labels != IGNORE_INDEX
    assert predicted.any(dim=1).all()
    assert abs(predicted.float().mean().item() - cfg.mask_prob) < 0.015
    shown, truth = inputs[predicted], labels[predicted]
    n = len(truth)
    masked = (shown == MASK).sum().item() / n
    kept = (shown == truth).sum().item() / n
    swapped = shown[(shown != MASK) & (shown != truth)]
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.03 and abs(len(swapped) / n - 0.1) < 0.03
    assert (swapped >= NUM_SPECIAL).all() and (swapped < corpus.vocab_size).all()
    assert not (inputs[~predicted] == MASK).any()
    # Labels are real text: windows of the training ids.
    assert (truth < corpus.vocab_size).all() and (truth >= 0).all()


def test_validation_batches_are_fixed_held_out_text(built):
    cfg, corpus, _, _ = built
    one = MLMData(cfg, 300, corpus).validation_batches()
    other = MLMData(DataConfig(**{**cfg.__dict__, "seed": 7}), 300, corpus).validation_batches()
    assert len(one) == cfg.val_batches
    for a, b in zip(one, other):
        assert a.input_ids.shape == (cfg.micro_batch_size, cfg.seq_len)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    # The windows are held-out text: the first starts at the held-out ids' start.
    first = one[0]
    row = torch.where(first.labels[0] == IGNORE_INDEX, corpus.val[:cfg.seq_len], first.labels[0])
    assert torch.equal(row, corpus.val[:cfg.seq_len])
    assert HELD_OUT_WORD not in vocab_of(corpus.tokenizer_json)


def test_synthetic_data_needs_no_corpus():
    cfg = DataConfig(text="synthetic", val_batches=2)
    data = MLMData(cfg, 50)
    mb = data.micro_batch(0, 0, 0)
    assert mb.input_ids.shape == (cfg.micro_batch_size, cfg.seq_len) and int(mb.input_ids.max()) < 50
    assert len(data.validation_batches()) == 2
    reseeded = MLMData(DataConfig(text="synthetic", val_batches=2, seed=5), 50)
    assert torch.equal(data.validation_batches()[0].labels, reseeded.validation_batches()[0].labels)


def test_bad_corpora_are_input_errors_naming_the_path(tmp_path):
    cache = str(tmp_path / "cache")
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(InputError, match=r"missing\.txt: no such file or folder"):
        load_corpus(data_cfg(missing), 100, cache)
    with pytest.raises(InputError, match=r"nothing.*\*\.txt: matches no files"):
        corpus_files(str(tmp_path / "nothing" / "*.txt"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.dat").write_bytes(b"\x00" * 10)
    with pytest.raises(InputError, match=r"bin: has no text files"):
        corpus_files(str(tmp_path / "bin"))
    short = tmp_path / "short.txt"
    short.write_text("just a few words\n")
    with pytest.raises(InputError, match=r"short\.txt: training text is \d+ tokens, shorter than one"):
        load_corpus(data_cfg(short), 100, cache)
    # Two files: whichever is held out is too short.
    pair = tmp_path / "pair"
    pair.mkdir()
    a, b = str(pair / "a.txt"), str(pair / "b.txt")
    _, (val,) = split_files([a, b], 0.25, str(pair))
    Path(a).write_text(prose(1) if val == b else "tiny\n")
    Path(b).write_text(prose(1) if val == a else "tiny\n")
    with pytest.raises(InputError, match=r"pair: held-out text is \d+ tokens"):
        MLMData(data_cfg(pair), 100, load_corpus(data_cfg(pair, val_batches=0), 100, cache))
    with pytest.raises(InputError, match=r"pair: held-out text"):
        load_corpus(data_cfg(pair), 100, cache)


def test_clm_labels_are_the_next_tokens_of_the_same_windows(built):
    cfg, corpus, _, _ = built
    mlm = MLMData(cfg, 300, corpus)
    clm = MLMData(DataConfig(**{**cfg.__dict__, "objective": "clm"}), 300, corpus)
    for step, replica, index in ((0, 0, 0), (3, 1, 2)):
        c, m = clm.micro_batch(step, replica, index), mlm.micro_batch(step, replica, index)
        assert torch.equal(c.labels[:, :-1], c.input_ids[:, 1:])  # every position predicts the next token
        assert (c.labels[:, -1] == IGNORE_INDEX).all()  # the last has none
        assert (c.input_ids != MASK).all()  # nothing masked
        # The same window as mlm's: mlm's labels are the original tokens where it predicts.
        kept = m.labels != IGNORE_INDEX
        assert torch.equal(c.input_ids[kept], m.labels[kept])
        again = MLMData(DataConfig(**{**cfg.__dict__, "objective": "clm"}), 300, corpus)
        assert torch.equal(again.micro_batch(step, replica, index).labels, c.labels)  # a pure function
    assert not torch.equal(clm.micro_batch(3, 1, 2).labels, clm.micro_batch(3, 0, 2).labels)
    val = clm.validation_batches()[0]
    assert torch.equal(val.labels[:, :-1], val.input_ids[:, 1:])


def test_clm_on_synthetic_tokens():
    data = MLMData(DataConfig(text="synthetic", objective="clm", seq_len=8), 50)
    mb = data.micro_batch(0, 0, 0)
    assert torch.equal(mb.labels[:, :-1], mb.input_ids[:, 1:]) and (mb.labels[:, -1] == IGNORE_INDEX).all()
