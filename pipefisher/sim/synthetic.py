"""Synthetic jobs straight from numbers: for benchmarks and property tests, no YAML needed."""
from __future__ import annotations

import random

from pipefisher.sim.costs import CostModel, ModuleCost
from pipefisher.sim.simulator import Timelines, simulate_timelines

# BERT-Base-like per-layer costs (ms) from the P100 bs=32 row of the published block measurements
# (see pipefisher/bundled/cost_models/bert-base-4stages.yaml for the derivation of the per-module split).
_LAYER_FORWARD_MS = 9.748
_LAYER_BACKWARD_MS = 16.450
_BERT_MODULES = (  # name, in, out
    ("attention.self.query", 768, 768),
    ("attention.self.key", 768, 768),
    ("attention.self.value", 768, 768),
    ("attention.output.dense", 768, 768),
    ("intermediate.dense", 768, 3072),
    ("output.dense", 3072, 768),
)
_BLOCK_COV_MS = 25.547
_BLOCK_INV_MS = 71.667
_SYNC_MS_PER_MIB = 0.1  # ~10 GB/s all-reduce (2 replicas)


def _modules(rng: random.Random | None) -> tuple[ModuleCost, ...]:
    cov_total = sum(a * a + b * b for _, a, b in _BERT_MODULES)
    inv_total = sum(a ** 3 + b ** 3 for _, a, b in _BERT_MODULES)

    def jitter() -> float:
        return 1.0 if rng is None else rng.uniform(0.8, 1.2)

    out = []
    for name, a, b in _BERT_MODULES:
        out.append(ModuleCost(
            name,
            cov_A_ms=_BLOCK_COV_MS * a * a / cov_total * jitter(),
            cov_B_ms=_BLOCK_COV_MS * b * b / cov_total * jitter(),
            sync_A_ms=4 * a * a / 2**20 * _SYNC_MS_PER_MIB * jitter(),
            sync_B_ms=4 * b * b / 2**20 * _SYNC_MS_PER_MIB * jitter(),
            inv_A_ms=_BLOCK_INV_MS * a ** 3 / inv_total * jitter(),
            inv_B_ms=_BLOCK_INV_MS * b ** 3 / inv_total * jitter(),
        ))
    return tuple(out)


def synthetic_model(
    stages: int = 4,
    micro_batches: int = 8,
    layers_per_stage: int = 3,
    kfac_scale: float = 1.0,
    seed: int | None = 0,
    order: str = "1f1b",
    chunks: int | None = None,
    latency_ms: float = 0.0,
) -> CostModel:
    """A BERT-like cost model with 6 K-FAC modules per layer; ``seed`` jitters the K-FAC costs by +-20 %
    (``seed=None``: no jitter). ``kfac_scale`` multiplies every K-FAC cost (light < 1 < heavy)."""
    rng = random.Random(seed) if seed is not None else None
    return CostModel(
        name=f"synthetic-{stages}x{layers_per_stage}",
        layers=stages * layers_per_stage,
        modules=_modules(rng),
        layer_forward_ms=_LAYER_FORWARD_MS,
        layer_backward_ms=_LAYER_BACKWARD_MS,
        latency_ms=latency_ms,
        kfac_scale=kfac_scale,
        order=order,
        stages=stages,
        micro_batches=micro_batches,
        chunks=chunks,
        source="synthetic (BERT-Base-like per-layer costs)",
    ).replace()


def synthetic_timelines(
    order: str = "1f1b",
    stages: int = 8,
    micro_batches: int = 64,
    layers_per_stage: int = 6,
    kfac_scale: float = 1.0,
    seed: int | None = 0,
    chunks: int | None = None,
    latency_ms: float = 0.0,
) -> Timelines:
    """Per-node profiled timelines of a synthetic job (``layers_per_stage * 6`` K-FAC modules per node)."""
    model = synthetic_model(stages, micro_batches, layers_per_stage, kfac_scale, seed, order, chunks, latency_ms)
    timelines, _ = simulate_timelines(model)
    return timelines
