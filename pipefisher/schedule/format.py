"""The schedule file's format: ``schedules[node][iteration] = [label, ...]``, and what its labels are.

A label is a timeline key (pipeline work, a K-FAC piece) or one of four markers. The markers and the
categories of labels are defined here once: the packers write them, the rules check them, the runtime
runs them (see the format spec in ``docs/formats.md``).
"""
from __future__ import annotations

from functools import lru_cache
from itertools import repeat
from typing import Any, NamedTuple

from pipefisher.errors import InputError
from pipefisher.schedule.timeline import BACKWARD, FORWARD, WEIGHT_KEY, TimelineKey

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


UNKNOWN = "unknown"
"""The kind :func:`parse_label` gives a label that is neither a marker, pipeline work nor K-FAC work."""


class Label(NamedTuple):
    """A label as a node runs it (:func:`parse_label`)."""

    kind: str
    """A marker, ``call_forward``/``call_backward``, ``call_backward:weight`` (a zero-bubble W pass),
    a K-FAC work kind without its factor (:data:`pipefisher.schedule.timeline.KFAC_WORK`), or :data:`UNKNOWN`."""
    factor: str | None
    """``'A'`` or ``'B'`` for K-FAC work, else None."""
    module: str | None
    """The K-FAC work's module (None where the label has none), else None."""
    copy: int
    """The stage copy: 1 for ``:up_pipe`` (Chimera), j for ``:chunk<j>`` (interleaved, ZB-V), else 0."""


@lru_cache(maxsize=65536)
def parse_label(label: str) -> Label:
    """What a label asks a node to do, read with the one key grammar (:meth:`TimelineKey.parse`); a
    marker with a pipe or chunk suffix, or pipeline work with a module, is :data:`UNKNOWN`."""
    if label in MARKERS:
        return Label(label, None, None, 0)
    key = TimelineKey.parse(label)
    copy = 1 if key.up_pipe else key.chunk
    if key.is_pipeline and str(key) == label:  # exactly its key: ``call_forward:`` is none
        return Label(WEIGHT_KEY if key.is_weight else key.kind, None, None, copy)
    if key.is_kfac:
        return Label(key.kind[: -len("_A")], key.factor, key.module, copy)
    return Label(UNKNOWN, None, None, copy)


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
