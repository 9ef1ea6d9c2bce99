"""Gantt charts of a timeline set or a packed schedule: one row per node, bubbles left empty.

The chart is first built as plain data (:class:`Chart`: rows, bars, iteration boundaries), which the
PNG/SVG renderer here and the Chrome-trace writer (:mod:`pipefisher.trace`) both draw from.
matplotlib is imported only when rendering.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from pipefisher.errors import InputError
from pipefisher.safe_io import atomic_path
from pipefisher.policies.base import MARKERS, JobSchedule, label_category
from pipefisher.timeline import STEP_KEY, UP_PIPE, Job, Time

CATEGORY_ORDER = ("forward", "backward", "weight", "cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B",
                  "inv_kron_A", "inv_kron_B", "other")
COLOURS = {
    "forward": "#4c78a8",
    "backward": "#54a24b",
    "weight": "#88d27a",
    "cov_kron_A": "#f58518",
    "cov_kron_B": "#ffbf79",
    "sync_kron_A": "#7a4fa3",
    "sync_kron_B": "#b9a0d9",
    "inv_kron_A": "#e45756",
    "inv_kron_B": "#ff9d98",
    "other": "#9d9d9d",
}
LEGEND = {
    "forward": "forward", "backward": "backward", "weight": "weight grad (W)",
    "cov_kron_A": "cov A", "cov_kron_B": "cov B", "sync_kron_A": "sync A", "sync_kron_B": "sync B",
    "inv_kron_A": "inv A", "inv_kron_B": "inv B", "other": "other",
}
UP_HATCH = "////"
WIDTH_IN = 14.0
ROW_IN = 0.55
EXTRA_IN = 2.0
DPI = 100


@dataclass(frozen=True)
class Bar:
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


def category(label: str) -> str:
    """The colour group of a timeline key or schedule label."""
    if label.startswith("call_backward:weight"):
        return "weight"
    cat = label_category(label)
    return cat if cat in COLOURS else "other"


def _scale(job: Job) -> tuple[float, str]:
    return (1.0, "s") if isinstance(job.span, float) else (1e-6, "ms")


def chart_from_job(job: Job, title: str = "pipeline step (timelines)") -> Chart:
    """Every interval of every node as recorded: the pipeline, then the node's naive K-FAC work.

    A row's usage is its busy time over the step (0 to the latest end of any node).
    """
    k, unit = _scale(job)
    bars: list[Bar] = []
    end = float(job.span)
    busy: list[float] = []
    for r, node in enumerate(job.nodes):
        total = 0.0
        for key, intervals in node.entries.items():
            if key == STEP_KEY:
                continue
            cat = category(key)
            for iv in intervals:
                if iv.start is None or iv.end is None:
                    continue
                bars.append(Bar(r, iv.start * k, iv.end * k, cat, key))
                total += (iv.end - iv.start) * k
                end = max(end, float(iv.end))
        busy.append(total)
    end_scaled = end * k
    rows = tuple(f"node{r}\nbusy {100 * b / end_scaled:.1f} %" if end_scaled else f"node{r}"
                 for r, b in enumerate(busy))
    return Chart(title, rows, tuple(bars), (0.0, job.span * k), end_scaled, unit)


def chart_from_schedule(schedule: JobSchedule, job: Job, title: str | None = None) -> Chart:
    """A packed K-FAC cycle: iteration ``i`` drawn after iteration ``i - 1``, each row with its usage.

    Placement times are relative to their iteration; an iteration lasts the pipeline span, or longer
    where a policy let work overflow it.
    """
    k, unit = _scale(job)
    span = float(job.span)
    n_iter = max((max((p.iteration for p in node.placements), default=0) + 1 for node in schedule.nodes), default=1)
    length = [span] * n_iter
    for node in schedule.nodes:
        for p in node.placements:
            if p.end is not None and p.iteration >= 0:
                length[p.iteration] = max(length[p.iteration], float(p.end))
    offsets = [0.0]
    for x in length:
        offsets.append(offsets[-1] + x)
    bars = []
    for r, node in enumerate(schedule.nodes):
        for p in node.placements:
            if p.label in MARKERS or p.start is None or p.end is None or p.end <= p.start:
                continue
            off = offsets[max(p.iteration, 0)]
            bars.append(Bar(r, (off + p.start) * k, (off + p.end) * k, category(p.label), p.label))
    rows = tuple(f"node{r}: {node.figures.iterations} it.\nusage {node.figures.usage:.1f} %"
                 for r, node in enumerate(schedule.nodes))
    title = title or f"K-FAC packed into bubbles (policy {schedule.policy})"
    return Chart(title, rows, tuple(bars), tuple(o * k for o in offsets), offsets[-1] * k, unit)


def chart_size_px(rows: int) -> tuple[int, int]:
    """Pixel size of a rendered PNG with ``rows`` rows."""
    return round(WIDTH_IN * DPI), round((EXTRA_IN + ROW_IN * rows) * DPI)


def render(chart: Chart, path: str | os.PathLike[str]) -> str:
    """Draw ``chart`` to ``path`` (PNG or SVG, by suffix), atomically; returns the path."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise InputError(path, "chart files must end in .png or .svg")

    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401  (no GUI backend needed)
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = max(len(chart.rows), 1)
    fig = Figure(figsize=(WIDTH_IN, EXTRA_IN + ROW_IN * n), dpi=DPI)
    # fixed margins (in inches) so the picture's size never depends on its content
    h = EXTRA_IN + ROW_IN * n
    ax = fig.add_axes((1.5 / WIDTH_IN, 0.6 / h, (WIDTH_IN - 1.75) / WIDTH_IN, (h - 1.6) / h))
    by_cat: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    for b in chart.bars:
        by_cat.setdefault((b.row, b.category, b.up_pipe), []).append((b.start, b.end - b.start))
    present = set()
    for (row, cat, up), spans in by_cat.items():
        y = n - 1 - row
        ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=COLOURS[cat], edgecolors="white", linewidth=0.2,
                       hatch=UP_HATCH if up else None)
        present.add(cat)
    for t in chart.boundaries:
        ax.axvline(t, color="black", linestyle="--", linewidth=0.9, alpha=0.7)
    ax.set_yticks(range(n))
    ax.set_yticklabels(list(reversed(chart.rows)) if chart.rows else [""], fontsize=8)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, chart.end * 1.005 if chart.end > 0 else 1)
    ax.set_xlabel(f"time ({chart.unit})")
    ax.set_facecolor("#f4f4f4")
    ax.grid(axis="x", color="white", linewidth=0.6)
    ax.set_axisbelow(True)
    left = 1.5 / WIDTH_IN
    fig.text(left, 1 - 0.3 / h, chart.title, fontsize=11, ha="left", va="center")
    handles = [Patch(facecolor=COLOURS[c], label=LEGEND[c]) for c in CATEGORY_ORDER if c in present]
    if any(b.up_pipe for b in chart.bars):
        handles.append(Patch(facecolor="white", edgecolor="#555555", hatch=UP_HATCH, label="up pipe"))
    handles.append(Patch(facecolor="#f4f4f4", edgecolor="#999999", label="bubble (idle)"))
    handles.append(Line2D([0], [0], color="black", linestyle="--", linewidth=0.9, label="iteration boundary"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(left - 0.005, 1 - 0.5 / h), ncol=len(handles),
               fontsize=8, frameon=False, borderaxespad=0.0, handlelength=1.4, columnspacing=1.2)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=ext[1:], dpi=DPI)
    return path


def plot_job(job: Job, path: str | os.PathLike[str], title: str | None = None) -> str:
    return render(chart_from_job(job, title or "pipeline step (timelines)"), path)


def plot_schedule(schedule: JobSchedule, job: Job, path: str | os.PathLike[str], title: str | None = None) -> str:
    return render(chart_from_schedule(schedule, job, title), path)


def categories_in(chart: Chart) -> Sequence[str]:
    return sorted({b.category for b in chart.bars})
