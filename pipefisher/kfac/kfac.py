"""K-FAC for the linear layers of one pipeline stage, one call per piece of work: a facade over its
components, each with its own state (and its own part of a checkpoint):

- :class:`~pipefisher.kfac.statistics.CurvatureStats` - the curvature statistics: hooks saving inputs
  and output gradients, covariance pieces, the data-parallel all-reduce, running averages;
- :class:`~pipefisher.kfac.refresher.Refresher` - the refresh: damped inverse or eigenbasis, in pieces
  (:mod:`pipefisher.kfac.refresh`), checked;
- :class:`~pipefisher.kfac.precondition.Preconditioner` - the update of the gradients: ``B^-1 G A^-1``
  and the KL-clip's sum and scaling (``kfac.update: soap``'s Adam in the eigenbasis is
  :class:`pipefisher.kfac.eigenbasis.EigenbasisAdam`, reading the bases through :meth:`KFAC.eigenbases`);
- :class:`~pipefisher.kfac.drift_meter.DriftMeter` - the curvature drift at every refresh of a layer.

The calls map one to one onto schedule labels (see the timeline-and-schedule spec):

- :meth:`KFAC.set_saving` - ``turn_on/off_save_inputs_outgrads``
- :meth:`KFAC.cov` - ``cov_kron_A:<m>`` / ``cov_kron_B:<m>``: add the OLDEST saved micro-batch
- :meth:`KFAC.sync` - ``sync_kron_X:<m>``: average the factor over the data-parallel group (started here,
  waited for where the factor is next read)
- :meth:`KFAC.inv` - ``inv_kron_X:<m>``: a piece of the factor's refresh (``refresh_pieces``)
- :meth:`KFAC.precondition` - part of ``-- end --``: ``B^-1 grad A^-1``
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from pipefisher.kfac.defaults import factor_decay_of, step_decay_of
from pipefisher.kfac.drift_meter import DriftMeter
from pipefisher.kfac.factors import INVERSE_METHODS, BadFactorError
from pipefisher.kfac.layers import (DEFAULT_IGNORE, DTYPES, FACTORS, LAYER_KINDS, Bases, Coverage, LayerKind,
                                    LayerState, LayerStates, coverage, is_ignored, kfac_modules, layer_kind,
                                    layer_states)
from pipefisher.kfac.precondition import Preconditioner
from pipefisher.kfac.refresh import PIECE_METHODS
from pipefisher.kfac.refresher import HostReader, Refresher
from pipefisher.kfac.statistics import CurvatureStats

__all__ = ["KFAC", "BadFactorError", "Coverage", "DEFAULT_IGNORE", "HostReader", "LAYER_KINDS", "LayerKind",
           "LayerState", "LayerStates", "coverage", "is_ignored", "kfac_modules", "layer_kind"]

STATE_FORMAT = 2
"""The layout of :meth:`KFAC.state_dict`: one part per component. A state without ``format`` is the one
before the components (one flat record per layer), which :func:`split_flat_state` reads; any other
format is refused (:func:`check_state_format`)."""

_FLAT_KEYS = {"curvature": ("sums", "counts", "running", "synced", "inputs", "outgrads"),
              "refresh": ("inverses", "last_pi", "inversions", "skipped", "flight", "completed"),
              "drift": ("last_grad", "last_pre", "pre_versions", "replaced", "handled", "previous")}


def check_state_format(state: Any) -> None:
    """``ValueError`` naming the format found and the ones known, for a state this code cannot read (one
    written by a newer pipefisher, or damaged): loading it as one of ours would resume wrongly."""
    known = (f"this pipefisher reads format {STATE_FORMAT} and the flat layout before it (no format, one record "
             "per layer)")
    if not isinstance(state, dict):
        raise ValueError(f"K-FAC state is a {type(state).__name__}, not a dict: {known}")
    if "format" in state:
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"K-FAC state of format {state['format']!r}: {known}")
    elif not {"saving", "layers"} <= set(state):
        raise ValueError(f"K-FAC state of no format and no flat layers (keys {', '.join(map(str, state))}): {known}")


def split_flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """A K-FAC state saved before the components (``{"saving", "layers": {name: one flat record}}``) in
    the components' layout, so that checkpoints written then still resume."""
    part = {c: {n: {k: s[k] for k in keys if k in s} for n, s in state["layers"].items()}
            for c, keys in _FLAT_KEYS.items()}
    for s in part["refresh"].values():
        s["installed"] = s.pop("inverses")
    return {"format": STATE_FORMAT, "curvature": {"saving": state["saving"], "layers": part["curvature"]},
            "refresh": part["refresh"], "drift": part["drift"]}


