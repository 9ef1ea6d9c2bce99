"""First-order optimizers: AdamW and LAMB against hand computations, Muon with AdamW as torch's own
updates, the learning-rate schedule and global-norm clipping (one process and pipelines over gloo)."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from pipefisher.runtime.job.config import OptimConfig
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.train.optim import (Lamb, LRSchedule, clip_grad_norm, lr_factor, make_optimizer, muon_split,
                                            no_decay, param_groups)


class Tiny(nn.Module):
    """A weight matrix, its bias and a LayerNorm: one parameter of each weight-decay kind."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(2, 1)
        self.LayerNorm = nn.LayerNorm(1)
        with torch.no_grad():
            self.dense.weight.copy_(torch.tensor([[1.0, -2.0]]))
            self.dense.bias.copy_(torch.tensor([0.5]))
            self.LayerNorm.weight.copy_(torch.tensor([1.5]))
            self.LayerNorm.bias.copy_(torch.tensor([0.0]))


def tiny() -> Tiny:
    return Tiny().double()  # float64, so hand computations agree to ~1e-15


def adam_hand(p: list[float], grads: list[list[float]], lr: float, b1: float, b2: float, eps: float,
              wd: float) -> list[float]:
    """AdamW (Loshchilov & Hutter) element by element: decoupled decay, bias-corrected moments."""
    m, v = [0.0] * len(p), [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        for i in range(len(p)):
            p[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            p[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
    return p


def lamb_hand(p: list[float], grads: list[list[float]], lr: float, b1: float, b2: float, eps: float,
              wd: float) -> list[float]:
    """LAMB (You et al. 2020, Algorithm 2) for one tensor: Adam direction plus decay, times ||p|| / ||u||."""
    m, v = [0.0] * len(p), [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        u = []
        for i in range(len(p)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            u.append(m[i] / (1 - b1 ** t) / (math.sqrt(v[i] / (1 - b2 ** t)) + eps) + wd * p[i])
        w_norm, u_norm = math.sqrt(sum(x * x for x in p)), math.sqrt(sum(x * x for x in u))
        r = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        p = [x - lr * r * y for x, y in zip(p, u)]
    return p


GRADS = {"dense.weight": [[0.5, -0.25], [1.0, 0.75], [-0.5, 2.0]],
         "dense.bias": [[0.1], [-0.3], [0.2]],
         "LayerNorm.weight": [[0.4], [0.4], [-1.0]],
         "LayerNorm.bias": [[-0.2], [0.0], [0.6]]}


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, grads: dict[str, list[list[float]]]) -> None:
    params = dict(model.named_parameters())
    for t in range(len(next(iter(grads.values())))):
        for name, p in params.items():
            p.grad = torch.tensor(grads[name][t], dtype=p.dtype).reshape(p.shape)
        opt.step()


def test_no_decay_exempts_biases_layernorm_and_1d_tensors():
    assert no_decay("encoder.layer.0.attention.output.dense.bias")
    assert no_decay("encoder.layer.0.output.LayerNorm.weight")
    assert not no_decay("encoder.layer.0.output.dense.weight")
    assert not no_decay("embeddings.word_embeddings.weight", torch.zeros(5, 3))
    assert no_decay("norm.weight", torch.zeros(3)) and not no_decay("norm.weight")  # 1-D: by the tensor


def test_param_groups_split_in_model_order_and_drop_empty_groups():
    m = tiny()
    groups = param_groups(m.named_parameters(), 0.1)
    assert [g["group"] for g in groups] == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"] == [m.dense.weight]
    assert groups[1]["params"] == [m.dense.bias, m.LayerNorm.weight, m.LayerNorm.bias]
    only_norms = param_groups(m.LayerNorm.named_parameters(prefix="LayerNorm"), 0.1)
    assert [g["group"] for g in only_norms] == ["no_decay"]
    tied = param_groups([("a.weight", m.dense.weight), ("b.weight", m.dense.weight)], 0.1)
    assert tied[0]["params"] == [m.dense.weight]  # a tied weight once: torch refuses duplicates


def test_adamw_equals_hand_computation_and_spares_biases_and_layernorm():
    cfg = OptimConfig(name="adamw", lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.5)
    m = tiny()
    start = {n: p.detach().flatten().tolist() for n, p in m.named_parameters()}
    opt = make_optimizer(cfg, m.named_parameters())
    assert isinstance(opt, torch.optim.AdamW)
    run_steps(m, opt, GRADS)
    for name, p in m.named_parameters():
        wd = 0.5 if name == "dense.weight" else 0.0
        want = adam_hand(list(start[name]), GRADS[name], 0.1, 0.9, 0.99, 1e-8, wd)
        assert p.detach().flatten().tolist() == pytest.approx(want, rel=1e-12, abs=1e-15), name


def test_decay_reaches_only_the_decay_group():
    """With zero gradients the Adam step is 0, so what moves is the weight decay alone."""
    kinds = {"adamw": torch.optim.AdamW, "lamb": Lamb, "sgd": torch.optim.SGD, "adam": torch.optim.Adam}
    for name, kind in kinds.items():
        m = tiny()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt = make_optimizer(OptimConfig(name=name, lr=0.1, weight_decay=0.5, momentum=0.0), m.named_parameters())
        assert type(opt) is kind
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for n, p in m.named_parameters():
            if n != "dense.weight":
                assert torch.equal(p, before[n]), (name, n)
        if name in ("adamw", "sgd"):  # p - lr * wd * p: decoupled for AdamW, an L2 gradient for SGD
            assert torch.allclose(m.dense.weight, before["dense.weight"] * 0.95, rtol=1e-15), name
        else:  # Adam normalises its L2 gradient; LAMB's trust ratio makes the step lr * ||p||
            assert not torch.equal(m.dense.weight, before["dense.weight"]), name


def test_lamb_equals_hand_computation_with_decay_and_trust_ratio():
    cfg = OptimConfig(name="lamb", lr=0.05, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.3)
    m = tiny()
    start = {n: p.detach().flatten().tolist() for n, p in m.named_parameters()}
    opt = make_optimizer(cfg, m.named_parameters())
    assert isinstance(opt, Lamb)
    run_steps(m, opt, GRADS)
    for name, p in m.named_parameters():
        wd = 0.3 if name == "dense.weight" else 0.0
        want = lamb_hand(list(start[name]), GRADS[name], 0.05, 0.9, 0.999, 1e-6, wd)
        assert p.detach().flatten().tolist() == pytest.approx(want, rel=1e-12, abs=1e-15), name
    # The weight matrix moved by exactly lr * ||p|| on the first step (trust ratio): check one step.
    m2 = tiny()
    w0 = m2.dense.weight.detach().clone()
    opt2 = Lamb([m2.dense.weight], lr=0.05, weight_decay=0.3)
    m2.dense.weight.grad = torch.tensor([[0.5, -0.25]], dtype=torch.float64)
    opt2.step()
    assert float((m2.dense.weight.detach() - w0).norm()) == pytest.approx(0.05 * float(w0.norm()), rel=1e-12)


def test_lamb_zero_norms_take_a_trust_ratio_of_one():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # a fresh bias: ||p|| = 0
    still = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))  # ||u|| = 0: no gradient, no decay
    opt = Lamb([p, still], lr=0.1, eps=1e-6)
    p.grad = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    still.grad = torch.zeros(2, dtype=torch.float64)
    opt.step()
    assert p.tolist() == pytest.approx(lamb_hand([0.0] * 3, [[1.0, -2.0, 0.0]], 0.1, 0.9, 0.999, 1e-6, 0.0),
                                       rel=1e-12, abs=1e-15)
    assert p.tolist() == pytest.approx([-0.1, 0.1, 0.0], rel=1e-5)  # a plain Adam step: lr * sign(g)
    assert still.tolist() == [1.0, 2.0]


def test_lamb_state_dict_round_trip_continues_bit_exactly():
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 3)

    def make() -> nn.Sequential:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3))

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    cfg = OptimConfig(name="lamb", lr=0.01, weight_decay=0.01)
    a = make()
    opt_a = make_optimizer(cfg, a.named_parameters())
    train(a, opt_a, 3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert [g["group"] for g in saved["optim"]["param_groups"]] == ["decay", "no_decay"]
    b = make()
    b.load_state_dict(saved["model"])
    opt_b = make_optimizer(cfg, b.named_parameters())
    opt_b.load_state_dict(saved["optim"])
    train(a, opt_a, 3)
    train(b, opt_b, 3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[pa][key], opt_b.state[pb][key]), (name, key)


def test_empty_parameter_list_still_gives_an_optimizer():
    """A stage whose every parameter K-FAC updates itself still gets an lr and a no-op step."""
    opt = make_optimizer(OptimConfig(), [])
    LRSchedule(OptimConfig(lr=0.2), 10).apply(opt, 0)
    assert opt.param_groups[0]["lr"] == 0.2
    opt.step()


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_factor_warms_up_linearly_from_the_first_step(schedule):
    f = [lr_factor(s, warmup_steps=4, total_steps=10, lr_schedule=schedule, min_lr_ratio=0.1) for s in range(4)]
    assert f == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, warmup_steps=4, total_steps=10, lr_schedule=schedule, min_lr_ratio=0.1) == 1.0


