"""A staleness curve: what an older curvature costs one job in steps, with where it was measured.

K-FAC refreshed every k steps needs ``ratio(k)`` times first-order's steps to reach a target loss (the
best first-order optimizer's, where the benchmark races several: :attr:`Provenance.relative_to`). That
ratio depends on the model, the data, the learning rate and how far training has gone (the convergence
benchmark's curve at 1000 steps is much flatter than at 300), so a curve is data about one job: it is
measured (``scripts/bench_staleness.py`` writes it as a file, :data:`STALENESS_FORMAT`, described in
``docs/formats.md``) or given by hand (``k:ratio,...``), and never assumed. :func:`read_staleness` takes
either, as every command's ``--staleness`` option does; :meth:`StalenessCurve.config_warning` says when
a curve was measured on another config than the job's.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pipefisher.errors import InputError

LOADED_FROM = "loaded_from"
"""A field :meth:`StalenessCurve.to_data` adds where a curve travels as data (to the training workers):
where it came from, which loading keeps as its source."""

STALENESS_FORMAT = "pipefisher-staleness/2"
"""The file format :meth:`StalenessCurve.to_data` writes and :meth:`StalenessCurve.load` reads (it also
reads ``pipefisher-staleness/1``, the staleness benchmark's earlier output, without most provenance)."""


@dataclass(frozen=True)
class Provenance:
    """Where a curve was measured: the run config (its :meth:`RunConfig.fingerprint` without the pipeline
    layout, its name and path), model, data, horizon, target, seeds, and the optimizer it is relative to."""

    config_digest: str = ""
    config_name: str = ""
    config_path: str = ""
    model: str = ""
    data: str = ""
    horizon: int | None = None
    """Steps of every run the curve was measured with."""
    target: float | None = None
    """The held-out loss the steps count to."""
    seeds: int | None = None
    relative_to: str = ""
    """The first-order optimizer the ratios are relative to, in words: its ``optim.name``, lr and warm-up
    (``scripts/bench_staleness.py``: the best first-order optimizer of its race, AdamW or Muon)."""

    @property
    def config(self) -> str:
        """The config, as a report names it: ``'small' (configs/small.yaml, digest 1a2b...)``."""
        if not (self.config_name or self.config_path or self.config_digest):
            return "an unrecorded config"
        extra = ", ".join(x for x in (self.config_path, f"digest {self.config_digest}" if self.config_digest else "")
                          if x)
        return f"'{self.config_name or '?'}'" + (f" ({extra})" if extra else "")


@dataclass(frozen=True)
class StalenessCurve:
    """K-FAC's steps to a target loss relative to first-order's, per curvature refresh interval k.

    Between measured points the ratio is interpolated linearly in log k; below the first it is the
    first; past the last point, or at a point that never reached the target (``inf``), it is infinite:
    a staleness nobody measured reaching the target is never chosen. ``spread``: per point, the
    (min, median, max) steps to the target over the seeds, where measured.
    """

    points: tuple[tuple[float, float], ...]
    source: str = ""
    """Where the curve comes from, as a report says it: a file, or given on the command line."""
    provenance: Provenance | None = None
    spread: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        ks = [k for k, _ in self.points]
        if not self.points or ks != sorted(ks) or len(set(ks)) != len(ks) or ks[0] < 1 \
                or any(not r > 0 for _, r in self.points):
            raise ValueError("a staleness curve needs points k:ratio with k >= 1 increasing and ratios > 0")

    def at(self, k: float) -> float:
        pts = self.points
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
            if k <= k1:
                if math.isinf(r0) or math.isinf(r1):
                    return r1 if k == k1 else math.inf
                w = math.log(k / k0) / math.log(k1 / k0)
                return r0 + (r1 - r0) * w
        return math.inf

    def least_from(self, k: float, upto: float = math.inf) -> float:
        """The least ratio at any refresh interval in [k, upto]: linear in log k between points, the
        curve takes it at ``k``, ``upto`` or a point between (a lower bound for any cycle in that range)."""
        if k > upto:
            return math.inf
        inside = [r for kp, r in self.points if k < kp < upto]
        return min([self.at(k), self.at(upto) if math.isfinite(upto) else math.inf, *inside])

    @property
    def finite(self) -> bool:
        """Whether any interval reaches the target."""
        return any(math.isfinite(r) for _, r in self.points)

    def config_warning(self, digest: str, name: str) -> str | None:
        """One line where this curve was measured on another config than the job's (``digest``: its
        :meth:`RunConfig.fingerprint` without the layout, ``name`` its name or path); None where it
        was measured on this one, or names no config (given by hand)."""
        p = self.provenance
        if p is None or not p.config_digest or p.config_digest == digest:
            return None
        return (f"warning: the staleness curve {self.source} was measured on config {p.config}, not on this "
                f"job's '{name}' (digest {digest}); packing with it anyway")

    def describe(self) -> str:
        """The curve's origin for a report: the file or the command line, and what it was measured on."""
        p = self.provenance
        if p is None:
            return self.source or "given"
        bits = [f"measured on config {p.config}"]
        if p.horizon:
            bits.append(f"{p.horizon} steps")
        if p.seeds:
            bits.append(f"{p.seeds} seed{'s' if p.seeds != 1 else ''}")
        if p.relative_to:
            bits.append(f"relative to {p.relative_to}")
        return f"{self.source}, " + ", ".join(bits)

    # -- text and files ---------------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> "StalenessCurve":
        """``"1:0.5,2:0.53,4:0.57,8:0.83,16:inf"``: k, then steps-to-target relative to first-order."""
        try:
            points = []
            for part in text.split(","):
                k, r = part.split(":")
                points.append((float(k), float(r)))
            return cls(tuple(points), source=f"given as {text}")
        except ValueError as e:
            why = str(e) if "staleness curve" in str(e) else "expected k:ratio pairs such as 1:0.5,4:0.57,8:0.83"
            raise InputError(None, f"staleness curve '{text}': {why}") from None

    def to_data(self, **raw: Any) -> dict[str, Any]:
        """The file's content (:data:`STALENESS_FORMAT`); ``raw``: more fields written beside it (the
        benchmark's runs), which loading ignores, or :data:`LOADED_FROM`."""
        p = self.provenance or Provenance()

        def num(x: float) -> float | None:
            return None if math.isinf(x) or math.isnan(x) else x

        rows = []
        for i, (k, r) in enumerate(self.points):
            row: dict[str, Any] = {"k": int(k) if float(k).is_integer() else k, "ratio": num(r)}
            if i < len(self.spread):
                row.update(zip(("steps_min", "steps_median", "steps_max"), map(num, self.spread[i])))
            rows.append(row)
        return {"format": STALENESS_FORMAT, "curve": rows,
                "config": {"name": p.config_name, "path": p.config_path, "digest": p.config_digest},
                "model": p.model, "data": p.data, "horizon": p.horizon, "target": p.target, "seeds": p.seeds,
                "relative_to": p.relative_to, **raw}

    @classmethod
    def from_data(cls, data: Any, path: str) -> "StalenessCurve":
        """A curve from a file's content; anything malformed is one :class:`InputError` naming ``path``."""
        if not isinstance(data, Mapping):
            raise InputError(path, "is not a staleness curve (a JSON object with 'format' and 'curve' expected)")
        fmt = data.get("format")
        if fmt not in (STALENESS_FORMAT, "pipefisher-staleness/1"):
            raise InputError(path, f"is not a staleness curve: format {fmt!r}, expected '{STALENESS_FORMAT}'")
        rows = data.get("curve")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, Mapping) for r in rows):
            raise InputError(path, "has no 'curve' rows (one {\"k\": ..., \"ratio\": ...} per refresh interval)")
        old = fmt != STALENESS_FORMAT
        try:
            points = tuple((float(r["interval" if old else "k"]),
                            math.inf if r["vs_baseline" if old else "ratio"] is None
                            else float(r["vs_baseline" if old else "ratio"])) for r in rows)
            spread = () if old else tuple(
                tuple(math.inf if r.get(key) is None else float(r[key])
                      for key in ("steps_min", "steps_median", "steps_max")) for r in rows
                if any(key in r for key in ("steps_min", "steps_median", "steps_max")))
            config = data.get("config") or {}
            if old:
                args = data.get("args") or {}
                config = {"path": str(args.get("config") or "")}
            seeds = data.get("seeds", (data.get("args") or {}).get("seeds"))
            provenance = Provenance(
                config_digest=str(config.get("digest") or ""), config_name=str(config.get("name") or ""),
                config_path=str(config.get("path") or ""), model=str(data.get("model") or ""),
                data=str(data.get("data") or ""),
                horizon=None if data.get("horizon") is None else int(data["horizon"]),
                target=None if data.get("target") is None else float(data["target"]),
                seeds=None if seeds is None else int(seeds), relative_to=str(data.get("relative_to") or ""))
            return cls(points, source=str(data.get(LOADED_FROM) or path),
                       provenance=None if provenance == Provenance() else provenance,
                       spread=spread if len(spread) == len(points) else ())
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            why = str(err) if "staleness curve" in str(err) else f"a malformed row or field ({type(err).__name__}: {err})"
            raise InputError(path, f"is not a usable staleness curve: {why}") from None

    @classmethod
    def load(cls, path: str) -> "StalenessCurve":
        """Read a curve file (:data:`STALENESS_FORMAT`) through :mod:`pipefisher.safe_io`."""
        from pipefisher.safe_io import load_json

        return cls.from_data(load_json(path), path)


