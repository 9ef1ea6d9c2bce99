"""pipefisher export: a checkpoint's stages become one model that computes what the pipeline computes,
loads without pipefisher (Hugging Face builders) and trains again as model.pretrained."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.pipeline_orders import UP
from pipefisher.runtime.data.corpus import SPECIAL_TOKENS
from pipefisher.runtime.job.config import RunConfig, load_config
from pipefisher.runtime.job.dist import single_process
from pipefisher.runtime.models.bert import PipelineStage, from_transformers
from pipefisher.runtime.models.builders import make_stage
from pipefisher.runtime.pipeline.copies import StageChunks, StagePair
from pipefisher.runtime.pipeline.layout import node_pipes
from pipefisher.runtime.train.checkpoint import FORMAT, MANIFEST, rank_filename, step_folder
from pipefisher.runtime.train.consolidate import export
from pipefisher.runtime.train.trainer import Trainer, TrainOptions
from pipefisher.safe_io import dump_json_atomic

from _schedules import TINY as TINY_YAML, tiny
from test_runtime_hf import MODELS, batch, chain

AUTO = {"bert": "AutoModelForMaskedLM", "gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM"}


def _runner() -> CliRunner:
    """stdout and stderr apart (click < 8.2 needs asking)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def trained(cfg: RunConfig, ck: str, steps: int = 2) -> Trainer:
    """``cfg`` trained in this process (one stage) for ``steps`` steps, checkpointed to ``ck``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opts = TrainOptions.of(steps=steps, progress=False, log_every=10**9, checkpoint_dir=ck)
        t = Trainer(cfg, single_process(), opts)
        t.run()
    finally:
        torch.set_num_threads(threads)
    return t


def hf_run(kind: str) -> RunConfig:
    builder = {"bert": "bert_mlm", "gpt2": "gpt2_clm", "llama": "llama_clm"}[kind]
    model = dataclasses.replace(MODELS[kind], builder=f"pipefisher.runtime.models.hf:{builder}", dropout=0.1)
    base = RunConfig()
    return RunConfig(name=f"hf-{kind}", model=model,
                     data=dataclasses.replace(base.data, text="synthetic", seq_len=10, micro_batch_size=2,
                                              num_micro_batches=2, objective="mlm" if kind == "bert" else "clm"),
                     optim=dataclasses.replace(base.optim, name="adam", lr=0.01),
                     pipeline=dataclasses.replace(base.pipeline, stages=1))


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_a_hugging_face_export_loads_without_pipefisher_and_computes_what_the_pipeline_does(kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = hf_run(kind)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "model")
    stage = trained(cfg, ck).stage.eval()
    line = export(ck, out)
    assert line.startswith(f"wrote {out}: a ") and "\n" not in line and "after 2 steps" in line
    model = getattr(transformers, AUTO[kind]).from_pretrained(out).eval()  # transformers alone
    assert model.config.tie_word_embeddings is False
    if kind != "bert":  # generation stops at the [SEP] that ends every document; [PAD] pads
        ids = (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id)
        assert ids == tuple(SPECIAL_TOKENS.index(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    for name, t in stage.state_dict().items():  # the trained weights, none lost (BERT's decoder bias)
        assert torch.equal(model.state_dict()[name], t), name
    x, labels, ref_labels = batch(kind)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, stage(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(input_ids=x, labels=ref_labels).loss, stage(x, labels), rtol=1e-5, atol=1e-5)
    # the exported folder is a pretrained model to train from, split into stages
    again = cfg.replace(model={"pretrained": out})
    stages = [make_stage(again, i, 2).eval() for i in range(2)]
    for s in stages:
        for name, t in s.state_dict().items():
            assert torch.equal(t, model.state_dict()[name]), name
    with torch.no_grad():
        torch.testing.assert_close(chain(stages, x), stage(x), rtol=1e-5, atol=1e-5)


def test_an_export_needs_neither_the_pretrained_folder_nor_the_folder_the_run_started_in(tmp_path, monkeypatch,
                                                                                        capsys, cli_lines):
    """The checkpoint keeps the transformers config: exported after the pretrained folder is gone, and
    from another working folder, it is the same model. A run from pretrained weights says so."""
    transformers = pytest.importorskip("transformers")
    first, ck0, ck = str(tmp_path / "first"), str(tmp_path / "ck0"), str(tmp_path / "ck")
    trained(hf_run("gpt2"), ck0, steps=1)
    export(ck0, first)
    capsys.readouterr()
    stage = trained(hf_run("gpt2").replace(model={"pretrained": first}), ck, steps=1).stage.eval()
    assert f"model.pretrained: the model starts from the weights in {first}\n" in capsys.readouterr().out
    shutil.rmtree(first)
    monkeypatch.chdir(ck0)
    export(ck, str(tmp_path / "again"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    x = batch("gpt2")[0]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, stage(x), rtol=1e-5, atol=1e-5)


def test_the_built_in_model_exported_through_the_cli_from_a_run_folder(tmp_path):
    """A run on real text: the export is a transformers BertForMaskedLM and a tokenizer, both loaded
    by transformers alone, the model computing what the pipeline does; model.pretrained trains from it;
    --force replaces only what an export writes."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny(pipeline={"stages": 1})  # configs/tiny.yaml's model on the standard library's text
    run = tmp_path / "runs"
    ck = str(run / f"{cfg.name}_checkpoints")  # where pipefisher run --out puts a run's checkpoints
    trainer = trained(cfg, ck)
    stage = trainer.stage.eval()
    out = str(tmp_path / "model")
    res = _runner().invoke(main, ["export", str(run), "--out", out])
    assert res.exit_code == 0, res.output
    assert res.stdout == (f"wrote {out}: a BertForMaskedLM in model.safetensors, {len(stage.state_dict()) + 2} "
                          "tensors (transformers.AutoModelForMaskedLM.from_pretrained loads it; model.pretrained "
                          "trains from it); its tokenizer (transformers.AutoTokenizer loads it); run 'tiny' after 2 "
                          f"steps, from {os.path.join(ck, step_folder(2))}\n")
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(out)) == files
    mask = os.umask(0)
    os.umask(mask)
    assert {oct(os.stat(os.path.join(out, f)).st_mode & 0o777) for f in files} == {oct(0o666 & ~mask)}
    model, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # every weight there, none left over
    model.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=g)
    labels = torch.where(torch.rand(x.shape, generator=g) < 0.3, x, torch.full_like(x, -100))
    labels[0, 0] = x[0, 0]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, stage(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(input_ids=x, labels=labels).loss, stage(x, labels), rtol=1e-5, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert [tokenizer.pad_token, tokenizer.unk_token, tokenizer.cls_token, tokenizer.sep_token,
            tokenizer.mask_token] == list(SPECIAL_TOKENS)
    assert tokenizer.mask_token_id == SPECIAL_TOKENS.index("[MASK]")
    from tokenizers import Tokenizer

    text = "def f(x):\n    return x + 1"
    assert tokenizer(text).input_ids == Tokenizer.from_str(trainer.data.corpus.tokenizer_json).encode(text).ids
    again = cfg.replace(model={"pretrained": out})
    for i in range(2):
        for name, t in make_stage(again, i, 2).state_dict().items():
            assert torch.equal(t, stage.state_dict()[name]), name
    # an existing folder: refused, then written into with --force, which leaves what is not an export's alone
    (tmp_path / "model" / "notes.txt").write_text("mine")
    (tmp_path / "model" / "sub").mkdir()
    (tmp_path / "model" / "model.pt").write_bytes(b"an older export's weights")
    res = _runner().invoke(main, ["export", ck, "--out", out])
    assert res.exit_code == 2
    assert res.stderr == (f"error: {out}: is not empty; --force writes the export into it, replacing only the files "
                          "an export writes (config.json, model.safetensors, tokenizer.json, ...)\n")
    res = _runner().invoke(main, ["export", ck, "--out", out, "--force"])
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(out)) == sorted(files + ["notes.txt", "sub"])
    assert (tmp_path / "model" / "notes.txt").read_text() == "mine"
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == []  # no temp folder left behind