def test_lr_factor_decays_to_the_floor_at_total_steps_and_stays():
    kw = dict(warmup_steps=4, total_steps=10, min_lr_ratio=0.1)
    # progress = (step - 4) / 6
    assert lr_factor(7, lr_schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(9, lr_schedule="linear", **kw) == pytest.approx(0.1 + 0.9 / 6)  # the last step still moves
    assert lr_factor(7, lr_schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(5, lr_schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 6)))
    for schedule in ("linear", "cosine"):
        assert lr_factor(10, lr_schedule=schedule, **kw) == pytest.approx(0.1)
        assert lr_factor(1000, lr_schedule=schedule, **kw) == pytest.approx(0.1)
    assert lr_factor(1000, lr_schedule="constant", **kw) == 1.0
    assert lr_factor(10, lr_schedule="linear", warmup_steps=4, total_steps=10, min_lr_ratio=0.0) == 0.0


def test_lr_factor_without_warmup_starts_at_the_peak():
    assert lr_factor(0, warmup_steps=0, total_steps=4, lr_schedule="linear", min_lr_ratio=0.0) == 1.0
    assert lr_factor(2, warmup_steps=0, total_steps=4, lr_schedule="linear", min_lr_ratio=0.0) == 0.5
    assert lr_factor(0, warmup_steps=0, total_steps=0, lr_schedule="cosine", min_lr_ratio=0.2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, warmup_steps=0, total_steps=4, lr_schedule="step", min_lr_ratio=0.0)