def _check_settings(damping: float, damping_min: float | None, damping_decay: float, factor_decay: float,
                    inverse: str, inverse_dtype: str, on_bad_factor: str, fisher: str, cov_stride: int,
                    refresh_pieces: int | str, cov_micro_batches: int | None, basis_block: int = 0) -> None:
    """``ValueError`` for a setting K-FAC cannot run with (the run config's check says the same to users)."""
    if not (damping > 0 and math.isfinite(damping)):  # also refuses NaN and infinity
        raise ValueError(f"K-FAC damping must be positive and finite, not {damping!r}: an undamped "
                         "factor is singular")
    if not 0 < (damping if damping_min is None else damping_min) <= damping:
        raise ValueError(f"K-FAC damping_min must be in (0, damping], not {damping_min!r}")
    if not 0 < damping_decay <= 1 or not 0 <= factor_decay < 1:
        raise ValueError("K-FAC damping_decay must be in (0, 1] and factor_decay in [0, 1)")
    if inverse not in INVERSE_METHODS or inverse_dtype not in ("float32", "float64"):
        raise ValueError(f"unknown inverse {inverse!r} in {inverse_dtype!r}")
    if on_bad_factor not in ("stop", "skip") or fisher not in ("empirical", "true"):
        raise ValueError(f"on_bad_factor {on_bad_factor!r} / fisher {fisher!r} not understood")
    if not isinstance(cov_stride, int) or cov_stride < 1:
        raise ValueError(f"K-FAC cov_stride must be an integer >= 1, not {cov_stride!r}")
    if cov_micro_batches is not None and (isinstance(cov_micro_batches, bool) or not isinstance(cov_micro_batches, int)
                                          or cov_micro_batches < 1):
        raise ValueError(f"K-FAC cov_micro_batches must be an integer >= 1 or None (all), not {cov_micro_batches!r}")
    if refresh_pieces != "auto" and (isinstance(refresh_pieces, bool) or not isinstance(refresh_pieces, int)
                                     or refresh_pieces < 1):
        raise ValueError(f"K-FAC refresh_pieces must be an integer >= 1 or 'auto', not {refresh_pieces!r}")
    if refresh_pieces not in (1, "auto") and inverse not in PIECE_METHODS:
        raise ValueError(f"K-FAC refresh_pieces > 1 needs inverse {' or '.join(PIECE_METHODS)}, not {inverse!r}")
    if isinstance(basis_block, bool) or not isinstance(basis_block, int) or basis_block < 0:
        raise ValueError(f"K-FAC basis_block must be an integer >= 0 (0: whole factors), not {basis_block!r}")
    if basis_block and inverse != "eigenbasis":
        raise ValueError(f"K-FAC basis_block cuts eigenbases (inverse eigenbasis), not {inverse!r} inverses")


