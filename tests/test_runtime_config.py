"""Configs, model split and data: the plain pieces the workers are built from."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.runtime.data.batches import MASK, MLMData
from pipefisher.runtime.job.config import (RunConfig, apply_overrides, config_from_dict, load_config, load_settings,
                                           split_settings)
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.models.builders import IGNORE_INDEX, stage_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


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
    ({"pipeline": {"order": "zigzag"}}, "pipeline.order must be one of gpipe, 1f1b, interleaved"),
    ({"pipeline": {"order": "chimera", "stages": 3}, "model": {"num_layers": 4}},
     "chimera needs an even number of stages"),
    ({"pipeline": {"order": "chimera"}, "data": {"num_micro_batches": 3}}, "and of data.num_micro_batches"),
    ({"kfac": {"cov_stride": 0}}, "kfac.cov_stride must be an integer >= 1"),
    ({"kfac": {"update": "soap", "basis_block": -1}}, "kfac.basis_block must be an integer >= 0"),
    ({"kfac": {"basis_block": 128}}, "kfac.basis_block cuts the eigenbases of kfac.update: soap"),
    ({"kfac": {"update": "soap", "rotation_dtype": "float16"}},
     "kfac.rotation_dtype must be one of float32, bfloat16, not 'float16'"),
    ({"kfac": {"rotation_dtype": "bfloat16"}}, "kfac.rotation_dtype is the dtype of kfac.update: soap's rotations"),
    ({"kfac": {"update": "soap", "nesterov": "yes"}}, "kfac.nesterov must be true or false, not 'yes'"),
    ({"kfac": {"nesterov": True}}, "kfac.nesterov is the look-ahead of kfac.update: soap's first moment"),
    ({"kfac": {"cov_micro_batches": 0}}, "kfac.cov_micro_batches must be an integer >= 1 or all, not 0"),
    ({"kfac": {"cov_micro_batches": "half"}}, "kfac.cov_micro_batches must be an integer >= 1 or all, not 'half'"),
    ({"kfac": {"cov_micro_batches": 5}, "data": {"num_micro_batches": 4}},
     "kfac.cov_micro_batches 5 is more than the step's 4 micro-batches"),
    ({"kfac": {"factor_decay": 1.0}}, "and kfac.factor_decay in"),
    ({"kfac": {"update": "soap", "factor_decay": "long"}}, "and kfac.factor_decay in"),
    ({"kfac": {"update": "soap", "factor_decay_per_step": 1.0}}, "kfac.factor_decay_per_step must be in .0, 1., not 1.0"),
    ({"kfac": {"factor_decay_per_step": 0.8}}, "kfac.factor_decay_per_step weighs the factors of kfac.update: soap"),
    ({"kfac": {"update": "soap", "factor_decay": 0.5, "factor_decay_per_step": 0.8}},
     "kfac.factor_decay (per refresh) and kfac.factor_decay_per_step both set: keep one"),
    ({"kfac": {"update": "adam"}}, "kfac.update must be one of base, momentum, soap"),
    ({"kfac": {"update": "soap", "kl_clip": 0.001}}, "kfac.kl_clip bounds a preconditioned step"),
    ({"kfac": {"update": "soap", "inverse": "eigen"}}, "kfac.inverse: eigen chooses how a damped inverse"),
])
def test_bad_configs_are_input_errors(raw, problem):
    with pytest.raises(InputError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(raw, "c.yaml")


@pytest.mark.parametrize("raw,problem", [
    ({"model": {"builder": "mymodel.build"}}, "model.builder must be 'package.module:function'"),
    ({"model": {"builder": ":build"}}, "model.builder must be 'package.module:function'"),
    ({"model": {"builder": 3}}, "model.builder must be a str"),
    ({"model": {"options": [1, 2]}}, "model.options must be a mapping"),
    ({"data": {"objective": "seq2seq"}}, "data.objective must be one of mlm, clm"),
    ({"data": {"objective": "clm", "seq_len": 1}}, "data.objective clm needs data.seq_len >= 2"),
])
def test_bad_builder_options_and_objective_are_one_line_input_errors(raw, problem):
    with pytest.raises(InputError, match=problem) as err:
        config_from_dict(raw, "c.yaml")
    assert str(err.value).startswith("c.yaml: ") and "\n" not in str(err.value)


def test_builder_defaults_to_bert_and_options_pass_through_untouched():
    cfg = config_from_dict({"model": {"builder": "pkg.mod:build", "options": {"depth_mult": 2, "act": "relu",
                                                                              "nested": {"k": [1, 2]}}}})
    assert RunConfig().model.builder == "pipefisher.runtime.models.bert:build_stage"
    assert RunConfig().data.objective == "mlm"
    assert cfg.model.builder == "pkg.mod:build"
    assert dict(cfg.model.options) == {"depth_mult": 2, "act": "relu", "nested": {"k": [1, 2]}}
    assert config_from_dict(cfg.to_dict()) == cfg  # the launcher's JSON round trip
    hash(cfg.model)  # stage layouts are cached by model config: options must not make it unhashable
    assert hash(cfg.replace(model={"options": {"depth_mult": 2}}).model) != hash(cfg.model)
    assert cfg.fingerprint() != cfg.replace(model={"options": {"depth_mult": 3}}).fingerprint()


@pytest.mark.parametrize("old, new", [("pipefisher.runtime.model:build_stage", "pipefisher.runtime.models.bert:build_stage"),
                                      ("pipefisher.runtime.hf:gpt2_clm", "pipefisher.runtime.models.hf:gpt2_clm")])
def test_the_built_in_builders_old_names_still_name_them(old, new):
    """Configs, checkpoints and schedule metadata written before the runtime's layers name the built-in
    builders by their old modules; they load, resume and match as the same builders."""
    from pipefisher.runtime.train.checkpoint import _config_for_compare

    cfg = config_from_dict({"model": {"builder": old}})
    assert cfg.model.builder == new
    assert apply_overrides(RunConfig(), [f"model.builder={old}"]).model.builder == new
    assert _config_for_compare({"model": {"builder": old}}) == _config_for_compare({"model": {"builder": new}})


def test_a_schedule_packed_for_the_old_default_builder_fits_the_default_model():
    from pipefisher.runtime.pipeline.checks import schedule_mismatch

    assert schedule_mismatch({"model.builder": "pipefisher.runtime.model:build_stage"}, RunConfig()) is None
    assert schedule_mismatch({"model.builder": "pkg.mod:build"}, RunConfig()) is not None


def test_a_schedules_metadata_with_the_old_order_key_is_still_checked():
    """``packed_for`` recorded ``pipeline.schedule`` before it was ``pipeline.order``."""
    from pipefisher.runtime.pipeline.checks import packed_for, schedule_mismatch

    assert packed_for(RunConfig())["pipeline.order"] == "1f1b" and "pipeline.schedule" not in packed_for(RunConfig())
    assert schedule_mismatch({"pipeline.schedule": "1f1b"}, RunConfig()) is None
    assert "pipeline.order" in schedule_mismatch({"pipeline.schedule": "gpipe"}, RunConfig())


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


def test_set_overrides_are_read_as_yaml_and_applied():
    from pipefisher.runtime.job.config import apply_overrides, parse_override

    assert parse_override("optim.lr=0.01") == ("optim.lr", 0.01)
    assert parse_override("optim.lr=1e-3") == ("optim.lr", 1e-3)  # YAML 1.1 would say '1e-3'
    assert parse_override("data.seed=3") == ("data.seed", 3)
    assert parse_override("optim.betas=[0.9, 0.98]") == ("optim.betas", [0.9, 0.98])
    assert parse_override("data.text=2024") == ("data.text", "2024")  # a str field takes what was typed
    assert parse_override("name=exp-1") == ("name", "exp-1")
    cfg = apply_overrides(load_config(TINY), ["optim.lr=0.01", "data.seed=3", "data.seed=4", "kfac.ignore=[cls]"],
                          TINY)
    assert (cfg.optim.lr, cfg.data.seed, cfg.kfac.ignore) == (0.01, 4, ("cls",))  # later ones win
    assert cfg == load_config(TINY).replace(optim={"lr": 0.01}, data={"seed": 4}, kfac={"ignore": ("cls",)})


@pytest.mark.parametrize("text,problem", [
    ("optim.lrr=0.1", "--set optim.lrr=0.1: unknown key 'lrr' in 'optim' (one of name, lr,"),
    ("optimizer.lr=0.1", "--set optimizer.lr=0.1: unknown config section 'optimizer'"),
    ("optim.lr", "--set optim.lr: expected SECTION.KEY=VALUE"),
    ("optim.lr=fast", "--set optim.lr=fast: optim.lr must be a float, not 'fast'"),
    ("data.seed=1.5", "--set data.seed=1.5: data.seed must be a int, not 1.5"),
    ("optim.betas=0.9", "--set optim.betas=0.9: optim.betas must be a list"),
    ("optim.lr=[1", "--set optim.lr=[1: the value is not valid YAML"),
    ("run.steps=3", "--set run.steps=3: run.steps is a run setting, not the config's: its flag sets it"),
    ("checkpoint.every=3", "--set checkpoint.every=3: checkpoint.every is a run setting"),
])
def test_bad_set_overrides_name_the_option_and_key(text, problem):
    from pipefisher.runtime.job.config import apply_overrides

    with pytest.raises(InputError) as err:
        apply_overrides(load_config(TINY), [text], TINY)
    assert str(err.value).startswith(problem)


def test_set_overrides_are_checked_with_the_file_like_the_file():
    from pipefisher.runtime.job.config import apply_overrides

    with pytest.raises(InputError) as err:
        apply_overrides(load_config(TINY), ["pipeline.stages=8"], TINY)
    assert str(err.value) == (f"{TINY} with --set pipeline.stages=8: pipeline.stages must be between 1 and "
                              "model.num_layers")


def test_a_string_setting_given_a_number_is_an_input_error_not_a_crash():
    with pytest.raises(InputError, match=r"data.text must be a str, not 5"):
        config_from_dict({"data": {"text": 5}}, "c.yaml")


def test_cli_set_is_applied_and_recorded_in_the_config_the_run_writes(tmp_path):
    from click.testing import CliRunner

    from pipefisher.cli import main

    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--steps", "1", "--no-progress",
                                    "--set", "optim.lr=0.05", "--set", "data.seed=3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert load_config(out / "tiny_config.yaml") == load_config(TINY).replace(
        optim={"lr": 0.05}, data={"seed": 3}, pipeline={"stages": 1})
    for command in (["train"], ["run", "--out", str(tmp_path / "runs")]):
        res = CliRunner().invoke(main, [*command, "--config", TINY, "--set", "optim.lrr=0.05", "--no-progress"])
        assert res.exit_code == 2, res.output
        assert res.output.startswith("error: --set optim.lrr=0.05: unknown key 'lrr' in 'optim'")
        assert res.output.count("\n") == 1


@pytest.mark.parametrize("section, key, value, problem", [
    ("train", "precision", "fp8", "train.precision must be one of fp32, bf16"),
    ("train", "recompute", "all", "train.recompute must be one of none, layer"),
    ("data", "dataset", "csv", "data.dataset must be one of text, json, parquet"),
    ("data", "builder", "nocolon", "data.builder must be 'package.module:function'"),
    ("checkpoint", "keep", 0, r"checkpoint.keep must be an integer >= 1 \(the newest checkpoints a run keeps\)"),
    ("checkpoint", "on_interrupt", "later", "checkpoint.on_interrupt must be true or false"),
])
def test_new_training_keys_are_checked_in_one_line(section, key, value, problem):
    with pytest.raises(InputError, match=problem):
        config_from_dict({section: {key: value}}, "run.yaml")


@pytest.mark.parametrize("optim, problem", [
    ({"muon_exclude": ["cls", ""]}, "optim.muon_exclude must list parameter-name parts"),
    ({"muon_include": [" encoder"]}, "optim.muon_include must list parameter-name parts"),
    ({"muon_include": "encoder"}, "optim.muon_include must be a list"),
    ({"muon_momentum": 1.0}, r"optim.muon_momentum must be in \[0, 1\)"),
    ({"name": "shampoo"}, "optim.name must be one of adamw, lamb, sgd, adam, muon"),
])
def test_muon_keys_are_checked_in_one_line(optim, problem):
    with pytest.raises(InputError, match=problem):
        config_from_dict({"optim": {"name": "muon", **optim}}, "run.yaml")


def test_muon_keys_read_from_yaml_and_set():
    cfg = config_from_dict({"optim": {"name": "muon", "muon_include": ["encoder"], "muon_exclude": []}})
    assert cfg.optim.muon_include == ("encoder",) and cfg.optim.muon_exclude == ()
    cfg = apply_overrides(cfg, ["optim.muon_exclude=[cls, lm_head]", "optim.muon_momentum=0.9"])
    assert cfg.optim.muon_exclude == ("cls", "lm_head") and cfg.optim.muon_momentum == 0.9


def test_a_data_builder_is_not_silently_replaced_by_synthetic_tokens():
    with pytest.raises(InputError, match="data.builder gives the documents"):
        config_from_dict({"data": {"builder": "docs:all", "text": "synthetic"}}, "run.yaml")
    assert config_from_dict({"data": {"builder": "docs:all"}}).data.builder == "docs:all"


def test_the_renamed_keys_still_read_saying_the_new_names_and_keep_the_configs_identity(tmp_path, capsys):
    """``pipeline.schedule`` is ``pipeline.order`` and ``optim.schedule`` ``optim.lr_schedule``: a file or
    ``--set`` with an old name gives the same config with one notice line each; both names at once are
    refused; the fingerprint (which checkpoints, schedules and staleness curves recorded) is the one the
    config had before the rename (tiny.yaml's, computed by the code of the commit before it)."""
    new = load_config(TINY)
    assert (new.fingerprint(), new.fingerprint(layout=False)) == ("95b500ae9af202f8", "ff151e767555e152")
    assert capsys.readouterr().err == ""
    old = tmp_path / "old.yaml"
    with open(TINY) as f:
        text = f.read()
    old.write_text(text.replace("pipeline: {stages: 2, order:", "pipeline: {stages: 2, schedule:")
                   .replace("weight_decay: 0.0}", "weight_decay: 0.0, schedule: cosine}"))
    cfg = load_config(old)
    assert cfg == new.replace(optim={"lr_schedule": "cosine"}) and cfg.pipeline.order == new.pipeline.order
    assert capsys.readouterr().err == (f"note: {old}: pipeline.schedule is now pipeline.order (the old name still works)\n"
                                       f"note: {old}: optim.schedule is now optim.lr_schedule (the old name still "
                                       "works)\n")
    assert apply_overrides(new, ["pipeline.schedule=gpipe"]).pipeline.order == "gpipe"
    assert "--set pipeline.schedule is now --set pipeline.order" in capsys.readouterr().err
    with pytest.raises(InputError, match="has both pipeline.schedule and pipeline.order"):
        config_from_dict({"pipeline": {"schedule": "gpipe", "order": "1f1b"}}, "x.yaml")


def test_cov_micro_batches_takes_a_count_or_all_from_set():
    """``--set kfac.cov_micro_batches=2`` is the count 2 (not the text '2' its default's type would make it)."""
    cfg = apply_overrides(RunConfig(), ["kfac.cov_micro_batches=2"])
    assert cfg.kfac.cov_micro_batches == 2
    assert apply_overrides(cfg, ["kfac.cov_micro_batches=all"]).kfac.cov_micro_batches == "all"


def test_an_unset_factor_decay_digests_as_the_0_it_was_except_under_soap():
    """A base config keeps the digest it had before ``kfac.factor_decay`` could be unset (unset is 0 for
    inverses); under soap, unset is the per-step default (:func:`factor_decay_of`), another config than
    soap at 0 (its old digest) or at any one value per refresh."""
    base = load_config(TINY)
    assert base.kfac.factor_decay is None
    assert base.fingerprint() == base.replace(kfac={"factor_decay": 0.0}).fingerprint() == "95b500ae9af202f8"
    soap = base.replace(kfac={"update": "soap"})
    assert soap.fingerprint() not in {soap.replace(kfac={"factor_decay": d}).fingerprint() for d in (0, 0.5, 0.8)}
    assert apply_overrides(base, ["kfac.factor_decay=0.9"]).kfac.factor_decay == 0.9
    assert config_from_dict(soap.to_dict()) == soap  # unset stays unset through the launcher's JSON


def test_soaps_weight_per_step_is_part_of_its_digest_and_of_no_other():
    """``kfac.factor_decay_per_step`` came later: unset under soap it is SOAP's 0.95 and digests as 0.95
    written out; another weight is another config; outside soap it does not exist (refused), so a base
    config keeps its digest."""
    base = load_config(TINY)
    assert base.kfac.factor_decay_per_step is None and base.fingerprint() == "95b500ae9af202f8"
    soap = base.replace(kfac={"update": "soap"})
    assert soap.fingerprint() == soap.replace(kfac={"factor_decay_per_step": 0.95}).fingerprint()
    assert soap.fingerprint() != soap.replace(kfac={"factor_decay_per_step": 0.8}).fingerprint()
    assert apply_overrides(soap, ["kfac.factor_decay_per_step=0.8"]).kfac.factor_decay_per_step == 0.8


def test_soaps_look_ahead_is_part_of_its_digest_and_of_no_other():
    """``kfac.nesterov`` came later, off by default (SOAP's plain Adam, the update soap ran before it): off,
    every config keeps its digest, soap's included; on, a soap config is another config; on outside
    soap is refused in one line."""
    base = load_config(TINY)
    assert base.kfac.nesterov is False and base.fingerprint() == "95b500ae9af202f8"
    soap = base.replace(kfac={"update": "soap"})
    assert soap.fingerprint() == "d06a5a61f745fc0b"  # soap's digest before the setting
    assert soap.replace(kfac={"nesterov": True}).fingerprint() != soap.fingerprint()
    assert apply_overrides(soap, ["kfac.nesterov=true"]).kfac.nesterov is True


def test_a_setting_added_later_changes_the_fingerprint_only_away_from_its_default():
    """``kfac.cov_micro_batches`` came after fingerprints were recorded: at ``all`` a config keeps the
    digest it had (checkpoints and staleness curves still match it); any other value is another config."""
    base = load_config(TINY)
    assert base.fingerprint() == "95b500ae9af202f8"
    assert base.replace(kfac={"cov_micro_batches": "all"}).fingerprint() == base.fingerprint()
    assert base.replace(kfac={"cov_micro_batches": 1}).fingerprint() != base.fingerprint()
    soap = base.replace(kfac={"update": "soap"})  # kfac.basis_block came later still
    assert soap.replace(kfac={"basis_block": 0}).fingerprint() == soap.fingerprint()
    assert soap.replace(kfac={"basis_block": 128}).fingerprint() != soap.fingerprint()
    assert soap.replace(kfac={"rotation_dtype": "float32"}).fingerprint() == soap.fingerprint()
    assert soap.replace(kfac={"rotation_dtype": "bfloat16"}).fingerprint() != soap.fingerprint()


def test_a_config_file_holds_the_run_settings_as_sections_beside_the_configs_own(tmp_path):
    """``run:``, ``log:``, ``evaluation:``, ``adapt:`` and ``checkpoint:`` (merged with the config's
    keep/on_interrupt) read as the flags they mirror; the config itself and its digest do not change."""
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nrun: {steps: 3, mode: kfac}\nlog: {every: 2, metrics: m.csv, progress: false}\n"
                    "evaluation: {every: 1}\ncheckpoint: {keep: 2, folder: ck, every: 1}\n"
                    "adapt: {enabled: true, policy: tight, staleness: s.json}\n")
    assert load_settings(path) == {"steps": 3, "mode": "kfac", "log_every": 2, "metrics": "m.csv", "progress": False,
                                   "eval_every": 1, "checkpoint_dir": "ck", "checkpoint_every": 1, "adapt": True,
                                   "adapt_policy": "tight", "staleness": "s.json"}
    cfg = load_config(path)
    assert cfg.checkpoint.keep == 2
    assert cfg.fingerprint() == RunConfig(name="t", checkpoint=cfg.checkpoint).fingerprint()