def test_lr_schedule_sets_every_group_and_honours_decay_steps():
    cfg = OptimConfig(lr=0.4, warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.0)
    m = tiny()
    opt = make_optimizer(cfg, m.named_parameters())
    sched = LRSchedule(cfg, total_steps=6)
    assert sched.apply(opt, 0) == pytest.approx(0.2)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.2)] * 2
    sched.apply(opt, 4)  # progress (4 - 2) / 4
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.2)] * 2
    sched.apply(opt, 1, peak_lr=3.0)  # K-FAC's own peak, same shape
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(3.0)] * 2
    early = LRSchedule(OptimConfig(lr=0.4, warmup_steps=2, lr_schedule="linear", decay_steps=4), total_steps=100)
    assert early.total_steps == 4 and early.factor(4) == 0.0


def test_clip_grad_norm_scales_to_max_norm_and_returns_the_norm_before():
    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (2, 1, 3))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])  # c has no gradient
    assert clip_grad_norm([a, b, c], 6.5) == pytest.approx(13.0)
    scale = 6.5 / (13.0 + 1e-6)
    assert a.grad.tolist() == pytest.approx([3.0 * scale, 4.0 * scale])
    assert b.grad.tolist() == pytest.approx([12.0 * scale])
    before = a.grad.clone()
    assert clip_grad_norm([a], 100.0) == pytest.approx(5 * scale)
    assert torch.equal(a.grad, before)  # under the bound: untouched
    a.grad = torch.tensor([float("inf"), 1.0])
    assert clip_grad_norm([a, b], 1.0) == math.inf
    assert a.grad[1] == 1.0 and b.grad.item() == pytest.approx(12.0 * scale)  # nothing scaled


