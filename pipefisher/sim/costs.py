"""Cost models: how long forwards, backwards, K-FAC work and point-to-point sends take.

A cost model is a YAML file (see the bundled ones in ``pipefisher/bundled/cost_models/``) or built in code.
Times in the file are milliseconds (as the published measurements are); the simulator works in integer nanoseconds.

Pipeline costs are given either per transformer layer (``layer: {forward_ms, backward_ms}`` with
``layers``, split evenly over the stages) or per stage (``stage: {forward_ms: [...], backward_ms:
[...]}``, one entry per stage). K-FAC costs are per module of one layer: either given per factor
directly, or derived from per-block totals in proportion to the factor sizes (covariance ~ d^2,
inverse ~ d^3 for a d x d factor; all-reduce time from the factor's bytes). End-of-step work is per
block per step: ``kfac.block_prec_ms`` (preconditioning the block's gradients, the published CSVs'
``time_prec``) and ``block_update_ms`` (the rest of the update: gradient all-reduce, clipping, optimizer
step); both default to 0, so files written before them load unchanged.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from pipefisher.errors import InputError, renamed_notice

NS_PER_MS = 1_000_000
FACTOR_KEYS = ("cov_A_ms", "cov_B_ms", "sync_A_ms", "sync_B_ms", "inv_A_ms", "inv_B_ms")


@dataclass(frozen=True)
class ModuleCost:
    """K-FAC costs of one module (a Linear layer) of one transformer layer, in milliseconds.

    ``cov_*`` are per micro-batch; ``sync_*`` and ``inv_*`` once per curvature refresh.
    """

    name: str
    cov_A_ms: float
    cov_B_ms: float
    sync_A_ms: float
    sync_B_ms: float
    inv_A_ms: float
    inv_B_ms: float

    def scaled(self, factor: float) -> "ModuleCost":
        return ModuleCost(self.name, *(getattr(self, k) * factor for k in FACTOR_KEYS))


@dataclass(frozen=True)
class CostModel:
    """Everything the simulator needs to know about a model on a cluster, plus default run settings."""

    name: str
    layers: int
    modules: tuple[ModuleCost, ...]
    layer_forward_ms: float | None = None
    layer_backward_ms: float | None = None
    stage_forward_ms: tuple[float, ...] | None = None
    stage_backward_ms: tuple[float, ...] | None = None
    backward_input_fraction: float = 0.5
    """Share of a backward that is the input gradient (B) when a pipeline order splits it from W."""
    latency_ms: float = 0.0
    """Point-to-point time between neighbouring stages (send of activations or gradients)."""
    kfac_scale: float = 1.0
    block_prec_ms: float = 0.0
    """Preconditioning one layer's gradients with its inverses, once per step (K-FAC work: ``kfac_scale``
    applies); on the step's critical path, after the pipeline."""
    block_update_ms: float = 0.0
    """The rest of one layer's share of the update, once per step (first-order pays it too)."""
    refresh_pieces: int = 1
    """Pieces each factor's refresh (its inverse) runs in: the runtime's ``kfac.refresh_pieces``; the
    timeline then holds that many intervals per inverse key, equal shares of its time."""
    refresh_piece_ms: float | None = None
    """Or pieces of at most this long: a factor's inverse of ``t`` ms runs in ``ceil(t / this)`` pieces."""
    module_template: str = "encoder.layer.{layer}.{module}"
    order: str = "1f1b"
    """The pipeline order (:func:`pipefisher.pipeline_orders.order_names`); the file's ``order`` key."""
    stages: int = 4
    micro_batches: int = 8
    chunks: int | None = None
    source: str = ""

    def replace(self, **changes: Any) -> "CostModel":
        """A copy with some fields changed; ``None`` values are ignored (unset CLI flags)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        model = dataclasses.replace(self, **changes)
        model.check()
        return model

    def check(self, path: str | None = None) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise InputError(path, what)

        need(self.layers >= 1, f"layers must be >= 1, got {self.layers}")
        per_layer = self.layer_forward_ms is not None and self.layer_backward_ms is not None
        per_stage = self.stage_forward_ms is not None and self.stage_backward_ms is not None
        need(per_layer or per_stage, "needs 'layer: {forward_ms, backward_ms}' or 'stage: {forward_ms: [...], backward_ms: [...]}'")
        if per_stage and not per_layer:
            need(len(self.stage_forward_ms or ()) == self.stages == len(self.stage_backward_ms or ()),
                 f"stage costs list {len(self.stage_forward_ms or ())} forward and {len(self.stage_backward_ms or ())} "
                 f"backward times, but stages is {self.stages}")
        times = [self.layer_forward_ms, self.layer_backward_ms, *(self.stage_forward_ms or ()),
                 *(self.stage_backward_ms or ()), self.latency_ms, self.block_prec_ms, self.block_update_ms]
        need(all(t is None or (math.isfinite(t) and t >= 0) for t in times), "times must be finite and >= 0")
        need(0.0 < self.backward_input_fraction < 1.0, "backward_input_fraction must be between 0 and 1")
        need(self.kfac_scale >= 0 and math.isfinite(self.kfac_scale), "kfac scale must be >= 0")
        need(bool(self.modules), "kfac needs at least one module")
        for m in self.modules:
            need(all(math.isfinite(getattr(m, k)) and getattr(m, k) >= 0 for k in FACTOR_KEYS),
                 f"module '{m.name}' has a negative or non-finite K-FAC cost")
        try:
            self.module_template.format(layer=0, module="x")
        except (KeyError, IndexError, ValueError):
            need(False, "module_template may only use {layer} and {module}")
        need(self.stages >= 1, f"stages must be >= 1, got {self.stages}")
        need(self.micro_batches >= 1, f"micro_batches must be >= 1, got {self.micro_batches}")
        need(self.refresh_pieces >= 1, f"kfac.refresh_pieces must be >= 1, got {self.refresh_pieces}")
        need(self.refresh_piece_ms is None or (math.isfinite(self.refresh_piece_ms) and self.refresh_piece_ms > 0),
             f"kfac.refresh_piece_ms must be > 0, got {self.refresh_piece_ms}")

    # ------------------------------------------------------------------------------------------------

    def stage_layers(self, stage: int, stages: int) -> range:
        """Layers of stage ``stage`` when the model is cut into ``stages`` even parts (the first ones
        take one more layer when it does not divide)."""
        base, extra = divmod(self.layers, stages)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def stage_times_ns(self, virtual_stages: int, chunks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Forward and backward time per micro-batch of each virtual stage of a pipe."""
        if self.layers < virtual_stages:
            raise InputError(None, f"{self.name}: {self.layers} layers cannot fill {virtual_stages} (virtual) stages")
        if self.layer_forward_ms is not None and self.layer_backward_ms is not None:
            n = [len(self.stage_layers(s, virtual_stages)) for s in range(virtual_stages)]
            fwd = tuple(round(k * self.layer_forward_ms * NS_PER_MS) for k in n)
            bwd = tuple(round(k * self.layer_backward_ms * NS_PER_MS) for k in n)
            return fwd, bwd
        assert self.stage_forward_ms is not None and self.stage_backward_ms is not None
        if len(self.stage_forward_ms) * chunks != virtual_stages:
            raise InputError(None, f"{self.name}: per-stage costs are given for {len(self.stage_forward_ms)} stages, "
                             f"not {virtual_stages // chunks}; set 'layer' costs to change the stage count")
        fwd = tuple(round(self.stage_forward_ms[s // chunks] / chunks * NS_PER_MS) for s in range(virtual_stages))
        bwd = tuple(round(self.stage_backward_ms[s // chunks] / chunks * NS_PER_MS) for s in range(virtual_stages))
        return fwd, bwd

    def module_costs(self) -> tuple[ModuleCost, ...]:
        """Per-module K-FAC costs with the K-FAC scale applied."""
        return tuple(m.scaled(self.kfac_scale) for m in self.modules)

    def pieces_of(self, inverse_ms: float) -> int:
        """How many pieces an inverse of ``inverse_ms`` (scaled) runs in: ``refresh_pieces``, or by
        ``refresh_piece_ms`` where that is set."""
        if self.refresh_piece_ms is None:
            return self.refresh_pieces
        return max(1, math.ceil(inverse_ms / self.refresh_piece_ms))

    def end_of_step_ns(self, layers: int) -> tuple[int, int]:
        """(preconditioning, the rest of the update) of a node holding ``layers`` layer copies, per step:
        each copy's gradients are preconditioned and stepped (Chimera's two copies of a stage both are)."""
        return (round(layers * self.block_prec_ms * self.kfac_scale * NS_PER_MS),
                round(layers * self.block_update_ms * NS_PER_MS))


# ----------------------------------------------------------------------------------------------------
# YAML


def _num(path: str, where: str, value: Any, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(path, f"'{where}' must be a number, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise InputError(path, f"'{where}' must be a whole number, got {value!r}")
        return int(value)
    if not math.isfinite(value) or value < 0:
        raise InputError(path, f"'{where}' must be a finite number >= 0, got {value!r}")
    return float(value)


def _map(path: str, where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InputError(path, f"'{where}' must be a mapping, got {type(value).__name__}")
    return value


def _allowed(path: str, where: str, data: Mapping[str, Any], keys: set[str]) -> None:
    extra = sorted(set(map(str, data)) - keys)
    if extra:
        raise InputError(path, f"unknown key{'s' if len(extra) > 1 else ''} in {where}: {', '.join(extra)}")


def _sync_ms(sync: Mapping[str, Any] | None, dim: int, path: str) -> float:
    """Ring all-reduce of a dim x dim fp32 factor: latency + 2 (n-1)/n * bytes / bandwidth."""
    if sync is None:
        return 0.0
    n = _num(path, "kfac.sync.data_parallel", sync.get("data_parallel", 1), integer=True)
    if n <= 1:
        return 0.0
    bw = _num(path, "kfac.sync.bandwidth_gb_per_s", sync.get("bandwidth_gb_per_s", 10.0))
    if bw <= 0:
        raise InputError(path, "'kfac.sync.bandwidth_gb_per_s' must be > 0")
    lat = _num(path, "kfac.sync.latency_ms", sync.get("latency_ms", 0.0))
    nbytes = 4 * dim * dim
    return lat + 2 * (n - 1) / n * nbytes / (bw * 1e9) * 1e3


def _modules(path: str, kfac: Mapping[str, Any]) -> tuple[ModuleCost, ...]:
    _allowed(path, "kfac", kfac, {"block_cov_ms", "block_inv_ms", "block_prec_ms", "sync", "modules", "scale",
                                  "refresh_pieces", "refresh_piece_ms"})
    raw = kfac.get("modules")
    if not isinstance(raw, list) or not raw:
        raise InputError(path, "'kfac.modules' must be a non-empty list")
    sync = kfac.get("sync")
    if sync is not None:
        sync = _map(path, "kfac.sync", sync)
        _allowed(path, "kfac.sync", sync, {"data_parallel", "bandwidth_gb_per_s", "latency_ms"})
    entries = []
    for i, m in enumerate(raw):
        m = _map(path, f"kfac.modules[{i}]", m)
        _allowed(path, f"kfac.modules[{i}]", m, {"name", "in", "out", *FACTOR_KEYS})
        if not isinstance(m.get("name"), str) or not m["name"]:
            raise InputError(path, f"'kfac.modules[{i}].name' must be a non-empty string")
        entries.append(m)
    names = [m["name"] for m in entries]
    if len(set(names)) != len(names):
        raise InputError(path, "'kfac.modules' names must be unique")

    needs_dims = any(k not in m for m in entries for k in FACTOR_KEYS if not k.startswith("sync")) or (
        sync is not None and any(k not in m for m in entries for k in ("sync_A_ms", "sync_B_ms")))
    dims: list[tuple[int, int]] = []
    if needs_dims:
        for i, m in enumerate(entries):
            if "in" not in m or "out" not in m:
                raise InputError(path, f"'kfac.modules[{i}]' ({m['name']}) needs 'in' and 'out' sizes, or all of "
                                 + ", ".join(FACTOR_KEYS))
            dims.append((_num(path, f"kfac.modules[{i}].in", m["in"], integer=True),
                         _num(path, f"kfac.modules[{i}].out", m["out"], integer=True)))
            if min(dims[-1]) < 1:
                raise InputError(path, f"'kfac.modules[{i}]' sizes must be >= 1")
    cov_total = sum(a * a + b * b for a, b in dims) or 1
    inv_total = sum(a ** 3 + b ** 3 for a, b in dims) or 1

    def block(key: str) -> float:
        if key not in kfac:
            raise InputError(path, f"'kfac.{key}' is needed to derive per-module costs from sizes")
        return _num(path, f"kfac.{key}", kfac[key])

    out = []
    for i, m in enumerate(entries):
        vals: dict[str, float] = {}
        a, b = dims[i] if dims else (0, 0)
        for key in FACTOR_KEYS:
            if key in m:
                vals[key] = _num(path, f"kfac.modules[{i}].{key}", m[key])
            elif key.startswith("cov"):
                vals[key] = block("block_cov_ms") * (a * a if key == "cov_A_ms" else b * b) / cov_total
            elif key.startswith("inv"):
                vals[key] = block("block_inv_ms") * (a ** 3 if key == "inv_A_ms" else b ** 3) / inv_total
            else:
                vals[key] = _sync_ms(sync, a if key == "sync_A_ms" else b, path)
        out.append(ModuleCost(m["name"], **vals))
    return tuple(out)


def cost_model_from_dict(data: Any, path: str | None = None) -> CostModel:
    """Build and check a cost model from parsed YAML; every problem is an :class:`InputError`."""
    where = path if path is not None else "<cost model>"
    data = _map(where, "the file", data)
    _allowed(where, "the file", data, {"name", "source", "order", "schedule", "stages", "micro_batches", "chunks",
                                       "layers", "layer", "stage", "backward_input_fraction", "latency_ms", "kfac",
                                       "module_template", "block_update_ms"})
    if "layers" not in data:
        raise InputError(where, "needs 'layers' (transformer layers in the whole model)")
    if "kfac" not in data:
        raise InputError(where, "needs a 'kfac' section")
    kfac = _map(where, "kfac", data["kfac"])
    kw: dict[str, Any] = {
        "name": str(data.get("name") or os.path.splitext(os.path.basename(where))[0]),
        "source": str(data.get("source", "")),
        "layers": _num(where, "layers", data["layers"], integer=True),
        "modules": _modules(where, kfac),
        "kfac_scale": _num(where, "kfac.scale", kfac.get("scale", 1.0)),
        "block_prec_ms": _num(where, "kfac.block_prec_ms", kfac.get("block_prec_ms", 0.0)),
        "refresh_pieces": _num(where, "kfac.refresh_pieces", kfac.get("refresh_pieces", 1), integer=True),
    }
    if kfac.get("refresh_piece_ms") is not None:
        kw["refresh_piece_ms"] = _num(where, "kfac.refresh_piece_ms", kfac["refresh_piece_ms"])
    if "layer" in data:
        layer = _map(where, "layer", data["layer"])
        _allowed(where, "layer", layer, {"forward_ms", "backward_ms"})
        for k in ("forward_ms", "backward_ms"):
            if k not in layer:
                raise InputError(where, f"'layer' needs '{k}'")
        kw["layer_forward_ms"] = _num(where, "layer.forward_ms", layer["forward_ms"])
        kw["layer_backward_ms"] = _num(where, "layer.backward_ms", layer["backward_ms"])
    if "stage" in data:
        stage = _map(where, "stage", data["stage"])
        _allowed(where, "stage", stage, {"forward_ms", "backward_ms"})
        for k in ("forward_ms", "backward_ms"):
            if not isinstance(stage.get(k), list) or not stage[k]:
                raise InputError(where, f"'stage.{k}' must be a non-empty list of times, one per stage")
        kw["stage_forward_ms"] = tuple(_num(where, "stage.forward_ms", x) for x in stage["forward_ms"])
        kw["stage_backward_ms"] = tuple(_num(where, "stage.backward_ms", x) for x in stage["backward_ms"])
    for k in ("backward_input_fraction", "latency_ms", "block_update_ms"):
        if k in data:
            kw[k] = _num(where, k, data[k])
    for k in ("stages", "micro_batches", "chunks"):
        if k in data:
            kw[k] = _num(where, k, data[k], integer=True)
    if "stages" not in kw and kw.get("stage_forward_ms"):
        kw["stages"] = len(kw["stage_forward_ms"])
    if "schedule" in data:  # order's old name, from before "schedule" named only the packed K-FAC schedule
        if "order" in data:
            raise InputError(where, "has both schedule and order (the same key, under its old and new name): "
                                    "keep order")
        renamed_notice("schedule", "order", where)
        data = {**data, "order": data["schedule"]}
    if "order" in data:
        if not isinstance(data["order"], str):
            raise InputError(where, "'order' must be a pipeline order name")
        kw["order"] = data["order"]
    if "module_template" in data:
        kw["module_template"] = str(data["module_template"])
    model = CostModel(**kw)
    model.check(where)
    return model


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """Read a cost model YAML file."""
    from pipefisher.safe_io import load_yaml

    path = os.fspath(path)
    data = load_yaml(path)
    if data is None:
        raise InputError(path, "is empty")
    return cost_model_from_dict(data, path)
