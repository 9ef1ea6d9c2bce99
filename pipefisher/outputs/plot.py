"""Gantt charts of a timeline set or a packed schedule: one row per node, idle time in its own fill.

The chart is first built as plain data (:class:`Chart`: rows, bars, iteration boundaries), which the
PNG/SVG renderer here and the Chrome-trace writer (:mod:`pipefisher.outputs.trace`) both draw from.
matplotlib and numpy are imported only when rendering.

A large job has over a million bars, most far narrower than a pixel. The renderer therefore draws
what a pixel can show: each kind's items closer than a pixel merge into one bar (:func:`merge_bars`),
every bar is at least a pixel wide, only bars wide enough to see get an edge, and each kind is one
collection artist, so drawing costs the same for 4 or 4000 micro-batches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from pipefisher.errors import InputError
from pipefisher.rules.violations import Violation
from pipefisher.safe_io import atomic_path
from pipefisher.schedule.format import MARKERS, PIPELINE_CATEGORIES, label_category
from pipefisher.schedule.packed import JobSchedule
from pipefisher.sim.simulator import parse_default_prefix
from pipefisher.schedule.timeline import (PRECONDITION_KEY, STEP_KEY, UP_PIPE, UPDATE_KEY, Job, TimelineKey,
                                          node_file_prefix)

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure
    from pipefisher.cost.measure import InstructionRow

CATEGORY_ORDER = ("forward", "backward", "weight", "cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B",
                  "inv_kron_A", "inv_kron_B", "update", "precondition", "other")
COLOURS = {
    "forward": "#4c78a8",
    "backward": "#54a24b",
    "weight": "#17becf",
    "cov_kron_A": "#f58518",
    "cov_kron_B": "#ffbf79",
    "sync_kron_A": "#7a4fa3",
    "sync_kron_B": "#b9a0d9",
    "inv_kron_A": "#e45756",
    "inv_kron_B": "#ff9d98",
    "update": "#c9b8a6",
    "precondition": "#8c564b",
    "other": "#9d9d9d",
}
LEGEND = {
    "forward": "forward", "backward": "backward", "weight": "weight grad (W)",
    "cov_kron_A": "cov A", "cov_kron_B": "cov B", "sync_kron_A": "sync A", "sync_kron_B": "sync B",
    "inv_kron_A": "inv A", "inv_kron_B": "inv B", "update": "update", "precondition": "preconditioning",
    "other": "other",
}
UP_HATCH = "////"
CHUNK_TINT = 0.35
"""How much lighter (mixed with white) each further model chunk's forwards and backwards are drawn, so
interleaved schedules show which chunk runs when (capped at :data:`CHUNK_TINT_MAX`)."""
CHUNK_TINT_MAX = 0.75


def chunk_of(category: str, label: str) -> int:
    """The model chunk a pipeline bar belongs to (``:chunk<j>`` labels); 0 for every other bar."""
    return TimelineKey.parse(label).chunk if category in PIPELINE and ":chunk" in label else 0


def chunk_colour(colour: str, chunk: int) -> tuple[float, float, float]:
    """``colour`` lightened for model chunk ``chunk`` (chunk 0 keeps it)."""
    from matplotlib.colors import to_rgb

    t = min(CHUNK_TINT * chunk, CHUNK_TINT_MAX)
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * t, g + (1 - g) * t, b + (1 - b) * t)
IDLE = "#dcdcdc"
"""Fill of a node's idle time (its bubbles): a band under the bars over the node's cycle, distinct
from the white background between rows."""
BACKGROUND = "white"
INVALID = "#c00000"
"""Colour of the row label of a node whose schedule does not validate."""
OVERRUN = "#c00000"
"""Outline of measured K-FAC work that kept the next call waiting past its planned bubble."""
OVERRUN_LW = 1.2
WIDTH_IN = 14.0
ROW_IN = 0.55
EXTRA_IN = 2.0
DPI = 100
LEFT_IN = 1.5
RIGHT_IN = 0.25
PLOT_PX = round((WIDTH_IN - LEFT_IN - RIGHT_IN) * DPI)
"""Width of the time axis in pixels: the resolution bars are merged at."""
EDGE_PX = 3.0
"""Bars at least this many pixels wide get an edge (a darker shade of their fill), and two such bars
that touch stay apart; narrower bars have no edge, which would otherwise be all one saw of them."""
EDGE_LW = 0.5
BOUNDARY_PX = 8.0
"""Iteration boundaries closer than this many pixels are thinned to every k-th one."""
S_FROM = 10.0
"""Spans of at least this many seconds are labelled in s, shorter ones in ms."""
ROW_H = 0.76
PIPELINE = PIPELINE_CATEGORIES


class Bar(NamedTuple):
    """One interval of one row (a tuple: a packed chart of a large job has over a million)."""

    row: int
    start: float
    end: float
    category: str
    label: str

    @property
    def up_pipe(self) -> bool:
        """Work of Chimera's second (up) pipe, drawn hatched."""
        return self.label.endswith(":" + UP_PIPE)