def _clip_two_stages() -> list[tuple[float, list[float]]]:
    """A 2-stage pipeline: stage 0 holds gradient (3, 4), stage 1 holds (12); then stage 1 has none."""
    import torch.distributed as dist

    from pipefisher.runtime.job.dist import join_process_group

    join_process_group("gloo")  # through the launcher's store (spawn_local)
    try:
        rank = dist.get_rank()
        pipe = dist.new_group([0, 1])
        p = nn.Parameter(torch.zeros(2 if rank == 0 else 1))
        p.grad = torch.tensor([3.0, 4.0]) if rank == 0 else torch.tensor([12.0])
        out = [(clip_grad_norm([p], 6.5, group=pipe), p.grad.tolist())]
        p.grad = torch.tensor([3.0, 4.0]) if rank == 0 else None
        out.append((clip_grad_norm([p], 1.0, group=pipe), [] if p.grad is None else p.grad.tolist()))
        return out
    finally:
        dist.destroy_process_group()


def test_clip_grad_norm_uses_the_global_norm_of_the_whole_pipeline():
    r0, r1 = spawn_local(_clip_two_stages, 2, timeout_s=60)
    scale = 6.5 / (13.0 + 1e-6)
    assert r0[0][0] == r1[0][0] == pytest.approx(13.0)  # sqrt(3^2 + 4^2 + 12^2), not 5 or 12
    assert r0[0][1] == pytest.approx([3.0 * scale, 4.0 * scale]) and r1[0][1] == pytest.approx([12.0 * scale])
    assert r0[1][0] == r1[1][0] == pytest.approx(5.0)  # a stage without gradients still joins
    assert r0[1][1] == pytest.approx([3.0 / (5.0 + 1e-6), 4.0 / (5.0 + 1e-6)]) and r1[1][1] == []


# ----------------------------------------------------------------------------------------------------
# Muon: torch's update on the hidden matrices, AdamW on the rest


def _named(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, nn.Parameter]]:
    return [(name, nn.Parameter(torch.zeros(shape))) for name, shape in shapes.items()]


BERT_NAMES = {"embeddings.word_embeddings.weight": (50, 8), "embeddings.LayerNorm.weight": (8,),
              "encoder.layer.0.attention.self.query.weight": (8, 8), "encoder.layer.0.attention.self.query.bias": (8,),
              "encoder.layer.0.intermediate.dense.weight": (16, 8), "encoder.layer.1.output.dense.weight": (8, 16),
              "cls.predictions.transform.dense.weight": (8, 8), "cls.predictions.decoder.weight": (50, 8)}
GPT2_NAMES = {"transformer.wte.weight": (50, 8), "transformer.wpe.weight": (16, 8),
              "transformer.h.0.attn.c_attn.weight": (8, 24), "transformer.h.0.ln_1.weight": (8,),
              "transformer.h.0.mlp.c_proj.weight": (32, 8), "lm_head.weight": (50, 8)}


def _split_names(shapes: dict[str, tuple[int, ...]], **optim) -> tuple[list[str], list[str]]:
    muon, rest = muon_split(_named(shapes), OptimConfig(name="muon", **optim))
    return [n for n, _ in muon], [n for n, _ in rest]


