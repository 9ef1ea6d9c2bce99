"""Pipeline orders (GPipe, 1F1B, Chimera, interleaved, zero-bubble H1 and V, DualPipeV): for each device, the
ordered forward/backward operations.

The simulator times them (:mod:`pipefisher.sim`) and the runtime's engine runs them
(:mod:`pipefisher.runtime.pipeline.engine`): one definition of each order, below both.

An order only fixes the ORDER of operations on each device; when they run follows from a cost model
(see :mod:`pipefisher.sim.simulator`). Operations are identified by kind, micro-batch, stage and pipe:

- ``stage`` is the position in its pipe, ``0 .. virtual_stages - 1``. With ``v`` model chunks per
  device there are ``p * v`` virtual stages, placed by the order's layout (:func:`stage_on`): in a
  loop (:data:`LOOP`, interleaved 1F1B as Megatron-LM lays it out) virtual stage ``s`` runs on device
  ``s % p``; in a V (:data:`V`, ZB-V's two chunks) it runs on device ``s`` going down and on device
  ``2p - 1 - s`` coming back, so the last device holds the V's turn (stages ``p - 1`` and ``p``) and the
  first device both ends. ``chunk`` always follows from the stage: ``stage // p`` on the down pipe (so 0
  everywhere in a single-chunk order) and 0 on the up pipe, in either layout, the same rule
  :meth:`PipelineOrder.dependencies` uses to name the operations it waits for.
- ``pipe`` is 0 for the usual (down) pipe and 1 for Chimera's second pipe, whose stage ``s`` runs on
  device ``p - 1 - s`` (the ``:up_pipe`` operations of the timeline format).
- ``kind`` is ``F`` (forward), ``B`` (backward; only the input gradient when the order splits the
  backward) or ``W`` (weight gradient, zero-bubble orders and DualPipeV only).

A few consecutive operations of a device may run as one call (:attr:`PipelineOrder.fused`): DualPipeV's
full backwards (a B and its own W) and its overlapped forward-backward pairs. Their outputs leave the
device only when the whole call ends, which :meth:`PipelineOrder.dependencies` says.
"""
from __future__ import annotations

import heapq
import numbers
import operator
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Callable, Iterator

from pipefisher.errors import InputError



class PassKind(Enum):
    """The kinds of pipeline pass, the one vocabulary every layer names them in: the orders' and the
    simulator's letter (:attr:`label`), the profiled timelines' key (:attr:`key`, :mod:`pipefisher.schedule.timeline`)
    and torch's ``_ComputationType`` (:meth:`torch_name`).

    ``BACKWARD`` (B) computes the input gradient only where the order splits the backward (zero-bubble
    orders, DualPipeV: torch's ``BACKWARD_INPUT``) and the full backward otherwise (torch's
    ``FULL_BACKWARD``); ``WEIGHT`` (W) is the deferred weight-gradient pass of a split."""

    FORWARD = ("F", "call_forward", "FORWARD", "FORWARD")
    BACKWARD = ("B", "call_backward", "FULL_BACKWARD", "BACKWARD_INPUT")
    WEIGHT = ("W", "call_backward:weight", "BACKWARD_WEIGHT", "BACKWARD_WEIGHT")

    def __new__(cls, label: str, key: str, torch_full: str, torch_split: str) -> PassKind:
        member = object.__new__(cls)
        member._value_ = label
        member._key, member._torch = key, (torch_full, torch_split)
        return member

    @property
    def label(self) -> str:
        """The letter of the orders and the simulator (:attr:`Op.kind`): ``F``, ``B`` or ``W``."""
        return str(self.value)

    @property
    def key(self) -> str:
        """The profiled timeline's key of this pass (chunk and pipe suffixes aside)."""
        return self._key

    def torch_name(self, split: bool = False) -> str:
        """The name of torch's ``_ComputationType`` that runs this pass, in an order that splits its
        backwards (``split``) or not."""
        return self._torch[1 if split else 0]


FORWARD, BACKWARD, WEIGHT = PassKind.FORWARD.label, PassKind.BACKWARD.label, PassKind.WEIGHT.label
"""The letters of the passes (:class:`PassKind`), as :attr:`Op.kind` holds them."""
DOWN, UP = 0, 1
LOOP, V = "loop", "v"
"""How model chunks sit on the devices: chunk ``c`` of device ``d`` is virtual stage ``d + c p`` in a
loop, and ``d`` (chunk 0) or ``2p - 1 - d`` (chunk 1) in a V (see :func:`stage_on`)."""
LAYOUTS = (LOOP, V)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown chunk layout {layout!r} (known: {', '.join(LAYOUTS)})")


