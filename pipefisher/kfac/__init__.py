"""K-FAC written for pipefisher: per-layer factors, all-reduce, damped inverses, preconditioning.

Every piece of work is its own call taking a module name, so a schedule can run them one label at a
time inside pipeline bubbles. Imports torch; only the runtime uses it.
"""
from __future__ import annotations

from pipefisher.kfac.kfac import KFAC, kfac_modules

__all__ = ["KFAC", "kfac_modules"]