def test_muon_takes_the_hidden_matrices_and_leaves_embeddings_heads_biases_and_norms_to_adamw():
    muon, rest = _split_names(BERT_NAMES)
    assert muon == ["encoder.layer.0.attention.self.query.weight", "encoder.layer.0.intermediate.dense.weight",
                    "encoder.layer.1.output.dense.weight"]
    assert rest == ["embeddings.word_embeddings.weight", "embeddings.LayerNorm.weight",
                    "encoder.layer.0.attention.self.query.bias", "cls.predictions.transform.dense.weight",
                    "cls.predictions.decoder.weight"]
    muon, rest = _split_names(GPT2_NAMES)  # transformers' GPT-2: Conv1D matrices, wte/wpe/lm_head
    assert muon == ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.weight"]
    # Chimera's and interleaving's copies prefix the names (down./up., chunks.<j>.): the rule still holds
    muon, _ = _split_names({"chunks.1.cls.predictions.decoder.weight": (50, 8), "down.encoder.layer.0.q.weight": (8, 8)})
    assert muon == ["down.encoder.layer.0.q.weight"]


def test_the_muon_split_is_overridden_by_include_and_exclude():
    muon, _ = _split_names(BERT_NAMES, muon_include=("encoder.layer.1",))
    assert muon == ["encoder.layer.1.output.dense.weight"]
    muon, rest = _split_names(BERT_NAMES, muon_exclude=())  # every matrix, never a 1-D tensor
    assert muon == [n for n, s in BERT_NAMES.items() if len(s) == 2]
    assert rest == [n for n, s in BERT_NAMES.items() if len(s) == 1]
    muon, _ = _split_names(BERT_NAMES, muon_exclude=("cls", "intermediate"))
    assert "embeddings.word_embeddings.weight" in muon and "encoder.layer.0.intermediate.dense.weight" not in muon
    frozen = _named({"a.weight": (4, 4)})
    frozen[0][1].requires_grad_(False)
    tied = _named({"b.weight": (4, 4)}) * 2
    assert muon_split(frozen + tied, OptimConfig(name="muon")) == (tied[:1], [])


class Block(nn.Module):
    """Embeddings, one hidden layer (matrix + bias), a norm and a head: both kinds of Muon parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embeddings = nn.Embedding(10, 6)
        self.dense = nn.Linear(6, 12)
        self.out = nn.Linear(12, 6, bias=False)
        self.LayerNorm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.LayerNorm(self.out(torch.relu(self.dense(self.embeddings(x))))))


def _grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


MUON = OptimConfig(name="muon", lr=0.01, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, muon_momentum=0.9)


def test_a_muon_step_is_torchs_muon_step_and_the_rest_torchs_adamw():
    ours, theirs = Block(), Block()
    opt = make_optimizer(MUON, ours.named_parameters())
    assert type(opt.muon) is torch.optim.Muon and type(opt.adamw) is torch.optim.AdamW
    assert [g["group"] for g in opt.param_groups] == ["muon", "decay", "no_decay"]
    hidden = [theirs.dense.weight, theirs.out.weight]
    muon = torch.optim.Muon(hidden, lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [theirs.embeddings.weight, theirs.head.weight], "weight_decay": 0.1},
                               {"params": [theirs.dense.bias, theirs.LayerNorm.weight, theirs.LayerNorm.bias,
                                           theirs.head.bias], "weight_decay": 0.0}],
                              lr=0.01, betas=(0.9, 0.98), eps=1e-8)
    schedule = LRSchedule(OptimConfig(lr=0.01, warmup_steps=2), 10)
    for step in range(3):
        schedule.apply(opt, step)  # one peak lr for both: the warm-up reaches every group
        for o in (muon, adamw):
            schedule.apply(o, step)
        _grads(ours, step)
        _grads(theirs, step)
        opt.step()
        muon.step()
        adamw.step()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in ours.parameters())
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert set(opt.state) == set(ours.parameters())  # every parameter's state, from one of the two


def test_muon_with_adamw_state_dict_round_trip_continues_bit_exactly():
    a = Block()
    opt_a = make_optimizer(MUON, a.named_parameters())
    for step in range(2):
        _grads(a, step)
        opt_a.step()
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # what a checkpoint holds reads back without code
    b = Block()
    b.load_state_dict(saved["model"])
    opt_b = make_optimizer(MUON, b.named_parameters())
    opt_b.load_state_dict(saved["optim"])
    for step in range(2, 4):
        _grads(a, step)
        _grads(b, step)
        opt_a.step()
        opt_b.step()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.equal(opt_a.state[a.dense.weight]["momentum_buffer"], opt_b.state[b.dense.weight]["momentum_buffer"])
    with pytest.raises(ValueError, match="not that of Muon with AdamW"):
        make_optimizer(MUON, Block().head.named_parameters(prefix="head")).load_state_dict(saved["optim"])


def test_a_stage_without_muon_parameters_steps_with_adamw_alone():
    """A head-only stage (every matrix excluded), or one whose matrices all went to K-FAC's own update."""
    head = Block().head
    opt = make_optimizer(MUON, head.named_parameters(prefix="head"))
    assert opt.muon is None and [g["group"] for g in opt.param_groups] == ["decay", "no_decay"]
    LRSchedule(MUON, 10).apply(opt, 0)
    _grads(head, 0)
    before = head.weight.detach().clone()
    opt.step()
    assert not torch.equal(head.weight, before)
    assert opt.state_dict()["muon"] is None
    empty = make_optimizer(MUON, [])
    empty.step()
    assert empty.param_groups[0]["lr"] == MUON.lr


