"""A staleness curve as data about one job: interpolation, the file format, the ``--staleness`` option."""
from __future__ import annotations

import json
import math

import pytest

from pipefisher.errors import InputError
from pipefisher.safe_io import dump_json_atomic
from pipefisher.cost.staleness import (
    STALENESS_FORMAT,
    Provenance,
    StalenessCurve,
    curve_for_job,
    read_staleness,
    staleness_data,
)

MEASURED = Provenance(config_digest="0123456789abcdef", config_name="small", config_path="configs/small.yaml",
                      model="bert: 4 layers, hidden 128", data="stdlib (bpe)", horizon=300, target=6.001, seeds=3,
                      relative_to="adamw lr 0.001, warm-up 30 steps")


def measured_curve() -> StalenessCurve:
    return StalenessCurve(((1, 0.5), (2, 0.533), (4, 0.567), (8, 0.833), (16, math.inf)), provenance=MEASURED,
                          spread=((140, 150, 160), (150, 160, 170), (160, 170, 180), (240, 250, math.inf),
                                  (math.inf, math.inf, math.inf)))


def test_curves_interpolate_in_log_k_and_refuse_bad_text() -> None:
    curve = StalenessCurve(((1, 0.5), (4, 0.7), (8, math.inf)))
    assert curve.at(1) == 0.5 and curve.at(0.5) == 0.5
    assert curve.at(2) == pytest.approx(0.6)  # halfway in log k between 1 and 4
    assert curve.at(8) == math.inf and curve.at(5) == math.inf and curve.at(100) == math.inf
    assert StalenessCurve.parse("1:0.5,4:0.7").at(2) == pytest.approx(0.6)
    for bad in ("1:x", "2:1,1:3", "0:1", "1:-1", ""):
        with pytest.raises(InputError, match="staleness curve"):
            StalenessCurve.parse(bad)


def test_the_least_ratio_from_a_cycle_on_is_a_lower_bound() -> None:
    curve = StalenessCurve(((1, 0.7), (2, 0.7), (4, 0.8), (8, 0.9), (16, 0.85)))
    for k in (1, 3, 5, 9, 16):
        assert curve.least_from(k) == min(curve.at(x) for x in range(k, 17))
    assert curve.least_from(17) == math.inf and curve.least_from(5, upto=4) == math.inf
    assert curve.least_from(5, upto=6) == pytest.approx(min(curve.at(5), curve.at(6)))


def test_a_curve_file_keeps_its_provenance_and_spread(tmp_path) -> None:
    path = str(tmp_path / "staleness.json")
    dump_json_atomic(path, measured_curve().to_data(runs=[{"mode": "kfac"}]))
    with open(path) as f:
        data = json.load(f)
    assert data["format"] == STALENESS_FORMAT and data["curve"][-1]["ratio"] is None  # never: null
    assert data["curve"][0] == {"k": 1, "ratio": 0.5, "steps_min": 140, "steps_median": 150, "steps_max": 160}
    loaded = StalenessCurve.load(path)
    assert loaded.points == measured_curve().points and loaded.spread == measured_curve().spread
    assert loaded.provenance == MEASURED and loaded.source == path
    assert "measured on config 'small' (configs/small.yaml, digest 0123456789abcdef), 300 steps, 3 seeds" \
        in loaded.describe()
    assert read_staleness(path) == loaded  # a path: the file; k:ratio text: inline
    assert read_staleness("1:0.5,2:0.6").points == ((1, 0.5), (2, 0.6)) and read_staleness(None) is None


def test_the_staleness_benchmarks_first_format_still_loads(tmp_path) -> None:
    path = str(tmp_path / "old.json")
    dump_json_atomic(path, {"format": "pipefisher-staleness/1", "horizon": 300, "target": 6.0,
                            "curve": [{"interval": 1, "vs_baseline": 0.5}, {"interval": 16, "vs_baseline": None}],
                            "args": {"config": "configs/small.yaml", "seeds": 3}})
    old = StalenessCurve.load(path)
    assert old.points == ((1, 0.5), (16, math.inf))
    assert old.provenance is not None and old.provenance.config_path == "configs/small.yaml"
    assert old.provenance.horizon == 300 and old.provenance.seeds == 3


@pytest.mark.parametrize("content, why", [
    ("{", "is not valid JSON"),
    ("[1, 2]", "is not a staleness curve"),
    ('{"format": "pipefisher-staleness/9", "curve": []}', "format 'pipefisher-staleness/9'"),
    (f'{{"format": "{STALENESS_FORMAT}", "curve": []}}', "has no 'curve' rows"),
    (f'{{"format": "{STALENESS_FORMAT}", "curve": [{{"k": 1}}]}}', "not a usable staleness curve"),
    (f'{{"format": "{STALENESS_FORMAT}", "curve": [{{"k": 2, "ratio": 1}}, {{"k": 1, "ratio": 1}}]}}',
     "k >= 1 increasing"),
    (f'{{"format": "{STALENESS_FORMAT}", "curve": [{{"k": 1, "ratio": 1}}], "horizon": "long"}}',
     "not a usable staleness curve"),
])
def test_a_bad_curve_file_is_one_line_naming_it(tmp_path, content, why) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError) as err:
        read_staleness(str(path))
    assert str(err.value).startswith(f"{path}: ") and why in str(err.value) and "\n" not in str(err.value)


def test_a_missing_file_or_a_folder_is_one_line(tmp_path) -> None:
    for text, why in ((str(tmp_path / "none.json"), "no such file"), (str(tmp_path), "is a directory")):
        with pytest.raises(InputError, match=why):
            read_staleness(text)


def test_another_configs_curve_is_used_with_one_warning_naming_both() -> None:
    curve = measured_curve()
    assert curve.config_warning("0123456789abcdef", "configs/small.yaml") is None  # its own config
    warning = curve.config_warning("fedcba9876543210", "configs/other.yaml")
    assert warning is not None and "\n" not in warning
    assert "'small' (configs/small.yaml, digest 0123456789abcdef)" in warning
    assert "'configs/other.yaml' (digest fedcba9876543210)" in warning
    assert StalenessCurve.parse("1:0.5").config_warning("x", "y") is None  # given by hand: names no config
    said: list[str] = []
    assert curve_for_job(None, "x", "y", said.append) is None and not said


def test_a_curve_travels_as_data_to_the_workers_and_keeps_its_source() -> None:
    curve = StalenessCurve.parse("1:0.5,2:0.6")
    back = StalenessCurve.from_data(json.loads(json.dumps(staleness_data(curve))), "--staleness")
    assert back.points == curve.points and back.source == curve.source and back.provenance is None
    assert staleness_data(None) is None
