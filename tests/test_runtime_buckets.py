"""Gradient buckets: where in a step their all-reduce starts, that their storage stays put, and that
gradients accumulated into them are autograd's own.

The all-reduce itself is recorded here (one process); the multi-process tests
(``test_runtime_engine``, ``test_runtime_copies``, ``test_runtime_zero_bubble``,
``test_runtime_interleaved``) check the averaged gradients against the one-process model.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job.dist import DistContext, Grid, single_process
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.buckets import GradientBuckets, plan_buckets
from pipefisher.runtime.pipeline.checks import single_iteration_schedule
from pipefisher.runtime.pipeline.engine import PipelineEngine, splits_backward
from pipefisher.runtime.pipeline.executor import ScheduleExecutor
from pipefisher.runtime.pipeline.labels import BACKWARD, WEIGHT, parse_label
from pipefisher.runtime.train.update import make_kfac

from _schedules import tiny

STARTED, WAITED = "all-reduce started", "all-reduce waited"


class _Recorded:
    """An all-reduce that only says when it starts and when it is waited for (one process: a sum over
    one member is the tensor itself)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, tensor: torch.Tensor, group=None, async_op: bool = False) -> "_Recorded":
        assert async_op, "the buckets' all-reduce must not block"
        self.log.append((STARTED, tensor.numel()))
        return self

    def wait(self) -> None:
        self.log.append((WAITED, 0))


class _LabelLog:
    """A step recorder that writes every label down as it starts."""

    def __init__(self, log: list) -> None:
        self.log = log

    def attach(self, engine) -> None:
        pass

    def begin_step(self, step: int, iteration: int) -> None:
        pass

    def wrap(self, label: str, call):
        def logged() -> None:
            self.log.append((label, 0))
            call()
        return logged

    def end_step(self) -> None:
        return None


def _one_stage(order: str, members: int):
    """A whole-model stage under ``order`` with its one-iteration schedule (all K-FAC work in the tail
    bubble, after the last backward), its engine in a context whose stage group has ``members`` ranks."""
    cfg = tiny(pipeline=dict(stages=1, schedule=order))
    stage = PipelineStage(cfg.model, 0, 1, seed=cfg.data.seed)
    kfac = make_kfac(cfg, stage)
    kfac.set_saving(True)  # as step 0 leaves it for the schedule's first iteration
    ctx = single_process() if members == 1 else DistContext(Grid(0, 1, 1), torch.device("cpu"), None,
                                                            stage_group_size=members)
    engine = PipelineEngine(stage, ctx, MLMData(cfg.data, cfg.model.vocab_size), cfg.data.num_micro_batches,
                            kfac=kfac, split=splits_backward(order), grad_bucket_mb=0.02)  # several buckets
    return cfg, stage, kfac, engine, single_iteration_schedule(cfg)[0]


def _steps(order: str, members: int, steps: int = 3):
    """``steps`` scheduled steps; the label log with the all-reduces in it, the buckets' storage after
    each step, and the gradients of the last step."""
    cfg, stage, kfac, engine, labels = _one_stage(order, members)
    log: list = []
    engine.grads.reduce = _Recorded(log)
    executor = ScheduleExecutor(labels, engine, {0: kfac}, engine.allreduce_gradients, recorder=_LabelLog(log))
    storage = []
    for step in range(1, steps + 1):
        stage.zero_grad(set_to_none=True)  # as the optimizer leaves them after each step
        log.clear()
        executor.run_step(step)
        storage.append(engine.grads.storage())
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    return engine, stage, log, storage, grads


