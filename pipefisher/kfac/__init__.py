"""K-FAC written for pipefisher: per-layer factors, all-reduce, damped inverses, preconditioning.

Every piece of work is its own call taking a module name, so a schedule can run them one label at a
time inside pipeline bubbles. Its classes import torch (only the runtime uses them), on first use: the
package itself does not, so the torch-free run config takes K-FAC's defaults from here
(:mod:`pipefisher.kfac.defaults`) instead of writing them twice.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipefisher.kfac.defaults import DEFAULT_IGNORE

if TYPE_CHECKING:
    from pipefisher.kfac.kfac import KFAC, kfac_modules


def __getattr__(name: str) -> Any:
    """``KFAC`` and ``kfac_modules`` from :mod:`pipefisher.kfac.kfac`, imported (with torch) when first named."""
    if name in ("KFAC", "kfac_modules"):
        from pipefisher.kfac import kfac

        return getattr(kfac, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_IGNORE", "KFAC", "kfac_modules"]
