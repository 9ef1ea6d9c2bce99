"""K-FAC state for the linear layers of one pipeline stage, one call per piece of work.

The layers K-FAC handles are ``nn.Linear`` (and its subclasses) and Hugging Face's GPT-style
``Conv1D`` (``y = x @ W + b`` with ``W`` stored ``(in, out)``); :class:`LayerKind` says how each
stores its weight, and everything else works on the gradient in ``(out, in)`` layout.

The calls map one to one onto schedule labels (see the timeline-and-schedule spec):

- :meth:`KFAC.set_saving` - ``turn_on/off_save_inputs_outgrads``
- :meth:`KFAC.cov` - ``cov_kron_A:<m>`` / ``cov_kron_B:<m>``: add the OLDEST saved micro-batch
- :meth:`KFAC.sync` - ``sync_kron_X:<m>``: average the factor over the data-parallel group (the
  all-reduce is started here and waited for where the factor is next read, so a device never blocks
  on its peers at the sync label itself; see :meth:`KFAC.sync`)
- :meth:`KFAC.inv` - ``inv_kron_X:<m>``: fold the new factor into its running average, damped
  inverse, then clear the new factor; a refresh may run in pieces, one per label
  (``refresh_pieces``, :mod:`pipefisher.kfac.refresh`; see :meth:`KFAC.inv` for which label runs which)
- :meth:`KFAC.precondition` - part of ``-- end --``: ``B^-1 grad A^-1``

At every refresh of a layer (once both of its factors went through ``inv``) K-FAC also measures the
layer's **drift**: how far the refresh moves its preconditioned gradient, ``||P_new(G) - P_old(G)||``
against ``||P_new(G)||`` with ``P(G) = B^-1 G A^-1`` and ``G`` the gradient it preconditioned last, and
the same against the inverses of the refresh before (see :meth:`KFAC.inv`, :meth:`KFAC.take_drift` and
:mod:`pipefisher.drift`).

Within a refresh a factor is the mean of its micro-batch contributions, so it does not matter how the
covariance pieces are spread over time; across refreshes factors are running averages
(``factor_decay``), so curvature survives a refresh and one refresh's few micro-batches do not
dominate. With ``fisher="true"`` the output gradients that build factor B come from labels sampled
from the model's own predictions (an extra backward through the stage, driven by the engine through
:meth:`KFAC.end_forward` / :meth:`KFAC.take_forward` / :meth:`KFAC.save_outgrads`), not from the
training labels.
"""
from __future__ import annotations

import collections
import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.kfac import factors as fx
from pipefisher.kfac.factors import BadFactorError
from pipefisher.kfac.refresh import PIECE_METHODS, Refresh, pieces_for

logger = logging.getLogger(__name__)

FACTORS = ("A", "B")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
DEFAULT_IGNORE = ("embeddings", "LayerNorm", "cls")


def is_ignored(name: str, ignore: Iterable[str]) -> bool:
    """A module is ignored when a pattern equals one of its dotted name parts or a prefix of its name."""
    parts = name.split(".")
    return any(p in parts or name == p or name.startswith(p + ".") for p in ignore)


@dataclass(frozen=True)
class LayerKind:
    """One kind of linear layer K-FAC handles: how to recognise it and how it stores its weight.

    K-FAC's math wants the weight gradient ``G`` as ``(out, in)`` (``nn.Linear``'s layout); a kind whose
    weight is stored ``(in, out)`` (``transposed``) is read and written through a transpose. Adding a
    kind is one entry in :data:`LAYER_KINDS`; its module must have a 2-D ``weight``, an optional
    ``bias`` of ``out`` entries, and be called as a module (its forward hook sees its input).
    """

    name: str
    matches: Callable[[nn.Module], bool]
    transposed: bool  # weight stored (in, out): y = x @ W + b

    def grad_matrix(self, weight_grad: torch.Tensor) -> torch.Tensor:
        """The weight gradient as ``(out, in)`` (a view, no copy)."""
        return weight_grad.t() if self.transposed else weight_grad.reshape(weight_grad.shape[0], -1)

    def write_grad(self, weight: torch.Tensor, g: torch.Tensor) -> None:
        """Write an ``(out, in)`` gradient into ``weight.grad`` in the layer's own layout."""
        assert weight.grad is not None
        weight.grad.copy_(g.t() if self.transposed else g.reshape(weight.shape))


def _is_hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2, GPT, ...), recognised by structure, without importing
    transformers: the class is named ``Conv1D``, has an ``nf`` attribute (out features) and a 2-D
    ``weight`` whose second dimension is ``nf`` (stored ``(in, out)``)."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(getattr(m, "nf", None), int)
            and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == m.nf)