def stage_on(device: int, chunk: int, stages: int, layout: str = LOOP) -> int:
    """The virtual stage that model chunk ``chunk`` of ``device`` holds, in a pipe of ``stages`` devices.

    The one mapping from (device, chunk) to stage: the simulator names a node's K-FAC layers by it and
    the runtime builds its model chunks by it. A V has exactly two chunks.
    """
    _check_layout(layout)
    if not (0 <= device < stages and chunk >= 0):
        raise ValueError(f"device {device}, chunk {chunk} is not a place in a pipe of {stages} devices")
    if layout == V:
        if chunk > 1:
            raise ValueError(f"a V has chunks 0 and 1, not {chunk}")
        return device if chunk == 0 else 2 * stages - 1 - device
    return device + chunk * stages


def device_of_stage(stage: int, stages: int, layout: str = LOOP) -> int:
    """The device that holds virtual ``stage`` (as chunk ``stage // stages``): :func:`stage_on` inverted."""
    _check_layout(layout)
    chunk = stage // stages
    if layout == V and chunk == 1:
        return 2 * stages - 1 - stage
    return stage - chunk * stages


@dataclass(frozen=True, order=True)
class Op:
    """One pipeline operation of one micro-batch on one (virtual) stage of one pipe."""

    kind: str
    micro_batch: int
    stage: int
    chunk: int = 0
    pipe: int = DOWN

    def key(self) -> tuple[str, int, int, int]:
        """Identity without the chunk (which follows from the stage)."""
        return (self.kind, self.micro_batch, self.stage, self.pipe)


