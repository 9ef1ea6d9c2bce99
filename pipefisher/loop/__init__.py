"""The closed loop (``--adapt``): drift, how fast a run's curvature ages (``drift``), and repacking from
the run's own measured steps (``closed_loop``). The top of the scheduling path; the runtime drives it.
"""
from __future__ import annotations
