"""Schedule generators: closed-form bubbles, dependencies, and clear refusals."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import (BACKWARD, FORWARD, LOOP, V, WEIGHT, Op, PipelineOrder, default_chunks,
                                        device_of_stage, generate, layout_of, order_names, stage_on)
from pipefisher.sim.simulator import PipeCosts, simulate

UNIT = 1000  # ns; equal forward and backward cost, zero latency


def uniform(order, forward=UNIT, backward=UNIT, latency=0, input_grad_fraction=0.5):
    return PipeCosts.uniform(order.virtual_stages, forward, backward, latency, input_grad_fraction)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 8), (8, 32), (3, 5)])
def test_gpipe_and_1f1b_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    s = generate(name, p, m)
    r = simulate(s, uniform(s))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (8, 2, 16), (4, 4, 12)])
def test_interleaved_bubble_fraction_is_p_minus_1_over_vm_plus_p_minus_1(p, v, m):
    s = generate("interleaved", p, m, chunks=v)
    # each chunk holds 1/v of a stage: its forward and backward take 1/v of a stage's (1200 ns)
    r = simulate(s, uniform(s, 1200 // v, 1200 // v))
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p", [4, 6, 8, 10, 16])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_chimera_matches_its_papers_bubble_ratio(p, k):
    """Chimera (Li & Hoefler, SC'21) gives (D-2)/(2N+D-2) for D stages and N micro-batches.

    Under the paper's own assumptions: forward and backward of a micro-batch take the same time on
    every stage, and communication is free. N = k * D: one basic unit, or k of them concatenated.
    """
    m = k * p
    s = generate("chimera", p, m)
    r = simulate(s, uniform(s))
    assert r.bubble_fraction == pytest.approx((p - 2) / (2 * m + p - 2))


@pytest.mark.parametrize("p", [4, 6, 8, 16])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_chimera_with_twice_as_long_backwards_beats_1f1b(p, k):
    """With backward = 2 x forward (as in practice) and the costs given to the generator, concatenated
    units leave no intermediate bubbles: the paper's ratio still holds from two units on."""
    m = k * p
    costs = uniform(generate("1f1b", p, m), UNIT, 2 * UNIT)
    s = generate("chimera", p, m, durations=lambda op: costs.duration(op, False))
    chimera = simulate(s, costs).bubble_fraction
    assert chimera < simulate(generate("1f1b", p, m), costs).bubble_fraction
    if k > 1:
        assert chimera == pytest.approx((p - 2) / (2 * m + p - 2))


@pytest.mark.parametrize("p", [4, 6, 8, 12])
def test_chimera_leaves_d_minus_2_idle_units_on_every_device(p):
    """The paper's D - 2 bubbles are per device (D/2 - 1 as the pipes fill, D/2 - 1 as they drain)."""
    s = generate("chimera", p, p)
    r = simulate(s, uniform(s))
    assert r.makespan == (2 * p + p - 2) * UNIT
    assert [r.idle(d) for d in range(p)] == [(p - 2) * UNIT] * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 24)])
@pytest.mark.parametrize("f,b,w", [(3, 3, 3), (4, 3, 2), (2, 3, 1), (3, 2, 3)])
def test_zb_h1_idle_per_device_is_its_closed_form_and_below_1f1b(p, m, f, b, w):
    """ZB-H1 (Qi et al. 2023) leaves (p-1)(T_F + T_B - T_W) idle per device, 1F1B (p-1)(T_F + T_B + T_W).

    The closed form assumes T_W <= T_B (as the paper's equal-cost case); with a longer W the forward
    ramp-up, (p-1) T_F, is the floor.
    """
    zb = generate("zb-h1", p, m)
    costs = PipeCosts.uniform(p, f * UNIT, (b + w) * UNIT, 0, b / (b + w))
    r = simulate(zb, costs)
    assert [r.idle(d) for d in range(p)] == [(p - 1) * max(f + b - w, f) * UNIT] * p
    base = simulate(generate("1f1b", p, m), costs)
    assert all(r.idle(d) < base.idle(d) for d in range(p))
    assert [base.idle(d) for d in range(p)] == [(p - 1) * (f + b + w) * UNIT] * p


