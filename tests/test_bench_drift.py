"""The drift benchmark's verdict: a measured staleness curve read as bench_staleness.py writes it, whether a
k lies within 10 % of the curve's k = 1 value, and the k most of an adaptive run's steps ran at."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from bench_drift import _most_steps, staleness_curve, within  # noqa: E402

from pipefisher.errors import InputError  # noqa: E402


def _curve_file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "staleness.json"
    path.write_text(json.dumps({"format": "pipefisher-staleness/1", "curve": rows}))
    return str(path)


def test_a_curve_within_ten_percent_of_its_first_point():
    curve = staleness_curve("1:0.718,2:0.718,4:0.769,8:0.923,16:0.846")  # the 1000-step one
    assert [within(curve, k)[0] for k in (1, 2, 4, 8, 16)] == [True, True, True, False, False]
    ok, text = within(curve, 4)
    assert text == "the curve at k = 4: 0.769 against 0.718 at k = 1 (+7.1%)"
    ok, text = within(staleness_curve("1:0.5,2:0.533,4:0.567,8:0.833,16:inf"), 16)
    assert not ok and "(never reached)" in text


def test_a_staleness_file_is_read_against_adamw_or_else_against_its_k_1(tmp_path):
    rows = [{"interval": 1, "vs_baseline": 0.5, "vs_first": 1.0}, {"interval": 4, "vs_baseline": 0.6, "vs_first": 1.2},
            {"interval": 16, "vs_baseline": None, "vs_first": None}]
    curve = staleness_curve(_curve_file(tmp_path, rows))
    assert curve.points == ((1, 0.5), (4, 0.6), (16, float("inf")))
    # AdamW never reached its own median target: its ratios are 0, the ratios to k = 1 still check k
    unknown = [{**r, "vs_baseline": 0.0 if r["vs_baseline"] is not None else None} for r in rows]
    curve = staleness_curve(_curve_file(tmp_path, unknown))
    assert curve.points == ((1, 1.0), (4, 1.2), (16, float("inf"))) and "relative to its k = 1" in curve.source
    with pytest.raises(InputError, match="no such staleness curve file"):
        staleness_curve(str(tmp_path / "missing.json"))


def test_the_k_most_steps_ran_at():
    ks = [[1, 4, "initial"], [21, 8, "longer"], [29, 4, "shorter"], [90, 16, "longer"]]
    assert _most_steps(ks, 100) == 4  # 20 + 61 steps at 4, 8 at 8, 10 at 16
    assert _most_steps([[1, 5, "initial"]], 300) == 5