@pytest.mark.parametrize("order", ["1f1b", "zb-h1"])
def test_the_all_reduce_starts_as_the_last_backward_ends_before_the_tail_bubbles_k_fac_work(order):
    engine, stage, log, _, _ = _steps(order, members=2)
    names = [name for name, _ in log]
    last = WEIGHT if splits_backward(order) else BACKWARD
    last_backward = max(i for i, name in enumerate(names) if name == last)
    starts = [i for i, name in enumerate(names) if name == STARTED]
    buckets = engine.grads.buckets(0)
    assert len(buckets) >= 2 and len(starts) == len(buckets)
    assert starts == list(range(last_backward + 1, last_backward + 1 + len(buckets)))  # right after it
    tail = names[starts[-1] + 1:names.index("-- end --")]
    assert tail and all(parse_label(name)[0] in ("cov_kron", "sync_kron", "inv_kron") for name in tail)
    waits = [i for i, name in enumerate(names) if name == WAITED]
    assert len(waits) == len(buckets) and min(waits) > names.index("-- end --")  # waited for at the end
    trainable = sum(p.numel() for p in stage.parameters() if p.requires_grad)
    assert sum(n for name, n in log if name == STARTED) == trainable


def test_the_flat_storage_is_allocated_once_and_the_gradients_are_its_views():
    engine, stage, _, storage, _ = _steps("1f1b", members=2)
    assert storage[0] and storage == [storage[0]] * len(storage)  # the same buffers every step
    for bucket in engine.grads.buckets(0):
        start, end = bucket.flat.data_ptr(), bucket.flat.data_ptr() + bucket.flat.numel() * bucket.flat.element_size()
        for p in bucket.params:
            assert start <= p.grad.data_ptr() < end


@pytest.mark.parametrize("order", ["1f1b", "zb-h1"])
def test_gradients_accumulated_into_the_buckets_are_autograds_own(order):
    *_, bucketed = _steps(order, members=2)
    *_, plain = _steps(order, members=1)  # one member: no buckets, autograd's own .grad tensors
    assert bucketed.keys() == plain.keys()
    for name in plain:
        assert torch.equal(bucketed[name], plain[name]), name


def test_buckets_are_bounded_hold_one_dtype_and_keep_parameter_order():
    f32, f16 = torch.float32, torch.float16
    assert plan_buckets([(10, f32), (10, f32), (10, f32)], 80) == [[0, 1], [2]]
    assert plan_buckets([(100, f32), (1, f32)], 80) == [[0], [1]]  # too large for any bucket: its own
    assert plan_buckets([(2, f32), (2, f16), (2, f16)], 1000) == [[0], [1, 2]]
    assert plan_buckets([], 80) == []


def _copies() -> dict[int, list[nn.Parameter]]:
    """Two stage copies in canonical order 1, 0 (a Chimera device whose up copy has the lower stage)."""
    return {1: [nn.Parameter(torch.ones(3))], 0: [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(4))]}


@pytest.mark.parametrize("ordered,want", [(True, [[], [1, 0]]), (False, [[0], [0, 1]])])
def test_a_chimera_pair_starts_its_copies_in_canonical_order(ordered, want):
    log: list = []
    grads = GradientBuckets(_copies(), None, members=2, divisor=2, ordered=ordered, reduce=_Recorded(log))
    for c in (1, 0):
        grads.attach(c)
    got = []
    for c in (0, 1):  # copy 0's last backward ends first on this device
        grads.ready(c)
        got.append(list(grads.started))
    assert got == want
    grads.finish()
    assert [float(p.grad.sum()) for p in grads.copies[0]] == [0.0, 0.0]  # zeros where nothing ran, / 2


def test_a_step_that_never_waited_for_its_gradients_is_refused_at_the_next():
    grads = GradientBuckets(_copies(), None, members=2, reduce=_Recorded([]))
    grads.attach(0)
    grads.ready(0)
    with pytest.raises(RuntimeError, match="previous step's gradient all-reduce is in flight"):
        grads.attach(0)


def test_a_gradient_replaced_while_its_all_reduce_is_in_flight_is_an_error():
    grads = GradientBuckets(_copies(), None, members=2, reduce=_Recorded([]))
    grads.attach(1)
    grads.ready(1)
    grads.copies[1][0].grad = torch.zeros(3)
    with pytest.raises(RuntimeError, match="replaced while its all-reduce was in flight"):
        grads.finish()
