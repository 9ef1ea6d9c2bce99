"""Profiled timelines: one dict of intervals per pipeline node, loaded into a job on one clock.

The file format is the one profiled PipeFisher-style runs write (a pickled
``dict[str, list[tuple[start, end]]]`` per node). Loading does four things a policy should not care
about: orders the files by node (natural sort), keeps only the last profiled step, shifts every time
onto the job's shared time base, and checks the structure, so that bad input fails here with a clear
message naming the file.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import PassKind
from pipefisher.safe_io import load_json, load_pickle

Time = Union[int, float]
"""Integer nanoseconds (GPU profiles) or float seconds (CPU or hand-made profiles)."""

FORWARD = PassKind.FORWARD.key
BACKWARD = PassKind.BACKWARD.key
WEIGHT_KEY = PassKind.WEIGHT.key
WEIGHT = WEIGHT_KEY.partition(":")[2]
"""Zero-bubble schedules' deferred weight-gradient pass W (``call_backward:weight`` plus the pipe's or
chunk's suffix, :func:`weight_key`): pipeline work no K-FAC item may overlap, but not a micro-batch (m
counts forwards) and not a backward that covariance pieces of factor B follow (that is the B pass)."""
UP_PIPE = "up_pipe"
UP_SUFFIX = ":" + UP_PIPE
"""What a key or label of the second (up) pipe of a Chimera order ends with."""
CHUNK = "chunk"
_CHUNK_SUFFIX = re.compile(r"(?:^|:)chunk([1-9][0-9]*)$")
"""``:chunk<j>`` (j >= 1) ends the keys of model chunk j of an interleaved order; chunk 0 has none,
so the published tool's files (one chunk) read unchanged."""
STEP_KEY = "start_end"
UPDATE_KEY = "update"
"""End-of-step work a profile may record, one interval per step (an "other key" to the packer): the
whole ``-- end --`` (gradient all-reduce, clipping, preconditioning, optimizer step). A first-order
step pays it less :data:`PRECONDITION_KEY`."""
PRECONDITION_KEY = "precondition"
"""The part of :data:`UPDATE_KEY`'s interval that K-FAC adds: preconditioning every layer's gradient.
The time-to-target objective (:mod:`pipefisher.cost.objective`) adds both to a step's pipeline and K-FAC time."""
KFAC_WORK = ("cov_kron", "sync_kron", "inv_kron")
"""The kinds of K-FAC work, without the factor: covariance pieces, the all-reduce, the damped inverse."""
KFAC_KINDS = tuple(f"{work}_{factor}" for work in KFAC_WORK for factor in "AB")
"""Every K-FAC key's kind, work by work (``cov_kron_A``, ``cov_kron_B``, ``sync_kron_A``, ...): the
order the ``compat`` policy gives them priority in."""
COV_KINDS = ("cov_kron_A", "cov_kron_B")
COV_MICRO_BATCHES_KEY = "cov_micro_batches"
"""A profile's record of ``kfac.cov_micro_batches`` M: one pair ``(M, M)``, a count, not an interval. The
profiled step then saved, and its covariance keys cover, only the first M micro-batches of each pipe (or
model chunk); without it, all of them. The loader takes it out of the intervals (:attr:`NodeTimeline.cov_micro_batches`)."""


def cov_pieces(micro_batches: int, limit: int | None) -> int:
    """The rule of ``kfac.cov_micro_batches``: a refresh's covariance takes the first ``limit`` of a pipe's
    (or chunk's) ``micro_batches`` (None: all), one covariance piece per factor for each."""
    return micro_batches if limit is None else min(limit, micro_batches)


def cov_record(limit: int | None, micro_batches: int) -> int | str:
    """``kfac.cov_micro_batches`` as a schedule's metadata records it (``packed_for``): ``all`` where the
    limit takes every one of the step's ``micro_batches``, else the count (both sides compare the same)."""
    return "all" if limit is None or limit >= micro_batches else int(limit)


@dataclass(frozen=True)
class Interval:
    """One profiled interval on the job clock. ``None`` means no kernel ran in it."""

    start: Time | None
    end: Time | None

    @property
    def duration(self) -> Time:
        """Length, with a missing bound read as no time at all."""
        if self.start is None or self.end is None:
            return 0
        return self.end - self.start