def staleness_data(curve: StalenessCurve | None) -> dict[str, Any] | None:
    """A curve as JSON data that keeps its source (how training options carry it to the workers), or
    None; :meth:`StalenessCurve.from_data` reads it back."""
    return None if curve is None else curve.to_data(**{LOADED_FROM: curve.source})


def read_staleness(text: str | None) -> StalenessCurve | None:
    """What a ``--staleness`` option gives: a curve file's path, or ``k:ratio,...`` inline; None: no curve."""
    if text is None:
        return None
    if os.path.exists(text) or ":" not in text:
        return StalenessCurve.load(text)
    return StalenessCurve.parse(text)


def curve_for_job(text: str | None, digest: str, name: str, echo: Callable[[str], None] = print) -> StalenessCurve | None:
    """:func:`read_staleness` for a job whose config is known (``digest``: its
    :meth:`RunConfig.fingerprint` without the layout, ``name`` its name or path): a curve measured on
    another config is used with the one-line warning :meth:`StalenessCurve.config_warning` echoes."""
    curve = read_staleness(text)
    if curve is not None and (warning := curve.config_warning(digest, name)):
        echo(warning)
    return curve


STALENESS_HELP = ("the job's staleness curve: a file scripts/bench_staleness.py wrote (staleness.json), or "
                  "K:RATIO,... inline (K-FAC's steps to the target relative to first-order per curvature refresh "
                  "interval k, e.g. 1:0.5,2:0.53,4:0.57,8:0.83,16:inf). Without one, the packing density is "
                  "chosen by planned step time alone and no time-to-target is predicted")
"""The ``--staleness`` option's help, one text for every command and benchmark that takes it."""
