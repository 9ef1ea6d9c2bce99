"""Simulate a pipeline step from a pipeline order and a cost model, and write it as profiled timelines.

The simulation is event-free list execution: each device runs its operations in the pipeline order;
an operation starts when its device is free and all its inputs have arrived (a dependency on another
device arrives ``latency`` after it ends; :meth:`~pipefisher.pipeline_orders.PipelineOrder.dependencies`
names them, with a fused call's end in place of an operation inside it). Times are integer nanoseconds, starting at 0.

After the pipeline, each node runs the naive K-FAC phase a real profiled step has: covariance A and B
of every module (over all micro-batches), then the all-reduce of every factor, then every inverse;
then, where the cost model gives them, the step's end as the runtime profiles it (the curvature
refresh comes before the update there too): one :data:`~pipefisher.schedule.timeline.UPDATE_KEY` interval of
the node's layer copies x (``block_prec_ms`` + ``block_update_ms``), with the preconditioning
(layer copies x ``block_prec_ms``) as a :data:`~pipefisher.schedule.timeline.PRECONDITION_KEY` interval at its
start, inside it. A model without either writes neither key. The result is one ``dict[str, list[(start, end)]]`` per node in the profiled format, so
``pipefisher schedule`` packs it exactly like a profile.

Mapping choices (see also the format spec):

- Interleaved orders (the chunk format of the format spec): chunk 0's operations are
  ``call_forward``/``call_backward``, chunk j's (j >= 1) ``call_forward:chunk<j>``/``call_backward:chunk<j>``,
  one interval per micro-batch in execution order, so each chunk has ``m`` of each; the K-FAC keys of
  chunk j's layers end in ``:chunk<j>`` (none for chunk 0), each covering that chunk's ``m`` micro-batches.
- ZB-V: two chunks per device as interleaved (the chunk format, costs of two chunks per device), but
  placed in a V (:func:`pipefisher.pipeline_orders.stage_on`): chunk 1 of node d holds virtual stage
  ``2p - 1 - d``, so its ``:chunk1`` K-FAC keys are that stage's layers, and the last node hands its
  chunk 0's output to its own chunk 1 (no latency). Its W passes are written as ZB-H1's.
- ZB-H1 (and ZB-V): ``call_backward`` is the input-gradient pass B. A weight-gradient pass W that directly
  follows its own B is merged into that interval (so node 0 looks like 1F1B); a deferred W is written
  under :func:`pipefisher.schedule.timeline.weight_key` (``call_backward:weight`` plus the pipe's or chunk's
  suffix): pipeline work, which every policy and ``validate`` keep K-FAC out of (the problem's one
  list of pipeline keys), but not a micro-batch (m counts forwards) and not the backward that factor
  B's covariance pieces follow (that is B).
- DualPipeV: ZB-V's layout and keys. Its full backwards (a B and its own W, one fused call) come out
  as one ``call_backward`` interval like any W right after its B; an overlapped pair is its forward's
  interval, then its backward's. A fused call's outputs leave when it ends
  (:meth:`~pipefisher.pipeline_orders.PipelineOrder.dependencies`), so a pair's forward feeds the
  next stage only after the pair's backward, as torch's ``ScheduleDualPipeV`` sends it.
- Chimera: up-pipe operations are ``call_forward:up_pipe``/``call_backward:up_pipe``; the up-pipe copy
  of a layer has its K-FAC keys suffixed ``:up_pipe`` and covers that pipe's micro-batches.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import (BACKWARD, DOWN, FORWARD, UP, WEIGHT, Op, PipelineOrder, canonical_name,
                                        default_chunks, generate, stage_on)
from pipefisher.schedule.timeline import BACKWARD as BACKWARD_KEY, FORWARD as FORWARD_KEY
from pipefisher.sim.costs import NS_PER_MS, CostModel, ModuleCost
from pipefisher.schedule.timeline import (PRECONDITION_KEY, UP_SUFFIX, UPDATE_KEY, chunk_suffix, pipe_key, split_evenly,
                                          weight_key)

Timelines = list[dict[str, list[tuple[int, int]]]]


@dataclass(frozen=True)
class PipeCosts:
    """Per-micro-batch time of each virtual stage of a pipe, and the point-to-point latency (ns)."""

    forward_ns: tuple[int, ...]
    backward_ns: tuple[int, ...]
    latency_ns: int = 0
    input_grad_fraction: float = 0.5

    @classmethod
    def uniform(cls, stages: int, forward_ns: int, backward_ns: int, latency_ns: int = 0,
                input_grad_fraction: float = 0.5) -> "PipeCosts":
        return cls((forward_ns,) * stages, (backward_ns,) * stages, latency_ns, input_grad_fraction)

    def duration(self, op: Op, split: bool) -> int:
        if op.kind == FORWARD:
            return self.forward_ns[op.stage]
        full = self.backward_ns[op.stage]
        if not split:
            return full
        b = round(full * self.input_grad_fraction)
        return b if op.kind == BACKWARD else full - b


@dataclass(frozen=True)
class Timed:
    op: Op
    start: int
    end: int


@dataclass(frozen=True)
class SimResult:
    """When every operation of a pipeline step runs, per device in execution order."""

    order: PipelineOrder
    devices: tuple[tuple[Timed, ...], ...]

    @property
    def makespan(self) -> int:
        """From time 0 (the first forward) to the end of the last operation on any device."""
        return max((t.end for ops in self.devices for t in ops), default=0)

    def busy(self, device: int) -> int:
        return sum(t.end - t.start for t in self.devices[device])

    def idle(self, device: int) -> int:
        """Idle time of one device within ``[0, makespan]``."""
        return self.makespan - self.busy(device)

    @property
    def bubble_fraction(self) -> float:
        """Idle device-time over all device-time of the step: ``sum_d idle_d / (p * makespan)``.

        Time runs from the first forward (0) to the last operation of any device, on every device.
        """
        total = self.makespan * len(self.devices)
        return sum(self.idle(d) for d in range(len(self.devices))) / total if total else 0.0


def pipe_costs(model: CostModel, chunks: int = 1) -> PipeCosts:
    """The model's per-virtual-stage costs when each device holds ``chunks`` model chunks."""
    fwd, bwd = model.stage_times_ns(model.stages * chunks, chunks)
    return PipeCosts(fwd, bwd, round(model.latency_ms * NS_PER_MS), model.backward_input_fraction)