def chunk_suffix(chunk: int) -> str:
    """The key suffix of model chunk ``chunk``: none for chunk 0 (the published format)."""
    return f":{CHUNK}{chunk}" if chunk else ""


def pipe_key(kind: str, up_pipe: bool = False, chunk: int = 0) -> str:
    """The pipeline key of ``kind`` (forward, backward or :data:`WEIGHT_KEY`) for a pipe or a chunk
    (never both)."""
    return kind + (UP_SUFFIX if up_pipe else "") + chunk_suffix(chunk)


def weight_key(up_pipe: bool = False, chunk: int = 0) -> str:
    """The key of the deferred weight-gradient passes (W) of a pipe or a model chunk."""
    return pipe_key(WEIGHT_KEY, up_pipe, chunk)


def format_time(t: Time) -> str:
    """A time for a message, with its unit: ms for integer nanoseconds (ns below a microsecond), s for
    float seconds."""
    if isinstance(t, float):
        return f"{t:.6g} s"
    return f"{t / 1e6:.3f} ms" if abs(t) >= 1000 else f"{t} ns"


@dataclass(frozen=True)
class TimelineKey:
    """A parsed timeline key: ``<kind>[:<module>][:up_pipe | :chunk<j>]``."""

    kind: str
    module: str | None = None
    up_pipe: bool = False
    chunk: int = 0
    """The model chunk (interleaved schedules) the key belongs to; 0 where it has no ``:chunk<j>``."""

    @classmethod
    @lru_cache(maxsize=65536)  # schedules repeat a few thousand distinct labels many times
    def parse(cls, key: str) -> "TimelineKey":
        kind, _, rest = key.partition(":")
        up = False
        chunk = 0
        if rest == UP_PIPE:
            rest, up = "", True
        elif rest.endswith(":" + UP_PIPE):
            rest, up = rest[: -len(UP_PIPE) - 1], True
        else:
            found = _CHUNK_SUFFIX.search(rest)
            if found:
                rest, chunk = rest[: found.start()], int(found.group(1))
        return cls(kind, rest or None, up, chunk)

    def __str__(self) -> str:
        parts = [self.kind] + ([self.module] if self.module else []) + ([UP_PIPE] if self.up_pipe else [])
        return ":".join(parts) + chunk_suffix(self.chunk)

    @property
    def is_kfac(self) -> bool:
        return self.kind in KFAC_KINDS

    @property
    def is_weight(self) -> bool:
        """A zero-bubble weight-gradient pass (W): pipeline work, but neither a forward nor a backward."""
        return self.kind == BACKWARD and self.module == WEIGHT

    @property
    def is_pipeline(self) -> bool:
        """Pipeline work K-FAC must stay out of: a forward, a backward, or a weight-gradient pass (only
        a backward has one: ``call_forward:weight`` is no key of the format)."""
        return (self.kind in (FORWARD, BACKWARD) and self.module is None) or self.is_weight

    @property
    def factor(self) -> str | None:
        """``'A'`` or ``'B'`` for K-FAC keys, else ``None``."""
        return self.kind[-1] if self.is_kfac else None

    @property
    def layer(self) -> tuple[str | None, bool, int]:
        """The layer copy this work belongs to: (module, serves the up pipe, model chunk)."""
        return (self.module, self.up_pipe, self.chunk)


