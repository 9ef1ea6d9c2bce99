"""Where documents come from (pipefisher.runtime.data.sources): a data.builder function, a local
data.dataset (text, json, parquet) read by Hugging Face datasets, the held-out split of documents, the
cache keys, and the one-line refusals. The builders are this module's own functions, named by
``f"{__name__}:function"``."""
from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.runtime import api
from pipefisher.runtime.data import sources
from pipefisher.runtime.data.batches import SEP, MLMData
from pipefisher.runtime.data.corpus import load_corpus, save_tokenizer, train_tokenizer
from pipefisher.runtime.data.sources import IDS, TEXT, split_documents
from pipefisher.runtime.job.config import DataConfig, load_config
from pipefisher.runtime.job.dist import single_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the cat sat on a mat while dogs ran past small houses near green hills and rivers "
         "under bright skies every morning people walked slowly toward busy markets").split()
VOCAB = 300


def line(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(40)) + f" doc{seed} ."


LINES = [line(i) for i in range(24)]
ID_DOCS = [[random.Random(i).randrange(5, 100) for _ in range(30 + i)] for i in range(12)]


# -- builders (data.builder names them) ---------------------------------------------------------------

def prose_documents(cfg):
    return iter(LINES)  # any iterable: a generator is read once


def lines_of(cfg):
    """The non-empty lines of the file ``data.text`` names: a builder reading its own argument."""
    with open(cfg.text, encoding="utf-8") as f:
        return [s for s in f.read().splitlines() if s]


def token_ids(cfg):
    return [np.array(ID_DOCS[0]), tuple(ID_DOCS[1])] + ID_DOCS[2:]


def raises(cfg):
    raise ValueError("no corpus today\nsecond line")


def nothing(cfg):
    return ["", "  \n", None]


def not_iterable(cfg):
    return 42


def one_string(cfg):
    return LINES[0]


def mixed(cfg):
    return [LINES[0], [5, 6, 7]]


def out_of_range(cfg):
    return [[5, 6], [7, VOCAB]]


def floats(cfg):
    return [[5.5, 6.0]]


def spec(name: str) -> str:
    return f"{__name__}:{name}"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEFISHER_CACHE", str(tmp_path / "cache"))


def cfg_of(**kw) -> DataConfig:
    return DataConfig(**{"seq_len": 16, "micro_batch_size": 4, "val_fraction": 0.25, "val_batches": 2, **kw})


def test_a_builder_of_strings_trains_a_tokenizer_on_its_training_documents():
    cfg = cfg_of(builder=spec("prose_documents"))
    corpus = load_corpus(cfg, VOCAB)
    split = split_documents(LINES, TEXT, cfg.val_fraction)
    assert split.kind == TEXT and corpus.files == len(LINES) == len(split.train) + len(split.val)
    assert corpus.tokenizer_json == train_tokenizer(split.train, "bpe", VOCAB)  # training documents only
    assert int((corpus.train == SEP).sum()) == len(split.train) and int((corpus.val == SEP).sum()) == len(split.val)
    data = MLMData(cfg, VOCAB)
    mb = data.micro_batch(0, 0, 0)
    assert mb.input_ids.shape == (4, 16) and int(mb.input_ids.max()) < corpus.vocab_size <= VOCAB
    assert len(data.validation_batches()) == 2


def test_a_builder_of_token_ids_gives_batches_of_exactly_those_ids(tmp_path):
    cfg = cfg_of(builder=spec("token_ids"), objective="clm")
    corpus = load_corpus(cfg, 100)
    split = split_documents([np.array(d) for d in ID_DOCS], IDS, cfg.val_fraction)
    joined = [torch.tensor([i for doc in side for i in [*doc.tolist(), SEP]]) for side in (split.train, split.val)]
    assert torch.equal(corpus.train, joined[0]) and torch.equal(corpus.val, joined[1])
    assert corpus.tokenizer_json == "" and corpus.vocab_size == 100  # no tokenizer
    save_tokenizer(corpus, tmp_path / "tokenizer.json")
    assert not (tmp_path / "tokenizer.json").exists()
    windows = corpus.train.unfold(0, cfg.seq_len, 1)
    for step in range(3):
        for row in MLMData(cfg, 100).micro_batch(step, 0, 0).input_ids:  # clm: inputs are whole windows
            assert (windows == row).all(dim=1).any()
    again = load_corpus(cfg, 100)  # from the cache: tokens.pt alone
    assert again.key == corpus.key and torch.equal(again.train, corpus.train) and again.vocab_size == 100
    assert os.listdir(os.path.join(os.environ["PIPEFISHER_CACHE"], f"corpus-{corpus.key}")) == ["tokens.pt"]