def simulate(order: PipelineOrder, costs: PipeCosts) -> SimResult:
    """Run the pipeline order on the cost model; raise if the order can deadlock."""
    if len(costs.forward_ns) < order.virtual_stages or len(costs.backward_ns) < order.virtual_stages:
        raise InputError(None, f"costs cover {len(costs.forward_ns)} stages, the order has {order.virtual_stages}")
    p = order.stages
    ends: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # key -> (end, device)
    pos = [0] * p
    free = [0] * p
    out: list[list[Timed]] = [[] for _ in range(p)]
    remaining = sum(len(ops) for ops in order.devices)
    while remaining:
        progressed = False
        for d in range(p):
            ops = order.devices[d]
            while pos[d] < len(ops):
                op = ops[pos[d]]
                ready = free[d]
                blocked = False
                for dep in order.dependencies(op):
                    got = ends.get(dep.key())
                    if got is None:
                        blocked = True
                        break
                    end, dev = got
                    ready = max(ready, end + (costs.latency_ns if dev != d else 0))
                if blocked:
                    break
                end = ready + costs.duration(op, order.split_backward)
                ends[op.key()] = (end, d)
                out[d].append(Timed(op, ready, end))
                free[d] = end
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [f"device {d} at {order.devices[d][pos[d]]}" for d in range(p) if pos[d] < len(order.devices[d])]
            raise InputError(None, f"pipeline order '{order.name}' deadlocks: {'; '.join(waiting[:3])}")
    return SimResult(order, tuple(tuple(x) for x in out))


# ----------------------------------------------------------------------------------------------------
# Timelines


@dataclass(frozen=True)
class LayerCopy:
    """One copy of a transformer layer on a node: which layer, which pipe, how many micro-batches, and
    which model chunk of the node holds it (interleaved orders; 0 otherwise)."""

    layer: int
    up_pipe: bool
    micro_batches: int
    chunk: int = 0