@dataclass(frozen=True)
class Chart:
    """What a Gantt chart shows, in milliseconds (or seconds for float timelines, see ``unit``)."""

    title: str
    rows: tuple[str, ...]
    bars: tuple[Bar, ...]
    boundaries: tuple[float, ...]
    """Times of iteration boundaries (drawn as dashed lines)."""
    end: float
    unit: str
    spans: tuple[tuple[float, float], ...] = ()
    """Per row, the time the node is in its step or cycle: drawn as an idle band under the bars, so
    bubbles show as idle rather than as background. Empty: every row spans the whole chart."""
    invalid: tuple[int, ...] = ()
    """Rows whose node's schedule does not validate (their label, which says so, is drawn red)."""
    outlined: tuple[Bar, ...] = ()
    """Bars drawn again as a red outline over the rest: measured K-FAC work that overran its bubble."""


def category(label: str) -> str:
    """The colour group of a timeline key or schedule label (a profile's end-of-step keys have their own)."""
    if label in (UPDATE_KEY, PRECONDITION_KEY):
        return label
    cat = label_category(label)
    return cat if cat in COLOURS else "other"


def _scale(job: Job) -> tuple[float, str]:
    return (1.0, "s") if isinstance(job.span, float) else (1e-6, "ms")




def job_name(job: Job) -> str | None:
    """The node files' common name prefix (``<prefix>_node<i>_timeline.pickle``): the job's name, as
    profilers and ``pipefisher simulate`` give it; None for nodes not read from files."""
    files = [os.path.basename(n.path) for n in job.nodes if not n.path.startswith("<")]
    if not files:
        return None
    prefixes = {p for p in map(node_file_prefix, files) if p is not None}
    if prefixes:
        return prefixes.pop() if len(prefixes) == 1 else None  # several jobs' files (--allow-mixed): no one name
    prefix = os.path.commonprefix([os.path.splitext(f)[0] for f in files]).rstrip("_-. ")
    return prefix or None


def job_context(job: Job) -> str:
    """Model, pipeline order and micro-batches, as far as the timelines tell, for titles.

    Only the file names carry them: ``pipefisher simulate``'s prefix
    (:func:`pipefisher.sim.simulator.default_prefix`) gives all three; any other name is shown as it is, with the forward passes each node ran.
    """
    name = job_name(job)
    sim = parse_default_prefix(name) if name else None
    if sim:
        shape = (f", {sim['stages']} stages" if sim["stages"] else "") + (f", v={sim['chunks']}" if sim["chunks"] else "")
        return f"{sim['model']}, {sim['order']}{shape}, m={sim['m']}"
    node0 = job.nodes[0]
    forwards = node0.micro_batches(up_pipe=True) + sum(node0.micro_batches(chunk=c) for c in node0.chunks)
    return f"{name + ', ' if name else ''}{len(job.nodes)} nodes, {forwards} forward passes per node"


def _pick_nodes(count: int, node: int | None) -> list[int]:
    if node is None:
        return list(range(count))
    if not 0 <= node < count:
        raise InputError(None, f"--node {node}: the job has nodes 0 to {count - 1}")
    return [node]


