"""What the runtime adds to the label grammar: which labels are its engine's calls, and how a stage
copy's labels are named.

The grammar itself (markers, ``call_forward``/``call_backward``, the zero-bubble weight pass
``call_backward:weight``, K-FAC pieces ``<kind>_A|B:<module>``, the ``:up_pipe`` and ``:chunk<j>``
suffixes) is defined once on the scheduling side: :func:`pipefisher.schedule.format.parse_label` over
:class:`pipefisher.schedule.timeline.TimelineKey`; this module re-exports it for the engine, the executor and
the checks. Plain Python.
"""
from __future__ import annotations

from pipefisher.schedule.format import UNKNOWN, parse_label
from pipefisher.schedule.timeline import BACKWARD, FORWARD, KFAC_WORK, UP_SUFFIX, chunk_suffix
from pipefisher.schedule.timeline import WEIGHT_KEY as WEIGHT

__all__ = ["BACKWARD", "FORWARD", "KFAC_WORK", "PIPELINE_CALLS", "UNKNOWN", "WEIGHT", "chunk_suffix",
           "copy_suffix", "labelled", "parse_label"]

PIPELINE_CALLS = (FORWARD, BACKWARD, WEIGHT)
"""The kinds of label that are pipeline calls (the engine's), as :func:`parse_label` names them."""


def copy_suffix(copy: int, interleaved: bool) -> str:
    """The label suffix of a device's stage copy: its chunk's (interleaved) or its pipe's (Chimera)."""
    return chunk_suffix(copy) if interleaved else (UP_SUFFIX if copy else "")


def labelled(name: str, pipe: int, interleaved: bool = False) -> str:
    """A module's name as its labels carry it (``:up_pipe`` for the up copy, ``:chunk<j>`` for chunk j)."""
    return name + copy_suffix(pipe, interleaved)
