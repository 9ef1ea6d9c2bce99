"""The label grammar, defined once (``pipefisher.schedule.format.parse_label`` over ``TimelineKey.parse``)
and imported by the runtime: what every kind of label means to a node."""
from __future__ import annotations

import os
import re

import pytest

from pipefisher.schedule import timeline
from pipefisher.schedule import format as fmt
from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START, UNKNOWN, Label, parse_label

PACKAGE = os.path.dirname(os.path.abspath(timeline.__file__))


@pytest.mark.parametrize("label,parsed", [
    (START, Label(START, None, None, 0)),
    (END, Label(END, None, None, 0)),
    (SAVE_OFF, Label(SAVE_OFF, None, None, 0)),
    (SAVE_ON, Label(SAVE_ON, None, None, 0)),
    ("call_forward", Label("call_forward", None, None, 0)),
    ("call_backward:up_pipe", Label("call_backward", None, None, 1)),
    ("call_forward:chunk3", Label("call_forward", None, None, 3)),
    ("call_backward:weight", Label("call_backward:weight", None, None, 0)),
    ("call_backward:weight:chunk1", Label("call_backward:weight", None, None, 1)),
    ("cov_kron_A:enc.l0.q", Label("cov_kron", "A", "enc.l0.q", 0)),
    ("sync_kron_B:enc.l0.q:up_pipe", Label("sync_kron", "B", "enc.l0.q", 1)),
    ("inv_kron_A:layers.0.fc:chunk2", Label("inv_kron", "A", "layers.0.fc", 2)),
    ("cov_kron_B", Label("cov_kron", "B", None, 0)),  # older profiles' bare keys
    ("cov_kron_A:layer.0:chunk0", Label("cov_kron", "A", "layer.0:chunk0", 0)),  # chunk 0 has no suffix
    # neither markers, pipeline work nor K-FAC work
    ("-- end --:up_pipe", Label(UNKNOWN, None, None, 1)),
    ("call_forward:weight", Label(UNKNOWN, None, None, 0)),
    ("call_forward:", Label(UNKNOWN, None, None, 0)),
    ("call_backward:encoder.layer.0", Label(UNKNOWN, None, None, 0)),
    ("cov_kron_C:enc.l0.q", Label(UNKNOWN, None, None, 0)),
    ("frobnicate", Label(UNKNOWN, None, None, 0)),
])
def test_every_kind_of_label_parses_to_what_the_runtime_does(label: str, parsed: Label) -> None:
    assert parse_label(label) == parsed


def test_pipeline_labels_are_exactly_their_timeline_keys() -> None:
    for up, chunk in ((False, 0), (True, 0), (False, 2)):
        for kind in (timeline.FORWARD, timeline.BACKWARD, timeline.WEIGHT_KEY):
            key = timeline.pipe_key(kind, up, chunk)
            assert parse_label(key) == (kind, None, None, 1 if up else chunk)
            assert timeline.TimelineKey.parse(key).is_pipeline


def test_the_runtime_imports_the_one_label_grammar() -> None:
    from pipefisher.runtime.pipeline import labels

    assert labels.parse_label is fmt.parse_label
    assert labels.chunk_suffix is timeline.chunk_suffix
    assert labels.KFAC_WORK is timeline.KFAC_WORK
    assert timeline.KFAC_KINDS == tuple(f"{w}_{f}" for w in timeline.KFAC_WORK for f in "AB")


def test_no_second_label_grammar_in_the_package() -> None:
    """Only timeline.py compiles patterns for the ``:chunk<j>`` / ``:up_pipe`` suffixes."""
    pattern = re.compile(r"re\.compile\([^)]*(chunk|up_pipe)")
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != timeline.__file__:
                with open(path, encoding="utf-8") as f:
                    if pattern.search(f.read()):
                        found.append(os.path.relpath(path, PACKAGE))
    assert found == []
