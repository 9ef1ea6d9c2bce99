"""Chrome trace / Perfetto JSON: one thread per node, complete events in microseconds."""
from __future__ import annotations

import json

from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.outputs.plot import chart_from_job
from pipefisher.outputs.trace import trace_events
from pipefisher.schedule.timeline import job_from_dicts
from pipefisher.sim import simulate_timelines, synthetic_model, write_timelines


def test_trace_events_mirror_the_timelines():
    timelines, _ = simulate_timelines(synthetic_model(stages=2, micro_batches=3, layers_per_stage=1, seed=None))
    job = job_from_dicts(timelines)
    data = trace_events(chart_from_job(job))
    events = data["traceEvents"]
    names = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert names[0].startswith("node0") and "busy" in names[0]
    forwards = [e for e in events if e["ph"] == "X" and e["name"] == "call_forward" and e["tid"] == 1]
    assert len(forwards) == 3
    (s, e) = timelines[1]["call_forward"][0]
    assert forwards[0]["ts"] == s / 1000 and forwards[0]["dur"] == (e - s) / 1000  # ns -> us
    assert {e["cat"] for e in events if e["ph"] == "X"} >= {"forward", "backward", "cov_kron_A", "inv_kron_B"}
    json.dumps(data)


def test_trace_cli_writes_json_for_a_packed_schedule(tmp_path):
    timelines, _ = simulate_timelines(synthetic_model(stages=2, micro_batches=4, layers_per_stage=1))
    paths = write_timelines(tmp_path, "x", timelines)
    res = CliRunner().invoke(main, ["trace", *paths, "--packed", "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "t.json").read_text())
    assert any(e["ph"] == "i" for e in data["traceEvents"])  # iteration boundaries
    assert any("usage" in e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name")


def test_trace_file_is_compact_json_equal_to_the_events_and_the_cli_states_its_size(tmp_path):
    import os
    import re

    from pipefisher.outputs.plot import chart_from_schedule
    from pipefisher.outputs.trace import format_size, write_trace
    from pipefisher.policies import get_policy
    from pipefisher.schedule.timeline import load_job

    model = synthetic_model(stages=3, micro_batches=6, layers_per_stage=1)
    paths = write_timelines(tmp_path, "bert-x_1f1b_m6", simulate_timelines(model)[0])
    job = load_job(paths)
    chart = chart_from_schedule(get_policy("compat").pack(job), job)
    write_trace(chart, tmp_path / "direct.json")
    text = (tmp_path / "direct.json").read_text()
    assert json.loads(text) == trace_events(chart)
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) + "\n"  # compact
    assert "\n " not in text
    res = CliRunner().invoke(main, ["trace", *paths, "--policy", "compat", "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    size = os.path.getsize(tmp_path / "t.json")
    assert res.output.strip() == f"wrote {tmp_path / 't.json'} ({format_size(size)})"
    assert re.fullmatch(r"\d+(\.\d)? (B|kB|MB|GB)", format_size(size))
    assert (format_size(999), format_size(12_345), format_size(143_600_000)) == ("999 B", "12.3 kB", "143.6 MB")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # Perfetto's process name says what was packed, how, and under which policy
    (process,) = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert process.startswith("bert-x, 1f1b, m=6:") and "policy compat" in process
    threads = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert "invalid" in threads[1] and "invalid" not in threads[0]


def test_trace_cli_limits_iterations_and_nodes(tmp_path):
    timelines, _ = simulate_timelines(synthetic_model(stages=2, micro_batches=4, layers_per_stage=1))
    paths = write_timelines(tmp_path, "x", timelines)
    res = CliRunner().invoke(main, ["trace", *paths, "--packed", "--iterations", "1", "--node", "1",
                                    "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 0, res.output
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0}
    assert [e["args"]["name"] for e in events if e["name"] == "thread_name"][0].startswith("node1:")
    assert len([e for e in events if e["ph"] == "i"]) == 2  # the one iteration's two boundaries
