"""The refresh benchmark times each method against the Cholesky inverse measured in the same run."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_method_is_timed_against_the_cholesky_inverse_of_the_same_size() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_refresh.py"), "--sizes", "8,16",
                          "--repeat", "1"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 10  # 5 methods x 2 sizes
    assert out[0].startswith("n =    8: cholesky inverse") and out[0].endswith("1.00x the Cholesky inverse")
    assert all("ms" in line and line.endswith("x the Cholesky inverse") for line in out)
    for method in ("bare", "inverse label (KFAC.inv", "eigh", "power step + QR"):
        assert sum(method in line for line in out) == 2, method
