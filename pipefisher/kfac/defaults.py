"""K-FAC's defaults that the torch-free run config shares (:mod:`pipefisher.runtime.job.config`): written
once, here, where importing them imports no torch."""
from __future__ import annotations

DEFAULT_IGNORE = ("embeddings", "LayerNorm", "cls")
"""Substrings of module names K-FAC leaves alone: embeddings, norms and the prediction head (the
default of :class:`pipefisher.kfac.KFAC`'s ``ignore`` and of the run config's ``kfac.ignore``)."""
