"""The basis-block benchmark times the eigenbasis update, refresh and covariance with factors cut into
diagonal blocks against whole factors (and the update against Muon's step) in the same run."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_basis_block.py")


def test_each_block_is_a_row_against_whole_factors_measured_in_the_same_run() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--blocks", "8", "--hidden", "8", "--intermediate", "32",
                          "--layers", "1", "--rows", "16", "--repeat", "1"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("stage: 1 layers of hidden 8, intermediate 32 (12 factors)") and "Muon's step" in out[0]
    rows = [line.split(" | ") for line in out[3:]]
    assert [r[0] for r in rows] == ["| whole", "| 8"]  # whole factors first, the baseline, even unasked
    assert len(rows[0]) == 10 and rows[0][2] == rows[0][7] == rows[0][9].rstrip(" |") == "1.00"
    assert all(float(r[1]) > 0 and float(r[4]) > 0 and float(r[6]) > 0 for r in rows)


def test_a_bad_block_list_is_one_line() -> None:
    run = subprocess.run([sys.executable, SCRIPT, "--blocks", "a,b"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].endswith("--blocks: integers >= 0, not 'a,b'")
