"""K-FAC's curvature statistics: the inputs and output gradients the forward and backward hooks save,
the covariance pieces added from them, the data-parallel average of a factor, and its running average.

The labels it serves: ``turn_on/off_save_inputs_outgrads`` (:meth:`CurvatureStats.set_saving`),
``cov_kron_X:<m>`` (:meth:`CurvatureStats.cov`: add the OLDEST saved micro-batch) and ``sync_kron_X:<m>``
(:meth:`CurvatureStats.sync`: the all-reduce is started there and waited for where the factor is next
read, so a device never blocks on its peers at the sync label itself). A refresh takes the factor it
inverts from here (:meth:`CurvatureStats.begin_refresh`) and hands back the running average it keeps
(:meth:`CurvatureStats.set_running`); nothing else of this state is read from outside.

Within a refresh a factor is the mean of its micro-batch contributions, so it does not matter how the
covariance pieces are spread over time; across refreshes factors are running averages
(``factor_decay``), so curvature survives a refresh and one refresh's few micro-batches do not dominate.
With ``fisher="true"`` the output gradients that build factor B come from labels sampled from the model's
own predictions (an extra backward through the stage, driven by the engine through
:meth:`CurvatureStats.end_forward` / :meth:`CurvatureStats.take_forward` /
:meth:`CurvatureStats.save_outgrads`), not from the training labels.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.kfac import factors as fx
from pipefisher.kfac.layers import FACTORS, LayerState, check_factor


@dataclass
class LayerStats:
    """One layer's curvature statistics (per factor where a dict)."""

    inputs: collections.deque = field(default_factory=collections.deque)
    outgrads: collections.deque = field(default_factory=collections.deque)
    # the sum of this refresh's covariance pieces: owned (cov adds into it in place)
    sums: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    # pieces added into each factor: a number, or under fp16 a device tensor (pieces that overflowed count 0)
    counts: dict[str, Any] = field(default_factory=lambda: {"A": 0, "B": 0})
    running: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    synced: dict[str, bool] = field(default_factory=lambda: {"A": False, "B": False})  # since the last piece
    overflowed: dict[str, Any] = field(default_factory=lambda: {"A": 0, "B": 0})  # fp16 pieces dropped (a tensor)

    def factor(self, f: str) -> torch.Tensor | None:
        s = self.sums[f]
        return None if s is None else s / self.counts[f]


