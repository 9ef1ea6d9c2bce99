"""Which stage copies each device holds, and their K-FAC modules, for a run config.

A device holds one stage, two under Chimera (the up pipe's copy of stage ``D - 1 - d``), ``chunks``
virtual stages when interleaved, or two in ZB-V's V (stages ``d`` and ``2D - 1 - d``); every label
names its copy. The K-FAC module names come from the run's
stage builder, built on torch's "meta" device (no memory, whatever the model's size).
"""
from __future__ import annotations

import functools

from pipefisher.errors import InputError
from pipefisher.pipeline_orders import LOOP, device_of_stage, layout_of, stage_on
from pipefisher.runtime.job.config import RunConfig


@functools.lru_cache(maxsize=32)
def _stage_kfac_names(cfg: RunConfig, stages: int) -> tuple[tuple[str, ...], ...]:
    import torch

    from pipefisher.kfac.layers import kfac_modules
    from pipefisher.runtime.models.builders import make_stage

    # Module names do not depend on the weights: the stages are built through the run's builder on
    # torch's "meta" device (no memory, no init cost, whatever the model's size). A builder that cannot
    # build there is run on the CPU instead.
    out = []
    with torch.random.fork_rng(devices=[]):
        for s in range(stages):
            try:
                with torch.device("meta"):
                    stage = make_stage(cfg, s, stages)
            except InputError:
                raise
            except Exception:
                stage = make_stage(cfg, s, stages)
            out.append(tuple(kfac_modules(stage, cfg.kfac.ignore)))
    return tuple(out)


def stage_kfac_names(cfg: RunConfig) -> list[list[str]]:
    """The K-FAC module names of every pipeline stage of ``cfg``, in model order."""
    return [list(n) for n in _stage_kfac_names(cfg, cfg.pipeline.virtual_stages)]


def is_chimera(cfg: RunConfig) -> bool:
    return cfg.pipeline.order == "chimera"


def node_pipes(cfg: RunConfig, node: int) -> dict[int, int]:
    """Copy -> the (virtual) stage that copy holds on device ``node``, in canonical order (stage index):
    the order of everything a Chimera pair of devices does together. Copies are pipes under Chimera
    (the up pipe's: stage ``D - 1 - node``) and chunks in model-chunk orders (chunk j: the stage
    :func:`pipefisher.pipeline_orders.stage_on` places there, ``node + j*D`` interleaved)."""
    p = cfg.pipeline
    if p.chunked:
        return {j: stage_on(node, j, p.stages, layout_of(p.order)) for j in range(p.chunks)}
    pipes = {0: node}
    if is_chimera(cfg):
        pipes[1] = p.stages - 1 - node
    return dict(sorted(pipes.items(), key=lambda kv: kv[1]))


def loss_device(cfg: RunConfig) -> int:
    """The device holding the model's last (virtual) stage, which computes the loss: ``D - 1``, except
    in ZB-V's V, which ends on device 0 where it began."""
    p = cfg.pipeline
    return device_of_stage(p.virtual_stages - 1, p.stages, layout_of(p.order) if p.chunked else LOOP)


def node_kfac_names(cfg: RunConfig) -> list[dict[int, list[str]]]:
    """Per device, per pipe (canonical order), the K-FAC module names of the stage copy on it."""
    names = stage_kfac_names(cfg)
    return [{pipe: names[stage] for pipe, stage in node_pipes(cfg, node).items()}
            for node in range(cfg.pipeline.stages)]


def sync_copies(cfg: RunConfig, replicas: int) -> int:
    """How many copies of each stage average their K-FAC factors: the data-parallel replicas, twice
    that under Chimera (both pipes hold a copy)."""
    return replicas * (2 if is_chimera(cfg) else 1)
