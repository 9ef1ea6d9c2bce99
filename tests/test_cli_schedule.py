"""``pipefisher schedule``, ``pipefisher validate`` and ``scripts/auto_schedule.py`` as a user runs them."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import COMPAT_CASES, case_timelines, small_node
from pipefisher.cli import main

ROOT = Path(__file__).resolve().parent.parent
CASE = COMPAT_CASES[1]  # case_02: two nodes, two iterations on node 1


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_schedule_prints_the_published_lines_and_writes_the_file(tmp_path) -> None:
    out = tmp_path / "schedule.pickle"
    result = run("schedule", *case_timelines(CASE), "--policy", "compat", "--save-path", str(out))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == (CASE / "expected_report.txt").read_text().splitlines()
    assert pickle.loads(out.read_bytes()) == pickle.loads((CASE / "expected_schedule.pickle").read_bytes())


def test_json_report_holds_the_figures(tmp_path) -> None:
    report = tmp_path / "report.json"
    result = run("schedule", *case_timelines(CASE), "--policy", "compat", "--json", str(report))
    assert result.exit_code == 0
    data = json.loads(report.read_text())
    assert data["policy"] == "compat" and data["time_unit"] == "nanoseconds"
    node1 = data["nodes"][1]
    assert node1["iterations"] == 2 and node1["usage_percent"] == pytest.approx(74.93, abs=0.005)
    for key in ("pipeline_busy_time", "kfac_placed_time", "bubble_time_left", "cycle_time"):
        assert key in node1


def test_print_workloads_lists_items_and_bubbles() -> None:
    result = run("schedule", *case_timelines(CASE), "--policy", "compat", "--print-workloads")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].startswith("node0: ")
    assert any(line.strip().startswith("(bubble)") for line in lines)
    assert any("cov_kron_A:encoder.layer.0.m0" in line and "duration=" in line for line in lines)


def test_validate_exits_1_with_every_violation_and_0_when_clean(tmp_path) -> None:
    bad = COMPAT_CASES[0]  # case_01: the published tool broke rules there
    result = run("validate", "--schedule", str(bad / "expected_schedule.pickle"), *case_timelines(bad))
    assert result.exit_code == 1
    assert "cov-before-backward" in result.output
    assert result.output.count("\n") >= 16
    good = COMPAT_CASES[4]  # case_05 is dependency-correct, but overfills bubbles (float pieces floored to 0)
    result = run("validate", "--no-room", "--schedule", str(good / "expected_schedule.pickle"), *case_timelines(good))
    assert result.exit_code == 0 and "no violations" in result.output
    result = run("validate", "--schedule", str(good / "expected_schedule.pickle"), *case_timelines(good))
    assert result.exit_code == 1 and "bubble-overfilled" in result.output
    ours = tmp_path / "tight.pickle"
    assert run("schedule", *case_timelines(good), "--save-path", str(ours)).exit_code == 0
    result = run("validate", "--schedule", str(ours), *case_timelines(good))
    assert result.exit_code == 0 and "no violations" in result.output


def test_auto_schedule_script_takes_comma_separated_paths(tmp_path) -> None:
    out = tmp_path / "s.pickle"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "auto_schedule.py"), ",".join(case_timelines(CASE)),
         "--save_path", str(out), "--policy", "compat"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == (CASE / "expected_report.txt").read_text().splitlines()
    assert pickle.loads(out.read_bytes()) == pickle.loads((CASE / "expected_schedule.pickle").read_bytes())


class Evil:
    def __reduce__(self):  # noqa: D105
        return (os.system, ("echo pwned",))


def _bad_inputs(tmp_path: Path) -> list[tuple[str, str]]:
    """(path, expected message) for each kind of bad input the issue names."""
    def write(name: str, data: bytes) -> str:
        p = tmp_path / name
        p.write_bytes(data)
        return str(p)

    good = pickle.dumps(small_node())
    no_fwd = small_node(); no_fwd.pop("call_forward")
    no_bwd = small_node(); no_bwd.pop("call_backward")
    counts = small_node(); counts["call_backward"].pop()
    pairs = small_node(); pairs["call_forward"][1] = (1, 2, 3)
    types = small_node(); types["cov_kron_A:layer.0"] = [("a", "b")]
    backwards = small_node(); backwards["cov_kron_B:layer.0"] = [(2_000_000, 1_000_000)]
    (tmp_path / "folder.pickle").mkdir()
    (tmp_path / "run_timelines").mkdir()
    (tmp_path / "run_timelines" / "run_losses.json").write_text("[2.5, 2.25]")
    return [
        (str(tmp_path / "missing.pickle"), "no such file"),
        (str(tmp_path / "folder.pickle"), "is a folder with no node timelines"),
        (str(tmp_path / "run_timelines"), "is a folder with no node timelines"),
        (str(tmp_path / "run_timelines" / "run_losses.json"), "is not a node timeline: it holds a list.*give the folder"),
        (write("run_tokenizer.json", b'{"vocab": [1, 2]}'), "is not a node timeline: it has no 'call_forward' key"),
        (write("backwards.pickle", pickle.dumps(backwards)),
         "key 'cov_kron_B:layer.0' interval 0 ends before it starts: \\(2.000 ms, 1.000 ms\\)"),
        (write("truncated.pickle", good[: len(good) // 2]), "truncated or not a pickle|not a valid pickle"),
        (write("text.pickle", b"just some text\n"), "not a valid pickle|truncated or not a pickle"),
        (write("evil.pickle", pickle.dumps({"call_forward": Evil()})), "refused: the pickle refers to"),
        (write("nofwd.pickle", pickle.dumps(no_fwd)), "has no 'call_forward' key"),
        (write("nobwd.pickle", pickle.dumps(no_bwd)), "has no 'call_backward' key"),
        (write("counts.pickle", pickle.dumps(counts)), "has 2 'call_forward' but 1 'call_backward'"),
        (write("pairs.pickle", pickle.dumps(pairs)), "is not a \\(start, end\\) pair"),
        (write("types.pickle", pickle.dumps(types)), "has a str time, not a number or None"),
    ]


def test_every_bad_input_is_one_line_exit_2_and_leaves_the_old_schedule(tmp_path) -> None:
    out = tmp_path / "schedule.pickle"
    out.write_bytes(b"old contents")
    for path, message in _bad_inputs(tmp_path):
        result = subprocess.run(
            [sys.executable, "-m", "pipefisher", "schedule", path, "--save-path", str(out), "--json",
             str(tmp_path / "r.json")], capture_output=True, text=True, check=False, cwd=ROOT)
        assert result.returncode == 2, (path, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith(f"error: {path}: ")
        import re
        assert re.search(message, lines[0]), (message, lines[0])
        assert out.read_bytes() == b"old contents"
        assert not (tmp_path / "r.json").exists()


def test_a_folder_stands_for_its_node_timelines(tmp_path) -> None:
    # a trainer's run folder: node timelines, and its losses and tokenizer files beside them
    folder = tmp_path / "run_timelines"
    folder.mkdir()
    for i in range(2):
        (folder / f"run_node{i}_timeline.pickle").write_bytes(pickle.dumps(small_node(offset=10 * i)))
    (folder / "run_losses.json").write_text("[2.5, 2.25]")
    (folder / "run_tokenizer.json").write_text('{"vocab": [1, 2]}')
    files = sorted(str(p) for p in folder.glob("*_timeline.pickle"))
    by_files = run("schedule", *files)
    by_folder = run("schedule", str(folder), "--save-path", str(tmp_path / "s.pickle"))
    assert by_folder.exit_code == 0 and by_folder.output == by_files.output
    assert run("validate", "--schedule", str(tmp_path / "s.pickle"), str(folder)).exit_code == 0
    trace = run("trace", str(folder), "--out", str(tmp_path / "t.json"))
    assert trace.exit_code == 0 and (tmp_path / "t.json").exists()


def test_unknown_policy_and_unwritable_output_are_clear(tmp_path) -> None:
    result = run("schedule", *case_timelines(CASE), "--policy", "nope")
    assert result.exit_code == 2 and "unknown policy 'nope' (known: " in result.output
    result = run("schedule", *case_timelines(CASE), "--save-path", str(tmp_path / "no" / "s.pickle"))
    assert result.exit_code == 2 and "cannot be written: its folder does not exist" in result.output


def test_validate_refuses_a_schedule_of_another_job(tmp_path) -> None:
    other = COMPAT_CASES[0]  # 8 nodes, CASE has 2
    result = run("validate", "--schedule", str(other / "expected_schedule.pickle"), *case_timelines(CASE))
    assert result.exit_code == 2 and "has 8 node schedules but the job has 2 timelines" in result.output


def test_scheduling_path_imports_no_torch_and_no_matplotlib() -> None:
    code = "import sys, pipefisher.cli, pipefisher.policies, pipefisher.outputs.report, pipefisher.schedule.file; " \
           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


def test_no_paths_packs_the_bundled_example(tmp_path) -> None:
    out = tmp_path / "s.pickle"
    result = run("schedule", "--policy", "compat", "--save-path", str(out))
    assert result.exit_code == 0, result.output
    assert "packing the bundled example, 4 nodes" in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("node")]) == 4
    assert len(pickle.loads(out.read_bytes())) == 4


def test_margin_is_recorded_beside_the_schedule_and_validate_uses_it(tmp_path) -> None:
    out = tmp_path / "s.pickle"
    paths = case_timelines(CASE)
    result = run("schedule", *paths, "--policy", "tight", "--margin", "0.3", "--save-path", str(out))
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "s.pickle.meta.json").read_text())
    assert meta["margin"] == 0.3 and meta["policy"] == "tight"
    assert [n["iterations"] for n in meta["nodes"]] == [len(it) for it in pickle.loads(out.read_bytes())]
    assert run("validate", "--schedule", str(out), *paths).exit_code == 0  # under the recorded 0.3
    assert run("validate", "--schedule", str(out), "--margin", "0.05", *paths).exit_code == 0  # looser: also ok
    # ... and the timelines it was packed from, which the trainer plans its measurements against
    from pipefisher.schedule.file import schedule_timelines

    assert schedule_timelines(out) == [os.path.abspath(p) for p in paths] == meta["timelines"]
    assert schedule_timelines(tmp_path / "none.pickle") is None


def test_a_schedule_packed_without_margin_is_refused_under_the_default_one(tmp_path) -> None:
    # One bubble of 100 and one covariance piece of 97 (m = 1): it fits with margin 0 (97 < 100),
    # not with 5 % (101.85 > 100), so under the default rule it fits no bubble: forced overflow.
    node = {"call_forward": [(0, 10)], "call_backward": [(110, 120)], "cov_kron_A:l": [(0, 97)],
            "cov_kron_B:l": [(0, 1)], "start_end": [(0, 120)]}
    path = tmp_path / "n.pickle"
    path.write_bytes(pickle.dumps(node))
    out = tmp_path / "s.pickle"
    assert run("schedule", str(path), "--margin", "0", "--save-path", str(out)).exit_code == 0
    assert run("validate", "--schedule", str(out), str(path)).exit_code == 0
    refused = run("validate", "--schedule", str(out), "--margin", "0.05", str(path))
    assert refused.exit_code == 1 and "bubble-overfilled" in refused.output
    default = run("schedule", str(path))
    # times with their unit, per step (over the cycle's 2 iterations) and per cycle
    assert default.exit_code == 0 and "overflow 48 ns per step, 97 ns per cycle]" in default.output


def test_a_plain_schedule_file_drops_stale_metadata(tmp_path) -> None:
    from pipefisher.schedule.file import save_schedule

    out = tmp_path / "s.pickle"
    assert run("schedule", *case_timelines(CASE), "--save-path", str(out)).exit_code == 0
    assert (tmp_path / "s.pickle.meta.json").exists()
    save_schedule(out, pickle.loads(out.read_bytes()))  # hand-written data: no record of its margin
    assert not (tmp_path / "s.pickle.meta.json").exists()


def test_report_says_optimal_or_gap_for_every_policy(tmp_path) -> None:
    report = tmp_path / "r.json"
    for policy in ("tight", "best-fit", "compat"):
        result = run("schedule", *case_timelines(CASE), "--policy", policy, "--json", str(report))
        assert result.exit_code == 0, result.output
        data = json.loads(report.read_text())
        assert data["margin"] == 0.05
        for node in data["nodes"]:
            assert node["gap"] == node["iterations"] - node["lower_bound"]
            assert node["optimal"] == (node["gap"] == 0)
        if policy != "compat":  # compat's lines stay the published ones, character for character
            assert all(("optimal]" in line) or (", gap " in line) for line in result.output.splitlines()
                       if "pipeline iterations" in line)


def test_bad_margin_is_one_line() -> None:
    result = run("schedule", *case_timelines(CASE), "--margin", "-1")
    assert result.exit_code == 2 and "--margin" in result.output


def test_time_limit_belongs_to_the_exact_policy() -> None:
    result = run("schedule", *case_timelines(CASE), "--time-limit", "3")
    assert result.exit_code == 2 and "--time-limit applies to the 'exact' policy only" in result.output


@pytest.mark.parametrize("option", ["--save-path", "--json"])
def test_an_unwritable_output_is_refused_before_any_packing_or_report(tmp_path, option) -> None:
    result = run("schedule", *case_timelines(CASE), option, str(tmp_path / "nonexistent" / "x"))
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"its folder does not exist ({option})" in result.output and "pipeline iterations" not in result.output


def test_schedule_and_validate_refuse_two_jobs_unless_allow_mixed(tmp_path) -> None:
    mixed = case_timelines(CASE) + [str(p) for p in case_timelines(COMPAT_CASES[0])[2:3]]  # + case_01's node 2
    result = run("schedule", *mixed)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "--allow-mixed" in result.output
    out = tmp_path / "s.pickle"
    assert run("schedule", *mixed, "--allow-mixed", "--save-path", str(out)).exit_code == 0
    result = run("validate", "--schedule", str(out), *mixed)
    assert result.exit_code == 2 and "--allow-mixed" in result.output, result.output
    result = run("validate", "--schedule", str(out), *mixed, "--allow-mixed")
    assert result.exit_code in (0, 1) and "--allow-mixed" not in result.output, result.output
    twice = case_timelines(CASE) + case_timelines(CASE)[:1]
    assert "is given twice" in run("schedule", *twice).output


def test_only_a_process_that_ends_with_its_command_freezes_the_packed_job(tmp_path: Path) -> None:
    # The console script freezes what is alive after packing (the collector's passes over a packed job
    # free nothing); a process that goes on (tests, the library, the trainer) must keep collecting.
    import gc

    from pipefisher.cli.schedule import run_schedule

    before = gc.get_freeze_count()
    run_schedule([], None, None, False, echo=lambda _: None)
    assert gc.get_freeze_count() == before and gc.isenabled()
    # there, the collector stays off from loading to the freeze (turned on in between, its first pass
    # would walk everything the packer made), and is on again after it
    code = ("import gc; from pipefisher.cli import _common; _common.ENDS_WITH_COMMAND = True; "
            "from pipefisher.policies.tight import TightPolicy; pack = TightPolicy.pack; "
            "TightPolicy.pack = lambda *a, **k: (pack(*a, **k), print('collector on after packing', gc.isenabled()))[0]; "
            "from pipefisher.cli.schedule import run_schedule; run_schedule([], None, 'tight', False, echo=print); "
            "print('frozen', gc.get_freeze_count(), gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "collector on after packing False" in out
    frozen, enabled = out.split("frozen")[1].split()
    assert int(frozen) > 0 and enabled == "True"


def test_the_default_policy_prints_why_its_k_and_predicts_nothing_without_a_curve() -> None:
    result = run("schedule")
    assert result.exit_code == 0, result.output
    assert "packing densities weighed" in result.output and result.output.count("<- chosen") == 1
    assert "no time-to-target is predicted" in result.output and "chosen: by planned step time alone" in result.output
    assert "time-to-target vs" not in result.output and "never" not in result.output


def test_the_default_policy_takes_a_staleness_curve_inline_or_as_a_file(tmp_path) -> None:
    from pipefisher.cost.staleness import Provenance, StalenessCurve
    from pipefisher.safe_io import dump_json_atomic

    steep = run("schedule", "--staleness", "1:0.5,2:50")  # any staler curvature is ruinous: the shortest k
    tight = run("schedule", "--policy", "tight")
    assert steep.exit_code == 0 and "time-to-target trade-off" in steep.output
    def cycles(output: str) -> list[str]:  # per node its cycle and usage, not the margin its bound is at
        return [line.split(" [")[0] for line in output.splitlines() if " pipeline iterations " in line]

    assert cycles(steep.output) == cycles(tight.output)
    path = str(tmp_path / "staleness.json")
    dump_json_atomic(path, StalenessCurve(((1, 0.5), (2, 50.0)), provenance=Provenance(
        config_digest="0123456789abcdef", config_name="small", config_path="configs/small.yaml", horizon=300)).to_data())
    from_file = run("schedule", "--staleness", path)
    assert from_file.exit_code == 0, from_file.output
    # the job's config is unknown here (timelines only): the report says which one the curve was measured on
    assert f"staleness {path}, measured on config 'small' (configs/small.yaml, digest 0123456789abcdef), 300 steps" \
        in from_file.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "pipefisher-staleness/2"}')
    for args, why in ((["--staleness", "1:x"], "staleness curve '1:x'"),
                      (["--staleness", str(bad)], f"{bad}: has no 'curve' rows"),
                      (["--staleness", str(tmp_path / "none.json")], "none.json: no such file"),
                      (["--policy", "tight", "--staleness", "1:0.5"], "--staleness applies to the 'target'"),
                      (["--policy", "tight", "--kfac-slowdown", "0.2"], "--kfac-slowdown applies to the 'target'")):
        result = run("schedule", *args)
        assert result.exit_code == 2 and why in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_bert_large_packs_near_first_order_without_a_curve_and_for_its_curve_with_one() -> None:
    """The regression job, as a user packs it: no curve, then the convergence benchmark's 1000-step curve,
    then a curve past which k = 7 never reaches the target."""
    files = sorted(str(p) for p in (Path(__file__).parent / "data" / "regressions" / "bert-large-8stages-m12-bs8")
                   .glob("*_timeline.pickle"))
    plain = run("schedule", *files)
    assert plain.exit_code == 0 and "never" not in plain.output
    chosen = next(line for line in plain.output.splitlines() if line.endswith("<- chosen"))
    k, _, overhead = chosen.split()[:3]
    assert k == "7" and float(overhead.rstrip("%")) <= 5.0
    for curve, want in (("1:0.718,2:0.718,4:0.769,8:0.923,16:0.846", "7"), ("1:0.5,2:0.533,4:0.567,6:inf", "3")):
        result = run("schedule", *files, "--staleness", curve)
        chosen = next(line for line in result.output.splitlines() if line.endswith("<- chosen"))
        assert chosen.split()[0] == want, result.output
