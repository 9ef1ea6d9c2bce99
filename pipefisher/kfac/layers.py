"""The layers K-FAC handles on a stage and the record of one: which modules, of which kind, and what is
left to the first-order optimizer.

The layers are ``nn.Linear`` (and its subclasses) and Hugging Face's GPT-style ``Conv1D`` (``y = x @ W + b``
with ``W`` stored ``(in, out)``); :class:`LayerKind` says how each stores its weight, and every K-FAC
component works on the gradient in ``(out, in)`` layout through :class:`LayerState`. Kept apart from the
components (:mod:`pipefisher.kfac.statistics`, :mod:`pipefisher.kfac.refresher`,
:mod:`pipefisher.kfac.precondition`, :mod:`pipefisher.kfac.drift_meter`) because all of them, and the
runtime's layout, name layers the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch
from torch import nn

from pipefisher.kfac.defaults import DEFAULT_IGNORE

FACTORS = ("A", "B")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


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


@dataclass(eq=False)
class LayerState:
    """One layer K-FAC handles, as every component sees it: its module and how it stores its weight. The
    components keep their own per-layer state (factors, inverses, drift) apart, by the layer's name."""

    module: nn.Module
    kind: LayerKind = field(default=LAYER_KINDS[0])

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

    def factor_size(self, factor: str) -> int:
        """The side of the layer's factor: its inputs (and the bias column) for A, its outputs for B."""
        out_features, in_features = self.kind.grad_matrix(self.module.weight).shape
        return in_features + int(self.bias) if factor == "A" else out_features


def layer_states(model: nn.Module, ignore: Iterable[str] = DEFAULT_IGNORE) -> dict[str, LayerState]:
    """The records of the layers :func:`kfac_modules` takes, by name, in model order."""
    return {n: LayerState(m, layer_kind(m) or LAYER_KINDS[0]) for n, m in kfac_modules(model, ignore).items()}


Bases = tuple["torch.Tensor | None", "torch.Tensor | None", tuple[int, int]]
"""A layer's eigenbases of factors A and B as its refreshes installed them (None before the first) and how
many refreshes of each installed them."""


class LayerStates(Protocol):
    """What an optimizer of K-FAC's layers (:class:`pipefisher.kfac.eigenbasis.EigenbasisAdam`) may ask
    of a K-FAC holder, so that one stage's :class:`pipefisher.kfac.KFAC` and a device's stage copies
    (:class:`pipefisher.runtime.pipeline.copies.StageCopiesKFAC`) serve it alike."""

    def layer_states(self) -> list[LayerState]:
        """The layers K-FAC preconditions, over every copy, in canonical order."""
        ...

    def parameters(self) -> list[nn.Parameter]:
        """Their weights and biases, in the same order."""
        ...

    def eigenbases(self) -> list[Bases]:
        """Per layer of :meth:`layer_states`, in its order: its :data:`Bases`."""
        ...

    def on_refresh(self, call: Callable[[LayerState, Bases], None]) -> None:
        """From now on, ``call(layer, bases)`` in every inverse label that ends a refresh of one of the
        layers' factors (a new basis installed, or the old one kept), with the layer's bases after it:
        where the optimizer carries its state into a new basis, in the refresh's bubble."""
        ...


def check_factor(factor: str) -> str:
    """``factor`` when it names one (A or B); ``ValueError`` otherwise."""
    if factor not in FACTORS:
        raise ValueError(f"factor must be 'A' or 'B', not {factor!r}")
    return factor
