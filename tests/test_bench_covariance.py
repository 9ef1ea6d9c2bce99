"""The covariance benchmark: what it reads of a profile, and bad settings refused in one line."""
from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_covariance import _cov_seconds  # noqa: E402

from pipefisher.safe_io import dump_pickle_atomic  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_covariance.py")


def test_covariance_per_refresh_is_the_sum_of_the_cov_kron_intervals(tmp_path) -> None:
    path = str(tmp_path / "t_node0_timeline.pickle")
    dump_pickle_atomic(path, {"call_forward": [(0, 10**9)], "call_backward": [(10**9, 2 * 10**9)],
                              "cov_kron_A:l": [(0, 3 * 10**6)], "cov_kron_B:l": [(5, 5 + 2 * 10**6)],
                              "inv_kron_A:l": [(0, 10**9)]})
    assert abs(_cov_seconds(path) - 5e-3) < 1e-12


def test_a_bad_setting_is_one_line_before_any_worker_starts() -> None:
    res = subprocess.run([sys.executable, SCRIPT, "--only", "1:all:4,0:all:4"], capture_output=True, text=True)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "kfac.cov_stride must be an integer >= 1" in res.stderr
    res = subprocess.run([sys.executable, SCRIPT, "--only", "1:all"], capture_output=True, text=True)
    assert res.returncode == 2 and "settings are STRIDE:MICRO:K" in res.stderr
