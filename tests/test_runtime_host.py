"""Device-to-host reads on the step path: one counter per worker (``HostReads``, none process-wide), and at
most one read per step that logs nothing, in kfac and scheduled mode, fp32 and fp16, on one process and on
two gloo ranks."""
from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import pytest
import torch

from _schedules import TINY, spread_schedule
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.job.dist import init_from_env, shutdown, single_process
from pipefisher.runtime.job.host import HostReads, unrouted_reads
from pipefisher.runtime.launch.local import spawn_local
from pipefisher.runtime.train.trainer import Trainer, TrainOptions

STEPS = 7  # logging steps: 0 and the last (log_every is larger); steps 1-5 log nothing
RUNS = [(mode, precision) for mode in ("kfac", "scheduled") for precision in ("fp32", "fp16")]


def test_a_read_counts_once_and_brings_what_waits_along():
    host = HostReads()
    seen: list[list[float]] = []
    host.later(torch.tensor([1.0, 0.0]), seen.append)
    host.settle()  # what waits: one read
    assert seen == [[1.0, 0.0]] and host.take() == 1 and host.take() == 0
    host.settle()  # nothing waits: no read
    host.later(torch.tensor([3.0]), seen.append)
    assert host.value(torch.tensor(2.5)) == 2.5  # the waiting read comes along: still one read
    assert seen[-1] == [3.0] and host.take() == 1 and not host.waiting
    assert host.flag(torch.tensor([0.0])) is False and host.values(torch.ones(2), torch.zeros(1)) == [1.0, 1.0, 0.0]
    assert host.take() == 2 and host.total == 4


def test_a_float_put_back_on_the_step_path_counts_as_a_read():
    loss = torch.tensor(1.5)
    host = HostReads()
    with unrouted_reads(host) as places:
        float(loss)  # this test's own read: not pipefisher's
        from pipefisher.kfac.factors import bad_factor  # any pipefisher code that converts counts
        assert bad_factor([1.0, loss, 0.0, 0.0, 1.0, 1.0], "cholesky") is None  # type: ignore[list-item]
        counted = host.count
        assert counted >= 1 and len(places) == counted
        assert all(p.startswith("pipefisher/kfac/factors.py:") for p in places), places
    assert float(loss) == 1.5 and host.count == counted  # closed: conversions are plain again


def test_no_counter_is_process_wide():
    """No module of pipefisher holds a counter: each worker makes its own and hands it to those who read."""
    import pipefisher.runtime.api  # noqa: F401  (every runtime module a worker uses, loaded)
    import pipefisher.runtime.train.trainer  # noqa: F401

    shared = [f"{name}.{attr}" for name, module in list(sys.modules.items())
              if name.startswith("pipefisher") and module is not None
              for attr, value in vars(module).items() if isinstance(value, HostReads)]
    assert not shared, shared


def test_two_workers_in_one_process_count_their_reads_apart():
    from pipefisher.runtime import api

    torch.set_num_threads(1)
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    a, b = (api.build_worker(cfg, single_process(), mode="kfac", total_steps=3) for _ in range(2))
    assert a.host is not b.host
    for w in (a, b):  # everything in a worker that reads, reads through the worker's own counter
        assert w.updater.host is w.host and w.engine.host is w.host  # type: ignore[attr-defined]
        assert w.kfacs and all(k.refresher.host is w.host for k in w.kfacs.values())
    a.step(0)  # the first refresh: inverses with none to fall back on, checked at once through a's counter
    assert a.host.take() >= 1 and not a.host.waiting
    a.step(1)  # the next refresh: its checks wait for a's next read, not b's
    assert a.host.waiting and not b.host.waiting
    a.step(2)  # which the next step makes, at its start: one read
    assert a.host.take() == 1 and b.host.take() == 0 and b.host.total == 0


def test_two_trainers_in_one_process_have_a_counter_each():
    torch.set_num_threads(1)
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    one, two = (Trainer(cfg, single_process(), TrainOptions.of(mode="kfac", steps=1, progress=False)) for _ in range(2))
    assert one.host is one.worker.host and two.host is two.worker.host and one.host is not two.host
    assert one.drift_log is not None and one.drift_log.host is one.host


