"""The training loop's evaluator: held-out evaluation every ``eval_every`` steps and after the last."""
from __future__ import annotations

from pipefisher.runtime.train.evaluator import Evaluator


class Engine:
    """Stands in for a pipeline engine: the loss stage returns a held-out loss, another stage None."""

    def __init__(self, holds_loss: bool = True) -> None:
        self.holds_loss, self.calls = holds_loss, 0

    def evaluate(self, batches):
        self.calls += 1
        return 2.0 / self.calls if self.holds_loss else None


def test_due_every_eval_every_steps_and_after_the_last():
    ev = Evaluator(Engine(), ["b"], every=4, steps=10)
    assert [s for s in range(10) if ev.due(s)] == [3, 7, 9]


def test_never_due_without_eval_every_or_held_out_batches():
    assert not any(Evaluator(Engine(), ["b"], every=0, steps=5).due(s) for s in range(5))
    assert not any(Evaluator(Engine(), [], every=1, steps=5).due(s) for s in range(5))


def test_curve_holds_steps_done_loss_and_training_seconds_only():
    engine = Engine()
    ev = Evaluator(engine, ["b"], every=2, steps=3)
    vals = [ev.after_step(s, 0.5) for s in range(3)]
    assert vals == [None, 2.0, 1.0] and engine.calls == 2
    assert ev.curve == [(2, 2.0, 1.0), (3, 1.0, 1.5)]


def test_a_stage_without_the_loss_evaluates_but_keeps_no_curve():
    engine = Engine(holds_loss=False)
    ev = Evaluator(engine, ["b"], every=1, steps=2)
    assert [ev.after_step(s, 0.1) for s in range(2)] == [None, None] and engine.calls == 2 and ev.curve == []