def test_a_torch_without_muon_is_refused_in_one_line(monkeypatch):
    from pipefisher.errors import InputError
    from pipefisher.runtime.train.optim import check_optimizer

    monkeypatch.delattr(torch.optim, "Muon")
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    with pytest.raises(InputError, match=r"^run.yaml: optim.name muon needs torch >= 2.9 \(torch.optim.Muon\); "
                                         r"this torch is 2.8.0"):
        check_optimizer(MUON, "run.yaml")
    with pytest.raises(InputError, match="needs torch >= 2.9"):
        make_optimizer(MUON, Block().named_parameters())
    check_optimizer(OptimConfig(name="adamw"), "run.yaml")  # the others need nothing new

    class EarlyMuon(torch.optim.Optimizer):  # a Muon without the learning-rate scaling we ask for
        def __init__(self, params, lr=1e-3, momentum=0.95):  # noqa: ANN001, ANN204
            super().__init__(params, {"lr": lr})

    monkeypatch.setattr(torch.optim, "Muon", EarlyMuon, raising=False)
    with pytest.raises(InputError, match="needs torch >= 2.9"):
        check_optimizer(MUON, "run.yaml")


def _muon_step_worker(cfg) -> dict:
    """One training step with Muon (first-order, then kfac with ``kfac.update: base``, each from the seed's
    weights) in a worker of a pipeline: per stage copy, its virtual stage, which of its parameters Muon
    took, Muon's momentum buffers (after one step: (1 - momentum) x the gradient Muon saw) and the
    parameters after the step."""
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    out: dict = {"device": ctx.grid.stage, "replica": ctx.grid.replica}
    try:
        for mode in ("first-order", "kfac"):
            trainer = Trainer(cfg, ctx, TrainOptions.of(mode=mode, steps=1, progress=False, log_every=10**9))
            copies = dict(trainer.worker.copies)
            opt = trainer.updater.optimizer
            muon_ids = {id(p) for g in opt.param_groups if g["group"] == "muon" for p in g["params"]}
            trainer.train_step(0)
            out[mode] = {j: {"index": c.index,
                             "muon": sorted(n for n, p in c.named_parameters() if id(p) in muon_ids),
                             "buffers": {n: opt.state[p]["momentum_buffer"].clone()
                                         for n, p in c.named_parameters() if id(p) in muon_ids},
                             "params": {n: p.detach().clone() for n, p in c.named_parameters()}}
                         for j, c in copies.items()}
    finally:
        shutdown(ctx)
    return out


