"""Every private name of ``torch.distributed.pipelining`` that pipefisher uses, in one place.

The torch engine (:mod:`pipefisher.runtime.pipeline.torch_engine`) runs torch's ``PipelineStage``\\ s
through torch's ``_PipelineScheduleRuntime``: torch walks its per-rank list of ``_Action``\\ s (compute,
send, receive, ``REDUCE_GRAD``) and calls, for each action type registered with
``register_custom_function``, our function instead of its own handler. Its own handler is a closure
inside ``_step_microbatches`` that nothing outside can call or wrap, so the compute handlers below
(:class:`Runtime`) redo the few lines it runs around the stage's own methods: wait the receive torch
posted, ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``, the loss, and
the V's hand-off between two stages of one rank. Nothing of torch's scheduling is redone: the orders
come from torch's generators, the sends and receives from its lowering (``_prepare_schedule_with_comms``).

This module is the only one besides the engine that imports ``torch.distributed.pipelining``, and the
only one that names a private attribute of it. :func:`check_torch` checks, before anything runs, that
torch is in the supported range (:data:`SUPPORTED`, the range ``setup.cfg``'s ``torch-pipelining``
extra states) and that every name and signature used here is still there; what moved is said in one
line. The rest of pipefisher gets plain data: per-rank compute orders as :class:`Compute` tuples.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, ContextManager, Sequence

import torch

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import BACKWARD, FORWARD, WEIGHT, PassKind
from pipefisher.runtime.job.config import torch_rounds

SUPPORTED = ((2, 13), (2, 14))
"""The torch versions the torch engine supports: ``>= 2.13, < 2.14`` (``setup.cfg``: ``torch-pipelining``)."""
SUPPORTED_TEXT = f">={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]}"

INPUT = "I"
"""A backward that computes the input gradient only (torch's ``BACKWARD_INPUT``); :data:`BACKWARD` is
a full backward (torch's ``FULL_BACKWARD``), :data:`FORWARD` and :data:`WEIGHT` as in our orders."""

SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "zb-v": "ScheduleZBVZeroBubble", "zb-h1": "ScheduleInterleavedZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}
"""Our pipeline orders and the torch schedule class whose per-rank order each one is (zb-h1: torch's
interleaved zero-bubble schedule with one stage per rank, whose order is ZB-H1's)."""

_MODULE = "torch.distributed.pipelining.schedules"
# (module, dotted name) of everything used; a moved one fails check_torch with its name
_NAMES = [
    (_MODULE, "_Action"), (_MODULE, "_ComputationType"), (_MODULE, "_PipelineScheduleRuntime"),
    (_MODULE, "_wait_batch_p2p"), (_MODULE, "_ComputationType.FORWARD"),
    (_MODULE, "_ComputationType.FULL_BACKWARD"), (_MODULE, "_ComputationType.BACKWARD_INPUT"),
    (_MODULE, "_ComputationType.BACKWARD_WEIGHT"), (_MODULE, "_ComputationType.REDUCE_GRAD"),
    (_MODULE, "_ComputationType.OVERLAP_F_B"),
    (_MODULE, "_PipelineScheduleRuntime.register_custom_function"),
    (_MODULE, "_PipelineScheduleRuntime._prepare_schedule_with_comms"),
    (_MODULE, "_PipelineScheduleRuntime._maybe_compute_loss"),
    (_MODULE, "_PipelineScheduleRuntime._maybe_get_loss"), (_MODULE, "Schedule1F1B"),
    (_MODULE, "Schedule1F1B._step_microbatches"), (_MODULE, "_batch_p2p"), (_MODULE, "ScheduleGPipe"),
    (_MODULE, "ScheduleGPipe._step_microbatches"),
    (_MODULE, "ScheduleInterleaved1F1B._calculate_single_rank_operations"),
    (_MODULE, "ScheduleZBVZeroBubble._calculate_single_rank_operations"),
    (_MODULE, "ScheduleInterleavedZeroBubble._calculate_single_rank_operations"),
    (_MODULE, "ScheduleDualPipeV._calculate_single_rank_operations"),
    ("torch.distributed.pipelining.stage", "PipelineStage"),
    ("torch.distributed.pipelining.stage", "PipelineStage.forward_one_chunk"),
    ("torch.distributed.pipelining.stage", "PipelineStage.backward_one_chunk"),
    ("torch.distributed.pipelining.stage", "PipelineStage.backward_weight_one_chunk"),
    ("torch.distributed.pipelining.stage", "PipelineStage.set_local_fwd_input"),
    ("torch.distributed.pipelining.stage", "PipelineStage.set_local_bwd_input"),
    ("torch.distributed.pipelining.stage", "PipelineStage.get_local_bwd_output"),
    ("torch.distributed.pipelining.stage", "PipelineStage.scale_grads"),
]
# the parameters the handlers pass by name (or position), by callable
_SIGNATURES = {
    "PipelineStage.forward_one_chunk": ("fwd_chunk_id", "args", "kwargs", "save_forward_output"),
    "PipelineStage.backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "PipelineStage.backward_weight_one_chunk": ("bwd_chunk_id", "last_backward"),
    "_PipelineScheduleRuntime.register_custom_function": ("computation_type", "custom_function"),
    "_PipelineScheduleRuntime._maybe_compute_loss": ("stage", "output", "target_mbs", "mb_index"),
    "_PipelineScheduleRuntime._maybe_get_loss": ("stage", "mb_index"),
    "_PipelineScheduleRuntime._prepare_schedule_with_comms": ("actions",),
}
# attributes of a runtime instance the handlers read (set in its __init__, checked on the instance)
_RUNTIME_ATTRIBUTES = ("fwd_recv_ops", "bwd_recv_ops", "backward_counter", "_n_microbatches", "rank", "_loss_fn",
                       "scale_grads")


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (default: the installed torch's)."""
    major, minor = (version or torch.__version__).split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _lookup(module: str, dotted: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def missing_names() -> list[str]:
    """What this module uses and the installed torch lacks: a name, or a parameter of a signature."""
    out = []
    for module, dotted in _NAMES:
        try:
            _lookup(module, dotted)
        except (ImportError, AttributeError):
            out.append(f"{module}.{dotted}")
    for dotted, params in _SIGNATURES.items():
        module = _MODULE if dotted.startswith("_Pipeline") else "torch.distributed.pipelining.stage"
        try:
            have = inspect.signature(_lookup(module, dotted)).parameters
        except (ImportError, AttributeError, TypeError, ValueError):
            continue  # reported above as a missing name
        lost = [p for p in params if p not in have]
        if lost:
            out.append(f"{module}.{dotted}({', '.join(lost)})")
    return out


def check_torch(where: str = "pipeline.engine torch") -> None:
    """Refuse, in one line, a torch outside :data:`SUPPORTED` or one whose private names moved."""
    have = torch_version()
    if not SUPPORTED[0] <= have < SUPPORTED[1]:
        raise InputError(None, f"{where} supports torch {SUPPORTED_TEXT} (its private pipelining API), "
                               f"not torch {torch.__version__}")
    if not torch.distributed.is_available():
        raise InputError(None, f"{where} needs torch.distributed, which this torch build lacks")
    lost = missing_names()
    if lost:
        raise InputError(None, f"{where}: torch {torch.__version__} lacks what it uses of "
                               f"torch.distributed.pipelining: {', '.join(lost)} (supported: torch {SUPPORTED_TEXT})")


def check_engine(cfg: Any) -> None:
    """:func:`check_torch` for a run config whose ``pipeline.engine`` is ``torch`` (the CLI calls it
    before any worker starts); nothing for the own engine."""
    if cfg.pipeline.engine == "torch":
        check_torch()


# ----------------------------------------------------------------------------------------------------
# Orders: torch's generators, run without process groups, as plain data


@dataclass(frozen=True)
class Compute:
    """One compute action of torch's order: ``kind`` (:data:`FORWARD`, :data:`BACKWARD` for a full
    backward, :data:`INPUT`, :data:`WEIGHT`), its stage index and its micro-batch."""

    kind: str
    stage: int
    micro_batch: int


def _schedules() -> Any:
    import torch.distributed.pipelining.schedules as schedules

    return schedules


def _kinds() -> dict[Any, str]:
    ct = _schedules()._ComputationType
    kinds = {getattr(ct, p.torch_name()): p.label for p in PassKind}
    return {**kinds, getattr(ct, PassKind.BACKWARD.torch_name(split=True)): INPUT}


def _grouped(actions: Sequence[Any]) -> list[list[Compute]]:
    """Compute actions in order, each as the computes it runs: bubbles (None) and non-compute actions
    left out, an OVERLAP_F_B as its sub-actions in their order, anything else as itself."""
    kinds, out = _kinds(), []
    overlap = _schedules()._ComputationType.OVERLAP_F_B
    for a in actions:
        if a is None:
            continue
        subs = a.sub_actions if a.computation_type == overlap else (a,)
        group = [Compute(kinds[s.computation_type], s.stage_index, s.microbatch_index)
                 for s in subs or () if s.computation_type in kinds]
        if group:
            out.append(group)
    return out


def _flatten(actions: Sequence[Any]) -> list[Compute]:
    """Compute actions in order, an OVERLAP_F_B as its sub-actions (:func:`_grouped`, flat)."""
    return [c for group in _grouped(actions) for c in group]


def inside_calls(actions: Sequence[Any], split: bool) -> set[int]:
    """The positions, in a rank's pipefisher pipeline calls (:func:`label_kinds` of each compute of
    ``actions``, that rank's compute-only list), of the calls that continue one of torch's actions: the
    second half of an overlapped pair, a full backward's W pass in an order that splits backwards.
    Torch sends such an action's outputs only when all of it has run."""
    inside, at = set(), 0
    for group in _grouped(actions):
        n = sum(len(label_kinds(c, split)) for c in group)
        inside.update(range(at + 1, at + n))
        at += n
    return inside


def torch_actions(kind: str, stages: int, micro_batches: int, chunks: int = 2) -> dict[int, list[Any]]:
    """Torch's compute-only ``_Action`` lists (with its ``None`` bubbles) of order ``kind`` per rank,
    from its schedule class's generator, without process groups (:data:`SCHEDULE_CLASSES`)."""
    if kind not in SCHEDULE_CLASSES:
        raise ValueError(f"torch has no schedule class for the pipeline order {kind!r} "
                         f"({', '.join(SCHEDULE_CLASSES)})")
    schedules = _schedules()
    cls = getattr(schedules, SCHEDULE_CLASSES[kind])
    m, p = micro_batches, stages
    if kind == "1f1b":
        return {r: _recorded_loop(cls, r, p, m) for r in range(p)}
    if kind in ("zb-v", "dualpipev"):
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    else:
        local = chunks if kind == "interleaved" else 1
        rounds = torch_rounds(m, p)
        if m % rounds:
            raise ValueError(f"torch's {SCHEDULE_CLASSES[kind]} needs data.num_micro_batches a multiple of "
                             f"its {rounds} rounds (max(1, m // stages)), not {m}")
        fake = SimpleNamespace(n_local_stages=local, microbatches_per_round=m // rounds, pp_group_size=p,
                               _n_microbatches=m)
    return {r: list(cls._calculate_single_rank_operations(fake, r)) for r in range(p)}


def _recorded_loop(cls: Any, rank: int, stages: int, micro_batches: int) -> list[Any]:
    """The compute actions a one-stage-per-rank schedule class (``Schedule1F1B``, ``ScheduleGPipe``)
    runs on ``rank``, recorded from its own loop (``_step_microbatches``) run on a stand-in stage that
    computes and communicates nothing.

    These classes walk no action list (their loop is the schedule), and ``Schedule1F1B``'s
    ``_get_pipeline_order`` (used for drawing) names micro-batches 1..m on the last rank in torch 2.13,
    so the order is taken from what the loop calls; the engine then runs it through
    ``_PipelineScheduleRuntime``.
    """
    s = _schedules()
    ct = s._ComputationType
    actions: list[Any] = []
    stage = SimpleNamespace(
        stage_index=rank, is_first=rank == 0, is_last=rank == stages - 1,
        get_fwd_recv_ops=lambda mb: [], get_bwd_recv_ops=lambda mb: [],
        get_fwd_send_ops=lambda mb: [], get_bwd_send_ops=lambda mb: [],
        forward_one_chunk=lambda mb, *a, **k: actions.append(s._Action(rank, ct.FORWARD, mb)),
        backward_one_chunk=lambda mb, **k: actions.append(s._Action(rank, ct.FULL_BACKWARD, mb)),
        perform_reduce_grad=lambda *a: None)
    fake = SimpleNamespace(_stage=stage, _num_stages=stages, _n_microbatches=micro_batches, scale_grads=False,
                           _check_inputs=lambda a, k, t, losses: ([()] * micro_batches, [{}] * micro_batches),
                           _initialize_stage=lambda *a: None, _maybe_compute_loss=lambda *a: None,
                           _maybe_get_loss=lambda *a: None, _update_losses=lambda *a: None)
    cls._step_microbatches(fake, None, None, None, None)
    return actions


def compute_orders(kind: str, stages: int, micro_batches: int, chunks: int = 2) -> dict[int, list[Compute]]:
    """Per rank, torch's compute order of pipeline order ``kind`` as :class:`Compute` tuples."""
    return actions_order(torch_actions(kind, stages, micro_batches, chunks))


def lowered(kind: str, stages: int, micro_batches: int, chunks: int = 2) -> dict[int, list[str]]:
    """Every rank's action list as torch's runtime walks it (compute, ``SEND_F``/``RECV_B``...,
    ``REDUCE_GRAD``; as torch prints them: ``0F1``, ``0SEND_F1``), from torch's own lowering
    (``_prepare_schedule_with_comms``) run without process groups."""
    actions = torch_actions(kind, stages, micro_batches, chunks)
    runtime = object.__new__(_schedules()._PipelineScheduleRuntime)
    virtual = 1 + max(c.stage for order in actions_order(actions).values() for c in order)
    runtime.__dict__.update(_n_microbatches=micro_batches, _num_stages=virtual, pp_group_size=stages,
                            _defer_pp_recv=False, _stages=[])
    runtime._prepare_schedule_with_comms(actions)
    return {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order_with_comms.items()}


def micro_batches(schedule: Any) -> int:
    """The micro-batch count a torch schedule object was built with."""
    return int(schedule._n_microbatches)


def loss_function(schedule: Any) -> Any:
    """The loss function a torch schedule object was built with (``loss_fn(output, target)``)."""
    if schedule._loss_fn is None:
        raise InputError(None, f"the torch schedule {type(schedule).__name__} has no loss_fn: it runs no backward")
    return schedule._loss_fn


def scales_grads(schedule: Any) -> bool:
    """Whether a torch schedule divides the gradients by its micro-batch count (``scale_grads``)."""
    return bool(schedule.scale_grads)


def label_kinds(c: Compute, split: bool) -> list[str]:
    """The pipeline calls of pipefisher's order (:data:`FORWARD`, :data:`BACKWARD`, :data:`WEIGHT`) that
    torch's compute action ``c`` stands for: one each, but a full backward in an order that splits its
    backwards (``split``: DualPipeV's, in full or in an ``OVERLAP_F_B``) is a B pass and its W pass."""
    if c.kind == BACKWARD and split:
        return [BACKWARD, WEIGHT]
    return [BACKWARD if c.kind == INPUT else c.kind]


def splits(orders: dict[int, list[Compute]]) -> bool:
    """Whether an order splits backwards into B and W passes anywhere (then every full backward is both)."""
    return any(c.kind in (INPUT, WEIGHT) for order in orders.values() for c in order)


def actions_order(actions: dict[int, list[Any]]) -> dict[int, list[Compute]]:
    """Per rank, the :class:`Compute` order of compute-only ``_Action`` lists."""
    return {r: _flatten(acts) for r, acts in actions.items()}


def schedule_actions(schedule: Any) -> dict[int, list[Any]]:
    """Every rank's compute-only ``_Action`` lists of a torch schedule object a user built: its
    ``pipeline_order`` (the runtime schedules: interleaved, zero-bubble, DualPipeV, one loaded from
    CSV), or for ``Schedule1F1B`` and ``ScheduleGPipe``, whose loop is their order, the order that loop
    runs."""
    s = _schedules()
    for cls in (s.Schedule1F1B, s.ScheduleGPipe):
        if isinstance(schedule, cls):
            p, m = schedule._num_stages, schedule._n_microbatches
            return {r: _recorded_loop(cls, r, p, m) for r in range(p)}
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(schedule, s._PipelineScheduleRuntime) or not order:
        raise InputError(None, f"the torch schedule {type(schedule).__name__} has no per-rank action list "
                               "pipefisher can place K-FAC work in (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, "
                               "ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleInterleavedZeroBubble, or "
                               "one loaded with _load_csv)")
    reduce = s._ComputationType.REDUCE_GRAD
    return {r: [a for a in acts if a is None or a.computation_type != reduce] for r, acts in order.items()}


# ----------------------------------------------------------------------------------------------------
# The runtime: torch walks its lowered list; our handlers run each compute action


@dataclass
class Calls:
    """What the engine supplies: ``run(compute, do)`` is called for each compute action of the rank,
    in torch's order, and must call ``do(wait, around)`` exactly once, after whatever it runs first
    (K-FAC work in the bubble): ``wait(fn)`` runs the receive's wait ``fn`` (the engine times it),
    ``around`` is a context manager around the compute alone (the profiler's span).
    ``reduce(stage)`` runs where torch puts ``REDUCE_GRAD``: after a stage's last backward."""

    run: Callable[[Compute, Callable[..., None]], None]
    reduce: Callable[[int], None]


class Runtime:
    """torch's ``_PipelineScheduleRuntime`` over this rank's ``stages``, lowered from ``actions``
    (every rank's compute-only ``_Action`` lists), with our handlers for every compute type and
    ``REDUCE_GRAD``. ``loss_fn(output, target)`` is the last stage's loss of one micro-batch;
    ``scale_loss(loss)``, when given, is what each last-stage backward starts from instead (fp16's loss
    scale); the losses torch reports stay unscaled."""

    def __init__(self, stages: Sequence[Any], micro_batches: int, loss_fn: Callable[..., Any],
                 actions: dict[int, list[Any]], calls: Calls, scale_grads: bool = False,
                 scale_loss: Callable[[Any], Any] | None = None) -> None:
        s = _schedules()
        self.calls, self.scale_loss = calls, scale_loss
        self.schedule = s._PipelineScheduleRuntime(list(stages), micro_batches, loss_fn=loss_fn,
                                                   scale_grads=scale_grads)
        missing = [a for a in _RUNTIME_ATTRIBUTES if not hasattr(self.schedule, a)]
        if missing:
            raise InputError(None, f"pipeline.engine torch: torch {torch.__version__}'s _PipelineScheduleRuntime "
                                   f"lacks {', '.join(missing)} (supported: torch {SUPPORTED_TEXT})")
        self.schedule._prepare_schedule_with_comms(actions)
        self.by_index = {st.stage_index: st for st in stages}
        self.rank = self.schedule.rank
        self._done_at_input: set[tuple[int, int]] = set()  # first stage: full backward ran at its B slot
        ct = s._ComputationType
        self._kinds = _kinds()
        for t in self._kinds:  # every compute kind of pipefisher's passes, split or not
            self.schedule.register_custom_function(t, self._compute)
        self.schedule.register_custom_function(ct.OVERLAP_F_B, self._overlap)
        self.schedule.register_custom_function(ct.REDUCE_GRAD, self._reduce)

    def step(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, losses: list[Any]) -> None:
        """One step: torch splits ``args``/``kwargs``/``target`` into micro-batches and walks its list."""
        self._done_at_input.clear()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)

    # -- the handlers (what torch's closure would run, around the stage's own methods) ----------------

    def _overlap(self, action: Any, ctx: Any) -> None:
        for sub in action.sub_actions or ():
            self._compute(sub, ctx)

    def _reduce(self, action: Any, ctx: Any) -> None:
        self.calls.reduce(action.stage_index)

    def _compute(self, action: Any, ctx: Any) -> None:
        compute = Compute(self._kinds[action.computation_type], action.stage_index, action.microbatch_index)
        self.calls.run(compute, lambda wait, around: self._do(compute, ctx, wait, around))

    def _do(self, c: Compute, ctx: Any, wait: Callable[[Callable[[], None]], None], around: ContextManager[Any]) -> None:
        """The receive's wait (through ``wait``, which times it), then the compute of ``c`` in ``around``."""
        sched, stage = self.schedule, self.by_index[c.stage]
        mb, s = c.micro_batch, c.stage
        if c.kind == FORWARD:
            if not stage.is_first and s - 1 not in self.by_index:  # the V's turn hands over locally
                works = sched.fwd_recv_ops.pop((s, mb), None)
                if works is None:
                    raise RuntimeError(f"torch engine: forward of stage {s} micro-batch {mb} before its receive")
                wait(lambda: _schedules()._wait_batch_p2p(works))
            with around:
                out = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
                sched._maybe_compute_loss(stage, out, ctx.target_mbs, mb)
            if s + 1 in self.by_index:
                self.by_index[s + 1].set_local_fwd_input(out, mb)
            return
        if c.kind == WEIGHT:
            sched.backward_counter[s] += 1
            with around:
                if (s, mb) not in self._done_at_input:
                    last = sched.backward_counter[s] == sched._n_microbatches
                    stage.backward_weight_one_chunk(mb, last_backward=last)
            return
        if not stage.is_last and s + 1 not in self.by_index:
            works = sched.bwd_recv_ops.pop((s, mb), None)
            if works is None:
                raise RuntimeError(f"torch engine: backward of stage {s} micro-batch {mb} before its receive")
            wait(lambda: _schedules()._wait_batch_p2p(works))
        loss = sched._maybe_get_loss(stage, mb)
        if loss is not None and self.scale_loss is not None:
            loss = self.scale_loss(loss)
        full = c.kind == BACKWARD
        if not full and stage.is_first:
            # torch's first stage computes nothing in its B pass and all in its W pass; pipefisher's
            # B pass computes what K-FAC's factor B needs (a packed cov_kron_B may follow it), so the
            # first stage runs its whole backward here and its W slot only counts
            full = True
            self._done_at_input.add((s, mb))
        if c.kind == BACKWARD:
            sched.backward_counter[s] += 1
        last = c.kind == BACKWARD and sched.backward_counter[s] == sched._n_microbatches
        with around:
            stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last)
        if s - 1 in self.by_index:
            self.by_index[s - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def make_stage(module: torch.nn.Module, index: int, num_stages: int, device: torch.device, group: Any,
               example_input: torch.Tensor, example_output: torch.Tensor) -> Any:
    """A torch ``PipelineStage`` around ``module`` with static shapes (no metadata inference, which
    would run a forward, and K-FAC's hooks with it, before the first step)."""
    from torch.distributed.pipelining.stage import PipelineStage

    return PipelineStage(module, index, num_stages, device, input_args=example_input,
                         output_args=example_output, group=group)
