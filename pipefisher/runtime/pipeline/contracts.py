"""The runtime's written contracts: what the executor, the worker, the update and the trainer may call on
a pipeline engine and on K-FAC, as protocols (:class:`typing.Protocol`), so that every engine and every
K-FAC holder serves them alike, and nobody asks an object whether it happens to have a method.

- :class:`Engine`: one worker's pipeline engine, called by the executor, the worker, the evaluator and the
  recorder; kept by ``PipelineEngine``, ``StageCopiesEngine`` and ``TorchEngine``.
- :class:`CurvatureWork`: one stage copy's K-FAC as the executor runs its labels; kept by
  :class:`pipefisher.kfac.KFAC`.
- :class:`ForwardCurvature`: one stage copy's K-FAC as the engines see it around forwards and backwards;
  kept by :class:`pipefisher.kfac.KFAC`.
- :class:`Curvature`: a device's K-FAC as one, for the worker, the update rule and the trainer; kept by
  :class:`pipefisher.kfac.KFAC` and ``StageCopiesKFAC``.

An engine's optional capabilities (posting receives ahead, dropping them, walking its own order) have
no-op defaults in :class:`EngineDefaults`, which every engine derives from: an engine that cannot post
ahead posts nothing. K-FAC sits below the runtime (:mod:`pipefisher.kfac` imports nothing of it), so
:class:`pipefisher.kfac.KFAC` keeps these protocols by its shape; ``tests/test_runtime_contracts.py``
checks every keeper against every protocol it serves, member by member and signature by signature.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Protocol, Sequence, runtime_checkable

from pipefisher.kfac.layers import LayerState, LayerStates

if TYPE_CHECKING:
    import torch

Span = Callable[[str], ContextManager[Any]]
"""The profiler's span: ``span(key)`` times the work inside it under the timeline key ``key``."""


@runtime_checkable
class Engine(Protocol):
    """One worker's pipeline engine: the calls of a step's pipeline order, label by label or all at once."""

    def begin_step(self, step: int) -> None:
        """Training step ``step`` begins (the ``-- start --`` label)."""
        ...

    def op(self, label: str) -> Callable[[], None]:
        """The call a pipeline label (``call_forward``, ``call_backward``, ...) stands for on this engine."""
        ...

    def run(self, ops: Sequence[str]) -> None:
        """One step's pipeline calls ``ops`` in order, nothing between them (a plain step)."""
        ...

    def finish_step(self) -> torch.Tensor | None:
        """The step's sends waited for; its loss on the device holding the last stage, else None."""
        ...

    def allreduce_gradients(self) -> None:
        """The step's gradients averaged over the stage's replicas (waits for what is in flight)."""
        ...

    def evaluate(self, batches: list[Any]) -> float | None:
        """The mean held-out loss on the stage that holds it, else None (every stage calls it together)."""
        ...

    def set_wait_log(self, log: list[Any] | None) -> None:
        """Append every receive's wait to ``log`` (None: off); the recorder's clock reads it."""
        ...

    def prepost(self, label: str) -> int:
        """Post the receives of the call ``label`` ahead of it; how many it posted (optional: 0)."""
        ...

    def drop_preposted(self) -> int:
        """Forget the receives posted ahead and not taken (a failed step); how many (optional: 0)."""
        ...

    def fold_iteration(self, labels: Sequence[str], calls: Sequence[Callable[[], None]]) -> list[Callable[[], None]]:
        """A schedule iteration's bound calls, one per label, as this engine runs them (optional: as
        they are; an engine that walks its own order, torch's, folds them into it)."""
        ...


class EngineDefaults:
    """The no-op defaults of an :class:`Engine`'s optional capabilities, for engines to derive from."""

    def prepost(self, label: str) -> int:
        """Nothing to post ahead: the call posts its own receives."""
        return 0

    def drop_preposted(self) -> int:
        """Nothing was posted ahead."""
        return 0

    def fold_iteration(self, labels: Sequence[str], calls: Sequence[Callable[[], None]]) -> list[Callable[[], None]]:
        """The calls as they are: the executor runs them one after the other."""
        return list(calls)