def fake_checkpoint(cfg: RunConfig, folder: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """Worker files as ``Checkpointer.save`` lays them out (each device's stage copies in the container
    the worker trains: :class:`StagePair` under Chimera, :class:`StageChunks` with model chunks), the
    stage copies built as every worker builds them; returns the unsplit model's tensors."""
    v = cfg.pipeline.virtual_stages
    sub = os.path.join(folder, step_folder(steps))
    os.makedirs(sub)
    for device in range(cfg.pipeline.stages):
        copies = {p: make_stage(cfg, s, v) for p, s in node_pipes(cfg, device).items()}
        if cfg.pipeline.chunked:
            held: torch.nn.Module = StageChunks([copies[j] for j in range(len(copies))])
        elif len(copies) == 2:
            held = StagePair(copies[0], copies[UP], list(copies))
        else:
            held = copies[0]
        for replica in range(2):  # replica 1 holds other tensors: only replica 0's are read
            model = held.state_dict() if replica == 0 else {k: t + 1 for k, t in held.state_dict().items()}
            torch.save({"steps_done": steps, "stage": device, "replica": replica, "model": model},
                       os.path.join(sub, rank_filename(device, replica)))
    dump_json_atomic(os.path.join(folder, MANIFEST), {
        "format": FORMAT, "steps_done": steps, "folder": step_folder(steps), "stages": cfg.pipeline.stages,
        "replicas": 2, "config": cfg.to_dict(), "tokenizer_kind": cfg.data.tokenizer})
    return PipelineStage(cfg.model, 0, 1, seed=cfg.data.seed).state_dict()


@pytest.mark.parametrize("order", ["1f1b", "chimera", "interleaved", "zb-v"])
def test_every_stage_copy_layout_merges_into_the_unsplit_model(order, tmp_path):
    from safetensors.torch import load_file

    cfg = load_config(TINY_YAML).replace(pipeline={"order": order, "stages": 2})
    want = fake_checkpoint(cfg, str(tmp_path / "ck"))
    export(str(tmp_path / "ck"), str(tmp_path / "out"))
    got = from_transformers(load_file(str(tmp_path / "out" / "model.safetensors")), "out")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_bad_input_is_one_line_naming_the_path(tmp_path):
    cfg = load_config(TINY_YAML)
    ck = str(tmp_path / "a_checkpoints")
    fake_checkpoint(cfg, ck)
    shutil.copytree(ck, str(tmp_path / "b_checkpoints"))
    os.remove(os.path.join(ck, step_folder(3), rank_filename(1, 0)))
    (tmp_path / "plain").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "lines.txt").write_text("a file\n")
    (tmp_path / "step-00000007").mkdir()
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "nowhere"), "--out", out],
         f"{tmp_path / 'nowhere'}: is not a checkpoint folder nor a run folder (no such folder)"),
        ([str(tmp_path / "plain"), "--out", out],
         f"{tmp_path / 'plain'}: holds no checkpoint: no checkpoint.json (pipefisher train --checkpoint-dir writes "
         "one) and no <run>_checkpoints folder (pipefisher run --out writes one)"),
        ([str(tmp_path), "--out", out],
         f"{tmp_path}: holds the checkpoints of 2 runs (a_checkpoints, b_checkpoints): pass one checkpoint folder, "
         f"e.g. {ck}"),
        ([ck, "--out", out], f"{os.path.join(ck, step_folder(3))}: is incomplete: stage1-replica0.pt missing"),
        ([ck, "--out", str(tmp_path / "full")],
         f"{tmp_path / 'full'}: is not empty; --force writes the export into it, replacing only the files an export "
         "writes (config.json, model.safetensors, tokenizer.json, ...)"),
        ([ck, "--out", str(tmp_path / "lines.txt")], f"{tmp_path / 'lines.txt'}: is a file; --out needs a folder"),
        ([str(tmp_path / "lines.txt"), "--out", out],
         f"{tmp_path / 'lines.txt'}: is a file, not a checkpoint folder nor a run folder"),
        ([str(tmp_path / "step-00000007"), "--out", out],
         f"{tmp_path / 'step-00000007'}: is a step folder of a checkpoint, but {tmp_path} holds no checkpoint.json: "
         "pass the checkpoint folder that does"),
        ([ck, "--out", str(tmp_path), "--force"],
         f"{tmp_path}: holds the checkpoint being exported ({ck}); choose another --out"),
    ]
    for args, says in cases:
        res = _runner().invoke(main, ["export", *args])
        assert (res.exit_code, res.stdout, res.stderr) == (2, "", f"error: {says}\n"), args
    assert not os.path.exists(out) and os.listdir(tmp_path / "full") == ["x"]


