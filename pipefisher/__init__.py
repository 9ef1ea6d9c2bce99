"""pipefisher: pack K-FAC work into pipeline bubbles, and run the result.

The scheduling path (timelines, policies, schedules, reports, pictures) is plain Python and numpy;
only :mod:`pipefisher.runtime` and :mod:`pipefisher.kfac` import torch.
"""
from __future__ import annotations

__version__ = "0.1.0"