def test_held_out_documents_are_chosen_by_content_deterministically():
    docs = [f"document number {i}" for i in range(40)]
    split = split_documents(docs, TEXT, 0.25)
    assert split == split_documents(docs, TEXT, 0.25) and split.count == 40
    assert sorted(split.train + split.val) == sorted(docs) and not set(split.train) & set(split.val)
    # sha1 of the content: the same in every process and run (pinned), whatever the order or the neighbours
    assert [docs.index(d) for d in split.val] == [4, 15, 16, 19, 22, 27, 28, 30, 31, 32, 39]
    shuffled = split_documents(docs[::-1] + ["a newcomer"] + docs[:3], TEXT, 0.25)
    assert set(split.val) <= set(shuffled.val) and not set(split.val) & set(shuffled.train)
    ids = [np.arange(i, i + 5) for i in range(5, 45)]
    assert [int(d[0]) - 5 for d in split_documents(ids, IDS, 0.25).val] == [0, 7, 9, 21, 23, 24, 33, 36, 38]
    # Each side gets a document; a single document is cut, its end held out.
    for fraction in (1e-9, 1 - 1e-9):
        pair = split_documents(docs[:2], TEXT, fraction)
        assert len(pair.train) == len(pair.val) == 1
    one = split_documents(["abcdefghij"], TEXT, 0.2)
    assert (one.train, one.val) == (["abcdefgh"], ["ij"])