@pytest.mark.parametrize("text, says", [
    ("run: {steps: 0}", "run.steps must be at least 1, not 0"),
    ("run: {steps: many}", "run.steps must be an int, not 'many'"),
    ("log: {every: 0}", "log.every must be at least 1 step, not 0"),
    ("evaluation: {every: -1}", "evaluation.every must be at least 0 steps, not -1"),
    ("checkpoint: {folder: 3}", "checkpoint.folder must be a str or null, not 3"),
    ("checkpoint: {evry: 1}", "unknown key(s) in 'checkpoint': evry (one of keep, on_interrupt, folder, every"),
    ("adapt: {aging_low: 2.0}", "adapt.aging_low < adapt.aging_high"),
    ("adapt: {margin: 20}", "adapt.margin must be in [0, 10), not 20.0"),
    ("log: 5", "section 'log' must be a mapping"),
])
def test_a_bad_run_setting_is_one_line_naming_the_file_and_the_key(tmp_path, text, says):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    for read in (load_settings, load_config):
        with pytest.raises(InputError) as err:
            read(path)
        assert str(err.value).startswith(f"{path}: ") and says in str(err.value) and "\n" not in str(err.value)


def test_a_settings_combination_the_flags_may_complete_is_left_to_the_command():
    """``run.mode: scheduled`` needs a schedule, which ``--schedule`` may give: checked once merged."""
    assert split_settings({"run": {"mode": "scheduled"}, "adapt": {"drift": True}})[1] == \
        {"mode": "scheduled", "adapt_drift": True}