MUON_LAYOUTS = {"zb-v, 2 devices (4 virtual stages)": ("zb-v", 2, 1), "1f1b, 2 stages x 2 replicas": ("1f1b", 2, 2)}


@pytest.mark.parametrize("layout", list(MUON_LAYOUTS))
def test_muon_in_a_pipeline_steps_as_on_the_whole_model(layout):
    """Each copy's Muon takes its hidden matrices; it sees the whole model's gradient (first-order) or
    K-FAC's preconditioned one (``kfac.update: base``), and the step equals the whole model's."""
    from test_runtime_engine import BASE, _assert_close, _reference

    order, stages, replicas = MUON_LAYOUTS[layout]
    cfg = BASE.replace(pipeline=dict(order=order, stages=stages), kfac=dict(update="base"),
                       optim=dict(name="muon", lr=0.01, weight_decay=0.01))
    results = spawn_local(_muon_step_worker, stages * replicas, cfg, timeout_s=180)
    ref = _reference(cfg, replicas)
    momentum = cfg.optim.muon_momentum
    from pipefisher.runtime.models.bert import PipelineStage

    for mode, seen_grads in (("first-order", ref["grads"]), ("kfac", ref["precond"])):
        whole = PipelineStage(cfg.model, 0, 1, seed=cfg.data.seed)
        want_muon = [n for n, _ in muon_split(whole.named_parameters(), cfg.optim)[0]]
        opt = make_optimizer(cfg.optim, whole.named_parameters())
        LRSchedule(cfg.optim, 1).apply(opt, 0)
        for n, p in whole.named_parameters():
            p.grad = seen_grads[n].clone()
        opt.step()
        want = dict(whole.named_parameters())
        got_muon = set()
        for res in results:
            for j, copy in res[mode].items():
                assert copy["muon"] == sorted(n for n in want_muon if n in copy["params"])
                got_muon |= set(copy["muon"])
                for n, buf in copy["buffers"].items():
                    _assert_close(buf / (1 - momentum), seen_grads[n], f"{mode} {layout} Muon's gradient of {n}")
                for n, p in copy["params"].items():
                    _assert_close(p, want[n].detach(), f"{mode} {layout} {n} after the step")
        assert got_muon == set(want_muon) and want_muon
    if replicas > 1:  # the replicas of a stage hold the very same weights
        for a in results:
            for b in results:
                if a["device"] == b["device"]:
                    for n, p in a["kfac"][0]["params"].items():
                        assert torch.equal(p, b["kfac"][0]["params"][n]), n


def test_muon_under_fp16_sees_unscaled_gradients_and_skips_an_overflowing_step():
    from pipefisher.runtime.job.config import RunConfig
    from pipefisher.runtime.pipeline.compute import LossScale
    from pipefisher.runtime.train.update import Updater

    cfg = RunConfig().replace(optim={"name": "muon", "lr": 0.01, "betas": [0.9, 0.98], "muon_momentum": 0.9},
                              train={"precision": "fp16", "loss_scale": 1024.0})
    model, scaler = Block(), LossScale(cfg.train.loss_scale)
    updater = Updater(cfg, model, None, total_steps=10, scaler=scaler)
    updater.set_step(0)
    _grads(model, 0)
    true = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad.mul_(1024.0)  # what the backward of a scaled loss leaves
    updater.step(model)
    state = updater.optimizer.state
    # after one step Muon's momentum is (1 - momentum) g and AdamW's first moment (1 - beta1) g: g unscaled
    assert torch.allclose(state[model.dense.weight]["momentum_buffer"], 0.1 * true["dense.weight"], rtol=1e-6)
    assert torch.allclose(state[model.head.weight]["exp_avg"], 0.1 * true["head.weight"], rtol=1e-6)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffer = state[model.dense.weight]["momentum_buffer"].clone()
    updater.set_step(1)
    _grads(model, 1)
    model.out.weight.grad[0, 0] = float("inf")  # one overflow anywhere: no parameter moves
    updater.step(model)
    assert all(torch.equal(p, after[n]) for n, p in model.named_parameters())
    assert torch.equal(updater.optimizer.state[model.dense.weight]["momentum_buffer"], buffer)
    assert scaler.scale == 512.0 and scaler.skipped == 1 and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("update", ["base", "soap"])