def node_layers(model: CostModel, order: PipelineOrder) -> list[list[LayerCopy]]:
    """The layer copies each node holds: its chunks' layers (down pipe, chunk c of node d being virtual
    stage :func:`~pipefisher.pipeline_orders.stage_on` in the order's layout), then its up-pipe
    stage's layers."""
    S = order.virtual_stages
    down_mb = sum(1 for ops in order.devices for op in ops if op.kind == FORWARD and op.pipe == DOWN and op.stage == 0)
    up_mb = sum(1 for ops in order.devices for op in ops if op.kind == FORWARD and op.pipe == UP and op.stage == 0)
    out: list[list[LayerCopy]] = []
    for d in range(order.stages):
        copies = [LayerCopy(layer, False, down_mb, c) for c in range(order.chunks)
                  for layer in model.stage_layers(stage_on(d, c, order.stages, order.layout), S)]
        if up_mb:
            copies += [LayerCopy(layer, True, up_mb) for layer in model.stage_layers(order.stages - 1 - d, S)]
        out.append(copies)
    return out


def _pipeline_keys(result: SimResult, device: int) -> dict[str, list[tuple[int, int]]]:
    entries: dict[str, list[tuple[int, int]]] = {FORWARD_KEY: [], BACKWARD_KEY: []}
    ops = result.devices[device]
    i = 0
    while i < len(ops):
        t = ops[i]
        up, chunk = t.op.pipe == UP, (0 if t.op.pipe == UP else t.op.chunk)
        if t.op.kind == FORWARD:
            entries.setdefault(pipe_key(FORWARD_KEY, up, chunk), []).append((t.start, t.end))
        elif t.op.kind == BACKWARD:
            end = t.end
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            if nxt is not None and nxt.op.kind == WEIGHT and nxt.op.micro_batch == t.op.micro_batch \
                    and nxt.op.stage == t.op.stage and nxt.op.pipe == t.op.pipe:
                end = nxt.end  # W right after its own B: one backward interval
                i += 1
            entries.setdefault(pipe_key(BACKWARD_KEY, up, chunk), []).append((t.start, end))
        else:
            entries.setdefault(weight_key(up, chunk), []).append((t.start, t.end))
        i += 1
    return entries


def _ns(ms: float) -> int:
    return round(ms * NS_PER_MS)


def timelines_from_result(result: SimResult, model: CostModel) -> Timelines:
    """Per-node profiled timelines: the simulated pipeline, then naive K-FAC, then the update, one step."""
    modules: Sequence[ModuleCost] = model.module_costs()
    layers = node_layers(model, result.order)
    out: Timelines = []
    for d in range(result.order.stages):
        entries = _pipeline_keys(result, d)
        t = max((x.end for x in result.devices[d]), default=0)
        names: list[tuple[str, ModuleCost, LayerCopy]] = []
        for copy in layers[d]:
            for m in modules:
                name = model.module_template.format(layer=copy.layer, module=m.name)
                names.append((name + (UP_SUFFIX if copy.up_pipe else chunk_suffix(copy.chunk)), m, copy))
        has_sync = any(m.sync_A_ms > 0 or m.sync_B_ms > 0 for m in modules)
        phases: list[tuple[str, str]] = [("cov_kron_A", "cov_A_ms"), ("cov_kron_B", "cov_B_ms")]
        later = ([("sync_kron_A", "sync_A_ms"), ("sync_kron_B", "sync_B_ms")] if has_sync else []) + \
            [("inv_kron_A", "inv_A_ms"), ("inv_kron_B", "inv_B_ms")]
        for name, m, copy in names:  # covariance of every module, right after the pipeline
            for kind, attr in phases:
                dur = _ns(getattr(m, attr)) * copy.micro_batches
                entries[f"{kind}:{name}"] = [(t, t + dur)]
                t += dur
        for group in (later[:-2], later[-2:]):  # then every all-reduce, then every inverse
            for name, m, copy in names:
                for kind, attr in group:
                    dur = _ns(getattr(m, attr))
                    # an inverse runs in the model's refresh pieces: equal shares, back to back
                    shares = split_evenly(dur, model.pieces_of(getattr(m, attr))) if kind.startswith("inv") else (dur,)
                    entries[f"{kind}:{name}"] = []
                    for share in shares:
                        entries[f"{kind}:{name}"].append((t, t + share))
                        t += share
        precondition, update = model.end_of_step_ns(len(layers[d]))
        if precondition or update:
            entries[PRECONDITION_KEY] = [(t, t + precondition)]
            entries[UPDATE_KEY] = [(t, t + precondition + update)]
            t += precondition + update
        entries["start_end"] = [(0, t)]
        out.append(entries)
    return out


