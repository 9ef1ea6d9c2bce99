"""One place names every file of a run: the driver, the trainer, the closed loop and the export agree."""
from __future__ import annotations

import os

from pipefisher.runtime.job.files import MEASURED, RUN_CHECKPOINTS, RunPaths


def test_every_file_of_a_run_is_its_prefix_and_what_it_is():
    p = RunPaths("runs", "r1")
    assert p.prefix == os.path.join("runs", "r1")
    assert p.metrics == os.path.join("runs", "r1_metrics.csv") and p.losses == os.path.join("runs", "r1_losses.json")
    assert p.checkpoints == os.path.join("runs", "r1" + RUN_CHECKPOINTS)
    assert p.history == os.path.join("runs", "r1_schedules", "history.json")
    assert p.measured_files() == [os.path.join("runs", f"r1_{m}") for m in MEASURED]


def test_a_prefix_names_the_same_run():
    p = RunPaths("runs", "r1")
    assert RunPaths.at(p.prefix) == p and RunPaths.at("r1").cycles == "r1_cycles.jsonl"


def test_a_name_is_taken_once_the_folder_holds_one_of_its_files(tmp_path):
    p = RunPaths(str(tmp_path), "r1")
    assert not p.taken() and not RunPaths(str(tmp_path / "absent"), "r1").taken()
    open(p.config, "w").close()
    assert p.taken() and not RunPaths(str(tmp_path), "r2").taken()
