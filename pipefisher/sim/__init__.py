"""Simulated pipeline steps: cost models and a timeline simulator over the pipeline orders
(:mod:`pipefisher.pipeline_orders`, re-exported here).

Answers "what will K-FAC cost with this pipeline order?" from a cost model in seconds, writing timelines in
the profiled format so that ``pipefisher schedule`` packs them like a real profile.
"""
from __future__ import annotations

from pipefisher.pipeline_orders import Op, PipelineOrder, generate, order_names
from pipefisher.sim.costs import CostModel, ModuleCost, cost_model_from_dict, load_cost_model
from pipefisher.sim.simulator import (
    PipeCosts,
    SimResult,
    Timelines,
    pipe_costs,
    simulate,
    simulate_timelines,
    timelines_from_result,
    write_timelines,
)
from pipefisher.sim.synthetic import synthetic_model, synthetic_timelines

__all__ = [
    "CostModel", "ModuleCost", "Op", "PipeCosts", "PipelineOrder", "SimResult", "Timelines",
    "cost_model_from_dict", "generate", "load_cost_model", "pipe_costs", "order_names", "simulate",
    "simulate_timelines", "synthetic_model", "synthetic_timelines", "timelines_from_result", "write_timelines",
]
