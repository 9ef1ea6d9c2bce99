"""Output checks before any work: a profile's timelines are never overwritten without a word."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.cli._outputs import check_profile_folder
from pipefisher.errors import InputError

from _schedules import TINY


def timeline_filename(name: str, node: int) -> str:
    return f"{name}_node{node}_timeline.pickle"  # as the profiler names them


def test_a_folder_with_this_profiles_timelines_is_refused(tmp_path):
    check_profile_folder(tmp_path / "new", "tiny")  # not there yet: fine
    (tmp_path / timeline_filename("other", 0)).write_bytes(b"")
    check_profile_folder(tmp_path, "tiny")  # another name's files are not overwritten
    (tmp_path / timeline_filename("tiny", 1)).write_bytes(b"")
    with pytest.raises(InputError, match=r"already holds timelines of a profile named 'tiny' "
                                         r"\(tiny_node1_timeline.pickle, 1 file\(s\)\).*another name"):
        check_profile_folder(tmp_path, "tiny")


def test_train_profile_refuses_to_overwrite_before_any_step(tmp_path):
    old = tmp_path / timeline_filename("tiny", 0)
    old.write_bytes(b"the earlier profile")
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--profile", "--out", str(tmp_path), "--steps", "2",
                                    "--no-progress"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert f"error: {tmp_path}: already holds timelines" in res.output and "--set name=NEW" in res.output
    assert old.read_bytes() == b"the earlier profile"
