"""First-order optimizers: AdamW and LAMB against hand computations, the learning-rate schedule and
global-norm clipping (one process and a two-stage pipeline over gloo)."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from pipefisher.runtime.job.config import OptimConfig
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.train.optim import (Lamb, LRSchedule, clip_grad_norm, lr_factor, make_optimizer, no_decay,
                                            param_groups)


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
    f = [lr_factor(s, warmup_steps=4, total_steps=10, schedule=schedule, min_lr_ratio=0.1) for s in range(4)]
    assert f == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, warmup_steps=4, total_steps=10, schedule=schedule, min_lr_ratio=0.1) == 1.0


def test_lr_factor_decays_to_the_floor_at_total_steps_and_stays():
    kw = dict(warmup_steps=4, total_steps=10, min_lr_ratio=0.1)
    # progress = (step - 4) / 6
    assert lr_factor(7, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(9, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 / 6)  # the last step still moves
    assert lr_factor(7, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(5, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 6)))
    for schedule in ("linear", "cosine"):
        assert lr_factor(10, schedule=schedule, **kw) == pytest.approx(0.1)
        assert lr_factor(1000, schedule=schedule, **kw) == pytest.approx(0.1)
    assert lr_factor(1000, schedule="constant", **kw) == 1.0
    assert lr_factor(10, schedule="linear", warmup_steps=4, total_steps=10, min_lr_ratio=0.0) == 0.0


def test_lr_factor_without_warmup_starts_at_the_peak():
    assert lr_factor(0, warmup_steps=0, total_steps=4, schedule="linear", min_lr_ratio=0.0) == 1.0
    assert lr_factor(2, warmup_steps=0, total_steps=4, schedule="linear", min_lr_ratio=0.0) == 0.5
    assert lr_factor(0, warmup_steps=0, total_steps=0, schedule="cosine", min_lr_ratio=0.2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, warmup_steps=0, total_steps=4, schedule="step", min_lr_ratio=0.0)


def test_lr_schedule_sets_every_group_and_honours_decay_steps():
    cfg = OptimConfig(lr=0.4, warmup_steps=2, schedule="linear", min_lr_ratio=0.0)
    m = tiny()
    opt = make_optimizer(cfg, m.named_parameters())
    sched = LRSchedule(cfg, total_steps=6)
    assert sched.apply(opt, 0) == pytest.approx(0.2)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.2)] * 2
    sched.apply(opt, 4)  # progress (4 - 2) / 4
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.2)] * 2
    sched.apply(opt, 1, peak_lr=3.0)  # K-FAC's own peak, same shape
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(3.0)] * 2
    early = LRSchedule(OptimConfig(lr=0.4, warmup_steps=2, schedule="linear", decay_steps=4), total_steps=100)
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

    dist.init_process_group("gloo")
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
