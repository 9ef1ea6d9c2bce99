"""The refresh benchmark times each method against the Cholesky inverse measured in the same run."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_method_is_timed_against_the_cholesky_inverse_of_the_same_size() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_refresh.py"), "--sizes", "8,16",
                          "--repeat", "1", "--pieces", ""], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 10  # 5 methods x 2 sizes
    assert out[0].startswith("n =    8: cholesky inverse") and out[0].endswith("1.00x the Cholesky inverse")
    assert all("ms" in line and line.endswith("x the Cholesky inverse") for line in out)
    for method in ("bare", "inverse label (KFAC.inv", "eigh", "power step + QR"):
        assert sum(method in line for line in out) == 2, method


def test_the_refresh_in_pieces_is_timed_and_judged_against_the_whole_one() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_refresh.py"), "--sizes", "9",
                          "--repeat", "1", "--pieces", "2,3"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == 5 + 4  # the methods, then each refresh in 2 and 3 pieces
    pieces = out[5:]
    assert [line.split(":")[1].split(" in ")[0].strip() for line in pieces] == \
        ["cholesky inverse", "cholesky inverse", "eigenbasis power step", "eigenbasis power step"]
    assert all("largest piece" in line and "ms" in line for line in pieces)
    assert all("residual" in line and "(whole" in line for line in pieces[:2])
    assert all("off-diagonal mass" in line and "(eigh" in line for line in pieces[2:])
