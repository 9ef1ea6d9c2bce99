"""K-FAC's defaults that the torch-free run config shares (:mod:`pipefisher.runtime.job.config`): written
once, here, where importing them imports no torch."""
from __future__ import annotations

DEFAULT_IGNORE = ("embeddings", "LayerNorm", "cls")
"""Substrings of module names K-FAC leaves alone: embeddings, norms and the prediction head (the
default of :class:`pipefisher.kfac.KFAC`'s ``ignore`` and of the run config's ``kfac.ignore``)."""

EIGENBASIS_STEP_DECAY = 0.8
"""The running average of eigenbases' factors when ``factor_decay`` is not given (``kfac.update: soap``,
``KFAC(inverse="eigenbasis")``): the old factor keeps this weight per training step, so a refresh every k
steps folds its new factor in with ``0.8 ** k`` on the old one (a time constant of 5 steps, whatever k).

Why not 0, K-FAC's default: a basis from one refresh's few micro-batches alone jumps from refresh to
refresh in the directions those rows leave undetermined, and Adam's second moments, kept across a basis
change, then describe other coordinates. Why per step: the best weight per refresh fell with k as a
power of one per-step weight. Measured on ``configs/small.yaml`` (docs/benchmarks.md, "Factors averaged
across refreshes under soap"): refreshed every step (300 steps, seed 0; Muon 5.7919) 5.9214 at 0.5 a
refresh, 5.7640 at 0.8, 5.8142 at 0.95; in the bubbles at k = 3 (1000 steps, seeds 0 and 1) 5.4327 /
5.4079 at 0, 5.4255 / 5.4021 at 0.5 (0.8 ** 3 = 0.51), 5.4419 / 5.4047 at 0.8. Every step at 0 ended at
6.37 after 1000 steps (the basis never settles). K-FAC's inverses keep 0: the factors of the first steps
linger in a longer average."""


def factor_decay_of(setting: float | None, *, eigenbasis: bool, interval: int = 1) -> float:
    """The old factor's weight in a refresh's running average: ``setting`` where given (per refresh),
    else the default of the kind, for a refresh every ``interval`` steps: :data:`EIGENBASIS_STEP_DECAY`
    per step for eigenbases, 0 for inverses. The one rule :class:`pipefisher.kfac.KFAC` and the run config
    resolve a missing ``factor_decay`` by."""
    if setting is not None:
        return float(setting)
    return EIGENBASIS_STEP_DECAY ** interval if eigenbasis else 0.0
