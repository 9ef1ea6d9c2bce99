"""Chrome trace / Perfetto JSON of a timeline set or a packed schedule (open in ui.perfetto.dev).

One process, one thread per node (named with its usage), one complete event per interval, and an
instant event at every iteration boundary. Times are microseconds, as the format wants.
"""
from __future__ import annotations

import os
from typing import Any

from pipefisher.plot import Chart
from pipefisher.safe_io import dump_json_atomic


def trace_events(chart: Chart) -> dict[str, Any]:
    """The trace as JSON-ready data."""
    to_us = 1e3 if chart.unit == "ms" else 1e6
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": chart.title}},
    ]
    for r, name in enumerate(chart.rows):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": name.replace("\n", " · ")}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for b in sorted(chart.bars, key=lambda b: (b.row, b.start)):
        events.append({
            "name": b.label, "cat": b.category, "ph": "X", "pid": 0, "tid": b.row,
            "ts": round(b.start * to_us, 3), "dur": round((b.end - b.start) * to_us, 3),
        })
    for i, t in enumerate(chart.boundaries):
        events.append({"name": f"iteration boundary {i}", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                       "ts": round(t * to_us, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(chart: Chart, path: str | os.PathLike[str]) -> str:
    """Write the chart's trace JSON atomically; returns the path."""
    dump_json_atomic(path, trace_events(chart))
    return os.fspath(path)