@runtime_checkable
class CurvatureWork(Protocol):
    """One stage copy's K-FAC as a schedule's executor runs it: one call per K-FAC label, and the plan of
    its refreshes in pieces (:mod:`pipefisher.kfac.refresh`)."""

    @property
    def names(self) -> list[str]:
        """The K-FAC layers of the copy, as the labels name them."""
        ...

    def pieces(self, name: str, factor: str) -> int:
        """How many inverse labels a refresh of ``factor`` of layer ``name`` runs in."""
        ...

    def set_saving(self, on: bool) -> None:
        """``turn_on/off_save_inputs_outgrads``."""
        ...

    def cov(self, factor: str, name: str) -> Any:
        """``cov_kron_X:<name>``."""
        ...

    def sync(self, factor: str, name: str) -> None:
        """``sync_kron_X:<name>``."""
        ...

    def inv(self, factor: str, name: str) -> None:
        """``inv_kron_X:<name>``: a piece of the factor's refresh."""
        ...

    def complete(self, factor: str, name: str) -> None:
        """The factor holds the cycle's covariance: its next inverse label begins a refresh."""
        ...

    def plan_refresh(self) -> None:
        """Refreshes begin only where :meth:`complete` marked them (a schedule runs them)."""
        ...

    def refresh_every(self, steps: int) -> None:
        """Refreshes come once per cycle of ``steps`` steps (what a per-step running average weighs by)."""
        ...

    def finish_refreshes(self) -> None:
        """End every refresh under way now, in flight or completed but not begun (a switch to another schedule)."""
        ...


@runtime_checkable
class ForwardCurvature(Protocol):
    """One stage copy's K-FAC as an engine sees it around its forwards and backwards (the true Fisher's
    sampled-label backward among them)."""

    @property
    def samples_labels(self) -> bool:
        """Whether the forwards saved now need labels sampled from the model (true Fisher)."""
        ...

    def end_forward(self) -> None:
        """A forward micro-batch ended."""
        ...

    def take_forward(self) -> list[tuple[LayerState, torch.Tensor]] | None:
        """The layer outputs of the oldest forwarded micro-batch, or None when it was not saved."""
        ...

    def save_outgrads(self, outputs: list[tuple[LayerState, torch.Tensor]],
                      grads: Iterable[torch.Tensor | None]) -> None:
        """The sampled-label gradients of those outputs, for factor B."""
        ...


@runtime_checkable
class Curvature(LayerStates, Protocol):
    """A device's K-FAC as one (one stage's, or its stage copies' together) as the worker, the update
    rule and the trainer use it; its layers and parameters as :class:`pipefisher.kfac.layers.LayerStates`."""

    def set_saving(self, on: bool) -> None:
        """Save the next micro-batches' inputs and output gradients, or not."""
        ...

    def update_curvature(self, span: Span | None = None) -> None:
        """Naive K-FAC: every label's work after the pipeline, for every layer."""
        ...

    def clear_saved(self) -> None:
        """Drop what was saved and not added into a factor."""
        ...

    def settle_all(self) -> None:
        """Nothing left in flight or unchecked (a checkpoint, the run's end)."""
        ...

    def reset_peak_saved(self) -> None:
        """Start :attr:`peak_saved_bytes` anew."""
        ...

    @property
    def peak_saved_bytes(self) -> int:
        """The most bytes of saved inputs and output gradients held since :meth:`reset_peak_saved`."""
        ...

    def precondition_all(self) -> int:
        """``B^-1 G A^-1`` in place of every layer's gradient that has inverses; how many layers."""
        ...

    @property
    def grad_dot_step(self) -> torch.Tensor:
        """The KL-clip's ``sum <g, F^-1 g>`` of the last :meth:`precondition_all`, on the device."""
        ...

    def scale_step(self, nu: torch.Tensor | float) -> None:
        """Multiply the preconditioned gradients by ``nu`` (the KL-clip factor)."""
        ...