def peak_activations(ops) -> int:
    """The most activations one device holds at once: forwards whose weight gradient has not run."""
    live = peak = 0
    for op in ops:
        live += op.kind == FORWARD
        live -= op.kind == WEIGHT
        peak = max(peak, live)
    return peak


def test_zb_h1_keeps_1f1b_peak_activation_memory():
    p, m = 4, 12
    for ops in generate("zb-h1", p, m).devices:
        assert peak_activations(ops) <= p


def _check_times(result, latency):
    s = result.order
    when = {}
    for d, timed in enumerate(result.devices):
        assert [t.op for t in timed] == list(s.devices[d])
        for a, b in zip(timed, timed[1:]):
            assert b.start >= a.end, "a device runs one operation at a time"
        for t in timed:
            when[t.op.key()] = (t, d)
    for d, timed in enumerate(result.devices):
        for t in timed:
            for dep in s.dependencies(t.op):
                before, dd = when[dep.key()]
                assert t.start >= before.end + (latency if dd != d else 0), f"{t.op} starts before {dep}"


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "chimera"]),
    p=st.integers(1, 6),
    mult=st.integers(1, 4),
    extra=st.integers(0, 3),
    v=st.integers(2, 3),
    fwd=st.lists(st.integers(1, 50), min_size=18, max_size=18),
    bwd=st.lists(st.integers(1, 90), min_size=18, max_size=18),
    latency=st.integers(0, 7),
)
def test_every_generated_order_respects_its_dependencies(name, p, mult, extra, v, fwd, bwd, latency):
    if name == "chimera":
        p = 2 * ((p + 1) // 2)
        m = 2 * (mult + extra)
    elif name == "interleaved":
        m = p * mult
    elif name == "dualpipev":
        m = 2 * p + mult + extra - 1
    else:
        m = mult + extra
    s = generate(name, p, m, v if name == "interleaved" else None)
    s.check()
    S = s.virtual_stages
    costs = PipeCosts(tuple(fwd[:S]), tuple(bwd[:S]), latency, 0.5)
    r = simulate(s, costs)
    _check_times(r, latency)
    kinds = {BACKWARD, FORWARD} | ({WEIGHT} if s.split_backward else set())
    total = sum(len(ops) for ops in s.devices)
    assert total == len(kinds) * m * S


def test_latency_is_added_between_devices_only():
    s = generate("gpipe", 2, 1)
    r = simulate(s, PipeCosts.uniform(2, 10, 20, latency_ns=5))
    (f0, b0), (f1, b1) = r.devices
    assert (f0.start, f0.end, f1.start, f1.end, b1.start, b1.end, b0.start) == (0, 10, 15, 25, 25, 45, 50)


@pytest.mark.parametrize("call,message", [
    (lambda: generate("interleaved", 4, 9), r"split evenly into max\(1, 9 // 4\) = 2 rounds"),
    (lambda: generate("interleaved", 4, 8, chunks=1), "chunks >= 2"),
    (lambda: generate("chimera", 3, 6), "even number of stages"),
    (lambda: generate("chimera", 4, 5), "even number of micro-batches"),
    (lambda: generate("1f1b", 0, 4), "stages must be"),
    (lambda: generate("gpipe", 4, 0), "micro-batches must be"),
    (lambda: generate("gpipe", 4, 4, chunks=2), "one model chunk"),
    (lambda: generate("zb-v", 4, 8, chunks=3), "^zb-v: has exactly 2 model chunks per device \\(a V\\)$"),
    (lambda: generate("zb-v", 4, 8, chunks=1), "^zb-v: has exactly 2 model chunks"),
    (lambda: generate("dualpipev", 4, 8, chunks=3), "^dualpipev: has exactly 2 model chunks per device \\(a V\\)$"),
    (lambda: generate("dualpipev", 4, 7),
     "^dualpipev: needs micro-batches >= 2 x stages = 8 \\(one per virtual stage\\), got 7 \\(torch's"),
    (lambda: generate("dualpipe-v", 1, 1), "^dualpipev: needs micro-batches >= 2 x stages = 2"),
    (lambda: generate("pipedream-2bw", 4, 4), "unknown pipeline order"),
])
def test_generators_refuse_what_they_cannot_do_with_a_clear_message(call, message):
    with pytest.raises(InputError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_order_names_and_aliases():
    assert order_names() == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "chimera"]
    assert generate("DAPPLE", 2, 2).name == "1f1b"
    assert generate("interleaved-1f1b", 2, 2).chunks == 2
    for alias in ("zbv", "ZB_V", "zb-v"):
        s = generate(alias, 2, 4)
        assert (s.name, s.chunks, s.layout, s.split_backward) == ("zb-v", 2, V, True)
    for alias in ("dualpipev", "DualPipeV", "dual-pipe-v", "dualpipe-v", "dualpipe_v"):
        s = generate(alias, 2, 4)
        assert (s.name, s.chunks, s.layout, s.split_backward) == ("dualpipev", 2, V, True)
    assert [default_chunks(n) for n in order_names()] == [1, 1, 2, 1, 2, 2, 1]
    assert [layout_of(n) for n in order_names()] == [LOOP, LOOP, LOOP, LOOP, V, V, LOOP]
    assert layout_of("zbv") == V and layout_of("dual-pipe-v") == V
    for n in order_names():  # the layout a generator builds is the one layout_of names
        assert generate(n, 2, 4).layout == layout_of(n), n


# ----------------------------------------------------------------------------------------------------
# Chunk numbering, check() and size arguments (defects found against peer implementations)


ALL_SHAPES = [(name, p, m, v) for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "chimera")
              for p in range(1, 5) for m in range(1, 9) for v in ((2, 3) if name == "interleaved" else (None,))
              if not (name == "interleaved" and m % max(1, m // p)) and not (name == "chimera" and (p % 2 or m % 2))
              and not (name == "dualpipev" and m < 2 * p)]


@pytest.mark.parametrize("name,p,m,v", ALL_SHAPES)
def test_every_dependency_of_every_op_is_an_op_of_the_order(name, p, m, v):
    """dependencies() names chunk stage // p; the generators must number their ops the same way."""
    s = generate(name, p, m, v)
    ops = {op for device in s.devices for op in device}
    for op in ops:
        assert op.chunk == (op.stage // p if op.pipe == 0 else 0), op
        for dep in s.dependencies(op):
            assert dep in ops, f"{op} needs {dep}, which is not in the order"
    s.check()


def _without(order, drop):
    return PipelineOrder(order.name, order.stages, order.micro_batches, order.chunks,
                         tuple(tuple(op for op in ops if not drop(op)) for ops in order.devices),
                         order.split_backward, order.layout)


@pytest.mark.parametrize("drop,message", [
    (lambda op: op.micro_batch == 2, "micro-batch 2 never runs"),
    (lambda op: op.micro_batch == 2 and op.stage == 1, "never runs Op\\(kind='F', micro_batch=2, stage=1"),
    (lambda op: op.kind == WEIGHT and op.micro_batch == 0 and op.stage == 0, "never runs Op\\(kind='W', micro_batch=0"),
])
def test_check_refuses_an_order_that_misses_operations(drop, message):
    s = _without(generate("zb-h1", 2, 3), drop)
    with pytest.raises(AssertionError, match=message):
        s.check()


def test_check_refuses_crossed_orders_that_deadlock_and_names_the_stuck_ops():
    F, B = FORWARD, BACKWARD
    s = PipelineOrder("crossed", 2, 2, 1, (
        (Op(F, 0, 0), Op(B, 0, 0), Op(F, 1, 0), Op(B, 1, 0)),  # device 0 wants B0 before it sends F1
        (Op(F, 0, 1), Op(F, 1, 1), Op(B, 0, 1), Op(B, 1, 1)),  # device 1 wants F1 before it sends B0
    ))
    with pytest.raises(AssertionError, match="deadlocks") as err:
        s.check()
    assert "device 0 at Op(kind='B', micro_batch=0, stage=0" in str(err.value)
    assert "device 1 at Op(kind='F', micro_batch=1, stage=1" in str(err.value)


def test_check_refuses_a_duplicate_and_an_op_on_the_wrong_device():
    s = generate("1f1b", 2, 2)
    twice = PipelineOrder("1f1b", 2, 2, 1, (s.devices[0] + s.devices[0][:1], s.devices[1]))
    with pytest.raises(AssertionError, match="appears twice"):
        twice.check()
    swapped = PipelineOrder("1f1b", 2, 2, 1, (s.devices[1], s.devices[0]))
    with pytest.raises(AssertionError, match="is listed on device 0"):
        swapped.check()


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-v", "dualpipev", "chimera", "interleaved"])
def test_numpy_integers_are_accepted_as_sizes(name):
    v = np.int64(default_chunks(name))
    s = generate(name, np.int64(2), np.int32(4), v)
    assert (s.stages, s.micro_batches) == (2, 4) and type(s.stages) is int and type(s.chunks) is int
    assert [[op.key() for op in ops] for ops in s.devices] == \
        [[op.key() for op in ops] for ops in generate(name, 2, 4, int(v)).devices]


@pytest.mark.parametrize("args,message", [
    ((True, 2), "stages must be a whole number >= 1, got True"),
    ((2, True), "micro-batches must be a whole number >= 1, got True"),
    ((2.0, 2), "stages must be a whole number >= 1, got 2.0"),
    ((2, "2"), "micro-batches must be a whole number >= 1, got '2'"),
    ((np.int64(0), 2), "stages must be a whole number >= 1"),
    ((2, 2, True), "chunks must be a whole number >= 1, got True"),
])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-v", "dualpipev", "chimera"])
def test_bool_and_non_integer_sizes_are_refused_in_one_line(name, args, message):
    with pytest.raises(InputError, match=f"^{name}: {message}") as err:
        generate(name, *args)
    assert "\n" not in str(err.value)


def test_interleaved_refuses_true_as_its_chunk_count():
    with pytest.raises(InputError, match="interleaved: needs chunks >= 2 model chunks per device, got True"):
        generate("interleaved", 2, 4, True)


def _megatron_order(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """The interleaved order for m a multiple of p, in Megatron-LM's closed form (the order before
    counts that are not multiples were accepted): forward k is chunk (k // p) % v of micro-batch
    (k // (p v)) p + k % p."""
    out = []
    for d in range(p):
        def mb(k: int) -> int:
            return (k // (p * v)) * p + k % p
        f = [("F", mb(k), ((k // p) % v) * p + d) for k in range(m * v)]
        b = [("B", mb(k), (v - 1 - (k // p) % v) * p + d) for k in range(m * v)]
        warmup = min((p - d - 1) * 2 + (v - 1) * p, m * v)
        ops = f[:warmup]
        for k in range(m * v - warmup):
            ops += [f[warmup + k], b[k]]
        ops += b[m * v - warmup:]
        out.append(ops)
    return out


@pytest.mark.parametrize("p,m,v", [(p, m, v) for p in range(1, 6) for m in range(p, 4 * p + 1, p) for v in (2, 3)])
def test_interleaved_keeps_megatrons_order_for_multiples_of_the_stage_count(p, m, v):
    s = generate("interleaved", p, m, v)
    assert [[(op.kind, op.micro_batch, op.stage) for op in ops] for ops in s.devices] == _megatron_order(p, m, v)


@pytest.mark.parametrize("p,m,v", [(4, 3, 2), (4, 6, 2), (4, 10, 2), (4, 6, 3), (3, 4, 2), (3, 8, 3), (5, 7, 2),
                                   (2, 3, 2), (8, 12, 2)])
def test_interleaved_accepts_micro_batch_counts_torch_accepts(p, m, v):
    s = generate("interleaved", p, m, v)
    s.check()  # every op once, on its device, no deadlock
    assert s.micro_batches == m and sum(len(ops) for ops in s.devices) == 2 * m * v * p


@pytest.mark.parametrize("p,m,v", [(4, 6, 2), (4, 10, 2), (4, 3, 2), (3, 8, 3), (4, 8, 2)])
def test_interleaved_orders_each_device_as_torchs_schedule_interleaved_1f1b(p, m, v):
    """Cross-check with torch's own per-rank order (``ScheduleInterleaved1F1B``'s computation, run
    without process groups), where torch is installed."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rounds = max(1, m // p)
    fake = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m)
    s = generate("interleaved", p, m, v)
    for d in range(p):
        actions = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, d)
        theirs = [("F" if a.computation_type == schedules._ComputationType.FORWARD else "B", a.microbatch_index,
                   a.stage_index) for a in actions if a is not None]
        assert [(op.kind, op.micro_batch, op.stage) for op in s.devices[d]] == theirs, d


# ----------------------------------------------------------------------------------------------------
# Zero-bubble orders: ZB-V's layout and its cross-checks with torch


def _torch_actions(schedules, actions) -> list[tuple[str, int, int]]:
    """torch's per-rank actions (its None bubbles left out) as (kind, micro-batch, stage)."""
    kind = {schedules._ComputationType.FORWARD: FORWARD, schedules._ComputationType.BACKWARD_INPUT: BACKWARD,
            schedules._ComputationType.BACKWARD_WEIGHT: WEIGHT}
    return [(kind[a.computation_type], a.microbatch_index, a.stage_index) for a in actions if a is not None]


def _ours(order, d: int) -> list[tuple[str, int, int]]:
    return [(op.kind, op.micro_batch, op.stage) for op in order.devices[d]]


@pytest.mark.parametrize("p", range(1, 7))
def test_zb_v_orders_each_device_as_torchs_schedule_zbv_zero_bubble(p):
    """torch's ``ScheduleZBVZeroBubble`` computes every rank's order without process groups; any m >= 1."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for m in range(1, 17):
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        s = generate("zb-v", p, m)
        for d in range(p):
            actions = schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, d)
            assert _ours(s, d) == _torch_actions(schedules, actions), (m, d)


@pytest.mark.parametrize("p", range(1, 7))
def test_zb_h1_orders_each_device_as_torchs_interleaved_zero_bubble_with_one_local_stage(p):
    """torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank is ZB-H1; its constructor
    refuses micro-batch counts that do not split into ``max(1, m // p)`` rounds, so those are skipped."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    checked = 0
    for m in range(1, 17):
        rounds = max(1, m // p)
        if m % rounds:
            continue
        fake = SimpleNamespace(n_local_stages=1, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m)
        s = generate("zb-h1", p, m)
        for d in range(p):
            theirs = _torch_actions(
                schedules, schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, d))
            assert _ours(s, d) == theirs, (m, d)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("p", range(1, 6))
def test_stage_on_places_chunks_in_a_loop_or_a_v_and_device_of_inverts_it(p):
    loop = [[stage_on(d, c, p) for c in range(3)] for d in range(p)]
    assert loop == [[d, d + p, d + 2 * p] for d in range(p)]
    v = [[stage_on(d, c, p, V) for c in range(2)] for d in range(p)]
    assert v == [[d, 2 * p - 1 - d] for d in range(p)]
    assert sorted(s for row in v for s in row) == list(range(2 * p))  # every stage once
    assert stage_on(p - 1, 1, p, V) == p  # the V turns on the last device
    for layout, table in ((LOOP, loop), (V, v)):
        for d, row in enumerate(table):
            for c, s in enumerate(row):
                assert device_of_stage(s, p, layout) == d and s // p == c
    s = generate("zb-v", p, 4)
    assert [s.device_of(st) for st in range(2 * p)] == [device_of_stage(st, p, V) for st in range(2 * p)]


def test_stage_on_refuses_places_a_layout_does_not_have():
    with pytest.raises(ValueError, match="a V has chunks 0 and 1, not 2"):
        stage_on(0, 2, 4, V)
    with pytest.raises(ValueError, match="unknown chunk layout 'ring'"):
        stage_on(0, 0, 4, "ring")
    with pytest.raises(ValueError, match="not a place in a pipe of 4 devices"):
        stage_on(4, 0, 4)


def test_check_holds_zb_v_to_its_v():
    """The same order read in a loop layout puts chunk 1 on the wrong devices."""
    s = generate("zb-v", 3, 5)
    s.check()
    loop = PipelineOrder(s.name, s.stages, s.micro_batches, s.chunks, s.devices, s.split_backward, LOOP)
    with pytest.raises(AssertionError, match=r"stage=5, chunk=1.* is listed on device 0"):
        loop.check()


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_v_leaves_only_the_unavoidable_fill_idle_and_less_than_1f1b_and_interleaved(p):
    """Equal work per stage for every order: forward = B = W = 2 units per stage, so 1 unit per chunk.

    Every device does the same 6m units, and the last device cannot start before the first micro-batch
    has crossed the p - 1 devices above it: p - 1 units idle on every device is the least any order
    leaves. ZB-V leaves exactly that from m = 2p - 1 on (the micro-batches its warm-up fills the V with);
    below, measured, each micro-batch short of them adds 2 units. ZB-H1 leaves 2(p - 1), interleaved
    (v = 2) 3(p - 1), 1F1B 6(p - 1).
    """
    u = UNIT
    for m in range(1, 4 * p + 2):
        zbv = simulate(generate("zb-v", p, m), PipeCosts.uniform(2 * p, u, 2 * u, 0, 0.5))
        idle = [zbv.idle(d) for d in range(p)]
        assert idle == [max(4 * (p - 1) - 2 * (m - 1), p - 1) * u] * p, m
        one = simulate(generate("1f1b", p, m), PipeCosts.uniform(p, 2 * u, 4 * u))
        zbh1 = simulate(generate("zb-h1", p, m), PipeCosts.uniform(p, 2 * u, 4 * u, 0, 0.5))
        for d in range(p):
            if p > 1:
                assert idle[d] < one.idle(d)
            assert idle[d] <= zbh1.idle(d)
            if m >= 2 * p - 1 and p > 1:
                assert idle[d] < zbh1.idle(d)
        if m % max(1, m // p) == 0:
            inter = simulate(generate("interleaved", p, m), PipeCosts.uniform(2 * p, u, 2 * u))
            assert all(idle[d] < inter.idle(d) for d in range(p) if p > 1)


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_v_holds_at_most_1f1bs_peak_activations(p):
    """In-flight activations per device, in chunks (forwards whose W has not run): at most 2p, which is p
    whole stages, 1F1B's peak; measured, ``min(2p, 2m, m + 1 + d)`` on device d."""
    for m in range(1, 4 * p + 2):
        for d, ops in enumerate(generate("zb-v", p, m).devices):
            assert peak_activations(ops) == min(2 * p, 2 * m, m + 1 + d), (m, d)


# ----------------------------------------------------------------------------------------------------
# DualPipeV: torch's calls, its fused calls and its bubbles


def _torch_calls(schedules, actions) -> list[tuple[tuple[str, int, int], ...]]:
    """torch's per-rank actions as calls of (kind, micro-batch, stage): a FULL_BACKWARD is a B and its W,
    an OVERLAP_F_B its sub-actions in the order torch runs them."""
    ct = schedules._ComputationType
    kinds = {ct.FORWARD: (FORWARD,), ct.BACKWARD_INPUT: (BACKWARD,), ct.BACKWARD_WEIGHT: (WEIGHT,),
             ct.FULL_BACKWARD: (BACKWARD, WEIGHT)}

    def flat(a) -> tuple[tuple[str, int, int], ...]:
        if a.computation_type == ct.OVERLAP_F_B:
            return tuple(op for sub in a.sub_actions for op in flat(sub))
        return tuple((k, a.microbatch_index, a.stage_index) for k in kinds[a.computation_type])

    return [flat(a) for a in actions if a is not None]


def _our_calls(order, d: int) -> list[tuple[tuple[str, int, int], ...]]:
    """Device d's operations grouped into calls: each fused run one call, every other operation its own."""
    fused = {run[0]: run for run in order.fused}
    ops, calls, i = order.devices[d], [], 0
    while i < len(ops):
        run = fused.get(ops[i], (ops[i],))
        calls.append(tuple((op.kind, op.micro_batch, op.stage) for op in run))
        i += len(run)
    return calls


@pytest.mark.parametrize("p", range(1, 7))
def test_dualpipev_runs_torchs_schedule_dualpipev_call_for_call(p):
    """torch's ``ScheduleDualPipeV`` computes every rank's actions without process groups (it needs
    m >= 2p): ours are the same calls in the same order, fused where torch runs one action."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for m in range(2 * p, 4 * p + 3):
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        s = generate("dualpipev", p, m)
        for d in range(p):
            actions = schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, d)
            assert _our_calls(s, d) == _torch_calls(schedules, actions), (m, d)


def test_dualpipev_fuses_full_backwards_and_overlapped_pairs():
    s = generate("dualpipev", 2, 4)
    calls = _our_calls(s, 0)
    assert calls[:4] == [(("F", 0, 0),), (("F", 1, 0),), (("F", 2, 0),), (("F", 0, 3),)]
    assert calls[4:6] == [(("B", 0, 3),), (("W", 0, 3),)]  # split: its input gradient leaves before the W
    assert calls[7] == (("F", 3, 0), ("B", 1, 3), ("W", 1, 3))  # an overlapped pair
    assert calls[9] == (("B", 2, 3), ("W", 2, 3))  # a full backward
    assert calls[-4:] == [(("B", 2, 0),), (("W", 2, 0),), (("B", 3, 0),), (("W", 3, 0),)]  # deferred W passes
    # last device, first steady round: the forward feeding its own chunk 1 does not wait for a backward
    assert _our_calls(s, 1)[4:7] == [(("F", 2, 1),), (("B", 0, 2), ("W", 0, 2)),
                                     (("F", 2, 2), ("B", 0, 1), ("W", 0, 1))]


def test_a_fused_calls_outputs_leave_when_the_call_ends():
    """The previous stage's backward needs the W of a full backward, a forward the end of its pair."""
    s = generate("dualpipev", 2, 4)
    pair = next(run for run in s.fused if run[0].kind == FORWARD)
    f, b, w = pair
    assert s.sent_after(f) == w and s.sent_after(b) == w and s.sent_after(w) == w
    assert Op(FORWARD, f.micro_batch, f.stage + 1, (f.stage + 1) // 2) in [op for ops in s.devices for op in ops]
    assert s.dependencies(Op(FORWARD, f.micro_batch, f.stage + 1, (f.stage + 1) // 2)) == [w]
    assert s.dependencies(Op(BACKWARD, b.micro_batch, b.stage - 1, (b.stage - 1) // 2))[0] == w
    assert s.dependencies(w) == [b]  # the W itself needs its own B only
    split = Op(BACKWARD, 0, 3, 1)  # device 0's first B is split: its gradient leaves as it ends
    assert s.sent_after(split) == split and s.dependencies(Op(BACKWARD, 0, 2, 1))[0] == split
    r = simulate(s, uniform(s))
    when = {t.op: t for timed in r.devices for t in timed}
    assert when[b].start == when[f].end and when[w].start == when[b].end


def test_check_refuses_a_fused_call_that_is_not_one_run_of_a_device():
    s = generate("dualpipev", 2, 4)
    f, b, w = next(run for run in s.fused if len(run) == 3)
    first = s.devices[0][0]
    for bad, message in [(((f, w),), "not a run of consecutive operations"), (((first, f),), "not a run"),
                         ((s.fused[0], s.fused[0][-1:]), "is in two fused calls"),
                         (((Op(FORWARD, 9, 0),),), "holds operations the order does not run")]:
        broken = PipelineOrder(s.name, s.stages, s.micro_batches, s.chunks, s.devices, True, V, bad)
        with pytest.raises(AssertionError, match=message):
            broken.check()


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_leaves_twice_zb_vs_fill_idle_as_torch_sends_after_its_calls(p):
    """Equal work per chunk (forward = B = W = 1 unit): ZB-V leaves p - 1 units idle on every device (the
    least any order can). DualPipeV leaves 2(p - 1) for every m >= 2p: a pair's forward output leaves
    only after the pair's backward, as torch's runtime sends it; with every output sent as its
    operation ends (no fused calls, as the own engine runs it), the same order leaves ZB-V's p - 1."""
    import dataclasses

    for m in range(2 * p, 4 * p + 2):
        s = generate("dualpipev", p, m)
        costs = PipeCosts.uniform(2 * p, UNIT, 2 * UNIT, 0, 0.5)
        assert [simulate(s, costs).idle(d) for d in range(p)] == [2 * (p - 1) * UNIT] * p, m
        unfused = simulate(dataclasses.replace(s, fused=()), costs)
        assert [unfused.idle(d) for d in range(p)] == [(p - 1) * UNIT] * p, m
        zbv = simulate(generate("zb-v", p, m), costs)
        assert [zbv.idle(d) for d in range(p)] == [(p - 1) * UNIT] * p, m


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_holds_2p_plus_1_chunks_of_activations(p):
    """The DualPipe paper's PP + 1 activations (PP = 2p stages of a chunk each): one more than ZB-V's 2p."""
    for m in range(2 * p, 4 * p + 2):
        assert [peak_activations(ops) for ops in generate("dualpipev", p, m).devices] == [2 * p + 1] * p, m


def test_one_vocabulary_of_pass_kinds_names_them_for_the_orders_the_timelines_and_torch():
    """The orders' letters, the timeline keys and torch's computation types are :class:`PassKind`'s."""
    from pipefisher.schedule import timeline
    from pipefisher.pipeline_orders import BACKWARD, FORWARD, WEIGHT, PassKind

    assert [p.label for p in PassKind] == [FORWARD, BACKWARD, WEIGHT] == ["F", "B", "W"]
    assert [p.key for p in PassKind] == [timeline.FORWARD, timeline.BACKWARD, timeline.WEIGHT_KEY]
    assert timeline.WEIGHT_KEY == timeline.BACKWARD + ":" + timeline.WEIGHT
    assert PassKind("B") is PassKind.BACKWARD
    # B is the input gradient only where the order splits backwards, the full backward otherwise
    assert [p.torch_name() for p in PassKind] == ["FORWARD", "FULL_BACKWARD", "BACKWARD_WEIGHT"]
    assert [p.torch_name(split=True) for p in PassKind] == ["FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"]
    pytest.importorskip("torch")  # torch's names are its enum's members
    from torch.distributed.pipelining.schedules import _ComputationType

    assert all(hasattr(_ComputationType, p.torch_name(s)) for p in PassKind for s in (False, True))