@dataclass(frozen=True)
class NodeTimeline:
    """The last profiled step of one pipeline node, shifted onto the job's clock.

    ``entries`` keeps the file's key order, which the ``compat`` policy depends on.
    """

    path: str
    entries: Mapping[str, tuple[Interval, ...]]
    cov_micro_batches: int | None = None
    """How many micro-batches of each pipe (or chunk) a refresh's covariance covers (None: all; from
    :data:`COV_MICRO_BATCHES_KEY`)."""

    def intervals(self, key: str) -> tuple[Interval, ...]:
        return self.entries.get(key, ())

    def forwards(self, up_pipe: bool = False, chunk: int = 0) -> tuple[Interval, ...]:
        return self.intervals(pipe_key(FORWARD, up_pipe, chunk))

    def backwards(self, up_pipe: bool = False, chunk: int = 0) -> tuple[Interval, ...]:
        return self.intervals(pipe_key(BACKWARD, up_pipe, chunk))

    def weights(self, up_pipe: bool = False, chunk: int = 0) -> tuple[Interval, ...]:
        """The deferred weight-gradient passes (W) of a pipe or chunk: pipeline work, not micro-batches."""
        return self.intervals(weight_key(up_pipe, chunk))

    def micro_batches(self, up_pipe: bool = False, chunk: int = 0) -> int:
        """Forwards of one pipe (or one model chunk) in the step: the m its covariance pieces split over."""
        return len(self.forwards(up_pipe, chunk))

    def cov_pieces(self, up_pipe: bool = False, chunk: int = 0) -> int:
        """Covariance pieces per factor and profiled interval of a pipe (or chunk): one per micro-batch of the
        refresh's iteration that feeds the factors, its first ``cov_micro_batches`` (the one definition the
        packers, the rules and the runtime's checks share; the runtime saves only those)."""
        return cov_pieces(self.micro_batches(up_pipe, chunk), self.cov_micro_batches)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The model chunks (interleaved schedules) with pipeline keys here; ``(0,)`` for the rest."""
        return chunks_of(self.entries)

    def pipe_keys(self) -> tuple[str, ...]:
        """Every pipeline key this node may have (:func:`pipeline_keys`)."""
        return pipeline_keys(self.chunks)

    def kfac_keys(self) -> list[TimelineKey]:
        """The K-FAC work keys of this node, in file order."""
        return [k for k in (TimelineKey.parse(key) for key in self.entries) if k.is_kfac]

    @property
    def has_up_pipe(self) -> bool:
        return bool(self.forwards(True))


@dataclass(frozen=True)
class Job:
    """All nodes of one profiled job on one clock: time 0 is the pipeline's first forward."""

    nodes: tuple[NodeTimeline, ...]
    span: Time
    """The pipeline time: from node 0's first forward to its last backward (either pipe)."""
    origin: Time = 0
    """The raw timestamp that became time 0."""
    steps: int = 1
    """How many steps node 0's file profiled (only the last one is kept)."""

    def __len__(self) -> int:
        return len(self.nodes)


def chunks_of(keys: Iterable[str]) -> tuple[int, ...]:
    """The model chunks named by the pipeline keys among ``keys``, always with chunk 0."""
    found = {0}
    for key in keys:
        if key.startswith((FORWARD + ":", BACKWARD + ":")):
            parsed = TimelineKey.parse(key)
            if parsed.is_pipeline:
                found.add(parsed.chunk)
    return tuple(sorted(found))


def pipeline_keys(chunks: Iterable[int] = (0,)) -> tuple[str, ...]:
    """The one list of pipeline keys (all pipeline work, which K-FAC must stay out of) of ``chunks``:
    for chunk 0 both pipes (the published four, then the two weight-gradient keys), else the chunk's
    forward, backward and weight-gradient keys."""
    out: list[str] = []
    for c in chunks:
        if c == 0:
            out += [FORWARD, FORWARD + UP_SUFFIX, BACKWARD, BACKWARD + UP_SUFFIX, weight_key(), weight_key(True)]
        else:
            out += [pipe_key(FORWARD, chunk=c), pipe_key(BACKWARD, chunk=c), weight_key(chunk=c)]
    return tuple(out)


# ----------------------------------------------------------------------------------------------------
# Loading

_NATURAL_CHUNK = re.compile(r"(\d+)")


def split_evenly(length: Time, m: int) -> tuple[Time, ...]:
    """``m`` pieces that add up to ``length``: the remainder spread over the first pieces (integers)."""
    if isinstance(length, int):
        base, rem = divmod(length, m)
        return (base + 1,) * rem + (base,) * (m - rem)
    return (length / m,) * m


def natural_key(path: str) -> list[Any]:
    """Sort key that puts ``node2`` before ``node10``."""
    return [int(c) if c.isdigit() else c for c in _NATURAL_CHUNK.split(os.fspath(path))]


def _is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return False
    return isinstance(x, (np.integer, np.floating))