def chart_from_job(job: Job, title: str | None = None, node: int | None = None) -> Chart:
    """Every interval of every node (or of ``node`` only) as recorded: the pipeline, then the node's
    naive K-FAC work, then its update, where recorded.

    A row's usage is its busy time over the step (0 to the latest end of any node); the preconditioning
    runs inside the update, so it counts once.
    """
    k, unit = _scale(job)
    bars: list[Bar] = []
    end = float(job.span)
    busy: list[float] = []
    picked = _pick_nodes(len(job.nodes), node)
    for r, i in enumerate(picked):
        total = 0.0
        for key, intervals in job.nodes[i].entries.items():
            if key == STEP_KEY:
                continue
            cat = category(key)
            nested = key == PRECONDITION_KEY and UPDATE_KEY in job.nodes[i].entries
            for iv in intervals:
                if iv.start is None or iv.end is None:
                    continue
                bars.append(Bar(r, iv.start * k, iv.end * k, cat, key))
                if not nested:
                    total += (iv.end - iv.start) * k
                end = max(end, float(iv.end))
        busy.append(total)
    end_scaled = end * k
    rows = tuple(f"node{i}\nbusy {100 * b / end_scaled:.1f} %" if end_scaled else f"node{i}"
                 for i, b in zip(picked, busy))
    title = title or f"{job_context(job)}: pipeline step (timelines){'' if node is None else f', node {node}'}"
    return Chart(title, rows, tuple(bars), (0.0, job.span * k), end_scaled, unit)


def violations_per_node(schedule: JobSchedule, job: Job,
                        violations: Sequence[Violation] | None = None) -> dict[int, int]:
    """How many rules each node's schedule breaks (:func:`pipefisher.rules.validate`, under the
    margin it was packed with, unless the caller already has its ``violations``); nodes that break none
    are left out."""
    if violations is None:
        from pipefisher.rules import validate

        violations = validate(schedule.to_file_data(), job, margin=schedule.margin, overlap=schedule.overlap)
    counts: dict[int, int] = {}
    for v in violations:
        counts[v.node] = counts.get(v.node, 0) + 1
    return counts


def chart_from_schedule(schedule: JobSchedule, job: Job, title: str | None = None, iterations: int | None = None,
                        node: int | None = None, check: bool = True,
                        violations: Sequence[Violation] | None = None) -> Chart:
    """A packed K-FAC cycle: iteration ``i`` drawn after iteration ``i - 1``, each row with its usage.

    Placement times are relative to their iteration; an iteration lasts the pipeline span, or longer
    where a policy let work overflow it. ``iterations``: draw only the first that many; ``node``: only
    that node's row. With ``check``, nodes whose schedule does not validate say so in their row label
    (a chart of a broken schedule otherwise looks as plausible as any other); ``violations``: the
    schedule's, where the caller has already validated it.
    """
    if iterations is not None and iterations < 1:
        raise InputError(None, f"--iterations must be at least 1, got {iterations}")
    k, unit = _scale(job)
    span = float(job.span)
    n_iter = 1
    length: dict[int, float] = {}
    for nd in schedule.nodes:
        for p in nd.placements:
            it = p.iteration
            if it + 1 > n_iter:
                n_iter = it + 1
            if p.end is not None and it >= 0 and p.end > length.get(it, span):
                length[it] = float(p.end)
    offsets = [0.0]
    for it in range(n_iter):
        offsets.append(offsets[-1] + length.get(it, span))
    shown = n_iter if iterations is None else min(iterations, n_iter)
    picked = _pick_nodes(len(schedule.nodes), node)
    bad = violations_per_node(schedule, job, violations) if check else {}
    cats: dict[str, str | None] = {m: None for m in MARKERS}
    bars: list[Bar] = []
    append = bars.append
    new = tuple.__new__  # Bar(...) without the NamedTuple's Python-level __new__: a third of the time here
    for r, i in enumerate(picked):
        for label, start, end, it in schedule.nodes[i].placements:
            if it >= shown or start is None or end is None or end <= start:
                continue
            cat = cats.get(label, "")
            if cat == "":
                cat = cats[label] = category(label)
            if cat is None:
                continue
            off = offsets[it if it > 0 else 0]
            append(new(Bar, (r, (off + start) * k, (off + end) * k, cat, label)))
    rows = []
    for i in picked:
        fig = schedule.nodes[i].figures
        # short enough for the label margin; `pipefisher validate` lists the violations
        note = f"\ninvalid: {bad[i]} violation{'s' if bad[i] != 1 else ''}" if i in bad else ""
        rows.append(f"node{i}: {fig.iterations} it.\nusage {fig.usage:.1f} %{note}")
    spans = tuple((0.0, offsets[min(schedule.nodes[i].figures.iterations, shown)] * k) for i in picked)
    invalid = tuple(r for r, i in enumerate(picked) if i in bad)
    if not title:
        limits = (f", first {shown} of {n_iter} iterations" if shown < n_iter else "") + \
                 ("" if node is None else f", node {node}")
        title = f"{job_context(job)}: K-FAC packed into bubbles (policy {schedule.policy}{limits})"
    return Chart(title, tuple(rows), tuple(bars), tuple(o * k for o in offsets[:shown + 1]), offsets[shown] * k, unit,
                 spans, invalid)