@pytest.fixture
def files(tmp_path):
    """The same documents as a text file (one a line, blank lines between), a json file and a parquet
    file (in column ``body``, beside another column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"  # beside the cache, not above it
    folder.mkdir()
    text = folder / "lines.txt"
    text.write_text("\n\n".join(LINES) + "\n")
    (folder / "rows.jsonl").write_text("".join(json.dumps({"id": i, "body": s}) + "\n" for i, s in enumerate(LINES)))
    pq.write_table(pa.table({"id": list(range(len(LINES))), "body": LINES}), folder / "rows.parquet")
    return folder


@pytest.mark.parametrize("fmt,name,column", [("text", "lines.txt", "text"), ("json", "rows.jsonl", "body"),
                                             ("parquet", "rows.parquet", "body")])
def test_a_dataset_gives_the_ids_the_same_documents_give_through_a_builder(files, fmt, name, column):
    want = load_corpus(cfg_of(builder=spec("lines_of"), text=str(files / "lines.txt")), VOCAB)
    cfg = cfg_of(dataset=fmt, text=str(files / name), column=column)
    got = load_corpus(cfg, VOCAB)
    assert got.tokenizer_json == want.tokenizer_json and got.files == want.files == len(LINES)
    assert torch.equal(got.train, want.train) and torch.equal(got.val, want.val) and got.key != want.key
    assert os.path.isdir(os.path.join(os.environ["PIPEFISHER_CACHE"], "datasets"))  # its arrow cache is ours


def test_a_parquet_column_of_token_ids_is_used_as_it_is(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ids": ID_DOCS}), tmp_path / "ids.parquet")
    got = load_corpus(cfg_of(dataset="parquet", text=str(tmp_path / "*.parquet"), column="ids"), 100)
    want = load_corpus(cfg_of(builder=spec("token_ids")), 100)
    assert got.tokenizer_json == "" and torch.equal(got.train, want.train) and torch.equal(got.val, want.val)


def test_dataset_cache_hits_and_rebuilds_on_a_changed_file_or_column(files, monkeypatch):
    cfg = cfg_of(dataset="json", text=str(files), column="body")  # a folder: its .json / .jsonl files
    first = load_corpus(cfg, VOCAB)

    def no_reading(*args):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(sources, "_load_column", no_reading)
    assert torch.equal(load_corpus(cfg, VOCAB).train, first.train)
    monkeypatch.undo()
    rows = files / "rows.jsonl"
    rows.write_text(rows.read_text() + json.dumps({"id": 99, "body": line(99)}) + "\n")
    assert load_corpus(cfg, VOCAB).key != first.key
    other = cfg_of(dataset="json", text=str(files), column="id")
    assert sources.open_source(other, "").identity != sources.open_source(cfg, "").identity


@pytest.mark.parametrize("name,problem", [
    ("raises", "failed: ValueError: no corpus today"),
    ("nothing", "returned no documents"),
    ("not_iterable", "returned a int, not an iterable of documents"),
    ("one_string", "returned a str, not an iterable of documents"),
    ("mixed", "mixes strings (document 0) and token ids (document 1)"),
    ("out_of_range", f"token id {VOCAB} is outside [0, model.vocab_size = {VOCAB})"),
    ("floats", "document 0 is of type list, not a str or a sequence of int token ids"),
    ("missing", f"module '{__name__}' has no function 'missing'"),
])
def test_bad_builders_are_one_line_naming_the_builder(name, problem):
    with pytest.raises(InputError) as err:
        load_corpus(cfg_of(builder=spec(name)), VOCAB)
    assert str(err.value).startswith(f"data.builder '{spec(name)}': ") and problem in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_datasets_are_one_line_naming_the_files(files, monkeypatch):
    def refusal(fmt: str, name: str, column: str = "body") -> str:
        with pytest.raises(InputError) as err:
            load_corpus(cfg_of(dataset=fmt, text=str(files / name), column=column), VOCAB)
        assert "\n" not in str(err.value)
        return str(err.value)

    (files / "fake.parquet").write_text("not parquet\n")
    assert refusal("parquet", "fake.parquet") == (
        f"{files / 'fake.parquet'}: cannot be read as a parquet dataset (ArrowInvalid: Parquet magic bytes "
        "not found in footer. Either the file is corrupted or this is not a parquet file.)")
    assert refusal("json", "rows.jsonl", "text") == (
        f"{files / 'rows.jsonl'}: the json dataset has no column 'text' (its columns: id, body); set data.column")
    (files / "empty.jsonl").write_text('{"body": ""}\n{"body": null}\n')
    assert refusal("json", "empty.jsonl").endswith("empty.jsonl: column 'body' of the json dataset holds no text")
    assert refusal("json", "rows.jsonl", "id").endswith(
        "column 'id', row 0 is of type int, not a str or a sequence of int token ids")
    (files / "sub").mkdir()
    assert refusal("parquet", "sub").endswith("sub: has no .parquet files")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert refusal("json", "rows.jsonl") == (
        "data.dataset needs Hugging Face datasets: pip install 'pipefisher[datasets]' "
        "(in a clone: pip install -c constraints.txt -e '.[datasets]')")


def test_a_builder_corpus_trains_through_the_library_api():
    torch.set_num_threads(1)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml")).replace(
        pipeline={"stages": 1}, data={"text": "stdlib", "builder": spec("prose_documents"), "val_batches": 1})
    worker = api.build_worker(cfg, single_process(), mode="kfac", total_steps=2)
    losses = [float(worker.step(step)) for step in range(2)]  # one stage: the loss, a tensor, read here
    assert all(np.isfinite(loss) for loss in losses), losses
    assert worker.data.corpus is not None and worker.data.corpus.files == len(LINES)


def test_the_phase_lines_name_the_documents_source_and_a_build_only_when_there_is_one(capsys, cli_lines):
    """With data.builder the run says where its documents come from (not 'stdlib'), and that it builds the
    tokenizer and ids only on the run that builds them; later runs find them in the cache."""
    from pipefisher.cli.train import prepare_training
    from pipefisher.runtime.job.config import ModelConfig, PipelineConfig, RunConfig

    cfg = RunConfig(model=ModelConfig(vocab_size=VOCAB), data=cfg_of(builder=spec("prose_documents")),
                    pipeline=PipelineConfig(stages=1))
    prepare_training(cfg, "run.yaml", 1, None, None, "first-order")
    said = f"... preparing the documents of data.builder '{spec('prose_documents')}'\n"
    assert capsys.readouterr().out == said + ("... building its tokenizer and token ids (once: later runs load them "
                                              "from the cache)\n")
    prepare_training(cfg, "run.yaml", 1, None, None, "first-order")
    assert capsys.readouterr().out == said
    prepare_training(cfg, "run.yaml", 1, None, None, "first-order", progress=False)
    assert capsys.readouterr().out == ""
    assert sources.describe_source(cfg_of(dataset="json", text="corpus/*.jsonl")) == "the json dataset 'corpus/*.jsonl'"
    assert sources.describe_source(cfg_of(text="docs/")) == "the text files of 'docs/'"
