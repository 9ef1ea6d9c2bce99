"""The schedule file's format: ``schedules[node][iteration] = [label, ...]``, and what its labels are.

A label is a timeline key (pipeline work, a K-FAC piece) or one of four markers. The markers and the
categories of labels are defined here once: the packers write them, the rules check them, the runtime
runs them (see the format spec in ``docs/formats.md``).
"""
from __future__ import annotations

from functools import lru_cache
from itertools import repeat
from typing import Any

from pipefisher.errors import InputError
from pipefisher.timeline import BACKWARD, FORWARD, TimelineKey

ScheduleData = list[list[list[str]]]

START = "-- start --"
END = "-- end --"
SAVE_OFF = "turn_off_save_inputs_outgrads"
SAVE_ON = "turn_on_save_inputs_outgrads"
MARKERS = (START, END, SAVE_OFF, SAVE_ON)
PIPELINE_CATEGORIES = ("forward", "backward", "weight")
"""The categories of pipeline work (:attr:`TimelineKey.is_pipeline`): what K-FAC must stay out of."""


@lru_cache(maxsize=4096)
def label_category(label: str) -> str:
    """``'forward'``, ``'backward'``, ``'weight'`` (a zero-bubble W pass), ``'marker'``, or the K-FAC
    kind (``'cov_kron_A'``, ...)."""
    if label in MARKERS:
        return "marker"
    key = TimelineKey.parse(label)
    if key.is_weight:
        return "weight"
    if key.kind == FORWARD:
        return "forward"
    if key.kind == BACKWARD:
        return "backward"
    return key.kind if key.is_kfac else "other"


def check_schedule_data(data: Any, path: str | None = None) -> ScheduleData:
    """Check the schedule file's structure: a list per node of a list per iteration of label strings."""
    if not isinstance(data, list):
        raise InputError(path, f"holds a {type(data).__name__}, not a list of per-node schedules")
    for n, node in enumerate(data):
        if not isinstance(node, list):
            raise InputError(path, f"node {n} holds a {type(node).__name__}, not a list of iterations")
        for i, it in enumerate(node):
            if not isinstance(it, list) or not all(map(isinstance, it, repeat(str))):  # a C loop: big files
                raise InputError(path, f"node {n} iteration {i} is not a list of label strings")
    return data
