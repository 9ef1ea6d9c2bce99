"""The labels the runtime runs: what kind each is, which stage copy it belongs to, and its name there.

A label is a marker (:mod:`pipefisher.rules.format`), ``call_forward``/``call_backward``, a zero-bubble
weight pass ``call_backward:weight``, or a K-FAC piece ``<kind>_A|B:<module>``; any but a marker may end
in ``:up_pipe`` (Chimera's up pipe) or ``:chunk<j>`` (chunk j of an interleaved or ZB-V device). Plain
Python, shared by the engine, the executor and the checks.
"""
from __future__ import annotations

import re

from pipefisher.rules.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.timeline import BACKWARD, FORWARD, UP_SUFFIX
from pipefisher.timeline import WEIGHT_KEY as WEIGHT

KFAC_KINDS = ("cov_kron", "sync_kron", "inv_kron")
"""The kinds of K-FAC work a label names, without the factor (:data:`pipefisher.timeline.KFAC_KINDS` has both)."""

PIPELINE_CALLS = (FORWARD, BACKWARD, WEIGHT)
"""The kinds of label that are pipeline calls (the engine's), as :func:`parse_label` names them."""

CHUNK_SUFFIX = ":chunk"
_CHUNK_RE = re.compile(r":chunk([1-9][0-9]*)$")


def chunk_suffix(chunk: int) -> str:
    """The key suffix of an interleaved device's chunk: none for chunk 0, ``:chunk<j>`` otherwise."""
    return f"{CHUNK_SUFFIX}{chunk}" if chunk else ""


def copy_suffix(copy: int, interleaved: bool) -> str:
    """The label suffix of a device's stage copy: its chunk's (interleaved) or its pipe's (Chimera)."""
    return chunk_suffix(copy) if interleaved else (UP_SUFFIX if copy else "")


def parse_label(label: str) -> tuple[str, str | None, str | None, int]:
    """``(kind, factor, module, copy)``: kind is a marker, ``call_forward``/``call_backward``,
    ``call_backward:weight`` (:data:`WEIGHT`), ``cov_kron``, ``sync_kron``, ``inv_kron`` or ``unknown``;
    copy is 1 for ``:up_pipe`` labels and
    j for ``:chunk<j>`` ones (:func:`label_is_chunked` tells the two apart), else 0."""
    pipe = 0
    if label.endswith(UP_SUFFIX):
        label, pipe = label[: -len(UP_SUFFIX)], 1
    elif (hit := _CHUNK_RE.search(label)) is not None:
        label, pipe = label[: hit.start()], int(hit.group(1))
    if label in (START, END, SAVE_OFF, SAVE_ON):
        return (label, None, None, 0) if pipe == 0 else ("unknown", None, None, pipe)
    if label in (FORWARD, BACKWARD, WEIGHT):
        return label, None, None, pipe
    head, _, module = label.partition(":")
    for kind in KFAC_KINDS:
        if head in (kind + "_A", kind + "_B"):
            return kind, head[-1], module or None, pipe
    return "unknown", None, None, pipe


def labelled(name: str, pipe: int, interleaved: bool = False) -> str:
    """A module's name as its labels carry it (``:up_pipe`` for the up copy, ``:chunk<j>`` for chunk j)."""
    return name + copy_suffix(pipe, interleaved)
