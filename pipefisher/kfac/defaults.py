"""K-FAC's defaults that the torch-free run config shares (:mod:`pipefisher.runtime.job.config`): written
once, here, where importing them imports no torch."""
from __future__ import annotations

DEFAULT_IGNORE = ("embeddings", "LayerNorm", "cls")
"""Substrings of module names K-FAC leaves alone: embeddings, norms and the prediction head (the
default of :class:`pipefisher.kfac.KFAC`'s ``ignore`` and of the run config's ``kfac.ignore``)."""

EIGENBASIS_STEP_DECAY = 0.95
"""The old factor's weight per training step in the running average of eigenbases' factors when neither
``factor_decay`` (per refresh) nor ``factor_decay_per_step`` is given (``kfac.update: soap``,
``KFAC(inverse="eigenbasis")``): SOAP's own (Vyas et al., 2024, whose factors' average weighs the old
one by its second-moment beta, 0.95, every step). A refresh every k steps folds its new factor in with
``weight ** k`` on the old one, so the average spans the same steps whatever k.

Why not 0, K-FAC's default: a basis from one refresh's few micro-batches alone jumps from refresh to
refresh in the directions those rows leave undetermined, and Adam's second moments, kept across a basis
change, then describe other coordinates. Why per step: the best weight per refresh fell with k as a
power of one per-step weight. Why the published value rather than this project's measured best: the best
is a property of a job (on ``configs/small.yaml`` 0.8 a step did better than 0.95, docs/benchmarks.md,
"Factors averaged across refreshes under soap", and that config sets it); a default fitted there would
decide other users' jobs with one benchmark's numbers. K-FAC's inverses keep 0: the factors of the first
steps linger in a longer average."""


def factor_decay_of(setting: float | None, *, eigenbasis: bool, interval: int = 1,
                    per_step: float | None = None) -> float:
    """The old factor's weight in a refresh's running average: ``setting`` where given (per refresh),
    else for eigenbases the weight per step (``per_step``, or :data:`EIGENBASIS_STEP_DECAY`) to the
    power of the refresh ``interval`` in steps, else 0 (inverses). The one rule :class:`pipefisher.kfac.KFAC`
    and the run config resolve a missing ``factor_decay`` by."""
    if setting is not None:
        return float(setting)
    return step_decay_of(per_step) ** interval if eigenbasis else 0.0


def step_decay_of(per_step: float | None) -> float:
    """The weight per step an eigenbasis average uses: ``per_step`` where given, else the default."""
    return EIGENBASIS_STEP_DECAY if per_step is None else float(per_step)