def test_an_exported_tokenizer_gives_any_text_back_exactly(tmp_path):
    """A run's byte-level BPE, exported and loaded by transformers alone (AutoTokenizer, as the docs
    show): any text, code, tabs, blank lines and characters the corpus never had, decodes to itself."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from pipefisher.runtime.data.corpus import train_tokenizer
    from test_runtime_data import ANY_TEXT, CODE

    cfg = load_config(TINY_YAML).replace(model={"vocab_size": 600}, pipeline={"stages": 1},
                                         data={"objective": "clm"})
    ck = tmp_path / "ck"
    fake_checkpoint(cfg, str(ck))
    (ck / "tokenizer.json").write_text(train_tokenizer(CODE, "bpe", 600))
    line = export(str(ck), str(tmp_path / "out"))
    assert "its tokenizer (transformers.AutoTokenizer loads it);" in line
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ours = Tokenizer.from_str((ck / "tokenizer.json").read_text())
    for text in ANY_TEXT + CODE:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text, repr(text)
        if "[" not in text:  # transformers reads "[SEP]" in text as the token; the corpus as text
            assert ids == ours.encode(text).ids, repr(text)
    assert tok.decode(tok("def foo(x):\n    return x + 1\n").input_ids) == "def foo(x):\n    return x + 1\n"


def test_a_checkpoint_of_the_older_whitespace_bpe_resumes_and_exports(tmp_path):
    """A checkpoint from before byte-level BPE (its manifest says data.tokenizer bpe and records no
    tokenizer kind) had the whitespace-split BPE: resuming it as bpe is refused with what resumes it,
    which does, on the ids the run had; its export loads in transformers and says it drops the layout."""
    transformers = pytest.importorskip("transformers")
    from pipefisher.runtime.train.checkpoint import check_resumable

    old = tiny(pipeline={"stages": 1}, data={"tokenizer": "bpe-whitespace"})
    ck = str(tmp_path / "ck")
    first = trained(old, ck, steps=1)
    with open(os.path.join(ck, MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["tokenizer_kind"] == "bpe-whitespace"
    del manifest["tokenizer_kind"]  # as an older pipefisher wrote it
    manifest["config"]["data"]["tokenizer"] = "bpe"
    dump_json_atomic(os.path.join(ck, MANIFEST), manifest)
    as_bpe = old.replace(data={"tokenizer": "bpe"})
    with pytest.raises(InputError) as err:
        check_resumable(ck, as_bpe, "first-order", None, 1, 1)
    assert str(err.value) == (f"{ck}: was written by a run with another config (differs in data.tokenizer: bpe-whitespace "
                              "there, bpe here); its run's "
                              "tokenizer was bpe-whitespace (the whitespace-split BPE of older runs): --set "
                              "data.tokenizer=bpe-whitespace resumes it")
    res = _runner().invoke(main, ["train", "--config", TINY_YAML, "--set", "data.text=stdlib", "--set",
                                  "pipeline.stages=1", "--resume", ck, "--steps", "2", "--no-progress"])
    assert res.exit_code == 2 and "--set data.tokenizer=bpe-whitespace resumes it" in res.output
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumed = Trainer(old, single_process(), TrainOptions.of(steps=2, progress=False, log_every=10**9, resume=ck))
        resumed.run()
    finally:
        torch.set_num_threads(threads)
    assert resumed.start_step == 1
    with open(os.path.join(ck, "tokenizer.json"), encoding="utf-8") as f:
        assert resumed.data.corpus.tokenizer_json == f.read() == first.data.corpus.tokenizer_json
    out = str(tmp_path / "out")
    line = export(ck, out)
    assert ("its tokenizer (transformers.AutoTokenizer loads it; the whitespace-split BPE of older runs: decoding "
            "drops spaces and newlines)") in line
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1"
    assert tok(text).input_ids == Tokenizer.from_str(first.data.corpus.tokenizer_json).encode(text).ids
