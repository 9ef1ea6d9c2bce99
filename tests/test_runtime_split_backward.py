"""A backward in two passes (zero-bubble B and W): together exactly one full backward, each doing its half."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipefisher.kfac import KFAC
from pipefisher.runtime.job.config import RunConfig
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.split_backward import backward_input

CFG = RunConfig().replace(model=dict(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, intermediate_size=32,
                                     max_position=8, dropout=0.0), data=dict(seq_len=8))


def _run(stage: nn.Module, first: bool, last: bool, split: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One micro-batch through ``stage`` and back: its parameters' gradients and its input's."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8)) if first else torch.randn(2, 8, 16, requires_grad=True)
    out = stage(x, torch.randint(0, 64, (2, 8)) if last else None)
    grad = None if last else torch.randn_like(out)
    stage.zero_grad(set_to_none=True)
    if not split:
        out.backward(grad)
        gx = None if first else x.grad
    else:
        params = list(stage.parameters())
        grads, deferred = backward_input([out], [grad], [] if first else [x], params)
        gx = grads[0] if grads else None
        assert all(p.grad is None for p in params), "the B pass computed a weight gradient"
        assert deferred.joins, "nothing was left for the W pass"
        deferred.run()
        assert not deferred.joins
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, gx


@pytest.mark.parametrize("index", [0, 1, 2], ids=["first stage", "middle stage", "last stage"])
def test_b_then_w_equals_one_full_backward_bit_for_bit(index):
    stage = PipelineStage(CFG.model, index, 3, seed=1)
    first, last = index == 0, index == 2
    want, want_x = _run(stage, first, last, split=False)
    got, got_x = _run(stage, first, last, split=True)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if not first:
        assert torch.equal(got_x, want_x)


class _Reused(nn.Module):
    """A layer called twice and a weight tied to another layer's: per-join weight passes would count
    those gradients twice, so the B pass takes them whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6, bias=False)
        self.c.weight = self.b.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.a(self.a(x)))))


def test_reused_and_tied_weights_get_their_whole_gradient_once():
    model = _Reused()
    torch.manual_seed(0)
    x = torch.randn(3, 6, requires_grad=True)
    g = torch.randn(3, 6)
    model(x).backward(g)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_x = x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    (gx,), deferred = backward_input([model(x)], [g], [x], list(model.parameters()))
    taken_in_b = {n for n, p in model.named_parameters() if p.grad is not None}
    assert taken_in_b == {"a.weight", "a.bias", "b.weight"}  # the reused layer's and the tied weight
    deferred.run()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=1e-6, msg=n)
    torch.testing.assert_close(gx, want_x, rtol=0, atol=1e-6)


def test_kfac_keeps_each_output_gradient_once_when_the_w_pass_reenters_the_layer():
    """With 2-D inputs a linear layer's output is its join's own output: the W pass runs that node
    (and its tensor hooks) again with the same gradient, which K-FAC must not save twice."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    kfac = KFAC(model, ignore=())
    kfac.set_saving(True)
    x = torch.randn(7, 5, requires_grad=True)
    out = model(x)
    _, deferred = backward_input([out], [torch.randn_like(out)], [x], list(model.parameters()))
    deferred.run()
    assert [kfac.pending("B", n) for n in kfac.names] == [1, 1]
    assert [kfac.pending("A", n) for n in kfac.names] == [1, 1]


def test_a_stage_that_reaches_no_parameter_leaves_no_weight_pass():
    x = torch.randn(3, requires_grad=True)
    (gx,), deferred = backward_input([(x * 2).sum()], [None], [x], [])
    assert torch.equal(gx, torch.full((3,), 2.0)) and not deferred.joins


def test_a_stage_with_nothing_to_differentiate_returns_at_once():
    w = torch.ones(3, requires_grad=True)
    (gx,), deferred = backward_input([(w * 2).sum()], [None], [torch.zeros(3)], [])  # w is no parameter of it
    assert gx is None and not deferred.joins and w.grad is None