def simulate_timelines(
    model: CostModel,
    order: str | None = None,
    stages: int | None = None,
    micro_batches: int | None = None,
    chunks: int | None = None,
) -> tuple[Timelines, SimResult]:
    """Simulate ``model`` (its own settings, overridden by the arguments); returns timelines and times.

    The model's own ``chunks`` applies to the interleaved order only; an explicit ``chunks`` argument
    applies to any order (and is refused by those that cannot have that many). Without either, each
    order has its :func:`~pipefisher.pipeline_orders.default_chunks` (2 for interleaved, zb-v and
    dualpipev).
    """
    model = model.replace(order=order, stages=stages, micro_batches=micro_batches, chunks=chunks)
    name = canonical_name(model.order)
    use_chunks = chunks if chunks is not None else (model.chunks if name == "interleaved" else None)
    costs = pipe_costs(model, use_chunks or default_chunks(name))
    pipeline = generate(name, model.stages, model.micro_batches, use_chunks, lambda op: costs.duration(op, False))
    result = simulate(pipeline, costs)
    return timelines_from_result(result, model), result


def default_prefix(model_name: str, order: PipelineOrder) -> str:
    """``<model>_<order>_p<stages>[_v<chunks>]_m<micro-batches>``: simulations of other shapes get
    other file names, so one folder can hold several and ``OUT/*.pickle`` never mixes two of them."""
    chunks = f"_v{order.chunks}" if order.chunks > 1 else ""
    return f"{model_name}_{order.name}_p{order.stages}{chunks}_m{order.micro_batches}"


_DEFAULT_PREFIX = re.compile(
    r"^(?P<model>.+?)_(?P<order>[A-Za-z0-9-]+)(?:_p(?P<stages>\d+))?(?:_v(?P<chunks>\d+))?_m(?P<m>\d+)$")


def parse_default_prefix(prefix: str) -> dict[str, str | None] | None:
    """What a :func:`default_prefix` says (model, order, stages, chunks, m), or None for other names.
    Stages and chunks may be missing (None): older simulations named files ``<model>_<order>_m<m>``."""
    m = _DEFAULT_PREFIX.match(prefix)
    return m.groupdict() if m else None


def node_file(out_dir: str, prefix: str, node: int) -> str:
    return os.path.join(out_dir, f"{prefix}_node{node}_timeline.pickle")


def stale_node_files(out_dir: str | os.PathLike[str], prefix: str, nodes: int) -> list[str]:
    """Node files of this prefix beyond ``nodes``: left by an earlier, larger job written under it."""
    out_dir = os.fspath(out_dir)
    if not os.path.isdir(out_dir):
        return []
    pattern = re.compile(re.escape(prefix) + r"_node(\d+)_timeline\.pickle$")
    found = [(int(m.group(1)), e) for e in os.listdir(out_dir) if (m := pattern.match(e))]
    return [os.path.join(out_dir, e) for i, e in sorted(found) if i >= nodes]


def write_timelines(out_dir: str | os.PathLike[str], prefix: str, dicts: Timelines) -> list[str]:
    """Write ``{prefix}_node{i}_timeline.pickle`` per node (atomically); returns the paths.

    Node files of the same prefix beyond this job's nodes (an earlier run with more stages) are removed,
    so the folder holds exactly this job under ``prefix`` and a glob of it cannot pick up a stale node.
    """
    from pipefisher.safe_io import dump_pickle_atomic

    out_dir = os.fspath(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise InputError(out_dir, f"cannot be created ({err.strerror or err})") from None
    paths = []
    for i, entries in enumerate(dicts):
        path = node_file(out_dir, prefix, i)
        dump_pickle_atomic(path, entries)
        paths.append(path)
    for stale in stale_node_files(out_dir, prefix, len(dicts)):
        try:
            os.remove(stale)
        except OSError as err:
            raise InputError(stale, f"is a stale node file of an earlier job and cannot be removed "
                                    f"({err.strerror or err})") from None
    return paths
