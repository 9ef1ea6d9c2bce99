"""Schedule files: written and read back, their structure checked on the way in."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.schedule.file import load_schedule, meta_path, modules_difference, save_schedule
from test_rules_validation import GOOD


def test_schedule_files_round_trip_and_are_checked(tmp_path) -> None:
    path = tmp_path / "s.pickle"
    save_schedule(path, [GOOD])
    assert load_schedule(path) == [GOOD]
    (tmp_path / "bad.pickle").write_bytes(__import__("pickle").dumps([[["ok"], "oops"]]))
    with pytest.raises(InputError, match="node 0 iteration 1 is not a list of label strings"):
        load_schedule(tmp_path / "bad.pickle")


def test_validate_of_a_schedule_packed_for_another_pipeline_is_one_line(tmp_path) -> None:
    """A ZB-V schedule against 1F1B timelines: one line saying what its metadata names, not a violation for
    every label; the same for a schedule whose metadata names the pipeline order (packed by a run)."""
    runner = CliRunner()
    for order in ("zb-v", "1f1b"):
        res = runner.invoke(main, ["simulate", "--config", "bert-base-4stages", "--order", order, "-m", "4",
                                   "--stages", "2", "--out", str(tmp_path / order)])
        assert res.exit_code == 0, res.output
    sched = str(tmp_path / "zbv.pickle")
    assert runner.invoke(main, ["schedule", str(tmp_path / "zb-v"), "--save-path", sched]).exit_code == 0
    res = runner.invoke(main, ["validate", "--schedule", sched, str(tmp_path / "1f1b")])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert res.output.startswith(f"error: {sched}: was packed for another job than these timelines: another "
                                 "pipeline order (2 model chunks per device, whole backwards; the timelines: 1 model "
                                 "chunk per device, whole backwards); check it against the timelines it was packed "
                                 f"from (its metadata names {tmp_path / 'zb-v'}"), res.output
    assert runner.invoke(main, ["validate", "--schedule", sched, str(tmp_path / "zb-v")]).exit_code == 0
    meta = json.loads(open(meta_path(sched)).read())  # as a run records it: the order by name
    del meta["packed_for"]["layout"]
    meta["packed_for"].update({"pipeline.order": "zb-h1", "pipeline.chunks": 1})
    open(meta_path(sched), "w").write(json.dumps(meta))
    res = runner.invoke(main, ["validate", "--schedule", sched, str(tmp_path / "1f1b")])
    assert res.exit_code == 2 and "another job than these timelines: pipeline zb-h1 (1 model chunk per device, " \
        "backwards split into B and W; the timelines: 1 model chunk per device, whole backwards)" in res.output


def test_a_module_difference_says_which_are_missing_and_which_extra() -> None:
    assert modules_difference(1, ["a", "b", "c"], ["b", "c", "d", "e"], "in this run") == (
        "node 1's K-FAC modules: 1 of its 3 not in this run (e.g. 'a'); 2 in this run not in it (e.g. 'd')")


def test_an_overlapping_schedule_says_so_beside_it_and_validate_checks_it_by_that_rule(tmp_path, write_pickle) -> None:
    from conftest import overlapping_node

    timeline = write_pickle("job_node0_timeline.pickle", overlapping_node())
    runner = CliRunner()
    sched = str(tmp_path / "s.pickle")
    res = runner.invoke(main, ["schedule", timeline, "--policy", "tight", "--overlap", "--save-path", sched])
    assert res.exit_code == 0, res.output
    meta = json.loads(open(meta_path(sched)).read())
    assert meta["overlap"] is True and meta["nodes"][0]["iterations"] == 2
    res = runner.invoke(main, ["validate", "--schedule", sched, timeline])
    assert res.exit_code == 0 and "overlap" in res.output, res.output
    del meta["overlap"]  # without the flag: today's rules, which it breaks
    open(meta_path(sched), "w").write(json.dumps(meta))
    res = runner.invoke(main, ["validate", "--schedule", sched, timeline])
    assert res.exit_code == 1 and "inv-before-sync" in res.output, res.output
    meta["overlap"] = "yes"
    open(meta_path(sched), "w").write(json.dumps(meta))
    res = runner.invoke(main, ["validate", "--schedule", sched, timeline])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "overlap" in res.output, res.output
    # by default the same as --overlap (tight and target); --no-overlap: a cycle of 3, no flag
    for policy in ("tight", "target"):
        res = runner.invoke(main, ["schedule", timeline, "--policy", policy, "--save-path", sched])
        meta = json.loads(open(meta_path(sched)).read())
        assert res.exit_code == 0 and meta["overlap"] is True and meta["nodes"][0]["iterations"] == 2
    res = runner.invoke(main, ["schedule", timeline, "--policy", "tight", "--no-overlap", "--save-path", sched])
    meta = json.loads(open(meta_path(sched)).read())
    assert res.exit_code == 0 and "overlap" not in meta and meta["nodes"][0]["iterations"] == 3
    # --overlap where the policy cannot overlap: one line; --no-overlap is what such a policy does anyway
    res = runner.invoke(main, ["schedule", timeline, "--policy", "compat", "--overlap"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "--overlap applies to" in res.output, res.output
    res = runner.invoke(main, ["schedule", timeline, "--policy", "compat", "--no-overlap"])
    assert res.exit_code == 0, res.output