# ----------------------------------------------------------------------------------------------------
# Planned vs measured: a run's per-instruction CSV (pipefisher.cost.measure.CSV_COLUMNS)


class MeasuredStep(NamedTuple):
    """One node's step of a measurements CSV: its iteration and its rows (labels in the order they ran)."""

    iteration: int
    entries: list[InstructionRow]


def read_measured(path: str | os.PathLike[str]) -> dict[int, dict[int, MeasuredStep]]:
    """Replica 0's steps of a measurements CSV (:func:`pipefisher.cost.measure.read_rows`), planned times
    kept: ``{node: {step: MeasuredStep}}``; a CSV without replica-0 rows is an :class:`InputError`."""
    from pipefisher.cost.measure import read_rows

    out: dict[int, dict[int, MeasuredStep]] = {}
    for row in read_rows(path):
        if row.replica != 0:
            continue
        steps = out.setdefault(row.node, {})
        if row.step not in steps:
            steps[row.step] = MeasuredStep(row.iteration, [])
        steps[row.step].entries.append(row)
    if not out:
        raise InputError(os.fspath(path), "has no measurements of replica 0 (only replica 0 is drawn)")
    return out


def _node_cycle(iterations: Sequence[int]) -> int:
    """A node's K-FAC cycle length: the distinct iteration values of its last steps (walking back from
    the last until one repeats)."""
    seen: set[int] = set()
    for it in reversed(iterations):
        if it in seen:
            break
        seen.add(it)
    return max(len(seen), 1)


def measured_steps(data: dict[int, dict[int, MeasuredStep]], nodes: Sequence[int], iterations: int | None = None,
                   step: int | None = None, path: str | None = None) -> list[int]:
    """The steps a planned-vs-measured chart draws, among those every node of ``nodes`` has.

    ``step``: from that step on, ``iterations`` steps (default: a cycle); else ``iterations``: the last
    that many; else the last complete K-FAC cycle: the last run of steps that takes the node with the
    longest cycle (see :func:`_node_cycle`) from iteration 0 to its last (the last cycle-many steps if
    none does).
    """
    common = sorted(set.intersection(*(set(data[n]) for n in nodes)))
    if not common:
        raise InputError(path, "its nodes have no step in common")
    cycles = [_node_cycle([data[n][s].iteration for s in common]) for n in nodes]
    cycle = max(cycles)
    if step is not None:
        if step not in common:
            which = f"of node {nodes[0]}" if len(nodes) == 1 else "common to all nodes"
            raise InputError(path, f"--step {step} is not in the file (its steps {which}: {common[0]} to {common[-1]})")
        i = common.index(step)
        return common[i:i + (iterations or cycle)]
    if iterations is not None:
        return common[-iterations:]
    ref = nodes[cycles.index(cycle)]
    for e in range(len(common), cycle - 1, -1):
        window = common[e - cycle:e]
        if [data[ref][s].iteration for s in window] == list(range(cycle)):
            return window
    return common[-cycle:]


