"""Schedule files: written and read back, their structure checked on the way in."""
from __future__ import annotations

import pytest

from pipefisher.errors import InputError
from pipefisher.schedule_file import load_schedule, save_schedule
from test_rules_validation import GOOD


def test_schedule_files_round_trip_and_are_checked(tmp_path) -> None:
    path = tmp_path / "s.pickle"
    save_schedule(path, [GOOD])
    assert load_schedule(path) == [GOOD]
    (tmp_path / "bad.pickle").write_bytes(__import__("pickle").dumps([[["ok"], "oops"]]))
    with pytest.raises(InputError, match="node 0 iteration 1 is not a list of label strings"):
        load_schedule(tmp_path / "bad.pickle")
