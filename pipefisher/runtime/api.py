"""The runtime as a library: this worker's stage(s), pipeline, K-FAC and update, for your own loop.

``pipefisher train`` is one loop around these names (:class:`pipefisher.runtime.train.trainer.Trainer`);
a loop of your own uses the same ones, so it trains exactly as ``pipefisher train`` does:

    from pipefisher.runtime import api

    cfg = api.RunConfig(...)                      # or api.load_config("my.yaml")
    ctx = api.init_context(cfg)                   # torchrun / env:// job, or one process
    worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=100)
    ckpt, parts = worker.checkpointer(), worker.components()  # add your own: anything with state_dict()
    first = ckpt.load("ck", parts) if resuming else 0           # the steps done
    for step in range(first, 100):
        loss = worker.step(step)                  # the mean loss on the last stage (a 0-dim tensor), else None
    ckpt.save("ck", 100, parts)                   # every worker calls it
    api.shutdown(ctx)

The model comes from ``cfg.model.builder`` (``"package.module:function"``, a :data:`StageBuilder`);
every stage copy (both of Chimera's, every chunk of an interleaved device) is built by it. A stage is an ``nn.Module`` with ``is_first``,
``is_last``, ``hidden_size`` and ``forward(x, labels=None, sample=None)`` (see
:class:`pipefisher.runtime.models.bert.PipelineStage`).

This module only gathers those names; each is defined in its layer (:mod:`pipefisher.runtime.job`,
:mod:`pipefisher.runtime.models`, :mod:`pipefisher.runtime.train`).
"""
from __future__ import annotations

from pipefisher.runtime.job.config import RunConfig, load_config
from pipefisher.runtime.job.dist import init_context, shutdown
from pipefisher.runtime.models.builders import StageBuilder, load_builder, make_stage
from pipefisher.runtime.train.checkpoint import Checkpointer, Stateful, StateGroup
from pipefisher.runtime.job.options import MODES
from pipefisher.runtime.train.worker import Worker, build_stages, build_worker

__all__ = ["RunConfig", "load_config", "StageBuilder", "load_builder", "make_stage", "init_context",
           "build_stages", "build_worker", "Worker", "Checkpointer", "Stateful", "StateGroup", "shutdown"]
