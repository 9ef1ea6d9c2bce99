"""The dependency rules of one node's cycle: markers, counts, and K-FAC work after what it needs.

A covariance piece needs the forward (A) or backward (B) of its micro-batch in the first iteration; a
factor's all-reduce needs all its pieces, its inverse the all-reduce (or, without one, the pieces). The
trainer walks the labels one by one, so a label in the wrong place means curvature built from the
wrong data; these rules find every such place.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from pipefisher.rules.violations import Violation
from pipefisher.schedule.format import END, MARKERS, SAVE_OFF, SAVE_ON, START
from pipefisher.schedule.problem import cov_source, source_call
from pipefisher.schedule.timeline import COV_KINDS, NodeTimeline, TimelineKey


def _layer_key(key: TimelineKey) -> tuple[str | None, bool, int]:
    return key.layer


def dependency_violations(node_index: int, node: NodeTimeline, iterations: Sequence[Sequence[str]],
                          needs: str = "the timeline asks for", overlap: bool = False) -> list[Violation]:
    """Every violation of the problem's rules (:mod:`pipefisher.schedule.problem`) in one node's cycle: markers,
    counts, and every K-FAC piece after the work it depends on. ``needs`` says where the counts come
    from in a work-count message (the runtime checks its own step as ``node``). ``overlap``: the cycle
    overlaps the next (schedule metadata ``"overlap": true``): an inverse label may also come before its
    factor's completion, as a piece of the previous cycle's refresh (cyclically, the p labels after a
    completion are its refresh's pieces, and with p of them per cycle they come before the next one)."""
    out: list[Violation] = []

    def bad(iteration: int | None, label: str, rule: str, detail: str) -> None:
        out.append(Violation(node_index, iteration, label, rule, detail))

    if not iterations:
        bad(None, "-", "empty-cycle", "the node has no iterations")
        return out

    chunks = node.chunks
    pipe_counts = {(up, c): node.cov_pieces(up, c) for up in (False, True) for c in chunks}
    known = set(MARKERS)
    expected: dict[str, int] = {}
    has_sync: set[tuple[str, tuple[str | None, bool, int]]] = set()
    for key, intervals in node.entries.items():
        parsed = TimelineKey.parse(key)
        if parsed.is_pipeline:
            known.add(key)
        elif parsed.is_kfac:
            known.add(key)
            per = pipe_counts.get((parsed.up_pipe, parsed.chunk), 0) if parsed.kind in COV_KINDS else 1
            expected[key] = expected.get(key, 0) + len(intervals) * per
            if parsed.kind.startswith("sync"):
                has_sync.add((parsed.factor or "", _layer_key(parsed)))

    # -- markers and per-iteration pipeline work ------------------------------------------------
    last = len(iterations) - 1
    for i, labels in enumerate(iterations):
        if not labels or labels[0] != START:
            bad(i, labels[0] if labels else "-", "iteration-start", f"the iteration does not begin with '{START}'")
        ends = [j for j, label in enumerate(labels) if label == END]
        if len(ends) != 1:
            bad(i, END, "iteration-end", f"the iteration has {len(ends)} '{END}' labels, not 1")
        for pipe_key in node.pipe_keys():
            want = len(node.intervals(pipe_key))
            got = sum(1 for label in labels if label == pipe_key)
            if got != want:
                bad(i, pipe_key, "pipeline-count", f"{got} in the iteration, the pipeline step has {want}")
        for label in labels:
            if label not in known:
                bad(i, label, "unknown-label", "not a marker and not a key of this node's timeline")
        if i == 0:
            after_end = labels[ends[0] + 1:] if len(ends) == 1 else []
            if SAVE_OFF not in after_end:
                bad(0, SAVE_OFF, "save-off", f"the first iteration must stop saving after its '{END}'")
        if i == last and (not labels or labels[-1] != SAVE_ON):
            bad(i, SAVE_ON, "save-on", "the last iteration must end by turning saving back on")

    # -- dependencies, walking the cycle in execution order ---------------------------------------
    seen_pipe: dict[tuple[str, bool, int], int] = defaultdict(int)  # (kind, up pipe, chunk) -> calls in iteration 0
    cov_done: dict[str, int] = defaultdict(int)  # label -> pieces so far
    count: dict[str, int] = defaultdict(int)
    factor_state: dict[tuple[str, tuple[str | None, bool, int]], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for i, labels in enumerate(iterations):
        for label in labels:
            if label in MARKERS or label not in known:
                continue
            key = TimelineKey.parse(label)
            if key.is_pipeline:
                if i == 0 and not key.is_weight:  # a W pass is no forward or backward pieces follow
                    seen_pipe[(key.kind, key.up_pipe, key.chunk)] += 1
                continue
            count[label] += 1
            layer = (key.factor or "", _layer_key(key))
            state = factor_state[layer]
            m = pipe_counts.get((key.up_pipe, key.chunk), 0)
            if key.kind in COV_KINDS:
                j = cov_done[label]
                cov_done[label] += 1
                state["cov"] += 1
                needed_op = cov_source(key.factor, key.up_pipe, key.chunk)
                mb = source_call(j, m)
                if seen_pipe[(TimelineKey.parse(needed_op).kind, key.up_pipe, key.chunk)] < mb + 1:
                    what = "forward" if key.factor == "A" else "backward"
                    rule = f"cov-before-{what}"
                    whose = " (up pipe)" if key.up_pipe else f" of chunk {key.chunk} ('{needed_op}')" if key.chunk else ""
                    bad(i, label, rule, f"piece {j} needs {what} {mb} of the first iteration"
                        f"{whose}, which has not run yet")
            elif key.kind.startswith("sync"):
                cov_key = f"cov_kron_{key.factor}" + label[len(key.kind):]
                want = expected.get(cov_key, 0)
                if state["cov"] < want:
                    bad(i, label, "sync-before-cov", f"only {state['cov']} of {want} covariance pieces done")
                state["sync"] += 1
            elif not overlap:  # inverse
                cov_key = f"cov_kron_{key.factor}" + label[len(key.kind):]
                want = expected.get(cov_key, 0)
                if layer in has_sync:  # the inverse waits for the factor's first sync
                    if state["sync"] < 1:
                        bad(i, label, "inv-before-sync", "the factor has not been all-reduced yet")
                elif state["cov"] < want:
                    bad(i, label, "inv-before-cov", f"only {state['cov']} of {want} covariance pieces done")

    for label, want in expected.items():
        got = count.get(label, 0)
        if got != want:
            what = "pieces" if TimelineKey.parse(label).kind in COV_KINDS else "times"
            bad(None, label, "work-count", f"appears {got} {what} in the cycle, {needs} {want}")
    return out
