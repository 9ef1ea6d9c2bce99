"""What a packed schedule costs: measured steps and bubbles (``measure``), what an older curvature costs
in steps (``staleness``), and the objective that weighs the two (``objective``). Above the schedule and
the rules, below the policies, which pack against it.
"""
from __future__ import annotations