def _overrunning(entries: Sequence[InstructionRow]) -> set[int]:
    """Indices of the K-FAC entries whose work kept the next call waiting past its planned bubble
    (:func:`pipefisher.cost.measure.gap_overruns`) significantly (:func:`pipefisher.cost.measure.significant`); planned
    bubbles from the planned times, so none where a call has no planned time."""
    from pipefisher.cost.measure import LabelTime, StepRecord, gap_overruns, is_kfac, is_pipeline, significant
    from pipefisher.schedule.format import END, START

    calls = [e for e in entries if is_pipeline(e.label)]
    if not calls or any(e.planned_start is None or e.planned_end is None for e in calls):
        return set()
    first = next((e for e in entries if e.label == START and e.planned_start is not None), None)
    prev = first.planned_start if first is not None else 0.0
    planned: list[float] = []
    for e in calls:
        planned.append(max(0.0, e.planned_start - prev))  # type: ignore[operator]
        prev = max(prev, e.planned_end)  # type: ignore[type-var]
    end = next((e for e in entries if e.label == END and e.planned_start is not None), None)
    if end is not None:
        planned.append(max(0.0, end.planned_start - prev))  # type: ignore[operator]
    record = StepRecord(0, 0, 0, 0, tuple(LabelTime(e.label, e.start, e.end, e.wait) for e in entries))
    over = gap_overruns(record, planned)
    out: set[int] = set()
    gap = 0
    for j, e in enumerate(entries):
        if e.label == END:
            break
        if is_pipeline(e.label):
            gap += 1
        elif is_kfac(e.label) and gap < len(over) and significant(over[gap], planned[gap]):
            out.add(j)
    return out


def chart_from_measured(path: str | os.PathLike[str], node: int | None = None, iterations: int | None = None,
                        step: int | None = None, title: str | None = None) -> Chart:
    """A run's measurements CSV: per node (replica 0), a planned row and a measured row, step after step.

    Each step starts where the previous one ends: after the longer of its planned and measured lengths
    over all drawn rows, so every row's step starts at the same boundary (a dashed line). The planned row
    has a bar for every label with planned times; the measured row one per label as it ran, a forward's
    or backward's from its start plus its wait (the wait for its input is idle time: the bubble as it
    really was). Measured K-FAC work that kept the next call waiting past its planned bubble is
    outlined red (:func:`_overrunning`). Times are seconds. Steps: see :func:`measured_steps`.
    """
    if iterations is not None and iterations < 1:
        raise InputError(None, f"--iterations must be at least 1, got {iterations}")
    p = os.fspath(path)
    data = read_measured(p)
    nodes = sorted(data)
    if node is not None and node not in data:
        have = (f"{nodes[0]} to {nodes[-1]}" if nodes == list(range(nodes[0], nodes[-1] + 1))
                else ", ".join(map(str, nodes)))
        raise InputError(p, f"--node {node}: the file has nodes {have}")
    picked = nodes if node is None else [node]
    steps = measured_steps(data, picked, iterations, step, p)
    offsets = [0.0]
    for s in steps:
        length = 0.0
        for n in picked:
            for e in data[n][s].entries:
                length = max(length, e.end, e.planned_end if e.planned_end is not None else 0.0)
        offsets.append(offsets[-1] + length)
    bars: list[Bar] = []
    outlined: list[Bar] = []
    rows: list[str] = []
    for r, n in enumerate(picked):
        planned_row, measured_row = 2 * r, 2 * r + 1
        has_plan, overruns = False, 0
        for s, off in zip(steps, offsets):
            entries = data[n][s].entries
            over = _overrunning(entries)
            for j, e in enumerate(entries):
                if e.label in MARKERS:
                    continue
                cat = category(e.label)
                if e.planned_start is not None and e.planned_end is not None:
                    has_plan = True
                    if e.planned_end > e.planned_start:
                        bars.append(Bar(planned_row, off + e.planned_start, off + e.planned_end, cat, e.label))
                start = min(e.start + max(e.wait, 0.0), e.end)
                if e.end > start:
                    bar = Bar(measured_row, off + start, off + e.end, cat, e.label)
                    bars.append(bar)
                    if j in over:
                        outlined.append(bar)
                        overruns += 1
        rows.append(f"node{n} planned" + ("" if has_plan else "\n(no plan in file)"))
        rows.append(f"node{n} measured" + (f"\n{overruns} K-FAC overrun{'s' if overruns != 1 else ''}" if overruns else ""))
    if not title:
        which = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
        title = f"{os.path.basename(p)}: planned vs measured, {which}" + ("" if node is None else f", node {node}")
    return Chart(title, tuple(rows), tuple(bars), tuple(offsets), offsets[-1], "s", outlined=tuple(outlined))