def _plain_number(x: Any) -> Time:
    """numpy scalars become Python ints/floats so arithmetic behaves the same everywhere."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    return int(x) if getattr(x, "dtype", None) is not None and x.dtype.kind in "iu" else float(x)


_PLAIN = (int, float)
"""Time types :func:`_check_raw` takes as they are (exactly these: not bool, nor numpy's scalars)."""


def _check_raw(path: str, raw: Any) -> dict[str, list[tuple[Time | None, Time | None]]]:
    """Check the structure of one node's dict and return it with plain Python values."""
    if not isinstance(raw, dict):
        raise _not_a_timeline(path, f"it holds a {type(raw).__name__}, not a dict of interval lists")
    for key in (FORWARD, BACKWARD):  # first: a file without them is some other file, whatever it holds
        if key not in raw:
            raise _not_a_timeline(path, f"it has no '{key}' key")
    out: dict[str, list[tuple[Time | None, Time | None]]] = {}
    for key, values in raw.items():
        if not isinstance(key, str):
            raise InputError(path, f"has a key {key!r} that is not a string")
        if not isinstance(values, (list, tuple)):
            raise InputError(path, f"key '{key}' holds a {type(values).__name__}, not a list of intervals")
        pairs = []
        for i, pair in enumerate(values):
            if type(pair) is tuple and len(pair) == 2:  # the usual case, plain ints or floats: nothing to convert
                start, end = pair
                if type(start) in _PLAIN and type(end) in _PLAIN:
                    if end < start:
                        raise InputError(path, f"key '{key}' interval {i} ends before it starts: "
                                               f"({format_time(start)}, {format_time(end)})")
                    pairs.append(pair)
                    continue
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InputError(path, f"key '{key}' interval {i} is not a (start, end) pair: {pair!r}")
            for bound in pair:
                if bound is not None and not _is_number(bound):
                    raise InputError(
                        path, f"key '{key}' interval {i} has a {type(bound).__name__} time, not a number or None"
                    )
            start, end = (None if b is None else _plain_number(b) for b in pair)
            if start is not None and end is not None and end < start:
                raise InputError(path, f"key '{key}' interval {i} ends before it starts: "
                                       f"({format_time(start)}, {format_time(end)})")
            pairs.append((start, end))
        out[key] = pairs  # type: ignore[assignment]
    for suffix in ("", ":" + UP_PIPE) + tuple(chunk_suffix(c) for c in chunks_of(out) if c):
        nf, nb = len(out.get(FORWARD + suffix, ())), len(out.get(BACKWARD + suffix, ()))
        if nf != nb:
            raise InputError(path, f"has {nf} '{FORWARD + suffix}' but {nb} '{BACKWARD + suffix}' intervals")
    if not out[FORWARD] and not out.get(FORWARD + ":" + UP_PIPE):
        raise InputError(path, f"has no '{FORWARD}' intervals")
    return out


def _last_step(raw: dict[str, list[tuple[Any, Any]]]) -> tuple[dict[str, list[tuple[Any, Any]]], int]:
    steps = len(raw.get(STEP_KEY, ())) or 1
    if steps == 1:
        return raw, 1
    # The published tool slices values[-(len(values) // n):]; for a key with fewer intervals than steps
    # that is values[-0:], the whole list, so work profiled in only some steps (an inverse) is kept.
    return {k: list(v[-(len(v) // steps):]) for k, v in raw.items()}, steps


def _median(values: list[Any], integral: bool) -> Any:
    """The median; of an even count, the mean of the middle two, floored for integer times (so that
    integer nanoseconds stay integers). Both are monotone in every value, which keeps order."""
    xs = sorted(values)
    mid = len(xs) // 2
    if len(xs) % 2:
        return xs[mid]
    return (xs[mid - 1] + xs[mid]) // 2 if integral else (xs[mid - 1] + xs[mid]) / 2


STEADY = 0.10
"""A profiled step is steady when it took at most this fraction longer than the node's fastest (after the
warm-up). On a shared CPU another process can slow a node for several steps in a row (measured: 6 of 9
steps ~45 % slower), enough to move the median and the packed cycle; the quiet steps are the job's own
cost, and in them the run's steps have the same jitter (a few %) that this margin admits."""


def steady_steps(raw: Mapping[str, Sequence[tuple[Any, Any]]], skip: int = 1) -> tuple[list[int], list[int]]:
    """(the steps :func:`median_step` may use, the steady ones it does use), as indices into ``start_end``.

    Used: every step after the first ``skip`` when at least two remain, else none (then the median step
    is the last step alone). Steady: the used steps that took at most :data:`STEADY` longer than the
    fastest one, and never fewer than the two fastest (a median of one step is that step's jitter).
    A step whose bounds are not numbers makes every used step count as steady (no durations to rank).
    """
    used, took = _step_times(raw, skip)
    if took is None:
        return used, used
    by_speed = sorted(used, key=lambda j: (took[j], j))
    limit = took[by_speed[0]] * (1 + STEADY)
    return used, sorted(j for i, j in enumerate(by_speed) if i < 2 or took[j] <= limit)


def slowed_profile(raw: Mapping[str, Sequence[tuple[Any, Any]]], skip: int = 1) -> tuple[int, int, Time, Time] | None:
    """(steps left out, steps used, fastest, slowest) where the steps :func:`steady_steps` leaves out would
    have moved the median step's length by more than :data:`STEADY` (a slow step or two, the usual
    jitter, does not); else None. What a run says about a profile taken on a busy machine."""
    used, steady = steady_steps(raw, skip)
    _, took = _step_times(raw, skip)
    if took is None or len(steady) == len(used):
        return None
    if _median(list(took.values()), False) <= (1 + STEADY) * _median([took[j] for j in steady], False):
        return None
    return len(used) - len(steady), len(used), min(took.values()), max(took.values())


def _step_times(raw: Mapping[str, Sequence[tuple[Any, Any]]], skip: int) -> tuple[list[int], dict[int, Any] | None]:
    """The steps after the first ``skip`` (none unless at least two remain) and each one's length, None
    where a step's bounds are not numbers."""
    if skip < 0:
        raise ValueError(f"skip must be 0 or more, not {skip}")
    steps = list(raw.get(STEP_KEY) or [])
    if len(steps) < skip + 2:
        return [], None
    used = list(range(skip, len(steps)))
    if not all(isinstance(steps[j], (list, tuple)) and len(steps[j]) == 2
               and all(b is not None and _is_number(b) for b in steps[j]) for j in used):
        return used, None
    return used, {j: _plain_number(steps[j][1]) - _plain_number(steps[j][0]) for j in used}


def median_step(raw: Mapping[str, Sequence[tuple[Any, Any]]], skip: int = 1) -> dict[str, list[tuple[Any, Any]]]:
    """One representative step of a multi-step profile, in the same format (``start_end`` holds one step).

    Why: the loader keeps only the last step (:func:`_last_step`, as the published tool does), and on a
    CPU one step's bubbles jitter by +-25 %, so the cycle a profile packs to varied from run to run. The
    median step is steadier.

    Rule: with n steps in ``start_end``, the steps used are the steady ones (:func:`steady_steps`) of
    those after the first ``skip`` (the warm-up) when at least two remain (n >= skip + 2); otherwise the
    result is the last step alone, exactly what the loader would keep. For every key whose interval count
    is a multiple of n (the same count per step) and whose bounds are all numbers, interval i of the
    result starts at the median over the used steps of interval i's start, taken relative to that step's
    own ``start_end`` start, and ends at the median of its end, likewise; both are then placed relative to
    the last step's ``start_end`` start, so absolute times stay plausible (and comparable across nodes,
    whose profiled steps start together after a barrier). Other keys (another count, a ``None`` bound)
    keep the last step's slice the loader would keep. The median of an even count is the mean of the
    middle two, floored when every time is an integer (integers stay integers; otherwise times become
    floats).

    Order is kept: if ``x_j <= y_j`` in every step j then ``median(x) <= median(y)`` (order statistics,
    their mean and its floor are all monotone), so every interval still ends after it starts, work
    nested in another (``precondition`` in ``update``) stays inside it, and micro-batches stay in order.
    """
    plain = {k: list(v) for k, v in raw.items()}
    last, _ = _last_step(plain)
    fallback = {k: [tuple(p) for p in v] for k, v in last.items()}  # type: ignore[misc]
    steps = plain.get(STEP_KEY) or []
    n = len(steps)
    _, used = steady_steps(plain, skip)
    if not used:
        return fallback
    starts = [steps[j][0] if isinstance(steps[j], (list, tuple)) and len(steps[j]) == 2 else None for j in used]
    if any(s is None or not _is_number(s) for s in starts):
        return fallback
    step_start = [_plain_number(s) for s in starts]
    last_start = _plain_number(steps[-1][0])  # in ``used`` or ranked with them: a number

    def regular(v: list[Any]) -> bool:
        return len(v) % n == 0 and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(b is not None and _is_number(b) for b in p)
            for p in v)

    keys = [k for k, v in plain.items() if regular(v)]
    integral = all(isinstance(s, int) for s in (*step_start, last_start)) and all(
        isinstance(_plain_number(b), int) for k in keys for p in plain[k] for b in p)
    as_time = (lambda t: t) if integral else float
    base = as_time(last_start)  # the last step's, steady or not
    out: dict[str, list[tuple[Any, Any]]] = {}
    for key, values in plain.items():
        if key not in keys:
            out[key] = fallback[key]
            continue
        per = len(values) // n
        rows = []
        for i in range(per):
            pairs = [(as_time(_plain_number(values[j * per + i][0])) - as_time(s0),
                      as_time(_plain_number(values[j * per + i][1])) - as_time(s0))
                     for j, s0 in zip(used, step_start)]
            rows.append((base + _median([a for a, _ in pairs], integral),
                         base + _median([b for _, b in pairs], integral)))
        out[key] = rows
    return out


def read_node_file(path: str | os.PathLike[str]) -> dict[str, list[tuple[Time | None, Time | None]]]:
    """Read and check one node file (pickle, or JSON with the same structure); last step only."""
    path = os.fspath(path)
    raw = load_json(path) if path.endswith(".json") else load_pickle(path)
    checked, _ = _last_step(_check_raw(path, raw))
    return checked


def _first_start(intervals: Sequence[tuple[Any, Any]]) -> Any:
    return intervals[0][0] if intervals else None


def _last_end(intervals: Sequence[tuple[Any, Any]]) -> Any:
    return intervals[-1][1] if intervals else None


MIXED_HINT = "(--allow-mixed loads them anyway)"
"""How every refusal of timelines that look like different jobs ends: the way past it."""


def _step_bounds(raw: Mapping[str, Sequence[tuple[Any, Any]]]) -> tuple[int, Any, Any] | None:
    """(profiled steps, start, end of the last step) from ``start_end``; None where the file has none."""
    steps = raw.get(STEP_KEY) or ()
    if not steps:
        return None
    start, end = steps[-1]
    return len(steps), start, end


def check_one_job(paths: Sequence[str], raws: Sequence[Mapping[str, Sequence[tuple[Any, Any]]]]) -> None:
    """Refuse node files whose ``start_end`` says they were profiled in another run than node 0's.

    Nodes of one profiled job record the same number of steps, and (on the shared clock) their last
    steps overlap in time. Their spans differ per node (a node's step ends when its own K-FAC work does,
    and Chimera's nodes end their pipes at different times), so spans are not compared for equality.
    In-memory jobs (:func:`job_from_dicts`: simulations, generated test jobs) are not checked.
    """
    first = _step_bounds(raws[0])
    if first is None:
        return
    n0, s0, e0 = first
    for path, raw in zip(paths[1:], raws[1:]):
        mine = _step_bounds(raw)
        if mine is None:
            continue
        n, s, e = mine
        if n != n0:
            raise InputError(path, f"profiled {n} step(s) ('{STEP_KEY}'), but {paths[0]} profiled {n0}: "
                                   f"timelines of different jobs {MIXED_HINT}")
        if None not in (s, e, s0, e0) and (e < s0 or s > e0):
            raise InputError(path, f"its last profiled step ('{STEP_KEY}' {s}..{e}) does not overlap that of "
                                   f"{paths[0]} ({s0}..{e0}): timelines of different runs {MIXED_HINT}")


def job_from_dicts(raws: Sequence[Mapping[str, Sequence[tuple[Any, Any]]]], paths: Sequence[str] | None = None) -> Job:
    """Build a job from per-node dicts (already in node order), checking them like files."""
    paths = list(paths) if paths is not None else [f"<node{i}>" for i in range(len(raws))]
    if not raws:
        raise InputError(None, "no timeline files given")
    checked = []
    steps0 = 1
    for i, (path, raw) in enumerate(zip(paths, raws)):
        last, steps = _last_step(_check_raw(path, dict(raw) if not isinstance(raw, dict) else raw))
        if i == 0:
            steps0 = steps
        checked.append(last)

    node0, path0 = checked[0], paths[0]
    starts = [t for t in (_first_start(node0.get(FORWARD, ())), _first_start(node0.get(FORWARD + ":" + UP_PIPE, ())))
              if t is not None]
    ends = [t for t in (_last_end(node0.get(BACKWARD, ())), _last_end(node0.get(BACKWARD + ":" + UP_PIPE, ())))
            if t is not None]
    if not starts:
        raise InputError(path0, "node 0's first forward has no start time, so the job has no time base")
    if not ends:
        raise InputError(path0, "node 0's last backward has no end time, so the job has no pipeline span")
    origin = min(starts)
    span = max(ends) - origin

    def shift(t: Any) -> Any:
        return None if t is None else t - origin

    limits = [_cov_micro_batches(path, raw) for path, raw in zip(paths, checked)]
    nodes = tuple(
        NodeTimeline(path, {k: tuple(Interval(shift(s), shift(e)) for s, e in v) for k, v in raw.items()
                            if k != COV_MICRO_BATCHES_KEY}, limit)
        for path, raw, limit in zip(paths, checked, limits)
    )
    return Job(nodes=nodes, span=span, origin=origin, steps=steps0)


def _cov_micro_batches(path: str, raw: Mapping[str, Sequence[tuple[Any, Any]]]) -> int | None:
    """The count :data:`COV_MICRO_BATCHES_KEY` records (None where the file has none), or one line saying
    why it is no count."""
    pairs = raw.get(COV_MICRO_BATCHES_KEY)
    if pairs is None:
        return None
    ok = len(pairs) == 1 and pairs[0][0] == pairs[0][1] and isinstance(pairs[0][0], int) and pairs[0][0] >= 1
    if not ok:
        raise InputError(path, f"key '{COV_MICRO_BATCHES_KEY}' must hold one pair (M, M), M the whole number of "
                               f"micro-batches the covariance covers, not {list(pairs)!r}")
    return int(pairs[0][0])


TIMELINE_SUFFIXES = ("_timeline.pickle", "_timeline.json")
"""How node timeline files end: what a folder argument stands for (trainers write other files beside
them, such as ``<run>_losses.json`` and ``<run>_tokenizer.json``)."""


def expand_paths(paths: Iterable[str]) -> list[str]:
    """Accept the published script's comma-separated lists as well as separate arguments, and a folder
    for its node timelines (:data:`TIMELINE_SUFFIXES`), other files in it left alone."""
    out: list[str] = []
    for p in paths:
        for part in (part for part in str(p).split(",") if part):
            if not os.path.isdir(part):
                out.append(part)
                continue
            found = sorted(os.path.join(part, name) for name in os.listdir(part) if name.endswith(TIMELINE_SUFFIXES))
            if not found:
                raise InputError(part, f"is a folder with no node timelines (no *{' or *'.join(TIMELINE_SUFFIXES)} "
                                       f"files)")
            out.extend(found)
    return out


def _not_a_timeline(path: str, why: str) -> InputError:
    """The refusal of a file that is no node timeline, with the way to skip such files where its name
    says it is none (a trainer's losses or tokenizer file beside the timelines)."""
    hint = "" if path.endswith(TIMELINE_SUFFIXES) or path.startswith("<") else (
        f" (give the folder instead of its files to load only its *{' and *'.join(TIMELINE_SUFFIXES)} files)")
    return InputError(path, f"is not a node timeline: {why}{hint}")


_NODE_FILE = re.compile(r"^(?P<prefix>.*)_node(?P<node>\d+)_timeline(?:\.[A-Za-z0-9]+)?$")
"""``<prefix>_node<i>_timeline.<ext>``: the names profilers and ``pipefisher simulate`` give node files."""


def node_file_prefix(path: str) -> str | None:
    """The job prefix of a node file named ``<prefix>_node<i>_timeline.<ext>``, else None."""
    m = _NODE_FILE.match(os.path.basename(path))
    return m.group("prefix") if m else None


def check_node_files(ordered: Sequence[str]) -> None:
    """Refuse a file list that cannot be one job's nodes: a file twice, or (where every name follows
    ``<prefix>_node<i>_timeline``) several prefixes, a node index missing or twice, or indices out of
    the natural-sort order that decides which file is which node."""
    seen: dict[str, str] = {}
    for path in ordered:
        real = os.path.normcase(os.path.realpath(path))
        if real in seen:
            also = "" if seen[real] == path else f" (also as {seen[real]})"
            raise InputError(path, f"is given twice{also}: one file per node {MIXED_HINT}")
        seen[real] = path
    matched = [_NODE_FILE.match(os.path.basename(p)) for p in ordered]
    names = [m for m in matched if m is not None]
    if len(names) < len(ordered):
        return  # hand-named files: the natural sort alone says which node each is
    prefixes: dict[str, str] = {}  # prefix -> its first file
    for m, path in zip(names, ordered):
        prefixes.setdefault(m.group("prefix"), path)
    if len(prefixes) > 1:
        (a, pa), (b, pb) = list(prefixes.items())[:2]
        raise InputError(None, f"{pa} and {pb} have different name prefixes ('{a}', '{b}'): timelines of "
                               f"different jobs {MIXED_HINT}")
    nodes: dict[int, str] = {}
    for m, path in zip(names, ordered):
        i = int(m.group("node"))
        if i in nodes:
            raise InputError(path, f"is node {i} again (so is {nodes[i]}) {MIXED_HINT}")
        nodes[i] = path
    missing = [i for i in range(len(ordered)) if i not in nodes]
    if missing:
        want = os.path.join(os.path.dirname(ordered[0]), f"{names[0].group('prefix')}_node{missing[0]}_timeline.*")
        raise InputError(want, f"is missing: {len(ordered)} node file(s) given, for nodes "
                               f"{', '.join(map(str, sorted(nodes)))} {MIXED_HINT}")
    for pos, (m, path) in enumerate(zip(names, ordered)):
        if int(m.group("node")) != pos:
            raise InputError(path, f"is named node {m.group('node')} but is node {pos} by the natural sort of "
                                   f"the paths (files in different folders?) {MIXED_HINT}")


def load_job(paths: Iterable[str | os.PathLike[str]], allow_mixed: bool = False) -> Job:
    """Load one node file per pipeline node; the natural sort of the paths gives the node order.

    Unless ``allow_mixed``, files that look like several jobs' (:func:`check_node_files`,
    :func:`check_one_job`) are refused before packing anything.
    """
    ordered = sorted(expand_paths(os.fspath(p) for p in paths), key=natural_key)
    if not ordered:
        raise InputError(None, "no timeline files given")
    if not allow_mixed:
        check_node_files(ordered)
    raws = []
    for path in ordered:
        raw = load_json(path) if path.endswith(".json") else load_pickle(path)
        raws.append(raw if isinstance(raw, dict) else _check_raw(path, raw))
    job = job_from_dicts(raws, ordered)  # checks each file's structure first
    if not allow_mixed:
        check_one_job(ordered, raws)
    return job



KfacSelector = Callable[[str, Sequence[Interval]], bool]
"""Which K-FAC entries (key, intervals) :func:`inflate_kfac` lengthens."""


def inflate_kfac(job: Job, factor: float, which: KfacSelector | None = None) -> Job:
    """The job with every K-FAC interval ``factor`` times as long (same start): packing it leaves that
    much slack for K-FAC work that runs slower, or bubbles that are shorter, than profiled. ``which``:
    only the entries it selects (a refresh that costs more in pieces than whole)."""
    import dataclasses

    if factor == 1.0:
        return job
    return dataclasses.replace(job, nodes=tuple(inflate_node_kfac(n, factor, which) for n in job.nodes))


def inflate_node_kfac(node: NodeTimeline, factor: float, which: KfacSelector | None = None) -> NodeTimeline:
    """One node of :func:`inflate_kfac` (the ``target`` policy evaluates nodes one at a time)."""
    if factor == 1.0:
        return node

    def grow(iv: Interval) -> Interval:
        if iv.start is None or iv.end is None:
            return iv
        d = (iv.end - iv.start) * factor
        return Interval(iv.start, iv.start + (int(round(d)) if isinstance(iv.start, int) else d))

    return NodeTimeline(node.path, {k: (tuple(grow(iv) for iv in v)
                                        if TimelineKey.parse(k).is_kfac and (which is None or which(k, v)) else v)
                                    for k, v in node.entries.items()}, node.cov_micro_batches)