class KFAC:
    """K-FAC for one stage (one data-parallel replica of it): its components, composed.

    ``loss_scale`` is the number each micro-batch's mean loss was divided by (the number of
    micro-batches per step), so factor B is built from per-row gradients. ``dp_group`` is the stage's
    data-parallel process group (``None``: no data parallelism). Damping starts at ``damping`` and is
    multiplied by ``damping_decay`` after every refresh of a layer, never going below ``damping_min``.
    ``on_bad_factor``: ``stop`` raises :class:`BadFactorError` (one line naming the layer), ``skip``
    keeps the layer's previous inverse, drops that refresh and reports it through ``warn`` (default: a
    warning of the refresher's logger).
    ``drift``: measure every layer's drift at its refreshes; it keeps two gradient-sized tensors and the
    inverses of the refresh before per layer. Replicas hold the same gradients and inverses, so one
    replica measuring suffices. ``host``: the worker's reader of device values (:class:`HostReader`),
    which the checks of inverses are read with (None: each read at once). ``basis_block`` (``inverse=
    "eigenbasis"`` only): a factor wider than it is cut into diagonal blocks, its covariance and basis
    computed per block (:func:`pipefisher.kfac.factors.diagonal_blocks`); 0 keeps factors whole.
    ``factor_decay``: the old factor's weight in each refresh's running average; None takes the kind's
    default (:func:`pipefisher.kfac.defaults.factor_decay_of`: for eigenbases ``factor_decay_per_step``,
    None: SOAP's 0.95, to the power of the refresh interval, every step until :meth:`refresh_every` says
    otherwise; 0 for inverses).
    """

    def __init__(self, model: nn.Module, *, damping: float = 1e-3, ignore: Iterable[str] = DEFAULT_IGNORE,
                 loss_scale: float = 1.0, dp_group: Any = None, dp_size: int = 1,
                 damping_min: float | None = None, damping_decay: float = 1.0, factor_decay: float | None = None,
                 inverse: str = "cholesky", inverse_dtype: str = "float32", on_bad_factor: str = "stop",
                 save_dtype: str = "float32", fisher: str = "empirical",
                 warn: Callable[[str], None] | None = None, cov_stride: int = 1, drift: bool = True,
                 refresh_pieces: int | str = 1, host: HostReader | None = None,
                 cov_micro_batches: int | None = None, basis_block: int = 0,
                 factor_decay_per_step: float | None = None) -> None:
        self._factor_decay = factor_decay  # as given: None follows the refresh interval (refresh_every)
        self._per_step = step_decay_of(factor_decay_per_step)
        self._refresh_interval = 1
        if not 0.0 <= self._per_step < 1.0:
            raise ValueError(f"factor_decay_per_step must be in [0, 1), not {factor_decay_per_step}")
        factor_decay = factor_decay_of(factor_decay, eigenbasis=inverse == "eigenbasis", per_step=self._per_step)
        _check_settings(damping, damping_min, damping_decay, factor_decay, inverse, inverse_dtype,
                        on_bad_factor, fisher, cov_stride, refresh_pieces, cov_micro_batches, basis_block)
        self.layers = layer_states(model, ignore)
        self.coverage = coverage(model, ignore)  # what the run says at start
        self.stats = CurvatureStats(self.layers, loss_scale=loss_scale, dp_group=dp_group, dp_size=dp_size,
                                    factor_decay=factor_decay, save_dtype=DTYPES[save_dtype], fisher=fisher,
                                    cov_stride=cov_stride, cov_micro_batches=cov_micro_batches,
                                    basis_block=basis_block)
        self.refresher = Refresher(self.layers, self.stats, damping=float(damping),
                                   damping_min=float(damping if damping_min is None else damping_min),
                                   damping_decay=float(damping_decay), method=inverse,
                                   dtype=DTYPES[inverse_dtype], on_bad_factor=on_bad_factor,
                                   refresh_pieces=refresh_pieces, warn=warn, host=host, basis_block=basis_block)
        self.drift = DriftMeter(list(self.layers), enabled=drift)
        self.drift.follow(self.refresher)
        self.update = Preconditioner(self.layers, self.refresher, self.drift)

    # -- the labels and what the engines call -------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self.layers)

    @property
    def grad_scaler(self) -> Any:
        """fp16's loss scale (:class:`pipefisher.runtime.pipeline.compute.LossScale`), None otherwise."""
        return self.stats.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: Any) -> None:
        self.stats.grad_scaler = scaler

    def set_saving(self, on: bool) -> None:
        """Start or stop saving layer inputs (forward) and output gradients (backward)."""
        self.stats.set_saving(on)

    def cov(self, factor: str, name: str) -> bool:
        """``cov_kron_X:<name>`` (:meth:`CurvatureStats.cov`)."""
        return self.stats.cov(factor, name)

    def cov_all(self, factor: str, name: str) -> int:
        return self.stats.cov_all(factor, name)

    def sync(self, factor: str, name: str) -> None:
        """``sync_kron_X:<name>`` (:meth:`CurvatureStats.sync`)."""
        self.stats.sync(factor, name)

    def inv(self, factor: str, name: str) -> None:
        """``inv_kron_X:<name>`` (:meth:`Refresher.inv`)."""
        self.refresher.inv(factor, name)

    def pieces(self, name: str, factor: str) -> int:
        return self.refresher.pieces(name, factor)

    def complete(self, factor: str, name: str) -> None:
        self.refresher.complete(factor, name)

    def refresh_every(self, steps: int) -> None:
        """Refreshes come every ``steps`` training steps (``kfac.interval``, or a schedule's cycle): an
        unset ``factor_decay`` weighs the old factor per step (:func:`factor_decay_of`), a set one is kept."""
        self._refresh_interval = steps
        self.stats.factor_decay = factor_decay_of(self._factor_decay, eigenbasis=self.refresher.method == "eigenbasis",
                                                  interval=steps, per_step=self._per_step)

    def averaging_line(self) -> str | None:
        """What the run says of its factors' running average, which sets how fast the curvature follows
        the weights as much as the refresh interval does (None: each refresh keeps its own factor only)."""
        weight = self.stats.factor_decay
        if not weight:
            return None
        why = ("kfac.factor_decay" if self._factor_decay is not None
               else f"{self._per_step:g} a step, a refresh every {self._refresh_interval} step"
                    f"{'s' if self._refresh_interval != 1 else ''}")
        return f"factors averaged across refreshes: the old factor weighs {weight:.3g} a refresh ({why})"

    def plan_refresh(self) -> None:
        self.refresher.plan_refresh()

    def finish_refreshes(self) -> None:
        self.refresher.finish_refreshes()

    @property
    def samples_labels(self) -> bool:
        return self.stats.samples_labels

    def end_forward(self) -> None:
        self.stats.end_forward()

    def take_forward(self) -> list[tuple[LayerState, torch.Tensor]] | None:
        return self.stats.take_forward()

    def save_outgrads(self, outputs: list[tuple[LayerState, torch.Tensor]],
                      grads: Iterable[torch.Tensor | None]) -> None:
        self.stats.save_outgrads(outputs, grads)

    def replaying(self) -> "_Replaying":
        """Forwards run inside this context are recomputations of forwards already seen (activation
        checkpointing runs a block again in its backward): their inputs are not saved a second time.
        The context may be entered again and again (a graph kept for a second backward recomputes again)."""
        return _Replaying(self.stats)

    def remove_hooks(self) -> None:
        self.stats.remove_hooks()

    def pending(self, factor: str, name: str) -> int:
        return self.stats.pending(factor, name)

    def clear_saved(self) -> None:
        self.stats.clear_saved()

    def saved_bytes(self) -> int:
        return self.stats.saved_bytes()

    @property
    def saved_now(self) -> int:
        return self.stats.saved_now

    @property
    def peak_saved_bytes(self) -> int:
        return self.stats.peak_saved_bytes

    def reset_peak_saved(self) -> None:
        self.stats.reset_peak_saved()

    def settle_all(self) -> None:
        """Wait for every all-reduce in flight and check every inverse not checked yet (before a checkpoint,
        at the end of a run): nothing of this K-FAC is left for later."""
        self.stats.settle_all()
        self.refresher.settle()

    def check_inverses(self) -> None:
        self.refresher.check_inverses()

    def take_drift(self) -> list[tuple[Any, ...]]:
        """The drift measured since the last call (:meth:`DriftMeter.take`)."""
        return self.drift.take()

    # -- the update ----------------------------------------------------------------------------------

    def precondition(self, name: str) -> bool:
        return self.update.precondition(name)

    def precondition_all(self) -> int:
        return self.update.precondition_all()

    @property
    def grad_dot_step(self) -> torch.Tensor:
        return self.update.grad_dot_step

    def scale_step(self, nu: torch.Tensor | float) -> None:
        self.update.scale_step(nu)

    def layer_states(self) -> list[LayerState]:
        """The layers K-FAC preconditions, in layer order (:class:`LayerStates`)."""
        return list(self.layers.values())

    def parameters(self) -> list[nn.Parameter]:
        return self.update.parameters()

    def eigenbases(self) -> list[Bases]:
        return self.update.eigenbases()

    def on_refresh(self, call: Callable[[LayerState, Bases], None]) -> None:
        """``call(layer, bases)`` after every refresh of a factor (:class:`LayerStates`)."""
        self.refresher.listeners.append(_RefreshCall(self, call))

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly, one part per component (see the components'
        ``state_dict``). Waits for in-flight all-reduces and checks what is unchecked first."""
        self.settle_all()
        return {"format": STATE_FORMAT, "curvature": self.stats.state_dict(),
                "refresh": self.refresher.state_dict(), "drift": self.drift.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content (or one saved before the components:
        :func:`split_flat_state`); ``ValueError`` when it is of another format (:func:`check_state_format`)
        or covers other layers than these."""
        check_state_format(state)
        if "format" not in state:
            state = split_flat_state(state)
        if set(state["curvature"]["layers"]) != set(self.layers):
            raise ValueError("K-FAC state of other modules than this stage's")
        self.stats.load_state_dict(state["curvature"])
        self.refresher.load_state_dict(state["refresh"])
        self.drift.load_state_dict(state["drift"])

    # -- conveniences ----------------------------------------------------------------------------

    def factor(self, name: str, factor: str) -> torch.Tensor | None:
        """The current factor (mean of this refresh's contributions), or None when cleared."""
        return self.stats.factor(name, factor)

    def inverse(self, name: str, factor: str) -> torch.Tensor | None:
        """What the update uses for ``factor`` of layer ``name``: its inverse (or eigenbasis)."""
        return self.refresher.installed(name, factor)

    def update_curvature(self, span: Callable[[str], ContextManager[Any]] | None = None) -> None:
        """Naive K-FAC for every layer: all covariance, then sync, then both refreshes, each in its pieces.

        ``span(key)`` wraps each piece (a profiler uses it); keys are the timeline keys.
        """
        span = span or (lambda key: nullcontext())
        for name in self.layers:
            for f in FACTORS:
                with span(f"cov_kron_{f}:{name}"):
                    self.cov_all(f, name)
        if self.stats.dp_size > 1:
            for name in self.layers:
                for f in FACTORS:
                    with span(f"sync_kron_{f}:{name}"):
                        self.sync(f, name)
        for name in self.layers:
            for f in FACTORS:
                self.complete(f, name)
                for _ in range(self.pieces(name, f)):  # each piece in its own span: the timeline holds p
                    with span(f"inv_kron_{f}:{name}"):
                        self.inv(f, name)

    def apply_label(self, label: str) -> bool:
        """Run one K-FAC schedule label (``cov_kron_A:<m>``, ``turn_off_save_inputs_outgrads``, ...).

        Returns False for labels that are not K-FAC work (pipeline calls, markers).
        """
        if label == "turn_on_save_inputs_outgrads":
            self.set_saving(True)
            return True
        if label == "turn_off_save_inputs_outgrads":
            self.set_saving(False)
            return True
        kind, _, name = label.partition(":")
        work = {"cov_kron": self.cov, "sync_kron": self.sync, "inv_kron": self.inv}.get(kind[:-2])
        if work is None or kind[-2:] not in ("_A", "_B"):
            return False
        if name not in self.layers:
            raise KeyError(f"{label}: this stage has no K-FAC layer named {name!r}")
        work(kind[-1], name)
        return True


class _RefreshCall:
    """A refresh listener (:class:`pipefisher.kfac.refresher.RefreshListener`) handing each refreshed layer
    of ``kfac``, with its bases after the refresh, to ``call`` (:meth:`KFAC.on_refresh`)."""

    def __init__(self, kfac: KFAC, call: Callable[[LayerState, Bases], None]) -> None:
        self.kfac, self.call = kfac, call

    def replacing(self, name: str, factor: str, old: torch.Tensor | None) -> None:
        """Only what a refresh left matters here."""

    def refreshed(self, name: str, factor: str) -> None:
        self.call(self.kfac.layers[name], self.kfac.refresher.bases(name))


class _Replaying:
    """:meth:`KFAC.replaying`'s context: re-enterable, nesting-safe."""

    def __init__(self, stats: CurvatureStats) -> None:
        self.stats = stats
        self._before: list[bool] = []

    def __enter__(self) -> None:
        self._before.append(self.stats.replaying)
        self.stats.replaying = True

    def __exit__(self, *exc: Any) -> None:
        self.stats.replaying = self._before.pop()