LAYER_KINDS: tuple[LayerKind, ...] = (
    LayerKind("Linear", lambda m: isinstance(m, nn.Linear), transposed=False),
    LayerKind("Conv1D", _is_hf_conv1d, transposed=True),
)


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The kind of a module K-FAC can handle, or None (it is left to the first-order optimizer)."""
    return next((k for k in LAYER_KINDS if k.matches(module)), None)


def kfac_modules(model: nn.Module, ignore: Iterable[str] = DEFAULT_IGNORE) -> dict[str, nn.Module]:
    """The layers of ``model`` that K-FAC handles (see :data:`LAYER_KINDS`), by qualified name, in model
    order: every module of a known kind whose name ``ignore`` does not match."""
    ignore = tuple(ignore)
    return {n: m for n, m in model.named_modules()
            if layer_kind(m) is not None and not is_ignored(n, ignore) and n not in _called_functionally(model)}


def _called_functionally(model: nn.Module) -> set[str]:
    """Layers whose weights their parent uses directly, never calling them as modules: no forward hook
    would see their inputs, so K-FAC cannot build their factors (``nn.MultiheadAttention.out_proj``)."""
    return {f"{n}.out_proj" if n else "out_proj" for n, m in model.named_modules()
            if isinstance(m, nn.MultiheadAttention)}


@dataclass(frozen=True)
class Coverage:
    """What K-FAC preconditions on one stage and what it leaves to the first-order optimizer."""

    covered: dict[str, int]  # layer kind -> how many layers K-FAC handles, in model order
    first_order: dict[str, int]  # module class -> how many modules own parameters K-FAC does not touch
    ignored: tuple[str, ...]  # layers K-FAC could handle that ``kfac.ignore`` leaves out
    tied: tuple[tuple[str, str], ...]  # (K-FAC layer, other module sharing its weight)

    @property
    def layers(self) -> int:
        return sum(self.covered.values())

    def line(self, where: str, show: int = 4) -> str:
        """One line, e.g. ``K-FAC covers 12 layers (12 Linear) on stage 0; first-order only: ...``."""
        kinds = ", ".join(f"{n} {k}" for k, n in self.covered.items())
        head = (f"K-FAC covers {self.layers} layer{'s' if self.layers != 1 else ''} ({kinds}) on {where}"
                if self.layers else f"K-FAC covers no layers on {where}")
        rest = ["first-order only: " + (", ".join(f"{k} ({n})" for k, n in self.first_order.items()) or "nothing")]
        if self.ignored:
            more = f" and {len(self.ignored) - show} more" if len(self.ignored) > show else ""
            rest.append("ignored by kfac.ignore: " + ", ".join(self.ignored[:show]) + more)
        if self.tied:
            rest.append("weight shared (K-FAC preconditions the summed gradient): "
                        + ", ".join(f"{a} with {b}" for a, b in self.tied))
        return "; ".join([head] + rest)


def coverage(model: nn.Module, ignore: Iterable[str] = DEFAULT_IGNORE) -> Coverage:
    """Count what :func:`kfac_modules` takes and what it leaves, so a run can say so at start.

    A module counts as first-order when it owns (directly) a trainable parameter that no K-FAC layer
    holds; a K-FAC layer whose weight another module also owns (tied embeddings) is reported as tied.
    """
    ignore = tuple(ignore)
    layers = kfac_modules(model, ignore)
    covered: dict[str, int] = {}
    for m in layers.values():
        kind = layer_kind(m)
        assert kind is not None
        covered[kind.name] = covered.get(kind.name, 0) + 1
    kfac_params = {id(p): n for n, m in layers.items() for p in m.parameters(recurse=False)}
    first_order: dict[str, int] = {}
    ignored: list[str] = []
    tied: list[tuple[str, str]] = []
    for name, m in model.named_modules(remove_duplicate=False):
        if name in layers:
            continue
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        for p in own:
            if id(p) in kfac_params and (kfac_params[id(p)], name) not in tied:
                tied.append((kfac_params[id(p)], name))
        if layer_kind(m) is not None and is_ignored(name, ignore):
            ignored.append(name)
        elif any(id(p) not in kfac_params for p in own):
            cls = type(m).__name__
            first_order[cls] = first_order.get(cls, 0) + 1
    return Coverage(covered, first_order, tuple(ignored), tuple(tied))


def _owned(sums: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Copies of a layer's factor sums: :meth:`KFAC.cov` adds into a sum in place, so a state dict
    never shares one with a live K-FAC state."""
    return {f: None if t is None else t.clone() for f, t in sums.items()}


@dataclass
class LayerState:
    module: nn.Module
    kind: LayerKind = field(default=LAYER_KINDS[0])
    inputs: collections.deque = field(default_factory=collections.deque)
    outgrads: collections.deque = field(default_factory=collections.deque)
    # per factor, the sum of this refresh's covariance pieces: owned (KFAC.cov adds into it in place)
    sums: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    # pieces added into each factor: a number, or under fp16 a device tensor (pieces that overflowed count 0)
    counts: dict[str, Any] = field(default_factory=lambda: {"A": 0, "B": 0})
    inverses: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    last_pi: Any = None  # the pi of the last inversion (a 0-dim tensor)
    running: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    inversions: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    synced: dict[str, bool] = field(default_factory=lambda: {"A": False, "B": False})  # since the last piece
    skipped: int = 0  # refreshes of a factor dropped because it could not be inverted honestly
    overflowed: dict[str, Any] = field(default_factory=lambda: {"A": 0, "B": 0})  # fp16 pieces dropped (a tensor)
    # drift (KFAC.inv): the gradient last preconditioned, its preconditioned gradient and the inversion
    # counts of the inverses that made it; the inverses this refresh replaced (None: there was none yet),
    # the factors this refresh has been through inv so far (inverted, or kept for fp16 / on_bad_factor),
    # and the inverses as they were before the last completed refresh (the drift over two refreshes)
    last_grad: torch.Tensor | None = None
    last_pre: torch.Tensor | None = None
    pre_versions: tuple[int, int] | None = None
    replaced: dict[str, torch.Tensor | None] = field(default_factory=dict)
    handled: set[str] = field(default_factory=set)
    previous: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    # a refresh in pieces (KFAC.inv): per factor the refresh in flight (its Refresh and what it installs
    # with), and the factors completed (sync, or last covariance piece) since their last refresh began
    flight: dict[str, dict[str, Any] | None] = field(default_factory=lambda: {"A": None, "B": None})
    completed: set[str] = field(default_factory=set)
    saved_forwards: int = 0  # forwards saved since saving last turned on or off (KFAC.cov_micro_batches)

    @property
    def bias(self) -> bool:
        return getattr(self.module, "bias", None) is not None

    def grad_matrix(self) -> torch.Tensor:
        """The layer's gradient as K-FAC sees it: ``(out, in)`` whatever the layer's own layout, with the
        bias gradient as one more column (zeros where it has none yet). The weight must have a gradient."""
        w = self.module.weight
        assert w.grad is not None
        g = self.kind.grad_matrix(w.grad)
        if self.bias:
            b = self.module.bias
            bg = b.grad if b.grad is not None else torch.zeros_like(b)
            g = torch.cat([g, bg[:, None]], dim=1)
        return g

    def factor(self, f: str) -> torch.Tensor | None:
        s = self.sums[f]
        return None if s is None else s / self.counts[f]


class LayerStates(Protocol):
    """What an optimizer of K-FAC's layers (:class:`pipefisher.kfac.eigenbasis.EigenbasisAdam`) may ask
    of a K-FAC holder, so that one stage's :class:`KFAC` and a device's stage copies
    (:class:`pipefisher.runtime.pipeline.copies.StageCopiesKFAC`) serve it alike."""

    def layer_states(self) -> list[LayerState]:
        """The layers K-FAC preconditions, over every copy, in canonical order."""
        ...

    def parameters(self) -> list[nn.Parameter]:
        """Their weights and biases, in the same order."""
        ...


class HostReader(Protocol):
    """What K-FAC asks of the runtime's reader of device values (:class:`pipefisher.runtime.job.host.HostReads`,
    one per worker), so that its checks of inverses are read, and counted, with the worker's next read."""

    def values(self, *tensors: torch.Tensor) -> list[float]:
        """The tensors' elements as numbers, in one read (with whatever waited for it)."""
        ...

    def later(self, t: torch.Tensor, then: Callable[[list[float]], None]) -> None:
        """Read ``t`` with the next read and call ``then(values)`` there."""
        ...

    def settle(self) -> None:
        """Read now what waits for the next read, if anything does."""
        ...


