"""Hugging Face stage builders: a split model computes what the unsplit transformers model computes."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from pipefisher.errors import InputError
from pipefisher.runtime.models import hf
from pipefisher.runtime.job.config import ModelConfig, RunConfig

TINY = ModelConfig(vocab_size=40, hidden_size=16, num_layers=4, num_heads=2, intermediate_size=32,
                   max_position=12, dropout=0.0)
LLAMA = dataclasses.replace(TINY, num_heads=4, layer_norm_eps=1e-6, options={"num_key_value_heads": 2})
"""A Llama with grouped-query attention: 4 query heads share 2 key/value heads."""
SEED = 3
BUILDERS = {"bert": hf.bert_mlm, "gpt2": hf.gpt2_clm, "llama": hf.llama_clm}
MODELS = {"bert": TINY, "gpt2": TINY, "llama": LLAMA}


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, our labels, and the labels transformers' own model takes for the same loss."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, TINY.vocab_size, (3, 10), generator=g)
    if kind == "bert":
        labels = torch.where(torch.rand(x.shape, generator=g) < 0.3, x, torch.full_like(x, -100))
        labels[0, 0] = x[0, 0]  # at least one target
        return x, labels, labels
    # data.objective clm: labels are already the next tokens; transformers shifts its labels itself.
    return x, torch.cat([x[:, 1:], torch.full((3, 1), -100)], 1), x


def chain(stages: list[torch.nn.Module], x: torch.Tensor, labels: torch.Tensor | None = None,
          sample: torch.Generator | None = None):
    h = x
    for stage in stages[:-1]:
        h = stage(h)
    return stages[-1](h, labels, sample)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_split_model_matches_unsplit_transformers_model(transformers, kind: str) -> None:
    # The reference is transformers' own model class under the seed, built without our helpers.
    model = MODELS[kind]
    config = hf.hf_config(model, kind)
    torch.manual_seed(SEED)
    ref = getattr(transformers, hf.KINDS[kind])(config)
    if kind == "bert":
        ref.cls.predictions.decoder.bias = ref.cls.predictions.bias
    x, labels, ref_labels = batch(kind)
    ref_loss = ref(input_ids=x, labels=ref_labels).loss
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for num_stages in (2, 4):
        before = torch.random.get_rng_state()
        stages = [BUILDERS[kind](RunConfig(model=model), i, num_stages, SEED) for i in range(num_stages)]
        assert torch.equal(torch.random.get_rng_state(), before)  # building leaves the caller's RNG alone
        assert [s.is_first for s in stages] == [True] + [False] * (num_stages - 1)
        assert [s.is_last for s in stages] == [False] * (num_stages - 1) + [True]
        loss = chain(stages, x, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        seen = []
        for stage in stages:
            assert stage.hidden_size == TINY.hidden_size
            for name, p in stage.named_parameters():
                seen.append(name)
                assert torch.equal(p.detach(), ref_params[name].detach()), name
                torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6, msg=name)
        assert sorted(seen) == sorted(ref_params)  # every parameter on exactly one stage
        logits = chain(stages, x)
        torch.testing.assert_close(logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_sample_path_returns_two_finite_losses(transformers, kind: str) -> None:
    stages = [BUILDERS[kind](RunConfig(model=MODELS[kind]), i, 2, SEED) for i in range(2)]
    x, labels, _ = batch(kind)
    loss, sampled = chain(stages, x, labels, torch.Generator().manual_seed(0))
    assert loss.ndim == sampled.ndim == 0 and torch.isfinite(loss) and torch.isfinite(sampled)
    assert sampled.requires_grad
    torch.testing.assert_close(loss, chain(stages, x, labels))


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_stages_pass_transformers_no_deprecated_argument(transformers, kind: str, monkeypatch) -> None:
    """transformers 5.24 renamed ``past_key_values`` -> ``cache`` (mask helpers, layers) and warns on the
    old name: 8 lines per Llama run. The stages name neither (it is None), so no release in between warns:
    every name they pass is recorded, and a forward/backward raises on any transformers warning."""
    import warnings

    from transformers import masking_utils

    named: list[str] = []
    for helper in ("create_causal_mask", "create_bidirectional_mask"):
        real = getattr(masking_utils, helper)
        monkeypatch.setattr(masking_utils, helper, lambda *a, _real=real, **kw: named.extend(kw) or _real(*a, **kw))
    stages = [BUILDERS[kind](RunConfig(model=MODELS[kind]), i, 2, SEED) for i in range(2)]
    for stage in stages:
        for block in stage.modules():
            if type(block).__name__ in ("BertLayer", "GPT2Block", "LlamaDecoderLayer"):
                block.register_forward_pre_hook(lambda m, a, kw: named.extend(kw), with_kwargs=True)
    x, labels, _ = batch(kind)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=FutureWarning)
        warnings.filterwarnings("error", category=DeprecationWarning, module="transformers")
        chain(stages, x, labels).backward()
    assert named and "past_key_values" not in named and "cache" not in named


def test_module_names_are_transformers_names(transformers) -> None:
    cfg = RunConfig(model=TINY)
    bert = dict(hf.bert_mlm(cfg, 1, 2, SEED).named_modules())
    assert "bert.encoder.layer.3.attention.self.query" in bert and "cls.predictions.decoder" in bert
    assert "bert.encoder.layer.1.attention.self.query" not in bert and "bert.embeddings" not in bert
    gpt2 = dict(hf.gpt2_clm(cfg, 0, 2, SEED).named_modules())
    assert {"transformer.wte", "transformer.wpe", "transformer.h.1.attn.c_attn", "transformer.h.0.mlp.c_fc"} <= set(gpt2)
    assert "lm_head" not in gpt2 and "transformer.h.2.attn.c_attn" not in gpt2
    assert "lm_head" in dict(hf.gpt2_clm(cfg, 1, 2, SEED).named_modules())
    llama = dict(hf.llama_clm(RunConfig(model=LLAMA), 1, 2, SEED).named_modules())
    assert {"model.layers.2.self_attn.k_proj", "model.layers.3.mlp.gate_proj", "model.norm", "lm_head"} <= set(llama)
    assert "model.embed_tokens" not in llama and "model.layers.1.mlp.up_proj" not in llama


def test_k_fac_covers_every_projection_of_a_llama(transformers) -> None:
    """Grouped-query attention's narrower k/v projections and the gated MLP's three are plain Linear
    layers: K-FAC takes all seven of each layer; RMSNorm, embeddings and the ignored head are first-order."""
    from pipefisher.kfac.kfac import coverage

    stages = [hf.llama_clm(RunConfig(model=LLAMA), i, 2, SEED) for i in range(2)]
    covered = [coverage(s, ("lm_head",)) for s in stages]
    assert [c.line(f"stage {i}") for i, c in enumerate(covered)] == [
        "K-FAC covers 14 layers (14 Linear) on stage 0; first-order only: Embedding (1), LlamaRMSNorm (4)",
        "K-FAC covers 14 layers (14 Linear) on stage 1; first-order only: LlamaRMSNorm (5); ignored by "
        "kfac.ignore: lm_head"]
    assert stages[0].model.layers["0"].self_attn.k_proj.weight.shape == (8, 16)  # 2 of 4 heads' width


def test_a_key_value_head_count_that_does_not_divide_the_heads_is_one_line(transformers) -> None:
    bad = dataclasses.replace(LLAMA, options={"num_key_value_heads": 3})
    with pytest.raises(InputError, match=r"^model.options.num_key_value_heads must be a positive integer that "
                                         r"divides model.num_heads \(4\), not 3$"):
        hf.llama_clm(RunConfig(model=bad), 0, 2, SEED)


@pytest.mark.parametrize("builder", [hf.bert_mlm, hf.gpt2_clm])
def test_missing_transformers_is_one_line_input_error(monkeypatch, builder) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees when absent
    with pytest.raises(InputError) as err:
        builder(RunConfig(model=TINY), 0, 2, SEED)
    assert str(err.value) == ("the Hugging Face models need transformers: pip install 'pipefisher[hf]' "
                              "(in a clone: pip install -c constraints.txt -e '.[hf]')")


def test_too_old_transformers_is_one_line_input_error(transformers, monkeypatch) -> None:
    # Older releases call their blocks and mask helpers differently: refuse them before building.
    # (Building a model can swap the module object in sys.modules: patch the one imports see now.)
    transformers = sys.modules["transformers"]
    monkeypatch.setattr(transformers, "__version__", "5.0.0")
    with pytest.raises(InputError, match=r"need transformers>=5\.23, found 5\.0\.0: pip install -U"):
        hf.gpt2_clm(RunConfig(model=TINY), 0, 2, SEED)
    monkeypatch.setattr(transformers, "__version__", "5.23.0.dev0")
    hf.gpt2_clm(RunConfig(model=TINY), 0, 2, SEED)


def test_train_without_transformers_is_refused_before_any_worker_starts(monkeypatch) -> None:
    from click.testing import CliRunner

    from pipefisher.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the hf extra were not installed
    res = CliRunner().invoke(main, ["train", "--config", "configs/hf-gpt2-small.yaml", "--set", "data.text=synthetic",
                                    "--nproc-per-node", "2", "--steps", "1", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output.count("\n") == 1 and "pip install 'pipefisher[hf]'" in res.output
    assert "worker" not in res.output  # the parent said it: no worker was spawned