@dataclass(frozen=True)
class PipelineOrder:
    """The per-device operation order of one pipeline step."""

    name: str
    stages: int
    """Devices (= pipeline nodes)."""
    micro_batches: int
    chunks: int
    devices: tuple[tuple[Op, ...], ...]
    split_backward: bool = False
    """True when backwards are split into B (input gradient) and W (weight gradient)."""
    layout: str = LOOP
    """Where the model chunks sit (:data:`LOOP` or :data:`V`, see :func:`stage_on`)."""
    fused: tuple[tuple[Op, ...], ...] = ()
    """Runs of consecutive operations of one device that run as one call and hand their outputs on only
    when the call ends (DualPipeV): a full backward ``(B, W)`` of one micro-batch, which computes the
    weight gradient before it sends the input gradient, and an overlapped pair ``(F, B, W)``, a forward
    and another micro-batch's full backward, whose sends follow both (torch's ``FULL_BACKWARD`` and
    ``OVERLAP_F_B``). Every other operation sends its output as it ends."""

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def pipes(self) -> int:
        return 1 + any(op.pipe == UP for ops in self.devices for op in ops)

    def device_of(self, stage: int, pipe: int = DOWN) -> int:
        """The device that runs virtual stage ``stage`` of ``pipe``."""
        return self.stages - 1 - stage if pipe == UP else device_of_stage(stage, self.stages, self.layout)

    @cached_property
    def _call_end(self) -> dict[Op, Op]:
        return {op: run[-1] for run in self.fused for op in run}

    def sent_after(self, op: Op) -> Op:
        """The operation at whose end ``op``'s output leaves its device: the last one of ``op``'s fused
        call (:attr:`fused`), else ``op`` itself."""
        return self._call_end.get(op, op)

    def dependencies(self, op: Op) -> list[Op]:
        """The operations that must end before ``op`` can start (on any device): the ones whose outputs
        it needs, each replaced by the end of its fused call where it runs in one (:meth:`sent_after`).

        A forward needs the previous stage's forward; a backward its own forward and the next stage's
        backward (its output gradient; the last stage starts from the loss); a W its own B.
        """
        last = self.virtual_stages - 1
        chunk_of = (lambda s: 0) if op.pipe == UP else (lambda s: s // self.stages)
        if op.kind == FORWARD:
            if op.stage == 0:
                return []
            return [self.sent_after(Op(FORWARD, op.micro_batch, op.stage - 1, chunk_of(op.stage - 1), op.pipe))]
        if op.kind == BACKWARD:
            own_forward = Op(FORWARD, op.micro_batch, op.stage, op.chunk, op.pipe)
            if op.stage == last:
                return [own_forward]
            grad = Op(BACKWARD, op.micro_batch, op.stage + 1, chunk_of(op.stage + 1), op.pipe)
            return [self.sent_after(grad), own_forward]
        return [Op(BACKWARD, op.micro_batch, op.stage, op.chunk, op.pipe)]

    def check(self) -> None:
        """Every operation appears exactly once on its own device, and the order cannot deadlock.

        Expected: for each micro-batch, one pipe (Chimera splits micro-batches between two), and on it
        every virtual stage with each kind (F and B, plus W when the backward is split), with the chunk
        that :meth:`dependencies` names; each fused call a run of consecutive operations of one device.
        Raises AssertionError naming the first problem.
        """
        if len(self.devices) != self.stages:
            raise AssertionError(f"{self.name}: {len(self.devices)} device orders for {self.stages} stages")
        kinds = (FORWARD, BACKWARD, WEIGHT) if self.split_backward else (FORWARD, BACKWARD)
        listed: dict[Op, int] = {}
        pipe_of: dict[int, int] = {}
        for d, ops in enumerate(self.devices):
            for op in ops:
                if op.kind not in kinds or not 0 <= op.micro_batch < self.micro_batches \
                        or not 0 <= op.stage < self.virtual_stages or op.pipe not in (DOWN, UP):
                    raise AssertionError(f"{self.name}: {op} on device {d} is not an operation of this order")
                if op.chunk != (0 if op.pipe == UP else op.stage // self.stages):
                    raise AssertionError(f"{self.name}: {op} on device {d} has the wrong chunk for its stage")
                if self.device_of(op.stage, op.pipe) != d:
                    raise AssertionError(f"{self.name}: {op} is listed on device {d}")
                if op in listed:
                    raise AssertionError(f"{self.name}: {op} appears twice")
                if pipe_of.setdefault(op.micro_batch, op.pipe) != op.pipe:
                    raise AssertionError(f"{self.name}: micro-batch {op.micro_batch} runs on both pipes")
                listed[op] = d
        self._check_fused(listed)
        for j in range(self.micro_batches):
            if j not in pipe_of:
                raise AssertionError(f"{self.name}: micro-batch {j} never runs")
            missing = [op for op in (_op(k, j, s, self.stages, pipe_of[j]) for s in range(self.virtual_stages)
                                     for k in kinds) if op not in listed]
            if missing:
                shown = ", ".join(map(str, missing[:3])) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                raise AssertionError(f"{self.name}: never runs {shown}")
        self._check_no_deadlock()

    def _check_fused(self, listed: dict[Op, int]) -> None:
        """Every fused call is a run of consecutive operations of one device, each in one call only."""
        at = {op: (d, i) for d, ops in enumerate(self.devices) for i, op in enumerate(ops)}
        seen: set[Op] = set()
        for run in self.fused:
            if not run or any(op not in listed for op in run):
                raise AssertionError(f"{self.name}: fused call {run} holds operations the order does not run")
            d, i = at[run[0]]
            if [at[op] for op in run] != [(d, i + k) for k in range(len(run))]:
                raise AssertionError(f"{self.name}: fused call {run} is not a run of consecutive operations "
                                     "of one device")
            if seen & set(run):
                raise AssertionError(f"{self.name}: {sorted(seen & set(run))[0]} is in two fused calls")
            seen |= set(run)

    def _check_no_deadlock(self) -> None:
        """Run the per-device orders as dataflow: a device's next op may run once its dependencies have."""
        done: set[Op] = set()
        pos = [0] * self.stages
        progressed = True
        while progressed:
            progressed = False
            for d, ops in enumerate(self.devices):
                while pos[d] < len(ops) and all(dep in done for dep in self.dependencies(ops[pos[d]])):
                    done.add(ops[pos[d]])
                    pos[d] += 1
                    progressed = True
        stuck = [f"device {d} at {ops[pos[d]]} (waits for "
                 f"{', '.join(str(dep) for dep in self.dependencies(ops[pos[d]]) if dep not in done)})"
                 for d, ops in enumerate(self.devices) if pos[d] < len(ops)]
        if stuck:
            raise AssertionError(f"{self.name}: the order deadlocks: {'; '.join(stuck)}")


# ----------------------------------------------------------------------------------------------------
# Argument checks


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise InputError(None, what)


def _count(name: str, what: str, value: object, minimum: int = 1) -> int:
    """``value`` as a plain int: any integral type (numpy's too) but bool, which is a flag, not a size."""
    _need(isinstance(value, numbers.Integral) and not isinstance(value, bool) and operator.index(value) >= minimum,
          f"{name}: {what} must be a whole number >= {minimum}, got {value!r}")
    return operator.index(value)  # type: ignore[arg-type]


def _check_common(name: str, stages: object, micro_batches: object) -> tuple[int, int]:
    return _count(name, "stages", stages), _count(name, "micro-batches", micro_batches)


def _op(kind: str, mb: int, stage: int, p: int, pipe: int = DOWN) -> Op:
    """An operation with its chunk numbered the way :meth:`PipelineOrder.dependencies` names it."""
    return Op(kind, mb, stage, stage // p if pipe == DOWN else 0, pipe)


def _fwd(mb: int, stage: int, p: int, pipe: int = DOWN) -> Op:
    return _op(FORWARD, mb, stage, p, pipe)


def _bwd(mb: int, stage: int, p: int, pipe: int = DOWN) -> Op:
    return _op(BACKWARD, mb, stage, p, pipe)


# ----------------------------------------------------------------------------------------------------
# Generators


def gpipe(stages: int, micro_batches: int, chunks: int = 1) -> PipelineOrder:
    """GPipe: every device runs all forwards, then all backwards (in micro-batch order)."""
    stages, micro_batches = _check_common("gpipe", stages, micro_batches)
    _need(_count("gpipe", "chunks", chunks) == 1, "gpipe: has one model chunk per device (use 'interleaved' for chunks > 1)")
    devices = tuple(
        tuple(_fwd(j, d, stages) for j in range(micro_batches))
        + tuple(_bwd(j, d, stages) for j in range(micro_batches))
        for d in range(stages)
    )
    return PipelineOrder("gpipe", stages, micro_batches, 1, devices)


def one_f_one_b(stages: int, micro_batches: int, chunks: int = 1) -> PipelineOrder:
    """1F1B (PipeDream-flush / DAPPLE): a warm-up of ``p - d - 1`` forwards, then forward/backward pairs."""
    stages, micro_batches = _check_common("1f1b", stages, micro_batches)
    _need(_count("1f1b", "chunks", chunks) == 1, "1f1b: has one model chunk per device (use 'interleaved' for chunks > 1)")
    devices = []
    for d in range(stages):
        warmup = min(stages - d - 1, micro_batches)
        ops = [_fwd(j, d, stages) for j in range(warmup)]
        for j in range(micro_batches - warmup):
            ops += [_fwd(warmup + j, d, stages), _bwd(j, d, stages)]
        ops += [_bwd(j, d, stages) for j in range(micro_batches - warmup, micro_batches)]
        devices.append(tuple(ops))
    return PipelineOrder("1f1b", stages, micro_batches, 1, tuple(devices))


def interleaved(stages: int, micro_batches: int, chunks: int = 2) -> PipelineOrder:
    """Interleaved 1F1B (Megatron-LM, as torch's ``ScheduleInterleaved1F1B`` runs it): ``v`` model chunks
    per device, visited in rounds of ``r`` micro-batches.

    Like torch, the micro-batch count need not be a multiple of the stage count: there are
    ``max(1, m // p)`` rounds of ``r = m / rounds`` micro-batches (so m must split evenly into them; for
    multiples of ``p``, ``r = p``, Megatron-LM's order). The k-th forward of a device runs chunk
    ``(k // r) % v`` on that chunk's next micro-batch; backwards visit the chunks in reverse; device d
    warms up with ``(v - 1) r + 2 (p - 1 - d)`` forwards.
    """
    stages, micro_batches = _check_common("interleaved", stages, micro_batches)
    _need(isinstance(chunks, numbers.Integral) and not isinstance(chunks, bool) and operator.index(chunks) >= 2,
          f"interleaved: needs chunks >= 2 model chunks per device, got {chunks!r}")
    chunks = operator.index(chunks)
    p, v, m = stages, chunks, micro_batches
    rounds = max(1, m // p)
    _need(m % rounds == 0,
          f"interleaved: micro-batches ({m}) must split evenly into max(1, {m} // {p}) = {rounds} rounds "
          f"(torch's ScheduleInterleaved1F1B refuses it too)")
    per_round = m // rounds
    total = m * v

    devices = []
    for d in range(p):
        next_f = [0] * v  # per chunk: its next micro-batch, forwards and backwards in order
        next_b = [0] * v

        def f(k: int) -> Op:
            c = (k // per_round) % v
            next_f[c] += 1
            return _fwd(next_f[c] - 1, stage_on(d, c, p), p)

        def b(k: int) -> Op:
            c = v - 1 - (k // per_round) % v
            next_b[c] += 1
            return _bwd(next_b[c] - 1, stage_on(d, c, p), p)

        warmup = min((v - 1) * per_round + 2 * (p - 1 - d), total)
        ops = [f(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops.append(f(warmup + k))
            ops.append(b(k))
        ops += [b(k) for k in range(total - warmup, total)]
        devices.append(tuple(ops))
    return PipelineOrder("interleaved", p, m, v, tuple(devices))


def zb_h1(stages: int, micro_batches: int, chunks: int = 1) -> PipelineOrder:
    """ZB-H1 (zero bubble, Qi et al. 2023): 1F1B with the backward split into B and W.

    Device ``d`` keeps 1F1B's warm-up and its forward/B pairs, but runs each weight gradient ``d``
    micro-batches late, so the deferred W passes fill the tail where 1F1B waits for backwards. In-flight
    activations (forwards whose W has not run) stay at most ``p``, the peak of 1F1B.
    """
    stages, micro_batches = _check_common("zb-h1", stages, micro_batches)
    _need(_count("zb-h1", "chunks", chunks) == 1, "zb-h1: has one model chunk per device")
    devices = []
    for d in range(stages):
        warmup = min(stages - d - 1, micro_batches)
        ops: list[Op] = [_fwd(j, d, stages) for j in range(warmup)]
        next_w = 0

        def weights_up_to(k: int) -> list[Op]:
            nonlocal next_w
            out = []
            while next_w <= k:
                out.append(_op(WEIGHT, next_w, d, stages))
                next_w += 1
            return out

        for j in range(micro_batches):
            if warmup + j < micro_batches:
                ops.append(_fwd(warmup + j, d, stages))
            ops.append(_bwd(j, d, stages))
            ops += weights_up_to(j - d)
        ops += weights_up_to(micro_batches - 1)
        devices.append(tuple(ops))
    return PipelineOrder("zb-h1", stages, micro_batches, 1, tuple(devices), split_backward=True)


def zb_v(stages: int, micro_batches: int, chunks: int = 2) -> PipelineOrder:
    """ZB-V (zero bubble V, Qi et al. 2023, section 6): two model chunks per device in a V, the backward
    split into B and W.

    Device ``d`` holds virtual stage ``d`` (chunk 0, on the way down) and ``2p - 1 - d`` (chunk 1, on
    the way back), so the first device starts and ends every micro-batch and the last one turns it
    round locally. Each (kind, chunk) stream of a device runs its micro-batches in order; the device
    interleaves the streams in three phases:

    - warm-up: ``2 (p - d) - 1`` chunk-0 forwards (as many as fit while micro-batch 0 goes down the V
      from this device and comes back to it), then ``d`` pairs of chunk-1 and chunk-0 forwards, then ``p - d``
      chunk-1 F, B, W triples: the first backwards, each with its W at once, as nothing else is ready;
    - steady state: rounds of chunk 0's F, B, W then chunk 1's F, B, W, equal work on both chunks, so
      activations stay bounded (chunk 0 stops taking forwards once all are in);
    - cool-down: the B passes first (they are on the critical path to the devices above), ``d`` chunk-0
      and chunk-1 pairs, then ``p - d`` chunk-0 B passes each with a deferred chunk-0 W; the W passes
      still owed fill the drain: chunk 1's, then chunk 0's.

    This is torch's ``ScheduleZBVZeroBubble`` order, and like torch any ``m >= 1`` works: below the
    ``2p - 1`` micro-batches the warm-up assumes, the order is built for ``2p - 1`` and the operations
    of the missing micro-batches are left out.
    """
    stages, micro_batches = _check_common("zb-v", stages, micro_batches)
    _need(_count("zb-v", "chunks", chunks) == 2, "zb-v: has exactly 2 model chunks per device (a V)")
    p, m = stages, micro_batches
    n = max(2 * p - 1, m)
    devices = []
    for d in range(p):
        f0, b0, w0 = (FORWARD, 0), (BACKWARD, 0), (WEIGHT, 0)  # (kind, chunk) streams
        f1, b1, w1 = (FORWARD, 1), (BACKWARD, 1), (WEIGHT, 1)
        slots = [f0] * (2 * (p - d) - 1) + [f1, f0] * d + [f1, b1, w1] * (p - d)
        for k in range(n - p):  # chunk 1 catches up with chunk 0, whose last p - 1 - d rounds take no forward
            slots += ([f0] if k < n - 2 * p + 1 + d else []) + [b0, w0, f1, b1, w1]
        slots += [b0, b1] * d + [b0, w0] * (p - d) + [w1] * d + [w0] * d
        taken: dict[tuple[str, int], int] = {}
        ops = []
        for kind, c in slots:
            j = taken[kind, c] = taken.get((kind, c), -1) + 1
            if j < m:
                ops.append(_op(kind, j, stage_on(d, c, p, V), p))
        devices.append(tuple(ops))
    return PipelineOrder("zb-v", p, m, 2, tuple(devices), split_backward=True, layout=V)


def dualpipev(stages: int, micro_batches: int, chunks: int = 2) -> PipelineOrder:
    """DualPipeV (DeepSeek-V3 report's DualPipe, folded into a V as torch's ``ScheduleDualPipeV`` runs it):
    ZB-V's two chunks per device in a V, with the steady state made of overlapped pairs.

    Device ``d`` holds virtual stage ``d`` (chunk 0, down) and ``2p - 1 - d`` (chunk 1, back up), as in
    :func:`zb_v`. DualPipe's idea is to run a forward of one micro-batch and a whole backward of another
    as one overlapped call (the computation of each hides the communication of the other), and to split
    backwards into B and W only where a deferred W fills a bubble. Each (kind, chunk) stream runs its
    micro-batches in order; with ``m`` micro-batches, device ``d`` runs eight phases:

    1. ``2 (p - 1 - d)`` chunk-0 forwards, then 2. ``d + 1`` pairs of chunk-0 and chunk-1 forwards: the
       V fills;
    3. ``p - 1 - d`` rounds of a chunk-1 B, its W at once, a chunk-1 forward: the first backwards, split
       so that the input gradient leaves before the W (zero bubble);
    4. the steady state, ``m - 2p + d + 1`` rounds of two overlapped pairs: (chunk-0 forward, chunk-1 full
       backward), then (chunk-1 forward, chunk-0 full backward). On the last device the first round's
       first pair runs as two calls: its forward feeds the device's own chunk 1, which must not wait
       for the backward;
    5. ``p - 1 - d`` rounds of a chunk-1 full backward and an overlapped (chunk-1 forward, chunk-0 full
       backward): chunk 0 has no forwards left;
    6. ``d + 1`` rounds of a chunk-1 and a chunk-0 backward, full ones in the first half and split ones
       from round ``(d + 1) // 2`` on (from that round's chunk-1 backward on odd devices, from its
       chunk-0 one on even ones);
    7. ``p - 1 - d`` rounds of one deferred W and a split chunk-0 B; 8. the ``d + 1`` W passes still owed.

    A deferred W is always the oldest split B's of the device (either chunk), so each chunk's W passes
    run in micro-batch order too. A full backward is a B directly followed by its own W, fused into one
    call with it (:attr:`PipelineOrder.fused`), and so is an overlapped pair (its forward, then the
    backward's B and W): the outputs of a fused call leave when it ends, as torch sends them.

    torch needs ``m >= 2p`` micro-batches (the steady state of the first device is ``m - 2p + 1``
    rounds); fewer are refused.
    """
    stages, micro_batches = _check_common("dualpipev", stages, micro_batches)
    _need(_count("dualpipev", "chunks", chunks) == 2, "dualpipev: has exactly 2 model chunks per device (a V)")
    p, m = stages, micro_batches
    _need(m >= 2 * p, f"dualpipev: needs micro-batches >= 2 x stages = {2 * p} (one per virtual stage), got {m} "
                      f"(torch's ScheduleDualPipeV refuses it too)")
    devices: list[tuple[Op, ...]] = []
    fused: list[tuple[Op, ...]] = []
    for d in range(p):
        ops: list[Op] = []
        taken: dict[tuple[str, int], int] = {}  # (kind, chunk) -> micro-batches taken so far
        pending: list[Op] = []  # the W passes of split B passes, oldest first

        def take(kind: str, c: int) -> Op:
            j = taken[kind, c] = taken.get((kind, c), -1) + 1
            return _op(kind, j, stage_on(d, c, p, V), p)

        def forward(c: int) -> list[Op]:
            return [take(FORWARD, c)]

        def split(c: int) -> list[Op]:
            b = take(BACKWARD, c)
            pending.append(_op(WEIGHT, b.micro_batch, b.stage, p))
            return [b]

        def full(c: int) -> list[Op]:
            b = take(BACKWARD, c)
            return [b, _op(WEIGHT, b.micro_batch, b.stage, p)]

        def deferred_w() -> list[Op]:
            return [pending.pop(0)]

        def call(run: list[Op], one: bool = True) -> None:
            ops.extend(run)
            if one and len(run) > 1:
                fused.append(tuple(run))

        tail = p - 1 - d
        for _ in range(2 * tail):
            call(forward(0))
        for _ in range(d + 1):
            call(forward(0))
            call(forward(1))
        for _ in range(tail):
            call(split(1))
            call(deferred_w())
            call(forward(1))
        for i in range(m - 2 * p + d + 1):
            if i == 0 and d == p - 1:
                call(forward(0))
                call(full(1))
            else:
                call(forward(0) + full(1))
            call(forward(1) + full(0))
        for _ in range(tail):
            call(full(1))
            call(forward(1) + full(0))
        middle = (d + 1) // 2
        for i in range(d + 1):  # odd devices split from the middle round's chunk-1 B, even ones from its chunk-0 B
            call(split(1) if i > middle or (i == middle and d % 2) else full(1))
            call(split(0) if i >= middle else full(0))
        for _ in range(tail):
            call(deferred_w())
            call(split(0))
        for _ in range(d + 1):
            call(deferred_w())
        devices.append(tuple(ops))
    return PipelineOrder("dualpipev", p, m, 2, tuple(devices), split_backward=True, layout=V, fused=tuple(fused))


Durations = Callable[[Op], int]
"""Time of one operation (any unit); the generators that depend on costs take one."""


def chimera(stages: int, micro_batches: int, chunks: int = 1, durations: Durations | None = None) -> PipelineOrder:
    """Chimera (Li & Hoefler, SC'21): two pipelines in opposite directions over the same devices.

    Device ``d`` holds stage ``d`` of the down pipe and stage ``p - 1 - d`` of the up pipe. Micro-batches
    are dealt in units of ``p``: the first half of each unit goes down, the second half up.

    The paper draws its orders by hand; here the order on each device comes from list scheduling the
    step under ``durations`` (default: forward = backward = 1, the paper's own assumption), with two
    rules, keeping the shorter step:

    - *furthest along first*: a free device runs the ready operation whose micro-batch has done the most
      of its forward-then-backward chain. With equal forward and backward times this gives the paper's
      D - 2 idle units per device for any number of basic units, and holds about as many activations
      as 1F1B;
    - *forwards first*: a free device runs the ready forward that became ready first, else the ready
      backward that did. When backwards take longer than forwards it removes the intermediate
      bubbles of concatenated units (the paper's concern in its section on more micro-batches), at the
      memory cost of keeping forwards ahead.

    Forwards of one pipe always run in micro-batch order on each device.
    """
    stages, micro_batches = _check_common("chimera", stages, micro_batches)
    _need(_count("chimera", "chunks", chunks) == 1, "chimera: has one model chunk per device and pipe")
    _need(stages % 2 == 0, f"chimera: needs an even number of stages, got {stages}")
    _need(micro_batches % 2 == 0, f"chimera: needs an even number of micro-batches (half per pipe), got {micro_batches}")
    p, m = stages, micro_batches
    down: list[int] = []
    for unit in range(0, m, p):
        size = min(p, m - unit)  # the last unit may be short; it is split in halves too
        down += range(unit, unit + size // 2)
    up = [j for j in range(m) if j not in set(down)]
    order = {DOWN: down, UP: up}
    shell = PipelineOrder("chimera", p, m, 1, tuple(() for _ in range(p)))
    cost = durations or (lambda op: 1)
    candidates = [_list_order(shell, order, cost, rule) for rule in (_furthest_along_first, _forwards_first)]
    _, devices = min(candidates, key=lambda c: c[0])  # ties keep the first rule
    return PipelineOrder("chimera", p, m, 1, devices)


Priority = Callable[[Op, int, int, int], tuple]
"""(operation, its chain progress, when its inputs were ready, its micro-batch's rank) -> sort key."""


def _furthest_along_first(op: Op, progress: int, ready: int, rank: int) -> tuple:
    return (-progress, rank, op.pipe)


def _forwards_first(op: Op, progress: int, ready: int, rank: int) -> tuple:
    return (op.kind != FORWARD, ready, rank, op.pipe)


def _list_order(
    shell: PipelineOrder,
    order: dict[int, list[int]],
    cost: Durations,
    priority: Priority,
) -> tuple[int, tuple[tuple[Op, ...], ...]]:
    """Greedy list scheduling (Chimera): the step's makespan and the order it gives each device.

    Whenever a device is free it starts the ready operation that ``priority`` ranks first; a forward is
    ready only when it is its pipe's next on that device. Progress along a micro-batch's chain counts
    forwards by stage, then backwards from the last stage down.
    """
    p, S = shell.stages, shell.virtual_stages
    ops_of: list[list[Op]] = [[] for _ in range(p)]
    for pipe, mbs in order.items():
        for j in mbs:
            for s in range(S):
                d = shell.device_of(s, pipe)
                ops_of[d] += [_fwd(j, s, p, pipe), _bwd(j, s, p, pipe)]
    rank = {pipe: {j: i for i, j in enumerate(mbs)} for pipe, mbs in order.items()}
    end: dict[tuple[str, int, int, int], int] = {}
    pending = [set(o.key() for o in ops) for ops in ops_of]
    by_key = {o.key(): o for ops in ops_of for o in ops}
    free = [0] * p
    issued = {(d, pipe): 0 for d in range(p) for pipe in order}
    out: list[list[Op]] = [[] for _ in range(p)]
    total = sum(len(x) for x in pending)
    done = 0
    events: list[int] = [0]
    while done < total:
        if not events:  # pragma: no cover - the rules above always make progress
            raise AssertionError("list scheduling stalled")
        t = heapq.heappop(events)
        while events and events[0] == t:
            heapq.heappop(events)
        for d in range(p):
            if free[d] > t:
                continue
            best = None
            for k in pending[d]:
                op = by_key[k]
                deps = shell.dependencies(op)
                if any(dep.key() not in end or end[dep.key()] > t for dep in deps):
                    continue
                if op.kind == FORWARD and rank[op.pipe][op.micro_batch] != issued[(d, op.pipe)]:
                    continue
                ready = max([end[dep.key()] for dep in deps], default=0)
                progress = op.stage if op.kind == FORWARD else 2 * S - 1 - op.stage
                prio = priority(op, progress, ready, rank[op.pipe][op.micro_batch])
                if best is None or prio < best[0]:
                    best = (prio, op)
            if best is None:
                continue
            op = best[1]
            pending[d].discard(op.key())
            end[op.key()] = free[d] = t + cost(op)
            heapq.heappush(events, free[d])
            if op.kind == FORWARD:
                issued[(d, op.pipe)] += 1
            out[d].append(op)
            done += 1
    return max(end.values()), tuple(tuple(ops) for ops in out)


GENERATORS: dict[str, Callable[..., PipelineOrder]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
    "chimera": chimera,
}
ALIASES = {"interleaved-1f1b": "interleaved", "zbh1": "zb-h1", "zb_h1": "zb-h1", "zbv": "zb-v", "zb_v": "zb-v",
           "dapple": "1f1b", "pipedream-flush": "1f1b", "dual-pipe-v": "dualpipev", "dualpipe-v": "dualpipev",
           "dualpipe_v": "dualpipev"}
DEFAULT_CHUNKS = {"interleaved": 2, "zb-v": 2, "dualpipev": 2}
"""Model chunks per device of the orders that have more than one by default."""
V_ORDERS = ("zb-v", "dualpipev")
"""The orders whose two chunks sit in a V (:data:`V`); the rest use the loop (:data:`LOOP`)."""


def order_names() -> list[str]:
    """The pipeline orders' names, as ``--order`` and a cost model's ``order`` take them."""
    return list(GENERATORS)


def canonical_name(name: str) -> str:
    """The generator name for ``name`` (aliases and case accepted)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GENERATORS:
        raise InputError(None, f"unknown pipeline order '{name}' (known: {', '.join(GENERATORS)})")
    return key


def default_chunks(name: str) -> int:
    """Model chunks per device the named order has unless told otherwise: 2 for interleaved, zb-v and
    dualpipev, 1 for the rest."""
    return DEFAULT_CHUNKS.get(canonical_name(name), 1)


def layout_of(name: str) -> str:
    """Where the named order puts its model chunks: :data:`V` for zb-v and dualpipev, :data:`LOOP` for the
    rest."""
    return V if canonical_name(name) in V_ORDERS else LOOP


def generate(
    name: str, stages: int, micro_batches: int, chunks: int | None = None, durations: Durations | None = None,
) -> PipelineOrder:
    """Build the named order; ``chunks`` defaults to :func:`default_chunks` (2 for interleaved, zb-v and
    dualpipev, 1 otherwise).

    ``durations`` (operation -> time) is used by the generators whose order depends on costs (Chimera);
    the others ignore it.
    """
    key = canonical_name(name)
    if chunks is None:
        chunks = default_chunks(key)
    if key == "chimera":
        return chimera(stages, micro_batches, chunks, durations)
    return GENERATORS[key](stages, micro_batches, chunks)


def iter_ops(order: PipelineOrder) -> Iterator[tuple[int, Op]]:
    for d, ops in enumerate(order.devices):
        for op in ops:
            yield d, op
