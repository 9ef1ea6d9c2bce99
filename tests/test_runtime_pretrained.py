"""model.pretrained: stages start from a saved model's weights, split as a random model would be; a
folder that does not hold the run config's model is refused in one line."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.runtime.job.config import RunConfig
from pipefisher.runtime.models.builders import check_builder, make_stage

from test_runtime_hf import TINY, batch, chain

BUILDERS = {"bert": "pipefisher.runtime.models.hf:bert_mlm", "gpt2": "pipefisher.runtime.models.hf:gpt2_clm"}
GPT2_EPS = 1e-5  # GPT2Config's layer_norm_epsilon: the run config must say it


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def saved_model(transformers, kind: str, folder, **shape) -> torch.nn.Module:
    """A tiny transformers model as transformers makes it (embeddings *tied*), saved to ``folder``."""
    m = dataclasses.replace(TINY, **shape)
    torch.manual_seed(5)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                                         intermediate_size=m.intermediate_size,
                                         max_position_embeddings=m.max_position)
        model = transformers.BertForMaskedLM(config)
        with torch.no_grad():
            model.cls.predictions.bias.normal_()  # not the zeros of a fresh init: a lost bias would show
    else:
        config = transformers.GPT2Config(vocab_size=m.vocab_size, n_embd=m.hidden_size, n_layer=m.num_layers,
                                         n_head=m.num_heads, n_inner=m.intermediate_size, n_positions=m.max_position,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    assert config.tie_word_embeddings
    model.save_pretrained(str(folder))
    return model.eval()


def run_config(kind: str, folder, **model) -> RunConfig:
    eps = {"layer_norm_eps": GPT2_EPS} if kind == "gpt2" else {}
    return RunConfig(model=dataclasses.replace(TINY, builder=BUILDERS[kind], pretrained=str(folder), **eps, **model),
                     pipeline=dataclasses.replace(RunConfig().pipeline, stages=2))


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_every_stage_holds_the_saved_models_weights_untied(transformers, kind, tmp_path):
    source = saved_model(transformers, kind, tmp_path)
    want = source.state_dict()  # tied: the output layer's name holds the embeddings
    cfg = run_config(kind, tmp_path)
    check_builder(cfg)  # the check before any worker starts (on the meta device) passes
    x, labels, ref_labels = batch(kind)
    for num_stages in (2, 3):
        stages = [make_stage(cfg, i, num_stages).eval() for i in range(num_stages)]
        seen = []
        for stage in stages:
            for name, t in stage.state_dict().items():
                seen.append(name)
                assert torch.equal(t, want[name]), (num_stages, name)
        assert sorted(set(seen)) == sorted(want)  # every weight on some stage, from the folder
        with torch.no_grad():
            torch.testing.assert_close(chain(stages, x), source(input_ids=x).logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(chain(stages, x, labels), source(input_ids=x, labels=ref_labels).loss,
                                       rtol=1e-5, atol=1e-6)
    one = make_stage(cfg, 0, 1)
    head, emb = one.get_submodule("cls.predictions.decoder" if kind == "bert" else "lm_head"), \
        one.get_submodule("bert.embeddings.word_embeddings" if kind == "bert" else "transformer.wte")
    assert head.weight is not emb.weight and torch.equal(head.weight, emb.weight)  # a copy, not the same tensor
    if kind == "bert":  # the decoder bias stays tied to cls.predictions.bias, as transformers has it
        assert one.cls.predictions.decoder.bias is one.cls.predictions.bias


def test_a_model_of_another_shape_is_refused_in_one_line_naming_the_keys(transformers, tmp_path):
    saved_model(transformers, "bert", tmp_path, hidden_size=8, num_layers=2)
    cfg = run_config("bert", tmp_path)
    for attempt in (lambda: make_stage(cfg, 0, 2), lambda: check_builder(cfg, "job.yaml")):
        with pytest.raises(InputError) as err:
            attempt()
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"{tmp_path}: model.pretrained holds a model")
        assert "hidden_size 8 there, 16 in the run config" in text and "num_layers 2 there, 4 in the run config" in text
        assert "vocab_size" not in text and "num_heads" not in text


def test_a_missing_folder_a_folder_without_config_or_another_model_type_is_one_line(transformers, tmp_path):
    gpt2 = tmp_path / "gpt2"
    saved_model(transformers, "gpt2", gpt2)
    (tmp_path / "empty").mkdir()
    cases = {tmp_path / "nowhere": "no such folder (a folder save_pretrained wrote)",
             tmp_path / "empty": "holds no config.json (not a folder save_pretrained wrote)",
             gpt2: "holds a gpt2 model, not a bert one"}
    for folder, says in cases.items():
        with pytest.raises(InputError) as err:
            make_stage(run_config("bert", folder), 1, 2)
        assert str(err.value) == f"{folder}: model.pretrained (model.builder for BertForMaskedLM): {says}"


def test_the_built_in_model_refuses_weights_of_another_shape(tmp_path):
    from pipefisher.runtime.models.bert import PipelineStage

    small = RunConfig().model
    torch.save(PipelineStage(small, 0, 1).state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps({"format": "test", "model": dataclasses.asdict(small)}))
    cfg = RunConfig(model=dataclasses.replace(small, pretrained=str(tmp_path)))
    stages = [make_stage(cfg, i, 2, seed=9) for i in range(2)]  # another seed: the file's weights win
    whole = PipelineStage(small, 0, 1).state_dict()
    assert all(torch.equal(t, whole[k]) for s in stages for k, t in s.state_dict().items())
    bigger = RunConfig(model=dataclasses.replace(small, hidden_size=64, pretrained=str(tmp_path)))
    with pytest.raises(InputError, match=r"hidden_size 32 there, 64 in the run config"):
        make_stage(bigger, 0, 2)
    alone = RunConfig(model=dataclasses.replace(small, hidden_size=64, pretrained=str(tmp_path / "model.pt")))
    with pytest.raises(InputError) as err:  # a weights file alone: its tensors say it
        make_stage(alone, 0, 2)
    assert str(err.value).startswith(f"{tmp_path / 'model.pt'}: model.pretrained: holds embeddings.word_embeddings"
                                     ".weight of shape (100, 32), not (100, 64)")
