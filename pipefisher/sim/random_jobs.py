"""Random profiled jobs of odd shapes, for differential tests, property tests and policy suites.

Not realistic on purpose: random gaps, random F/B interleavings, bare keys, up-pipe keys, float
seconds, several profiled steps, ``None`` times and shuffled key order all appear, because the
loader accepts all of them and every policy must cope.
"""
from __future__ import annotations

import random
from typing import Any

KINDS = ("cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B", "inv_kron_A", "inv_kron_B")


def _pipe_order(rng: random.Random, m: int) -> list[str]:
    """A random order of m forwards and m backwards with no backward before its forward."""
    order, f, b = [], 0, 0
    while b < m:
        if f < m and (f == b or rng.random() < 0.5):
            order.append("F"); f += 1
        else:
            order.append("B"); b += 1
    return order


def random_raw_job(
    seed: int,
    nodes: int | None = None,
    micro_batches: int | None = None,
    layers: int | None = None,
    *,
    float_seconds: bool | None = None,
    bare_keys: bool | None = None,
    up_pipe: bool | None = None,
    steps: int | None = None,
    none_prob: float | None = None,
    heavy: bool | None = None,
) -> list[dict[str, list[tuple[Any, Any]]]]:
    rng = random.Random(seed)
    pick = lambda v, choices: rng.choice(choices) if v is None else v  # noqa: E731
    nodes = pick(nodes, [1, 2, 3, 4])
    m = pick(micro_batches, [1, 2, 3, 4, 6, 8])
    layers = pick(layers, [1, 2, 3, 5])
    float_seconds = pick(float_seconds, [False, False, True])
    bare_keys = pick(bare_keys, [False, False, False, True])
    up_pipe = pick(up_pipe, [False, False, True])
    steps = pick(steps, [1, 1, 2, 3])
    none_prob = pick(none_prob, [0.0, 0.0, 0.1])
    heavy = pick(heavy, [False, True])
    with_sync = rng.random() < 0.7
    base = 1_700_000_000_000_000_000 if rng.random() < 0.5 else 0

    def kfac_duration() -> int:
        scale = 400_000 if heavy else 60_000
        return rng.randint(1, scale)

    jobs: list[dict[str, list[tuple[Any, Any]]]] = [dict() for _ in range(nodes)]
    for node in range(nodes):
        d = jobs[node]
        d["start_end"] = []
        pipes = [""] + ([":up_pipe"] if up_pipe else [])
        modules = [None] if bare_keys else [f"encoder.layer.{node * layers + i}.m{i % 3}" for i in range(layers)]
        kfac_keys = []
        for kind in KINDS:
            if kind.startswith("sync") and not with_sync:
                continue
            for mod in modules:
                for pipe in pipes:
                    kfac_keys.append(kind + (f":{mod}" if mod else "") + pipe)
        if rng.random() < 0.3:
            rng.shuffle(kfac_keys)
        for key in ["call_forward", "call_backward"] + [f"call_{w}:up_pipe" for w in ("forward", "backward") if up_pipe]:
            d[key] = []
        for key in kfac_keys:
            d[key] = []
        t = base + node * rng.randint(0, 300_000)
        for _ in range(steps):
            step_start = t
            # each pipe keeps its own order; the pipes interleave at random
            per_pipe = {p: _pipe_order(rng, m) for p in pipes}
            merged = []
            while any(per_pipe.values()):
                p = rng.choice([q for q in pipes if per_pipe[q]])
                merged.append((p, per_pipe[p].pop(0)))
            for pipe, op in merged:
                t += rng.choice([0, 0, rng.randint(1, 500_000)])
                dur = rng.randint(50_000, 400_000)
                key = ("call_forward" if op == "F" else "call_backward") + pipe
                d[key].append((t, t + dur))
                t += dur
            for key in kfac_keys:
                dur = kfac_duration()
                s, e = t, t + dur
                if rng.random() < none_prob:
                    s, e = rng.choice([(None, None), (s, None), (None, e)])
                d[key].append((s, e))
                t += dur
            d["start_end"].append((step_start, t))
            t += 1000
    # node 0's first forward must exist with a start time: the job's clock starts there
    if float_seconds:
        for d in jobs:
            for key, ivs in d.items():
                d[key] = [tuple(None if x is None else x / 1e9 for x in iv) for iv in ivs]
    return jobs
