"""Held-out evaluation every ``eval_every`` steps (and after the last), timed apart from training.

A component beside the training loop: it decides when a step ends with an evaluation (:meth:`Evaluator.due`,
also the metrics' rule for printing that step's loss) and keeps the curve ``(steps done, held-out loss,
training seconds so far)`` on the worker that holds the loss. Every stage of a replica evaluates at the same
steps (the pipeline's evaluation is a collective of the replica). No torch here: the engine does the work.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from pipefisher.runtime.pipeline.contracts import Engine


class Evaluator:
    """Evaluates ``batches`` with ``engine`` (its ``evaluate(batches) -> float | None``, the loss on the
    stage that holds it, else None) every ``every`` steps and after step ``steps - 1``; ``every`` 0
    (or no held-out batches): never."""

    def __init__(self, engine: Engine, batches: Sequence[Any], every: int, steps: int) -> None:
        self.engine, self.batches, self.every, self.steps = engine, list(batches), every, steps
        self.train_seconds = 0.0  # training time so far (this run's steps), the curve's time axis
        self.curve: list[tuple[int, float, float]] = []

    def due(self, step: int) -> bool:
        """Whether ``step`` ends with an evaluation."""
        return bool(self.every and self.batches) and ((step + 1) % self.every == 0 or step == self.steps - 1)

    def after_step(self, step: int, seconds: float) -> float | None:
        """Count the step's ``seconds`` of training; evaluate when :meth:`due`. Returns the held-out loss
        (on the stage that holds it), else None."""
        self.train_seconds += seconds
        if not self.due(step):
            return None
        val = self.engine.evaluate(self.batches)
        if val is not None:
            self.curve.append((step + 1, val, self.train_seconds))
        return val