def chart_size_px(rows: int) -> tuple[int, int]:
    """Pixel size of a rendered PNG with ``rows`` rows."""
    return round(WIDTH_IN * DPI), round((EXTRA_IN + ROW_IN * rows) * DPI)


def time_unit(chart: Chart) -> tuple[float, str]:
    """The factor from the chart's unit to the time axis's, and that unit's name: s for spans of
    :data:`S_FROM` seconds or more, ms for shorter ones (tick labels then stay short, with no offset)."""
    seconds = chart.end * (1e-3 if chart.unit == "ms" else 1.0)
    unit = "s" if seconds >= S_FROM else "ms"
    if unit == chart.unit:
        return 1.0, unit
    return (1e-3, unit) if chart.unit == "ms" else (1e3, unit)


def merge_bars(rows: Any, starts: Any, ends: Any, px: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One kind's bars as the chart's resolution can show them, ``px`` being one pixel in time.

    Items of a row less than a pixel apart become one bar (a million sub-pixel bars would otherwise
    each be rasterised, and none would show), except two that are both at least :data:`EDGE_PX`
    pixels wide: separate micro-batches stay apart where there is room to see them. Returns the
    merged bars' rows, starts and ends, sorted by row and start.
    """
    import numpy as np

    r = np.asarray(rows, dtype=np.int64)
    s = np.asarray(starts, dtype=float)
    e = np.asarray(ends, dtype=float)
    if r.size == 0:
        return r, s, e
    order = np.lexsort((s, r))
    r, s, e = r[order], s[order], e[order]
    wide = (e - s) >= EDGE_PX * px
    new = np.empty(r.size, dtype=bool)
    new[0] = True
    new[1:] = (r[1:] != r[:-1]) | (s[1:] - e[:-1] >= px) | (wide[1:] & wide[:-1])
    first = np.flatnonzero(new)
    return r[first], s[first], np.maximum.reduceat(e, first)


def overlaps(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> tuple[list[int], list[float], list[float]]:
    """Where two kinds' merged bars (rows, starts, ends; sorted as :func:`merge_bars` returns them)
    overlap in one row: rows, starts, ends of the overlaps."""
    ar, as_, ae = (x.tolist() if hasattr(x, "tolist") else list(x) for x in a)  # plain numbers compare faster
    br, bs, be = (x.tolist() if hasattr(x, "tolist") else list(x) for x in b)
    rows: list[int] = []
    starts: list[float] = []
    ends: list[float] = []
    i = j = 0
    while i < len(ar) and j < len(br):
        if ar[i] == br[j]:
            lo, hi = max(as_[i], bs[j]), min(ae[i], be[j])
            if hi > lo:
                rows.append(ar[i])
                starts.append(lo)
                ends.append(hi)
        if (ar[i], ae[i]) < (br[j], be[j]):
            i += 1
        else:
            j += 1
    return rows, starts, ends


def _boxes(rows: Any, starts: Any, ends: Any, n: int, lo: float = -ROW_H / 2, hi: float = ROW_H / 2) -> np.ndarray:
    """Rectangles (PolyCollection vertices) of bars on rows counted from the top, from ``lo`` to
    ``hi`` about the row's centre."""
    import numpy as np

    rows, starts, ends = np.asarray(rows), np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    y0 = (n - 1 - rows) + lo
    y1 = (n - 1 - rows) + hi
    return np.stack([np.stack(p, axis=1) for p in ((starts, y0), (starts, y1), (ends, y1), (ends, y0))], axis=1)


def figure(chart: Chart) -> Figure:
    """The chart drawn on a matplotlib figure (Agg canvas, no GUI): what :func:`render` saves.

    One collection per kind (and pipe) whatever the number of bars; see the module's docstring.
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import ScalarFormatter

    n = max(len(chart.rows), 1)
    h = EXTRA_IN + ROW_IN * n
    fig = Figure(figsize=(WIDTH_IN, h), dpi=DPI)
    FigureCanvasAgg(fig)
    # fixed margins (in inches) so the picture's size never depends on its content
    ax = fig.add_axes((LEFT_IN / WIDTH_IN, 0.6 / h, PLOT_PX / DPI / WIDTH_IN, (h - 1.6) / h))
    f, unit = time_unit(chart)
    xmax = chart.end * f * 1.005 if chart.end > 0 else 1.0
    px = xmax / PLOT_PX

    spans = chart.spans or tuple((0.0, chart.end) for _ in chart.rows)
    idle = [(r, s * f, e * f) for r, (s, e) in enumerate(spans) if e > s]
    if idle:
        ir, is_, ie = (np.array(c) for c in zip(*idle))
        ax.add_collection(PolyCollection(_boxes(ir, is_, ie, n), facecolors=IDLE, linewidths=0, antialiased=False,
                                         zorder=1))

    # group the bars by kind and pipe with C-level loops (zip, map, numpy): a chart may hold millions
    merged: dict[tuple[str, bool, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    if chart.bars:
        count = len(chart.bars)
        kind_pairs = list(map(itemgetter(3, 4), chart.bars))
        pairs = set(kind_pairs)
        order = {c: i for i, c in enumerate(CATEGORY_ORDER)}
        pair_key = {(c, lab): (c, lab.endswith(":" + UP_PIPE), chunk_of(c, lab)) for c, lab in pairs}
        kinds = sorted(set(pair_key.values()), key=lambda key: (order.get(key[0], len(order)), key[0], key[1], key[2]))
        kind_index = {key: i for i, key in enumerate(kinds)}
        pair_kind = {pair: kind_index[key] for pair, key in pair_key.items()}
        kind_of = np.fromiter(map(pair_kind.__getitem__, kind_pairs), dtype=np.int64, count=count)
        rows_a = np.fromiter(map(itemgetter(0), chart.bars), dtype=np.int64, count=count)
        starts_a = np.fromiter(map(itemgetter(1), chart.bars), dtype=float, count=count) * f
        ends_a = np.fromiter(map(itemgetter(2), chart.bars), dtype=float, count=count) * f
        for i, key in enumerate(kinds):
            sel = kind_of == i
            merged[key] = merge_bars(rows_a[sel], starts_a[sel], ends_a[sel], px)
    # pipeline work first, K-FAC kinds over it: where a pixel holds both, the (rarer) K-FAC work shows
    for z, ((cat, up, chunk), (r, s, e)) in enumerate(merged.items()):
        widths = e - s
        colour = chunk_colour(COLOURS.get(cat, COLOURS["other"]), chunk)
        ax.add_collection(PolyCollection(
            _boxes(r, s, np.maximum(e, s + px), n),  # at least a pixel wide, so short work still shows
            facecolors=colour, edgecolors=tuple(0.7 * c for c in to_rgb(colour)),
            linewidths=np.where(widths >= EDGE_PX * px, EDGE_LW, 0.0),
            hatch=UP_HATCH if up else None, antialiased=False,
            zorder=(2.5 if cat in PIPELINE else 2.6) + z / 100))
        if cat == "backward" and ("forward", up, chunk) in merged:
            # where forwards and backwards alternate faster than pixels, the backwards would hide every
            # forward: draw the forwards of such stretches over the backwards' upper half
            both = overlaps(merged[("forward", up, chunk)], (r, s, e))
            if both[0]:
                ax.add_collection(PolyCollection(
                    _boxes(*both, n, 0.0, ROW_H / 2), facecolors=[chunk_colour(COLOURS["forward"], chunk)], linewidths=0,
                    hatch=UP_HATCH if up else None, antialiased=False, zorder=2.55 + z / 100))

    if chart.outlined:
        o_rows, o_starts, o_ends = (np.array(c) for c in zip(*((b.row, b.start * f, b.end * f) for b in chart.outlined)))
        ax.add_collection(PolyCollection(_boxes(o_rows, o_starts, np.maximum(o_ends, o_starts + px), n),
                                         facecolors="none", edgecolors=OVERRUN, linewidths=OVERRUN_LW, zorder=2.9))

    bounds = np.asarray(chart.boundaries, dtype=float) * f
    every, spacing = 1, 0.0
    if bounds.size > 2:
        spacing = (bounds[-1] - bounds[0]) / (bounds.size - 1) / px
        if spacing < BOUNDARY_PX:
            every = int(np.ceil(BOUNDARY_PX / max(spacing, 1e-9)))
    if bounds.size:
        dense = bounds.size > 2 and spacing * every < 4 * BOUNDARY_PX  # lighter lines, so they do not hide the work
        ax.vlines(bounds[::every], -0.6, n - 0.4, colors="black", linestyles="--", linewidth=0.6 if dense else 0.9,
                  alpha=0.45 if dense else 0.7, zorder=3)

    ax.set_yticks(range(n))
    labels = ax.set_yticklabels(list(reversed(chart.rows)) if chart.rows else [""], fontsize=8)
    for r in chart.invalid:
        if 0 <= r < len(chart.rows):
            labels[n - 1 - r].set_color(INVALID)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, xmax)
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    ax.xaxis.set_major_formatter(formatter)
    ax.set_xlabel(f"time ({unit})")
    ax.set_facecolor(BACKGROUND)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    left = LEFT_IN / WIDTH_IN
    fig.text(left, 1 - 0.3 / h, chart.title, fontsize=11, ha="left", va="center")
    present = {cat for cat, _, _ in merged}
    handles = [Patch(facecolor=COLOURS[c], label=LEGEND[c]) for c in CATEGORY_ORDER if c in present]
    for j in sorted({chunk for _, _, chunk in merged if chunk}):
        handles.append(Patch(facecolor=chunk_colour(COLOURS["forward"], j), label=f"chunk {j} (lighter)"))
    if any(up for _, up, _ in merged):
        handles.append(Patch(facecolor="white", edgecolor="#555555", hatch=UP_HATCH, label="up pipe"))
    if chart.outlined:
        handles.append(Patch(facecolor="none", edgecolor=OVERRUN, linewidth=OVERRUN_LW,
                             label="K-FAC overrunning its bubble"))
    handles.append(Patch(facecolor=IDLE, label="idle (bubble)"))
    handles.append(Line2D([0], [0], color="black", linestyle="--", linewidth=0.9,
                          label="iteration boundary" + (f" (every {every}th)" if every > 1 else "")))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(left - 0.005, 1 - 0.5 / h), ncol=len(handles),
               fontsize=8, frameon=False, borderaxespad=0.0, handlelength=1.4, columnspacing=1.2)
    return fig


def render(chart: Chart, path: str | os.PathLike[str]) -> str:
    """Draw ``chart`` to ``path`` (PNG or SVG, by suffix), atomically; returns the path."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise InputError(path, "chart files must end in .png or .svg")
    fig = figure(chart)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=ext[1:], dpi=DPI)
    return path


def plot_job(job: Job, path: str | os.PathLike[str], title: str | None = None) -> str:
    return render(chart_from_job(job, title), path)


def plot_schedule(schedule: JobSchedule, job: Job, path: str | os.PathLike[str], title: str | None = None) -> str:
    return render(chart_from_schedule(schedule, job, title), path)


def categories_in(chart: Chart) -> Sequence[str]:
    return sorted({b.category for b in chart.bars})
