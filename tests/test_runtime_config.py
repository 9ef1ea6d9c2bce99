"""Configs, model split and data: the plain pieces the workers are built from."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.runtime.config import RunConfig, config_from_dict, load_config
from pipefisher.runtime.data import MASK, MLMData
from pipefisher.runtime.model import IGNORE_INDEX, PipelineStage, stage_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_bundled_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.num_layers >= cfg.pipeline.stages
    assert config_from_dict(cfg.to_dict()) == cfg  # the launcher's JSON round trip


def test_bundled_configs_cover_tests_demo_and_bert_shapes():
    names = {load_config(p).name for p in CONFIGS}
    assert {"tiny", "small", "bert-base", "bert-large"} <= names
    assert load_config(os.path.join(ROOT, "configs", "bert-large.yaml")).model.hidden_size == 1024


@pytest.mark.parametrize("raw,problem", [
    ({"modle": {}}, "unknown config section"),
    ({"model": {"hidden": 3}}, "unknown key(s) in 'model'"),
    ({"model": {"hidden_size": "big"}}, "model.hidden_size must be a int"),
    ({"model": {"hidden_size": 30, "num_heads": 4}}, "multiple of model.num_heads"),
    ({"pipeline": {"stages": 5}}, "pipeline.stages must be between 1"),
    ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule must be one of gpipe, 1f1b, chimera"),
    ({"pipeline": {"schedule": "chimera", "stages": 3}, "model": {"num_layers": 4}},
     "chimera needs an even number of stages"),
    ({"pipeline": {"schedule": "chimera"}, "data": {"num_micro_batches": 3}}, "and of data.num_micro_batches"),
])
def test_bad_configs_are_input_errors(raw, problem):
    with pytest.raises(InputError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(raw, "c.yaml")


def test_stage_split_keeps_names_and_weights_of_the_whole_model():
    cfg = RunConfig().model.__class__(num_layers=5)
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    whole = dict(PipelineStage(cfg, 0, 1).named_parameters())
    parts = [dict(PipelineStage(cfg, s, 2).named_parameters()) for s in range(2)]
    assert set(parts[0]) | set(parts[1]) == set(whole) and not set(parts[0]) & set(parts[1])
    for part in parts:
        for name, p in part.items():
            assert torch.equal(p, whole[name]), name
    assert "embeddings.word_embeddings.weight" in parts[0] and "cls.predictions.decoder.weight" in parts[1]


def test_micro_batches_are_reproducible_and_masked():
    data = MLMData(RunConfig().replace(data={"text": "synthetic"}).data, 100)
    a, b = data.micro_batch(3, 1, 2), data.micro_batch(3, 1, 2)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids, data.micro_batch(3, 0, 2).input_ids)
    masked = a.labels != IGNORE_INDEX
    # BERT's rule: most predicted positions show [MASK], the rest a random or the original token
    assert masked.any(dim=1).all() and (a.input_ids[masked] == MASK).float().mean() > 0.5


def test_text_file_data(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEFISHER_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat . " * 200)
    cfg = RunConfig().replace(data={"text": str(text), "seq_len": 8})
    mb = MLMData(cfg.data, 100).micro_batch(0, 0, 0)
    assert mb.input_ids.shape == (cfg.data.micro_batch_size, 8) and int(mb.input_ids.max()) < 100
    with pytest.raises(InputError, match=r"nope\.txt: no such file"):
        MLMData(RunConfig().replace(data={"text": str(tmp_path / "nope.txt")}).data, 100)
