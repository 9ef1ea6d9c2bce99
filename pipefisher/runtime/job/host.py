"""Device-to-host reads on the step path, counted in one place.

On a GPU, turning a tensor into a Python number (``float(t)``, ``bool(t)``, ``.item()``, ``.tolist()``)
makes the host wait until the device has computed it: the host stops queueing work, and the device
idles once the queue runs dry. A training step should therefore read nothing, apart from what decides
the host's next move (fp16's overflow decides whether the optimizer steps) and what the run reports
(losses at logging steps). Every read of a worker goes through its :class:`HostReads`, made with the
worker (:func:`pipefisher.runtime.train.worker.build_worker`) and handed to those that read (its engine,
K-FAC, update rule, trainer), never a process-wide one: two workers in one process count apart. It counts
the reads (:meth:`HostReads.take`: the reads since the last take, so a loop counts them per step) and
batches those that can wait: :meth:`HostReads.later` files a tensor and what to do with its values, and
the next read of any kind (:meth:`HostReads.settle`) brings them over with it, in one transfer.

A read syncs no more than itself: ``.tolist()`` of one flat tensor (never ``torch.cuda.synchronize``).
Nothing here imports torch at module level, so the module costs nothing to import.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

Later = Callable[[list[float]], None]

CONVERSIONS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy", "__array__")
"""The ``torch.Tensor`` methods that turn a tensor into Python numbers (``f"{t:.3f}"`` goes through ``item``)."""
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pipefisher/
_HOST_SIDE = (os.path.abspath(__file__), os.path.join(_PACKAGE, "runtime", "data") + os.sep)


class HostReads:
    """Counts one worker's device-to-host reads and holds the reads that can wait for the next one
    (a :class:`pipefisher.kfac.refresher.HostReader` for K-FAC's checks).

    ``count``: reads since the last :meth:`take`; ``total``: over the counter's life."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self._later: list[tuple[Any, Later]] = []

    def _transfer(self, tensors: list[Any]) -> list[float]:
        """One read: ``tensors`` flattened into one float64 tensor, brought over as numbers."""
        import torch

        self.count += 1
        self.total += 1
        device = tensors[0].device  # a host tensor among device ones joins them (a copy the other way)
        flat = [t.detach().reshape(-1).to(device=device, dtype=torch.float64) for t in tensors]
        return (flat[0] if len(flat) == 1 else torch.cat(flat)).tolist()

    def values(self, *tensors: Any) -> list[float]:
        """Every element of ``tensors`` (flattened, in order) as numbers, in one read; what waited for
        the next read (:meth:`later`) comes over with it and is handed on first."""
        waiting, self._later = self._later, []
        got = self._transfer([t for t, _ in waiting] + list(tensors)) if waiting or tensors else []
        at = 0
        for t, then in waiting:
            n = t.numel()
            then(got[at:at + n])
            at += n
        return got[at:]

    def value(self, t: Any) -> float:
        """A one-element tensor as a number (one read)."""
        return self.values(t)[0]

    def flag(self, t: Any) -> bool:
        """A one-element tensor as a truth value (one read)."""
        return self.values(t)[0] != 0

    def wait(self, event: Any) -> None:
        """Wait for a CUDA event (counted as a read: the host waits on the device as a read does)."""
        self.count += 1
        self.total += 1
        event.synchronize()

    def later(self, t: Any, then: Later) -> None:
        """Read ``t`` with the next read, whatever it is, and call ``then(values)`` there."""
        self._later.append((t, then))

    @property
    def waiting(self) -> bool:
        """Whether a read filed with :meth:`later` still waits."""
        return bool(self._later)

    def settle(self) -> None:
        """Read now what waits (:meth:`later`), if anything does: one read, or none."""
        if self._later:
            self.values()

    def take(self) -> int:
        """The reads since the last take (a loop takes them once per step), and start counting anew."""
        n, self.count = self.count, 0
        return n


@contextmanager
def unrouted_reads(host: HostReads) -> Iterator[list[str]]:
    """While open, every conversion of a tensor into Python numbers (:data:`CONVERSIONS`) made by pipefisher
    code outside a :class:`HostReads` counts in ``host``'s count too (the worker's under test), and its place
    (``file:line``) is listed: so a ``float(loss)`` put back on the step path shows in the reads per step.
    Not counted: the counters' own reads, the data pipeline's (host tensors, before they go to the device)
    and torch's optimizers' (their step counts live on the host). A diagnostic for tests and benchmarks:
    every conversion walks the stack."""
    import torch

    places: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    optim_dir = os.path.join(torch_dir, "optim") + os.sep

    def caller() -> str | None:
        """``file:line`` of the pipefisher code making the conversion, or None where it does not count."""
        frame = sys._getframe(2)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if path.startswith(optim_dir):
                return None
            if not path.startswith(torch_dir):
                if path.startswith(_PACKAGE + os.sep) and not path.startswith(_HOST_SIDE):
                    return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
                return None
            frame = frame.f_back
        return None

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def conversion(self: Any, *args: Any, **kwargs: Any) -> Any:
            where = caller()
            if where is not None:
                host.count += 1
                host.total += 1
                places.append(where)
            return original(self, *args, **kwargs)
        return conversion

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield places
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