def _owned(sums: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Copies of a layer's factor sums: :meth:`CurvatureStats.cov` adds into a sum in place, so a state dict
    never shares one with a live state."""
    return {f: None if t is None else t.clone() for f, t in sums.items()}


def _running_scale(s: LayerStats, factor: str) -> torch.Tensor | None:
    """The mean trace of the layer's running average of ``factor`` (None before its first refresh)."""
    running = s.running[factor]
    return None if running is None else fx.mean_trace(running)


class CurvatureStats:
    """The curvature statistics of one stage's K-FAC layers (see the module's docstring).

    ``loss_scale`` is the number each micro-batch's mean loss was divided by, so factor B is built from
    per-row gradients; ``dp_group``/``dp_size`` the stage's data-parallel group (None/1: none);
    ``save_dtype`` what saved tensors wait in; ``cov_stride`` every how many token rows feed a piece;
    ``cov_micro_batches`` M: only each layer's first M forwards after saving turns on or off are saved
    (None: all; :func:`pipefisher.schedule.timeline.cov_pieces`); ``basis_block``: a factor wider than
    it holds its diagonal blocks only (``kfac.basis_block``, :func:`pipefisher.kfac.factors.diagonal_blocks`).
    """

    def __init__(self, layers: dict[str, LayerState], *, loss_scale: float, dp_group: Any, dp_size: int,
                 factor_decay: float, save_dtype: torch.dtype, fisher: str, cov_stride: int,
                 cov_micro_batches: int | None = None, basis_block: int = 0) -> None:
        self.layers = layers
        self.basis_block = basis_block  # only a wider factor's diagonal blocks are computed (fx.diagonal_blocks)
        self.state = {n: LayerStats() for n in layers}
        self._names = {id(st): n for n, st in layers.items()}  # a layer's name from its record
        self.loss_scale, self.factor_decay = float(loss_scale), float(factor_decay)
        self.dp_group, self.dp_size = dp_group, int(dp_size)
        self.save_dtype, self.fisher, self.cov_stride = save_dtype, fisher, cov_stride
        self.cov_micro_batches = cov_micro_batches
        self.forwards_saved = 0  # micro-batches saved since saving last turned on or off (end_forward counts)
        self.saving = False
        # bytes of saved tensors still waiting for their covariance piece, counted as they are saved and
        # freed (a tensor shared by several layers once), and the most they reached since reset_peak_saved
        self._held: dict[int, list[int]] = {}  # id(saved tensor) -> [bytes, layers holding it]
        self.saved_now = self.peak_saved_bytes = 0
        self._input_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._forward_outputs: list[tuple[LayerState, torch.Tensor]] = []
        self._awaiting: collections.deque = collections.deque()  # per forwarded micro-batch, true Fisher
        self._in_flight: dict[tuple[str, str], Any] = {}  # (layer, factor) -> all-reduce not yet waited for
        self.replaying = False  # a forward run again for its backward (activation recomputation)
        # fp16's loss scale (pipefisher.runtime.pipeline.compute.LossScale), None otherwise: saved output
        # gradients are divided by it, and a piece that overflowed is dropped rather than added
        self.grad_scaler: Any = None
        self._handles = [self._hook(n, st) for n, st in layers.items()]

    # -- saving inputs and output gradients -------------------------------------------------------

    def set_saving(self, on: bool) -> None:
        """Start or stop saving layer inputs (forward) and output gradients (backward). Either starts a
        new count of saved micro-batches: with ``cov_micro_batches`` M, only the first M forward
        micro-batches after this call (:meth:`end_forward` counts them) are saved, and under the true
        Fisher only they run the sampled-label backward."""
        self.saving = bool(on)
        self.forwards_saved = 0

    @property
    def _saving_this_one(self) -> bool:
        """Whether the forward micro-batch under way is saved: saving on, and within the cap."""
        return self.saving and (self.cov_micro_batches is None or self.forwards_saved < self.cov_micro_batches)

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
        for s in self.state.values():
            for t in (*s.inputs, *s.outgrads):
                self._hold(t)

    def reset_peak_saved(self) -> None:
        self.peak_saved_bytes = self.saved_now

    def _hook(self, name: str, st: LayerState) -> Any:
        s = self.state[name]

        def on_forward(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if not (self._saving_this_one and torch.is_grad_enabled()) or self.replaying:
                return  # beyond the refresh's micro-batches too: neither its input nor its output gradient
            s.inputs.append(self._saved_input(inputs[0]))
            if not out.requires_grad:
                return
            if self.fisher == "true":
                self._forward_outputs.append((st, out))
            else:
                out.register_hook(self._once(s))

        return st.module.register_forward_hook(on_forward)

    def _once(self, s: LayerStats) -> Callable[[torch.Tensor], None]:
        """The output-gradient hook of one forward: it keeps the first gradient it sees. A zero-bubble
        W pass (:mod:`pipefisher.runtime.pipeline.split_backward`) may re-enter the layer's node with the
        same gradient, which must not count twice."""
        seen = False

        def keep(g: torch.Tensor) -> None:
            nonlocal seen
            if not seen:
                seen = True
                s.outgrads.append(self._hold(self._unscaled(g)))
        return keep

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- true Fisher: the engine runs a second backward with sampled labels --------------------------

    @property
    def samples_labels(self) -> bool:
        """True while forwards are saved for a true-Fisher factor B (the engine must sample labels)."""
        return self.fisher == "true" and self._saving_this_one

    def end_forward(self) -> None:
        """Called by the engine after each forward micro-batch: closes its list of layer outputs and counts
        it among the saved ones where it was."""
        self._input_cache = None
        saved = self._saving_this_one and torch.is_grad_enabled()
        if self.fisher == "true":
            self._awaiting.append(self._forward_outputs if saved else None)
            self._forward_outputs = []
        if saved:
            self.forwards_saved += 1

    def take_forward(self) -> list[tuple[LayerState, torch.Tensor]] | None:
        """The layer outputs of the oldest forwarded micro-batch, or None if it was not saved."""
        if self.fisher != "true" or not self._awaiting:
            return None
        return self._awaiting.popleft()

    def save_outgrads(self, outputs: list[tuple[LayerState, torch.Tensor]],
                      grads: Iterable[torch.Tensor | None]) -> None:
        """Save the sampled-label gradients of those outputs for factor B (None: the output was unused)."""
        for (st, out), g in zip(outputs, grads):
            self.state[self._names[id(st)]].outgrads.append(
                self._hold(self._unscaled(torch.zeros_like(out) if g is None else g)))

    def _unscaled(self, g: torch.Tensor) -> torch.Tensor:
        """An output gradient as saved: compacted, and divided by fp16's loss scale when there is one."""
        saved = self._compact(g)
        return saved if self.grad_scaler is None else saved / self.grad_scaler.scale

    def pending(self, factor: str, name: str) -> int:
        """Saved micro-batches not yet added into ``factor`` of layer ``name``."""
        s = self.state[name]
        return len(s.inputs if factor == "A" else s.outgrads)

    def clear_saved(self) -> None:
        for s in self.state.values():
            s.inputs.clear()
            s.outgrads.clear()
        self._input_cache = None
        self._forward_outputs = []
        self._awaiting.clear()
        self._held, self.saved_now = {}, 0

    def saved_bytes(self) -> int:
        """Memory held by saved inputs and output gradients still waiting for their covariance piece,
        counted from the queues (:attr:`saved_now` is the same figure, kept as tensors come and go)."""
        seen: set[int] = set()
        total = 0
        for s in self.state.values():
            for t in (*s.inputs, *s.outgrads):
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    # -- covariance and its average ---------------------------------------------------------------

    def cov(self, factor: str, name: str) -> bool:
        """Add the oldest saved micro-batch of layer ``name`` into ``factor``; False if none is saved."""
        st, s = self.layers[name], self.state[name]
        queue = s.inputs if check_factor(factor) == "A" else s.outgrads
        if not queue:
            return False
        self.settle(name, factor)
        x = queue.popleft()
        self._release(x)
        # B: the saved rows are gradients of a mean over cov_stride times as many rows (see fx.cov_b)
        scale = self.loss_scale * self.cov_stride
        if self.grad_scaler is not None:  # fp16: a piece that overflowed adds nothing and counts 0 (its
            finite = torch.isfinite(x).all()  # step's update is skipped too); decided on the device
            contrib = fx.cov_a(x, st.bias, self.basis_block) if factor == "A" else fx.cov_b(x, scale, self.basis_block)
            contrib = torch.where(finite, contrib, torch.zeros_like(contrib))
            s.overflowed[factor] = s.overflowed[factor] + (~finite).long()
            s.counts[factor] = s.counts[factor] + finite.float()
            s.sums[factor] = contrib if s.sums[factor] is None else s.sums[factor].add_(contrib)
        else:
            acc = s.sums[factor]  # added into in place: nothing else holds it (see LayerStats.sums)
            s.sums[factor] = (fx.add_cov_a(acc, x, st.bias, self.basis_block) if factor == "A"
                              else fx.add_cov_b(acc, x, scale, self.basis_block))
            s.counts[factor] += 1
        s.synced[factor] = False
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
        s = self.state[name]
        self.settle(name, check_factor(factor))
        f = s.factor(factor)
        if f is None and self.grad_scaler is None:
            raise RuntimeError(f"sync_kron_{factor}:{name}: factor {factor} has no covariance yet")
        counts: Any = int(f is not None)
        if self.dp_size > 1:
            counted = self.grad_scaler is not None  # fp16: a replica whose every piece overflowed brings none
            if counted:  # the mean (or zeros), then whether this replica had one: averaged over those that had
                size = self.layers[name].factor_size(factor)
                dev = self.layers[name].module.weight.device
                had = torch.zeros((), device=dev) if f is None else torch.as_tensor(s.counts[factor], device=dev) > 0
                mean = torch.zeros((size, size), device=had.device) if f is None \
                    else torch.where(had, f, torch.zeros_like(f))
                f = torch.cat([mean.reshape(-1), had.to(mean.dtype).reshape(1)])
            else:
                f = f.contiguous()
            self._in_flight[name, factor] = (dist.all_reduce(f, group=self.dp_group, async_op=True), counted)
        elif f is not None and self.grad_scaler is not None:  # fp16: none if every piece overflowed
            counts = (torch.as_tensor(s.counts[factor], device=f.device) > 0).float()
            f = torch.where(counts > 0, f, torch.zeros_like(f))
        s.sums[factor], s.counts[factor] = f, counts
        s.synced[factor] = True

    def settle(self, name: str, factor: str) -> None:
        """Wait for the factor's all-reduce, if one is in flight, and finish the average."""
        entry = self._in_flight.pop((name, factor), None)
        if entry is None:
            return
        work, counted = entry
        work.wait()
        s = self.state[name]
        if not counted:
            s.sums[factor] /= self.dp_size
            return
        flat = s.sums[factor]
        assert flat is not None
        replicas, size = flat[-1], self.layers[name].factor_size(factor)  # replicas that had one (on the device)
        s.sums[factor] = flat[:-1].reshape(size, size) / replicas
        s.counts[factor] = (replicas > 0).float()

    def settle_all(self) -> None:
        """Wait for every all-reduce in flight."""
        for name, factor in list(self._in_flight):
            self.settle(name, factor)

    def factor(self, name: str, factor: str) -> torch.Tensor | None:
        """The current factor (mean of this refresh's contributions), or None when cleared."""
        self.settle(name, check_factor(factor))
        return self.state[name].factor(factor)

    def averaged(self, name: str, factor: str) -> torch.Tensor | None:
        """The factor as it will be inverted: the running average folded with the new covariance (if any)."""
        s = self.state[name]
        self.settle(name, check_factor(factor))
        cur = s.factor(factor)
        if cur is None:
            return s.running[factor]
        return self._fold(s, factor, cur, s.running[factor])

    def scale(self, name: str, factor: str) -> torch.Tensor | None:
        """``mean_trace(averaged(name, factor))``, folded from the traces instead (a trace is linear): pi
        reads both factors' scales at every inverse, and forming the averages for it cost passes over
        both whole factors."""
        s = self.state[name]
        self.settle(name, check_factor(factor))
        running = _running_scale(s, factor)
        if s.sums[factor] is None:
            return running
        return self._fold(s, factor, fx.mean_trace(s.sums[factor]) / s.counts[factor], running)

    def _fold(self, s: LayerStats, factor: str, cur: torch.Tensor, running: torch.Tensor | None,
              in_place: bool = False) -> torch.Tensor:
        """The new covariance ``cur`` folded into the running average ``running`` (a factor, or its scale);
        ``in_place``: into ``cur``, which the caller owns."""
        new = fx.running_average(running, cur, self.factor_decay, in_place)
        if self.grad_scaler is None or running is None:
            return new
        some = torch.as_tensor(s.counts[factor], device=new.device) > 0  # a number after a checkpoint's load
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
            s = self.state[name]
            local = self.dp_size > 1 and s.sums[f] is not None and not s.synced[f]
            scales.append(_running_scale(s, f) if local else self.scale(name, f))
        return fx.pi_split(*scales)  # a 0-dim tensor: no host sync

    # -- what a refresh takes and gives back ------------------------------------------------------

    def begin_refresh(self, factor: str, name: str) -> tuple[torch.Tensor, Any, torch.Tensor | None,
                                                           torch.Tensor | None] | None:
        """Take ``factor`` of layer ``name`` for a refresh: ``(averaged factor, pi, pieces kept, running
        average before)``, with pi taken before the new factor is cleared (it reads both factors' scales)
        and the averaged factor kept as the running average (the other factor's pi reads it while this
        one's refresh is in flight). None under fp16 when no piece reached the factor;
        ``RuntimeError`` when a factor has no covariance otherwise."""
        s = self.state[name]
        for f in FACTORS:  # this factor, and the other one that pi reads
            self.settle(name, f)
        if s.factor(factor) is None:
            if self.grad_scaler is not None:  # fp16: no piece of this refresh reached the factor
                s.synced[factor] = False
                return None
            raise RuntimeError(f"inv_kron_{factor}:{name}: factor {factor} has no covariance to invert")
        pi = self.pi(name)  # before the fold below consumes this refresh's sum
        # averaged(), folded in place into the sum the refresh takes (owned: see LayerStats.sums): the
        # out-of-place fold's passes and new factors were a third of a 129-wide factor's refresh on a CPU core
        total = s.sums[factor]
        assert total is not None  # s.factor(factor) above
        f = self._fold(s, factor, total.div_(s.counts[factor]), s.running[factor], in_place=True)
        kept = torch.as_tensor(s.counts[factor]) if self.grad_scaler is not None else None
        s.sums[factor], s.counts[factor], s.synced[factor] = None, 0, False
        old_running, s.running[factor] = s.running[factor], f
        return f, pi, kept, old_running

    def set_running(self, name: str, factor: str, running: torch.Tensor | None) -> None:
        """The running average a finished refresh keeps (the previous one where the refresh was dropped)."""
        self.state[name].running[factor] = running

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The saving flag and, per layer, factor sums and counts, running averages, sync marks and the
        saved inputs and output gradients still waiting for their covariance piece. Waits for in-flight
        all-reduces first."""
        self.settle_all()
        layers = {name: {"sums": _owned(s.sums), "counts": dict(s.counts), "running": dict(s.running),
                         "synced": dict(s.synced), "inputs": list(s.inputs), "outgrads": list(s.outgrads)}
                  for name, s in self.state.items()}
        return {"saving": self.saving, "layers": layers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_saving(bool(state["saving"]))
        for name, s in self.state.items():
            layer = state["layers"][name]
            s.sums = _owned(layer["sums"])
            s.counts = {f: int(layer["counts"][f]) for f in FACTORS}
            s.running = {f: layer["running"][f] for f in FACTORS}
            s.synced = {f: bool(layer["synced"][f]) for f in FACTORS}
            s.inputs.clear()
            s.inputs.extend(layer["inputs"])
            s.outgrads.clear()
            s.outgrads.extend(layer["outgrads"])
        self.recount_saved()
