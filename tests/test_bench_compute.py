"""The compute benchmark's table: peaks above the start never negative, no ratio against a peak that is noise."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_compute import RATIO_FLOOR, ratio  # noqa: E402


def test_no_ratio_is_shown_against_a_reference_peak_below_a_mib():
    assert ratio(3.0, 2.0) == "  1.50"
    assert ratio(6.3 * 2**20, 0.1 * 2**20, RATIO_FLOOR) == "     -" and ratio(0, 0, RATIO_FLOOR) == "     -"
    assert ratio(2 * 2**20, 4 * 2**20, RATIO_FLOOR) == "  0.50"


def test_a_peak_above_the_start_is_never_negative():
    from pipefisher.runtime.train.trainer import WorkerResult

    res = WorkerResult(0, 0, 0, peak_memory_bytes=100 << 20, base_memory_bytes=(100 << 20) + 4096)
    assert res.peak_above_base_bytes == 0  # the resident-set counters' noise, not memory given back
    assert WorkerResult(0, 0, 0, peak_memory_bytes=5 << 20, base_memory_bytes=2 << 20).peak_above_base_bytes == 3 << 20