def _train(cfg: Any, ctx: Any, folder: str) -> dict[str, Any]:
    """Each of :data:`RUNS` for :data:`STEPS` steps: the reads of each step (this worker's), and where any
    unrouted ones were made."""
    out: dict[str, Any] = {"reporter": None}
    for mode, precision in RUNS:
        run_cfg = cfg.replace(train={"precision": precision, "loss_scale": 1024.0})
        schedule = None
        if mode == "scheduled":
            schedule = os.path.join(folder, f"spread_{cfg.pipeline.stages}.pickle")
            with open(schedule, "wb") as f:
                pickle.dump(spread_schedule(run_cfg), f)
        torch.manual_seed(0)
        trainer = Trainer(run_cfg, ctx, TrainOptions.of(mode=mode, schedule=schedule, steps=STEPS, progress=False,
                                                        log_every=100))
        with unrouted_reads(trainer.host) as places:
            result = trainer.run()
        out[mode, precision] = (result.host_reads, places)
        out["reporter"] = trainer.reporter
    return out


def _worker(folder: str) -> dict[str, Any]:
    cfg = load_config(TINY).replace(pipeline={"timeout_s": 30.0})
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        return _train(cfg, ctx, folder)
    finally:
        shutdown(ctx)


def _assert_at_most_one_read_per_quiet_step(out: dict[str, Any]) -> None:
    for mode, precision in RUNS:
        reads, places = out[mode, precision]
        assert len(reads) == STEPS
        quiet = reads[1:-1]  # no loss printed, no checkpoint, no evaluation
        assert max(quiet) <= 1, (mode, precision, reads, places)
        if out["reporter"]:  # a logging step reads its loss
            assert reads[0] >= 1 and reads[-1] >= 1, (mode, precision, reads)


def test_one_process_reads_at_most_once_per_step_that_logs_nothing(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    out = _train(cfg, single_process(), str(tmp_path))
    print({k: v[0] for k, v in out.items() if k != "reporter"})
    _assert_at_most_one_read_per_quiet_step(out)


def test_two_gloo_ranks_read_at_most_once_per_step_that_logs_nothing(tmp_path):
    results = spawn_local(_worker, 2, str(tmp_path), timeout_s=300)
    for out in results:
        print({k: v[0] for k, v in out.items() if k != "reporter"})
        _assert_at_most_one_read_per_quiet_step(out)
    assert [out["reporter"] for out in results] == [False, True]


class FakeEvent:
    """A CUDA event stand-in: recorded at ``at`` seconds, done or not (``synchronize`` makes it done)."""

    def __init__(self, at: float, done: bool = True) -> None:
        self.at, self.done = at, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "elapsed_time of an event not done raises in CUDA"
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_a_gpu_step_time_comes_from_its_events_waiting_only_for_an_end_not_done():
    from pipefisher.runtime.train.trainer import StepOutcome

    host = HostReads()
    done = StepOutcome(3, None, (FakeEvent(1.0), FakeEvent(1.25)), 0.1, None)
    assert done.seconds(host) == 0.25 and host.take() == 0  # the loss read before waited for it: no wait
    late = StepOutcome(4, None, (FakeEvent(2.0), FakeEvent(2.5, done=False)), 0.1, None)
    assert late.seconds(host) == 0.5 and host.take() == 1  # one wait, counted as a read


def test_a_gpu_step_record_keeps_its_events_until_the_records_are_gathered():
    from pipefisher.runtime.train.recorder import ClockRecorder, EventRecord, resolved

    host = HostReads()
    rec = ClockRecorder(1, 0, cuda=True, host=host)
    clock = iter([0.0, 0.5, 1.5, 2.0, 2.0])  # the step's start, then each label's start and end
    rec._now = lambda: FakeEvent(next(clock), done=False)  # type: ignore[method-assign]
    rec.begin_step(7, 2)
    rec.wrap("call_forward", lambda: rec._waits.append((FakeEvent(0.6), FakeEvent(0.9))))()
    rec.wrap("-- end --", lambda: None)()
    record = rec.end_step()
    assert isinstance(record, EventRecord)  # nothing read at the step's end
    events = [rec._base] + [ev for _, start, end, _, _ in record._labels for ev in (start, end)]
    for ev in events:
        ev.done = True  # what the gather's read just before has waited for
    got = resolved(record)
    assert host.take() == 0  # every event done: nothing waited for
    assert (got.node, got.step, got.iteration) == (1, 7, 2)
    assert [(t.label, t.start, t.end) for t in got.labels] == [("call_forward", 0.5, 1.5), ("-- end --", 2.0, 2.0)]
    assert got.labels[0].wait == pytest.approx(0.3)
