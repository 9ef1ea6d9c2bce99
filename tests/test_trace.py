"""Chrome trace / Perfetto JSON: one thread per node, complete events in microseconds."""
from __future__ import annotations

import json

from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.plot import chart_from_job
from pipefisher.sim import simulate_timelines, synthetic_model, write_timelines
from pipefisher.timeline import job_from_dicts
from pipefisher.trace import trace_events


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