def _running_scale(st: LayerState, factor: str) -> torch.Tensor | None:
    """The mean trace of the layer's running average of ``factor`` (None before its first refresh)."""
    running = st.running[factor]
    return None if running is None else fx.mean_trace(running)


class KFAC:
    """K-FAC for one stage (one data-parallel replica of it).

    ``loss_scale`` is the number each micro-batch's mean loss was divided by (the number of
    micro-batches per step), so factor B is built from per-row gradients. ``dp_group`` is the stage's
    data-parallel process group (``None``: no data parallelism). Damping starts at ``damping`` and is
    multiplied by ``damping_decay`` after every refresh of a layer, never going below ``damping_min``.
    ``on_bad_factor``: ``stop`` raises :class:`BadFactorError` (one line naming the layer), ``skip``
    keeps the layer's previous inverse, drops that refresh and reports it through ``warn`` (default: a
    warning of this module's logger).
    ``drift``: measure every layer's drift at its refreshes (:meth:`inv`); it keeps two gradient-sized
    tensors and the inverses of the refresh before per layer. Replicas hold the same gradients and
    inverses, so one replica measuring suffices. ``host``: the worker's reader of device values
    (:class:`HostReader`), which the checks of inverses are read with (None: each read at once).
    """

    def __init__(self, model: nn.Module, *, damping: float = 1e-3, ignore: Iterable[str] = DEFAULT_IGNORE,
                 loss_scale: float = 1.0, dp_group: Any = None, dp_size: int = 1,
                 damping_min: float | None = None, damping_decay: float = 1.0, factor_decay: float = 0.0,
                 inverse: str = "cholesky", inverse_dtype: str = "float32", on_bad_factor: str = "stop",
                 save_dtype: str = "float32", fisher: str = "empirical",
                 warn: Callable[[str], None] | None = None, cov_stride: int = 1, drift: bool = True,
                 refresh_pieces: int | str = 1, host: HostReader | None = None,
                 cov_micro_batches: int | None = None) -> None:
        if not (damping > 0 and math.isfinite(damping)):  # also refuses NaN and infinity
            raise ValueError(f"K-FAC damping must be positive and finite, not {damping!r}: an undamped "
                             "factor is singular")
        self.damping = float(damping)
        self.damping_min = self.damping if damping_min is None else float(damping_min)
        if not 0 < self.damping_min <= self.damping:
            raise ValueError(f"K-FAC damping_min must be in (0, damping], not {damping_min!r}")
        if not 0 < damping_decay <= 1 or not 0 <= factor_decay < 1:
            raise ValueError("K-FAC damping_decay must be in (0, 1] and factor_decay in [0, 1)")
        if inverse not in fx.INVERSE_METHODS or inverse_dtype not in ("float32", "float64"):
            raise ValueError(f"unknown inverse {inverse!r} in {inverse_dtype!r}")
        if on_bad_factor not in ("stop", "skip") or fisher not in ("empirical", "true"):
            raise ValueError(f"on_bad_factor {on_bad_factor!r} / fisher {fisher!r} not understood")
        self.damping_decay, self.factor_decay = float(damping_decay), float(factor_decay)
        self.inverse_method, self.inverse_dtype = inverse, DTYPES[inverse_dtype]
        self.on_bad_factor, self.fisher = on_bad_factor, fisher
        self.save_dtype = DTYPES[save_dtype]
        if not isinstance(cov_stride, int) or cov_stride < 1:
            raise ValueError(f"K-FAC cov_stride must be an integer >= 1, not {cov_stride!r}")
        self.cov_stride = cov_stride
        if cov_micro_batches is not None and (isinstance(cov_micro_batches, bool) or not isinstance(cov_micro_batches, int)
                                              or cov_micro_batches < 1):
            raise ValueError(f"K-FAC cov_micro_batches must be an integer >= 1 or None (all), not {cov_micro_batches!r}")
        self.cov_micro_batches = cov_micro_batches
        if refresh_pieces != "auto" and (isinstance(refresh_pieces, bool) or not isinstance(refresh_pieces, int)
                                         or refresh_pieces < 1):
            raise ValueError(f"K-FAC refresh_pieces must be an integer >= 1 or 'auto', not {refresh_pieces!r}")
        if refresh_pieces not in (1, "auto") and inverse not in PIECE_METHODS:
            raise ValueError(f"K-FAC refresh_pieces > 1 needs inverse {' or '.join(PIECE_METHODS)}, not {inverse!r}")
        self.refresh_pieces = refresh_pieces
        self._marked = False  # completions are marked (complete) by a schedule's executor: see plan_refresh
        self.warn = warn or logger.warning
        self.loss_scale = float(loss_scale)
        self.dp_group, self.dp_size = dp_group, int(dp_size)
        self.layers = {n: LayerState(m, layer_kind(m) or LAYER_KINDS[0])
                       for n, m in kfac_modules(model, ignore).items()}
        self.coverage = coverage(model, ignore)  # what the run says at start
        self.saving = False
        self._grad_dot_step: torch.Tensor | float = 0.0  # sum of <g, F^-1 g> (KL-clip), kept on the device
        # bytes of saved tensors still waiting for their covariance piece, counted as they are saved and
        # freed (a tensor shared by several layers once), and the most they reached since reset_peak_saved
        self._held: dict[int, list[int]] = {}  # id(saved tensor) -> [bytes, layers holding it]
        self.saved_now = self.peak_saved_bytes = 0
        self._input_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._forward_outputs: list[tuple[LayerState, torch.Tensor]] = []
        self._awaiting: collections.deque = collections.deque()  # per forwarded micro-batch, true Fisher
        self._in_flight: dict[tuple[str, str], Any] = {}  # (layer, factor) -> all-reduce not yet waited for
        self._replaying = False  # a forward run again for its backward (activation recomputation)
        # fp16's loss scale (pipefisher.runtime.pipeline.compute.LossScale), None otherwise: saved output
        # gradients are divided by it, and a piece that overflowed is dropped rather than added
        self.grad_scaler: Any = None
        self._told_overflow = False
        self.measure_drift = bool(drift)
        self._drift: list[tuple[Any, ...]] = []  # (layer, change^2, change over two refreshes^2, norm^2), not taken
        self._handles = [self._hook(st) for st in self.layers.values()]
        # Checking inverses: through the worker's reader (host; None: read at once). An inverse with one to
        # fall back on is used on the device as it is, or passed over for that one where its findings say it
        # is dishonest, and its findings are read once, with the refresh's last inverse (at the next read
        # of the host's); one without is checked at once.
        self.host = host
        self._unchecked: list[tuple[str, str, torch.Tensor]] = []  # (layer, factor, findings) not read yet
        self._honest: dict[tuple[str, str], torch.Tensor] = {}  # (layer, factor) -> used or not, not read yet
        self._inverted: set[tuple[str, str]] = set()  # (layer, factor) inverted since the last check

    # -- saving inputs and output gradients -------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self.layers)

    def set_saving(self, on: bool) -> None:
        """Start or stop saving layer inputs (forward) and output gradients (backward). Either starts a
        new count of saved micro-batches: with ``cov_micro_batches`` M, only each layer's first M forwards
        (and their output gradients) after this call are saved (:func:`pipefisher.problem.cov_pieces`)."""
        self.saving = bool(on)
        for st in self.layers.values():
            st.saved_forwards = 0

    def _compact(self, t: torch.Tensor) -> torch.Tensor:
        """The rows a covariance piece will use, in the saved dtype: every ``cov_stride``-th token row
        (copied, so the full micro-batch is not kept alive by a view of it)."""
        t = t.detach().reshape(-1, t.shape[-1])
        if self.cov_stride > 1:
            t = t[::self.cov_stride].contiguous()
        return t if t.dtype == self.save_dtype else t.to(self.save_dtype)

    def _saved_input(self, x: torch.Tensor) -> torch.Tensor:
        """Layers fed the same tensor (query, key, value) share one saved copy of it."""
        if self._input_cache is not None and self._input_cache[0] is x:
            return self._hold(self._input_cache[1])
        saved = self._compact(x)
        self._input_cache = (x, saved)
        return self._hold(saved)

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        entry = self._held.get(id(t))
        if entry is None:
            self._held[id(t)] = [t.numel() * t.element_size(), 1]
            self.saved_now += t.numel() * t.element_size()
            self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_now)
        else:
            entry[1] += 1
        return t

    def _release(self, t: torch.Tensor) -> None:
        entry = self._held[id(t)]
        entry[1] -= 1
        if entry[1] == 0:
            self.saved_now -= entry[0]
            del self._held[id(t)]

    def recount_saved(self) -> None:
        """Rebuild the saved-bytes count from the queues (after a checkpoint restored them)."""
        self._held, self.saved_now = {}, 0
        for st in self.layers.values():
            for t in (*st.inputs, *st.outgrads):
                self._hold(t)

    def reset_peak_saved(self) -> None:
        self.peak_saved_bytes = self.saved_now

    def replaying(self) -> "_Replaying":
        """Forwards run inside this context are recomputations of forwards already seen (activation
        checkpointing runs a block again in its backward): their inputs are not saved a second time.
        The context may be entered again and again (a graph kept for a second backward recomputes again)."""
        return _Replaying(self)

    def _hook(self, st: LayerState) -> Any:
        def on_forward(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if not (self.saving and torch.is_grad_enabled()) or self._replaying:
                return
            if self.cov_micro_batches is not None and st.saved_forwards >= self.cov_micro_batches:
                return  # beyond the refresh's micro-batches: neither its input nor its output gradient
            st.saved_forwards += 1
            st.inputs.append(self._saved_input(inputs[0]))
            if not out.requires_grad:
                return
            if self.fisher == "true":
                self._forward_outputs.append((st, out))
            else:
                out.register_hook(self._once(st))

        return st.module.register_forward_hook(on_forward)

    def _once(self, st: LayerState) -> Callable[[torch.Tensor], None]:
        """The output-gradient hook of one forward: it keeps the first gradient it sees. A zero-bubble
        W pass (:mod:`pipefisher.runtime.pipeline.split_backward`) may re-enter the layer's node with the
        same gradient, which must not count twice."""
        seen = False

        def keep(g: torch.Tensor) -> None:
            nonlocal seen
            if not seen:
                seen = True
                st.outgrads.append(self._hold(self._unscaled(g)))
        return keep

    # -- true Fisher: the engine runs a second backward with sampled labels --------------------------

    @property
    def samples_labels(self) -> bool:
        """True while forwards are saved for a true-Fisher factor B (the engine must sample labels)."""
        return self.fisher == "true" and self.saving

    def end_forward(self) -> None:
        """Called by the engine after each forward micro-batch: closes its list of layer outputs."""
        self._input_cache = None
        if self.fisher == "true":
            self._awaiting.append(self._forward_outputs if self.saving else None)
            self._forward_outputs = []

    def take_forward(self) -> list[tuple[LayerState, torch.Tensor]] | None:
        """The layer outputs of the oldest forwarded micro-batch, or None if it was not saved."""
        if self.fisher != "true" or not self._awaiting:
            return None
        return self._awaiting.popleft()

    def save_outgrads(self, outputs: list[tuple[LayerState, torch.Tensor]],
                      grads: Iterable[torch.Tensor | None]) -> None:
        """Save the sampled-label gradients of those outputs for factor B (None: the output was unused)."""
        for (st, out), g in zip(outputs, grads):
            st.outgrads.append(self._hold(self._unscaled(torch.zeros_like(out) if g is None else g)))

    def _unscaled(self, g: torch.Tensor) -> torch.Tensor:
        """An output gradient as saved: compacted, and divided by fp16's loss scale when there is one."""
        saved = self._compact(g)
        return saved if self.grad_scaler is None else saved / self.grad_scaler.scale

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def pending(self, factor: str, name: str) -> int:
        """Saved micro-batches not yet added into ``factor`` of layer ``name``."""
        st = self.layers[name]
        return len(st.inputs if factor == "A" else st.outgrads)

    def clear_saved(self) -> None:
        for st in self.layers.values():
            st.inputs.clear()
            st.outgrads.clear()
        self._input_cache = None
        self._forward_outputs = []
        self._awaiting.clear()
        self._held, self.saved_now = {}, 0

    def saved_bytes(self) -> int:
        """Memory held by saved inputs and output gradients still waiting for their covariance piece,
        counted from the queues (:attr:`saved_now` is the same figure, kept as tensors come and go)."""
        seen: set[int] = set()
        total = 0
        for st in self.layers.values():
            for t in (*st.inputs, *st.outgrads):
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    # -- the per-label work -------------------------------------------------------------------------

    def cov(self, factor: str, name: str) -> bool:
        """Add the oldest saved micro-batch of layer ``name`` into ``factor``; False if none is saved."""
        st = self.layers[name]
        queue = st.inputs if _check(factor) == "A" else st.outgrads
        if not queue:
            return False
        self._settle(name, factor)
        x = queue.popleft()
        self._release(x)
        # B: the saved rows are gradients of a mean over cov_stride times as many rows (see fx.cov_b)
        scale = self.loss_scale * self.cov_stride
        if self.grad_scaler is not None:  # fp16: a piece that overflowed adds nothing and counts 0 (its
            finite = torch.isfinite(x).all()  # step's update is skipped too); decided on the device
            contrib = fx.cov_a(x, st.bias) if factor == "A" else fx.cov_b(x, scale)
            contrib = torch.where(finite, contrib, torch.zeros_like(contrib))
            st.overflowed[factor] = st.overflowed[factor] + (~finite).long()
            st.counts[factor] = st.counts[factor] + finite.float()
            st.sums[factor] = contrib if st.sums[factor] is None else st.sums[factor].add_(contrib)
        else:
            acc = st.sums[factor]  # added into in place: nothing else holds it (see LayerState.sums)
            st.sums[factor] = fx.add_cov_a(acc, x, st.bias) if factor == "A" else fx.add_cov_b(acc, x, scale)
            st.counts[factor] += 1
        st.synced[factor] = False
        return True

    def cov_all(self, factor: str, name: str) -> int:
        """Add every saved micro-batch into ``factor``; returns how many."""
        n = 0
        while self.cov(factor, name):
            n += 1
        return n

    def sync(self, factor: str, name: str) -> None:
        """Start averaging ``factor`` of layer ``name`` over the data-parallel group (no-op without one).

        The all-reduce is only started: whatever reads the factor next (its inverse, the other
        factor's inverse through pi, a checkpoint) waits for it. A device that reaches a sync before
        its peers therefore goes on with its pipeline instead of blocking, which under Chimera (whose
        peers also exchange activations with it) could otherwise deadlock. Every member must start
        its all-reduces in the same order (the schedule checks see to it).
        """
        st = self.layers[name]
        self._settle(name, _check(factor))
        f = st.factor(factor)
        if f is None and self.grad_scaler is None:
            raise RuntimeError(f"sync_kron_{factor}:{name}: factor {factor} has no covariance yet")
        counts: Any = int(f is not None)
        if self.dp_size > 1:
            counted = self.grad_scaler is not None  # fp16: a replica whose every piece overflowed brings none
            if counted:  # the mean (or zeros), then whether this replica had one: averaged over those that had
                size = _factor_size(st, factor)
                dev = st.module.weight.device
                had = torch.zeros((), device=dev) if f is None else torch.as_tensor(st.counts[factor], device=dev) > 0
                mean = torch.zeros((size, size), device=had.device) if f is None \
                    else torch.where(had, f, torch.zeros_like(f))
                f = torch.cat([mean.reshape(-1), had.to(mean.dtype).reshape(1)])
            else:
                f = f.contiguous()
            self._in_flight[name, factor] = (dist.all_reduce(f, group=self.dp_group, async_op=True), counted)
        elif f is not None and self.grad_scaler is not None:  # fp16: none if every piece overflowed
            counts = (torch.as_tensor(st.counts[factor], device=f.device) > 0).float()
            f = torch.where(counts > 0, f, torch.zeros_like(f))
        st.sums[factor], st.counts[factor] = f, counts
        st.synced[factor] = True

    def _settle(self, name: str, factor: str) -> None:
        """Wait for the factor's all-reduce, if one is in flight, and finish the average."""
        entry = self._in_flight.pop((name, factor), None)
        if entry is None:
            return
        work, counted = entry
        work.wait()
        st = self.layers[name]
        if not counted:
            st.sums[factor] /= self.dp_size
            return
        flat = st.sums[factor]
        assert flat is not None
        replicas, size = flat[-1], _factor_size(st, factor)  # how many replicas had one (on the device)
        st.sums[factor] = flat[:-1].reshape(size, size) / replicas
        st.counts[factor] = (replicas > 0).float()

    def settle_all(self) -> None:
        """Wait for every all-reduce in flight and check every inverse not checked yet (before a checkpoint,
        at the end of a run): nothing of this K-FAC is left for later."""
        for name, factor in list(self._in_flight):
            self._settle(name, factor)
        self.check_inverses()
        if self.host is not None:
            self.host.settle()

    def averaged(self, name: str, factor: str) -> torch.Tensor | None:
        """The factor as it will be inverted: the running average folded with the new covariance (if any)."""
        st = self.layers[name]
        self._settle(name, _check(factor))
        cur = st.factor(factor)
        if cur is None:
            return st.running[factor]
        return self._fold(st, factor, cur, st.running[factor])

    def scale(self, name: str, factor: str) -> torch.Tensor | None:
        """``mean_trace(averaged(name, factor))``, folded from the traces instead (a trace is linear): pi
        reads both factors' scales at every inverse, and forming the averages for it cost passes over
        both whole factors."""
        st = self.layers[name]
        self._settle(name, _check(factor))
        running = _running_scale(st, factor)
        if st.sums[factor] is None:
            return running
        return self._fold(st, factor, fx.mean_trace(st.sums[factor]) / st.counts[factor], running)

    def _fold(self, st: LayerState, factor: str, cur: torch.Tensor, running: torch.Tensor | None) -> torch.Tensor:
        """The new covariance ``cur`` folded into the running average ``running`` (a factor, or its scale)."""
        new = fx.running_average(running, cur, self.factor_decay)
        if self.grad_scaler is None or running is None:
            return new
        some = torch.as_tensor(st.counts[factor], device=new.device) > 0  # a number after a checkpoint's load
        return torch.where(some, new, running)  # fp16: no piece, no change

    def pi(self, name: str) -> torch.Tensor | float:
        """The pi damping split of layer ``name`` from the scales of BOTH factors.

        A factor that still holds covariance gives the scale it will be inverted with; one already
        inverted (and so cleared) this cycle gives the scale it was inverted with (its running average).
        With several replicas, covariance not yet all-reduced is local to this replica and would give
        each replica another split: such a factor counts with its running average until its sync.
        """
        scales = []
        for f in FACTORS:
            st = self.layers[name]
            local = self.dp_size > 1 and st.sums[f] is not None and not st.synced[f]
            scales.append(_running_scale(st, f) if local else self.scale(name, f))
        return fx.pi_split(*scales)  # a 0-dim tensor: no host sync

    def damping_of(self, name: str) -> float:
        """The damping of layer ``name``'s next refresh: decayed once per completed refresh, floored."""
        done = min(self.layers[name].inversions.values())
        return max(self.damping_min, self.damping * self.damping_decay ** done)

    def pieces(self, name: str, factor: str) -> int:
        """How many pieces (inverse labels) a refresh of ``factor`` of layer ``name`` runs in
        (``refresh_pieces``, :func:`pipefisher.kfac.refresh.pieces_for`)."""
        return pieces_for(_factor_size(self.layers[name], _check(factor)), self.refresh_pieces, self.inverse_method)

    def plan_refresh(self) -> None:
        """From now on a refresh begins only where its factor was marked complete (:meth:`complete`):
        a schedule's executor marks each factor's completion label, so an inverse label before it in a
        cycle continues the refresh in flight or does nothing (:meth:`inv`). Without a plan every
        :meth:`inv` with no refresh in flight begins one (direct calls, naive K-FAC)."""
        self._marked = True

    def complete(self, factor: str, name: str) -> None:
        """``factor`` of layer ``name`` holds this cycle's covariance (its sync, or its last covariance
        piece where it has no sync): the next inverse label with no refresh in flight begins one."""
        self.layers[name].completed.add(_check(factor))

    def inv(self, factor: str, name: str) -> None:
        """One inverse label: the next piece of the factor's refresh in flight; with none in flight, begin
        one (:meth:`_begin`) if the factor completed since the last began (always, without
        :meth:`plan_refresh`), else nothing (an overlapping schedule's first cycle). The last piece installs
        the result (:meth:`_install`); the update always uses the latest installed one."""
        st = self.layers[name]
        flight = st.flight[_check(factor)]
        if flight is None:
            if self._marked and factor not in st.completed:
                return
            st.completed.discard(factor)
            flight = self._begin(factor, name)
            st.flight[factor] = flight
        if flight["refresh"].step():
            st.flight[factor] = None
            self._install(factor, name, flight)

    def finish_refreshes(self) -> None:
        """Run every refresh in flight to its end at once (a schedule switch: the next schedule's labels
        know nothing of this one's pieces)."""
        for name, st in self.layers.items():
            for f in FACTORS:
                flight = st.flight[f]
                if flight is not None:
                    flight["refresh"].finish()
                    st.flight[f] = None
                    self._install(f, name, flight)

    def _begin(self, factor: str, name: str) -> dict[str, Any]:
        """Begin a refresh: fold the new ``factor`` of layer ``name`` into its running average, take pi and
        the damping, clear the new factor, and keep the matrix to invert (or take the eigenbasis of) in a
        :class:`pipefisher.kfac.refresh.Refresh` of :meth:`pieces` pieces."""
        st = self.layers[name]
        for f in FACTORS:  # this factor, and the other one that pi reads
            self._settle(name, f)
        p = self.pieces(name, factor)
        if st.factor(factor) is None:
            if self.grad_scaler is not None:  # fp16: no piece of this refresh reached the factor
                st.synced[factor] = False
                return {"refresh": Refresh.nothing(p)}
            raise RuntimeError(f"inv_kron_{factor}:{name}: factor {factor} has no covariance to invert")
        f = self.averaged(name, factor)
        assert f is not None
        pi = self.pi(name)  # before clearing: uses this factor's scale and the other's
        damp_a, damp_b = fx.damping_terms(self.damping_of(name), pi)
        pieces = st.counts[factor] if self.grad_scaler is not None else None
        st.sums[factor], st.counts[factor], st.synced[factor] = None, 0, False
        basis = st.inverses[factor] if self.inverse_method == "eigenbasis" else None
        refresh = Refresh(f, damp_a if factor == "A" else damp_b, method=self.inverse_method,
                          dtype=self.inverse_dtype, pieces=p, basis=basis,
                          kept=None if pieces is None else torch.as_tensor(pieces))
        flight = {"refresh": refresh, "f": f, "pi": pi, "old_running": st.running[factor]}
        st.running[factor] = f  # folded now: the other factor's pi reads it while this one is in flight
        return flight

    def _install(self, factor: str, name: str, flight: dict[str, Any]) -> None:
        """Install a finished refresh: the new inverse (or basis), or the previous one where it is not honest.

        A factor that cannot be inverted honestly raises :class:`BadFactorError` (``on_bad_factor:
        stop``) or keeps the previous inverse and drops this refresh of the factor (``skip``). Nothing is
        read back here when there is a previous inverse: the new one is used on the device, or the previous
        one where the new one's findings say it is dishonest, and the findings are read once, for the whole
        refresh, with its last inverse (:meth:`_checked`). A first inverse is checked at once.
        """
        st = self.layers[name]
        refresh = flight["refresh"]
        if refresh.mode == "none":  # fp16: every piece overflowed; kept, it counts as unchanged in the drift
            self._overflowed(name, factor)
            self._refreshed(name, factor)
            self._inverted_one(name, factor)
            return
        inverse, findings, ok = refresh.result()
        f, pi, old_running = flight["f"], flight["pi"], flight["old_running"]
        old_inverse = st.inverses[factor]
        if old_inverse is None or old_running is None:  # nothing to fall back on: read the findings now
            if not self._judge(name, factor, self._read(findings)):
                st.running[factor] = old_running
                self._refreshed(name, factor)
                self._inverted_one(name, factor)
                return
        else:
            inverse = torch.where(ok, inverse, old_inverse)
            f = torch.where(ok, f, old_running)
            if st.last_pi is not None:
                pi = torch.where(ok, torch.as_tensor(pi, dtype=torch.float64, device=ok.device), st.last_pi)
            self._unchecked.append((name, factor, findings))
            self._honest[name, factor] = ok
        st.last_pi = pi
        if factor not in st.replaced:  # the inverse the refresh started from (a second inv keeps the first)
            st.replaced[factor] = st.inverses[factor]
        st.inverses[factor] = inverse
        st.running[factor] = f
        st.inversions[factor] += 1
        self._refreshed(name, factor)
        self._inverted_one(name, factor)

    def _read(self, t: torch.Tensor) -> list[float]:
        """``t``'s elements as numbers: through the runtime's reader (counted), else at once."""
        return self.host.values(t) if self.host is not None else t.reshape(-1).tolist()

    def _inverted_one(self, name: str, factor: str) -> None:
        """Once every factor of every layer went through ``inv`` since the last check (the refresh's last
        inverse), its findings go to be read: with the runtime's next read, else at once."""
        self._inverted.add((name, factor))
        if len(self._inverted) == len(FACTORS) * len(self.layers):
            self.check_inverses()

    def check_inverses(self) -> None:
        """Hand the findings of the inverses not checked yet to be read (one read for all of them): with
        the runtime's next read (``host``), else now. A checkpoint and the run's end call it too."""
        batch, self._unchecked, self._inverted = self._unchecked, [], set()
        self._honest = {}
        if not batch:
            return
        flat = torch.stack([findings for _, _, findings in batch])
        if self.host is None:
            self._checked(batch, flat.reshape(-1).tolist())
        else:
            self.host.later(flat, lambda values: self._checked(batch, values))

    def _checked(self, batch: list[tuple[str, str, torch.Tensor]], values: list[float]) -> None:
        """The read findings of inverses already in place (each used on the device only where honest):
        a dishonest one stops the run, or counts as the skipped refresh it was (its inversion undone)."""
        n = fx.FINDINGS
        for i, (name, factor, _) in enumerate(batch):
            if not self._judge(name, factor, values[i * n:(i + 1) * n]):
                self.layers[name].inversions[factor] -= 1

    def _judge(self, name: str, factor: str, findings: list[float]) -> bool:
        """Whether an inverse with these findings (read) is kept; if not, say why: fp16's overflow once per
        run, ``on_bad_factor: stop`` as :class:`BadFactorError`, ``skip`` as a warning and a skip counted."""
        if findings[-1] <= 0:  # fp16: every piece of this refresh overflowed, on every replica
            self._overflowed(name, factor)
            return False
        reason = fx.bad_factor(findings, self.inverse_method, what=f"K-FAC layer {name} factor {factor}")
        if reason is None:
            return True
        if self.on_bad_factor == "stop":
            raise BadFactorError(reason)
        self.layers[name].skipped += 1
        self.warn(f"{reason}; kept the previous inverse (kfac.on_bad_factor: skip)")
        return False

    def _overflowed(self, name: str, factor: str) -> None:
        """fp16 left the factor no piece this refresh: the previous inverse stays, said once per run (an
        overflow usually hits every layer together)."""
        if not self._told_overflow:
            self._told_overflow = True
            self.warn(f"K-FAC layer {name} factor {factor}: every piece of this refresh overflowed in "
                      "fp16; kept the previous inverse (said once; LayerState.overflowed counts them)")

    def _refreshed(self, name: str, factor: str) -> None:
        """``factor`` of layer ``name`` went through ``inv`` (inverted, or kept); once both have, the
        refresh is complete and its drift is measured (:meth:`_measure_drift`)."""
        st = self.layers[name]
        st.handled.add(factor)
        if st.handled >= set(FACTORS):
            if st.replaced:  # an inverse changed: a refresh (one that changed none does not count)
                self._measure_drift(name, st)
                if self.measure_drift:  # the inverses before this refresh, for the next one's two-refresh drift
                    st.previous = {f: st.replaced.get(f, st.inverses[f]) for f in FACTORS}
            st.replaced, st.handled = {}, set()

    def _measure_drift(self, name: str, st: LayerState) -> None:
        """The refresh's drift of one layer: ``||P_new(G) - P_old(G)||^2``, ``||P_new(G) - P_older(G)||^2``
        and ``||P_new(G)||^2`` (kept as tensors, no host sync: :meth:`take_drift` hands them on).

        ``G`` is the gradient this layer preconditioned last (the previous step's, clipped and, in fp16,
        unscaled): a real gradient of this model at nearly the current weights, the very thing the
        inverses are applied to, and there in a bubble, where the step's own gradient is not yet. The
        same ``G`` on every side: what moves is the curvature alone. ``P_old`` uses the inverses the
        refresh replaced (a factor kept for fp16 overflow or ``on_bad_factor: skip`` counts as
        unchanged): it is the preconditioned gradient of that step itself when that step used exactly
        those inverses, else it is computed; ``P_older`` uses those of the refresh before (None until
        there are some). So a refresh costs one to three preconditionings of the layer's gradient, in
        its inverse's label. Nothing is measured at a layer's first refresh (no old inverse) or before
        its first preconditioning.
        """
        new_a, new_b = st.inverses["A"], st.inverses["B"]
        if not (self.measure_drift and st.last_grad is not None):
            return
        old_a, old_b = st.replaced.get("A", new_a), st.replaced.get("B", new_b)
        if old_a is None or old_b is None or new_a is None or new_b is None:
            return
        g = st.last_grad
        new = fx.precondition(g, new_a, new_b)
        before = (st.inversions["A"] - ("A" in st.replaced), st.inversions["B"] - ("B" in st.replaced))
        old = st.last_pre if st.pre_versions == before and st.last_pre is not None \
            else fx.precondition(g, old_a, old_b)
        older_a, older_b = st.previous["A"], st.previous["B"]
        older = None if older_a is None or older_b is None else fx.precondition(g, older_a, older_b)
        change, change2, norm = fx.drift_terms(new, old, older)
        honest = [self._honest.get((name, f)) for f in st.replaced]
        if all(h is not None for h in honest):  # every inverse it made may have been passed over: then the
            moved = torch.stack(honest).any()  # refresh changed nothing, and is no sample (NaN figures)
            norm = torch.where(moved, norm, torch.full_like(norm, math.nan))
        self._drift.append((name, change, change2, norm))

    def take_drift(self) -> list[tuple[Any, ...]]:
        """The drift measured since the last call, per completed refresh of a layer: ``(layer,
        ||P_new(G) - P_old(G)||^2, ||P_new(G) - P_older(G)||^2 or None, ||P_new(G)||^2)`` as 0-dim tensors
        (read them where the runtime gathers anyway: :class:`pipefisher.runtime.train.drift.DriftLog`). A
        refresh whose every new inverse turned out dishonest (passed over on the device, its findings not
        read yet) changed nothing and is no sample: its ``||P_new(G)||^2`` is NaN, and the reader drops it."""
        out, self._drift = self._drift, []
        return out

    def precondition(self, name: str) -> bool:
        """Replace the layer's gradient by ``B^-1 grad A^-1``; False (gradient untouched) without inverses.

        ``grad`` is ``(out, in[+1])`` for every layer kind; a transposed weight (``Conv1D``) is read and
        written back through its :class:`LayerKind`."""
        st = self.layers[name]
        a_inv, b_inv = st.inverses["A"], st.inverses["B"]
        w = st.module.weight
        if self.inverse_method == "eigenbasis":  # bases, not inverses: EigenbasisAdam takes the gradient
            return False
        if a_inv is None or b_inv is None or w.grad is None:
            return False
        g = st.grad_matrix()
        p = fx.precondition(g, a_inv, b_inv)
        self._grad_dot_step = self._grad_dot_step + (p * g).sum()  # no host sync per layer
        if self.measure_drift:  # the next refresh's drift is measured on this gradient (g: a view without bias)
            st.last_grad, st.last_pre = (g if st.bias else g.clone()), p
            st.pre_versions = (st.inversions["A"], st.inversions["B"])
        st.kind.write_grad(w, p[:, :-1] if st.bias else p)
        if st.bias:
            if st.module.bias.grad is None:
                st.module.bias.grad = p[:, -1].clone()
            else:
                st.module.bias.grad.copy_(p[:, -1])
        return True

    def precondition_all(self) -> int:
        """Precondition every layer that has inverses; sets :attr:`grad_dot_step` for the KL-clip."""
        self._grad_dot_step = 0.0
        return sum(self.precondition(n) for n in self.layers)

    @property
    def grad_dot_step(self) -> torch.Tensor:
        """``sum <g, F^-1 g>`` over the layers of the last :meth:`precondition_all` (the KL-clip's), a 0-dim
        float64 tensor on the device (no host sync)."""
        g = self._grad_dot_step
        if isinstance(g, torch.Tensor):
            return g.to(torch.float64)
        return torch.tensor(g, dtype=torch.float64, device=next(iter(self.parameters()), torch.empty(0)).device)

    def scale_step(self, nu: torch.Tensor | float) -> None:
        """Multiply the preconditioned gradients by ``nu`` (the KL-clip factor; a tensor stays on the device)."""
        if not isinstance(nu, torch.Tensor) and nu == 1.0:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, torch.as_tensor(nu, device=grads[0].device))

    def layer_states(self) -> list[LayerState]:
        """The layers K-FAC preconditions, in layer order (:class:`LayerStates`)."""
        return list(self.layers.values())

    def parameters(self) -> list[nn.Parameter]:
        """The parameters K-FAC preconditions (weights and biases of its layers), in layer order."""
        out = []
        for st in self.layer_states():
            out.append(st.module.weight)
            if st.bias:
                out.append(st.module.bias)
        return out

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: the saving flag and, per layer, factor sums
        and counts, inverses, pi scale, running averages, refresh counts, the saved inputs and output
        gradients still waiting for their covariance piece, and what the next refresh's drift is measured
        with (a refresh can be half done), refreshes in flight in pieces and the factors completed since
        their last refresh began. Waits for in-flight all-reduces first."""
        self.settle_all()
        layers = {}
        for name, st in self.layers.items():
            layers[name] = {
                "sums": _owned(st.sums), "counts": dict(st.counts), "inverses": dict(st.inverses),
                "last_pi": st.last_pi, "running": dict(st.running), "inversions": dict(st.inversions),
                "skipped": st.skipped, "synced": dict(st.synced),
                "inputs": list(st.inputs), "outgrads": list(st.outgrads),
                "last_grad": st.last_grad, "last_pre": st.last_pre,
                "pre_versions": list(st.pre_versions) if st.pre_versions is not None else None,
                "replaced": dict(st.replaced), "handled": sorted(st.handled), "previous": dict(st.previous),
                "flight": {f: _flight_state(st.flight[f]) for f in FACTORS}, "completed": sorted(st.completed),
            }
        return {"saving": self.saving, "layers": layers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s content; ``ValueError`` when it covers other layers than these."""
        layers = state["layers"]
        if set(layers) != set(self.layers):
            raise ValueError("K-FAC state of other modules than this stage's")
        self.set_saving(bool(state["saving"]))
        for name, st in self.layers.items():
            s = layers[name]
            st.sums = _owned(s["sums"])
            st.counts = {f: int(s["counts"][f]) for f in "AB"}
            st.inverses = {f: s["inverses"][f] for f in "AB"}
            st.last_pi = s["last_pi"]
            st.running = {f: s["running"][f] for f in "AB"}
            st.inversions = {f: int(s["inversions"][f]) for f in "AB"}
            st.skipped = int(s["skipped"])
            st.synced = {f: bool(s["synced"][f]) for f in "AB"}
            st.inputs.clear()
            st.inputs.extend(s["inputs"])
            st.outgrads.clear()
            st.outgrads.extend(s["outgrads"])
            st.last_grad, st.last_pre = s["last_grad"], s["last_pre"]
            versions = s["pre_versions"]
            st.pre_versions = (int(versions[0]), int(versions[1])) if versions is not None else None
            st.replaced = dict(s["replaced"])
            st.handled = set(s["handled"])
            st.previous = {f: s["previous"].get(f) for f in "AB"}
            flights = s.get("flight", {})  # a checkpoint from before refreshes in pieces has none in flight
            st.flight = {f: _flight_from_state(flights.get(f)) for f in FACTORS}
            st.completed = set(s.get("completed", ()))
        self.recount_saved()

    # -- conveniences ----------------------------------------------------------------------------

    def factor(self, name: str, factor: str) -> torch.Tensor | None:
        """The current factor (running mean of its contributions), or None when cleared."""
        self._settle(name, _check(factor))
        return self.layers[name].factor(factor)

    def inverse(self, name: str, factor: str) -> torch.Tensor | None:
        return self.layers[name].inverses[_check(factor)]

    def update_curvature(self, span: Callable[[str], ContextManager[Any]] | None = None) -> None:
        """Naive K-FAC for every layer: all covariance, then sync, then both refreshes, each in its pieces.

        ``span(key)`` wraps each piece (a profiler uses it); keys are the timeline keys.
        """
        span = span or (lambda key: nullcontext())
        for name in self.layers:
            for f in FACTORS:
                with span(f"cov_kron_{f}:{name}"):
                    self.cov_all(f, name)
        if self.dp_size > 1:
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


def _flight_state(flight: dict[str, Any] | None) -> dict[str, Any] | None:
    """A refresh in flight as a checkpoint holds it."""
    return None if flight is None else {**flight, "refresh": flight["refresh"].state_dict()}


def _flight_from_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if state is None else {**state, "refresh": Refresh.from_state(state["refresh"])}


def _factor_size(st: LayerState, factor: str) -> int:
    """The side of a layer's factor: its inputs (and the bias column) for A, its outputs for B."""
    out_features, in_features = st.kind.grad_matrix(st.module.weight).shape
    return in_features + int(st.bias) if factor == "A" else out_features


class _Replaying:
    """:meth:`KFAC.replaying`'s context: re-enterable, nesting-safe."""

    def __init__(self, kfac: KFAC) -> None:
        self.kfac = kfac
        self._before: list[bool] = []

    def __enter__(self) -> None:
        self._before.append(self.kfac._replaying)
        self.kfac._replaying = True

    def __exit__(self, *exc: Any) -> None:
        self.kfac._replaying = self._before.pop()


def _check(factor: str) -> str:
    if factor not in FACTORS:
        raise ValueError(f"factor must be 'A' or 'B', not {factor!r}")
    return factor