def test_the_precondition_span_holds_all_of_kfacs_update_and_none_of_first_orders(update):
    """The profile's ``precondition`` is what K-FAC adds to the update (the plan's first-order step is the
    profiled update without it, :func:`pipefisher.cost.objective.end_of_step`): under ``soap`` that is
    K-FAC's own optimizer (Adam in the eigenbases) too; the first-order optimizer steps outside it."""
    from contextlib import contextmanager

    from pipefisher.runtime.job.config import RunConfig
    from pipefisher.runtime.train.update import Updater, make_kfac
    from pipefisher.schedule.timeline import PRECONDITION_KEY

    cfg = RunConfig().replace(kfac={"update": update, "ignore": []})
    model = Block()
    open_spans: list[str] = []
    seen: list[tuple[str, tuple[str, ...]]] = []

    @contextmanager
    def span(key: str):  # noqa: ANN202
        open_spans.append(key)
        try:
            yield
        finally:
            open_spans.pop()

    updater = Updater(cfg, model, make_kfac(cfg, model), total_steps=10, span=span)
    for name, opt in [("first-order", updater.optimizer), ("kfac", updater.kfac_optimizer)]:
        if opt is not None:
            inner = opt.step
            opt.step = lambda inner=inner, name=name: (seen.append((name, tuple(open_spans))), inner())[1]
    updater.set_step(0)
    _grads(model, 0)
    updater.step(model)
    want = [("kfac", (PRECONDITION_KEY,))] if update == "soap" else []
    assert seen == want + [("first-order", ())]


def test_kfac_basis_block_reaches_the_covariance_the_refresh_and_the_rotations():
    """``kfac.basis_block`` (and ``kfac.rotation_dtype``) from the config: the factors wider than it hold
    their diagonal blocks only,
    their refreshed bases are block-diagonal, and soap's optimizer rotates block by block."""
    from pipefisher.kfac.factors import diagonal_blocks
    from pipefisher.runtime.job.config import RunConfig
    from pipefisher.runtime.train.update import Updater, make_kfac

    cfg = RunConfig().replace(kfac={"update": "soap", "ignore": ["embeddings", "LayerNorm"], "basis_block": 5,
                                    "rotation_dtype": "bfloat16"})
    model = Block()
    kfac = make_kfac(cfg, model)
    updater = Updater(cfg, model, kfac, total_steps=10)
    assert updater.kfac_optimizer.basis_block == 5 and updater.kfac_optimizer.rotation_dtype == torch.bfloat16
    kfac.stats.set_saving(True)
    out = model(torch.randint(0, 10, (4, 3)))
    kfac.stats.end_forward()
    out.square().sum().backward()
    for name in kfac.layers:
        for factor in "AB":
            kfac.stats.cov_all(factor, name)
    a = kfac.factor("dense", "A")  # 7 wide (6 inputs and the bias): blocks of 4 and 3
    assert diagonal_blocks(7, 5) == [(0, 4), (4, 7)] and torch.count_nonzero(a[:4, 4:]) == 0
    assert torch.count_nonzero(a[:4, :4]) == 16
    for name in kfac.layers:
        for factor in "AB":
            kfac.refresher.inv(factor, name)
    q = kfac.refresher.installed("dense", "A")
    assert torch.count_nonzero(q[:4, 4:]) == 0 and torch.count_nonzero(q[4:, :4]) == 0
    assert torch.allclose(q.t() @ q, torch.eye(7), atol=1e-5)
