"""Process layout and torch.distributed set-up: who is which stage of which replica, and groups.

Rank ``r`` is stage ``r % stages`` of data-parallel replica ``r // stages``, so each replica's pipeline
is a block of consecutive ranks (one node per pipeline under ``torchrun --nproc-per-node stages``).
Under Chimera, device ``d`` of a replica also holds the up pipe's copy of stage ``D - 1 - d``, so the
replicas of its two stages live on devices ``d`` and ``D - 1 - d`` of every replica: that pair (times
the replicas) is the group its gradients and K-FAC factors are averaged over.
Every group gets a timeout, so a dead or diverging peer ends in an error instead of a hang.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipefisher.runtime.job.config import PipelineConfig, RunConfig
from pipefisher.runtime.job.process import STORE_FD_ENV, threads_per_worker, torchrun_env


class StageMismatchError(RuntimeError):
    """Workers of one job started with different configurations."""


@dataclass(frozen=True)
class Grid:
    """Position of one worker in the (replica x stage) grid."""

    rank: int
    world_size: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.world_size % self.stages:
            raise ValueError(f"world size {self.world_size} is not a multiple of {self.stages} pipeline stages")

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    @property
    def prev_rank(self) -> int | None:
        return None if self.stage == 0 else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.stage == self.stages - 1 else self.rank + 1

    def dp_ranks(self, stage: int | None = None) -> list[int]:
        s = self.stage if stage is None else stage
        return [self.rank_of(s, r) for r in range(self.replicas)]

    @property
    def mirror(self) -> int:
        """The device whose stages are this one's, the other way round (Chimera's partner)."""
        return self.stages - 1 - self.stage

    def pair_ranks(self, stage: int | None = None) -> list[int]:
        """Every rank holding a copy of ``stage``'s two Chimera stages (it and its mirror), sorted."""
        s = self.stage if stage is None else stage
        return sorted({self.rank_of(d, r) for d in (s, self.stages - 1 - s) for r in range(self.replicas)})


@dataclass
class DistContext:
    """Everything a worker needs to talk to the others."""

    grid: Grid
    device: torch.device
    backend: str | None  # None: a single process without torch.distributed
    dp_group: Any = None
    pipe_group: Any = None  # the stages of this worker's replica (global norms, KL-clip); None alone
    stage_group: Any = None  # every replica of this device's stage(s): gradients and K-FAC factors
    stage_group_size: int = 1
    chimera: bool = False  # two pipes: this device also holds the up pipe's copy of stage ``mirror``
    pair_grad_group: Any = None  # Chimera: the stage group's ranks again, for the gradient buckets alone
    # every rank, over gloo on the host: small flags all ranks agree on (a stop request) without a device
    # round trip (NCCL), and without queueing behind the job's own collectives
    host_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def grad_group(self) -> Any:
        """The group the gradient buckets all-reduce over: the stage group's ranks. Under Chimera a group
        of its own, since the pair's two devices start their buckets at different points of their
        schedules than their K-FAC factor all-reduces (:mod:`pipefisher.runtime.pipeline.buckets`)."""
        return self.pair_grad_group if self.chimera and self.pair_grad_group is not None else self.stage_group


def single_process(device: torch.device | None = None) -> DistContext:
    """A context for one process holding the whole model (tests, references, 1-stage runs)."""
    return DistContext(Grid(0, 1, 1), device or torch.device("cpu"), None)


def gpu_of(local_rank: int, local_workers: int, gpus: int) -> int:
    """The GPU a worker takes: its own, since NCCL refuses two ranks of a group on one device.

    More workers than GPUs on a machine is refused here, in one line, instead of in NCCL's
    "duplicate GPU" error at the first collective.
    """
    if local_workers > gpus:
        raise ValueError(f"{local_workers} workers on this machine but {gpus} GPU(s): NCCL gives each worker "
                         f"its own GPU; start at most {gpus} per machine (--nproc-per-node), or hide the GPUs "
                         "(CUDA_VISIBLE_DEVICES=) to train on CPU with gloo")
    return local_rank


def pick_device(local_rank: int, local_workers: int = 1) -> tuple[torch.device, str]:
    """NCCL on the worker's own GPU when CUDA is there, gloo on CPU otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = gpu_of(local_rank, local_workers, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index), "nccl"
    return torch.device("cpu"), "gloo"


def init_from_env(stages: int, timeout_s: float, chimera: bool = False) -> DistContext:
    """Join the job described by torchrun-style environment variables (env://).

    ``chimera``: the stage group is the Chimera pair (devices ``d`` and ``D - 1 - d`` of every
    replica) instead of the data-parallel replicas of one device.
    """
    job = torchrun_env()
    if job is None:
        raise ValueError("init_from_env needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun)")
    rank, world, local_rank = job.rank, job.world_size, job.local_rank
    grid = Grid(rank, world, stages)
    device, backend = pick_device(local_rank, job.local_world_size)
    if device.type == "cpu":  # the user's OMP_NUM_THREADS, else this machine's cores shared out
        torch.set_num_threads(threads_per_worker(job.local_world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    join_process_group(backend, rank, world, timeout, **kwargs)
    dp_group = pipe_group = None
    for s in range(stages):  # every rank must create every group, in the same order
        ranks = grid.dp_ranks(s)
        group = dist.new_group(ranks, timeout=timeout) if grid.replicas > 1 else None
        if s == grid.stage:
            dp_group = group
    for r in range(grid.replicas):
        ranks = [grid.rank_of(s, r) for s in range(stages)]
        group = dist.new_group(ranks, timeout=timeout) if stages > 1 else None
        if r == grid.replica:
            pipe_group = group
    stage_group, size, grad_group = dp_group, grid.replicas, None
    if chimera:
        if stages % 2:
            raise ValueError(f"Chimera needs an even number of pipeline stages, not {stages}")
        size = 2 * grid.replicas
        for s in range(stages // 2):
            group = dist.new_group(grid.pair_ranks(s), timeout=timeout)
            grads = dist.new_group(grid.pair_ranks(s), timeout=timeout)
            if s in (grid.stage, grid.mirror):
                stage_group, grad_group = group, grads
    host_group = dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(grid, device, backend, dp_group, pipe_group, stage_group, size, chimera, grad_group,
                       host_group)


def check_agreement(ctx: DistContext, fingerprint: str) -> None:
    """Fail on every worker, with the odd ones named, unless all started from the same configuration."""
    if not ctx.distributed:
        return
    everyone: list[Any] = [None] * ctx.grid.world_size
    dist.all_gather_object(everyone, fingerprint)
    odd = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if odd:
        raise StageMismatchError(
            f"workers disagree on the run configuration: ranks {odd} differ from rank 0 "
            f"({everyone[odd[0]]} vs {everyone[0]}); start every worker with the same config")


def init_context(cfg: RunConfig, agree_on: str = "") -> DistContext:
    """Join the job torchrun (or any env:// launcher) started, or run alone when there is none.

    Checks that every worker has the same config (and ``agree_on``: the launcher adds its options), so
    stages never train different setups.
    """
    if torchrun_env() is not None:
        ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s,
                            chimera=cfg.pipeline.order == "chimera")
    else:
        if cfg.pipeline.stages != 1:
            raise ValueError("a pipeline of several stages needs several workers (pipefisher train "
                             "--nproc-per-node, or torchrun)")
        device, _ = pick_device(0)  # the GPU where there is one, as a launched worker would take
        if device.type == "cpu":
            torch.set_num_threads(threads_per_worker(1))
        ctx = single_process(device)
    try:
        check_agreement(ctx, cfg.fingerprint() + agree_on)
    except BaseException:
        shutdown(ctx)
        raise
    return ctx


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def join_process_group(backend: str, rank: int | None = None, world: int | None = None,
                       timeout: datetime.timedelta | None = None, **kwargs: Any) -> None:
    """``init_process_group`` for a worker of a local launch (through the store on the launcher's socket,
    :func:`pipefisher.runtime.job.process.store_socket`) or of any other env:// launcher such as
    torchrun. ``rank`` and ``world``: the environment's ``RANK`` and ``WORLD_SIZE`` where not given;
    ``timeout``: ``pipeline.timeout_s``'s default where not given. Every rank of a job must join the same
    way: a store passed in is not prefixed as env://'s is."""
    timeout = datetime.timedelta(seconds=PipelineConfig.timeout_s) if timeout is None else timeout
    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world is None else world
    fd = os.environ.get(STORE_FD_ENV)
    if fd is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout,
                                **kwargs)
        return
    listen = int(fd) if rank == 0 else None
    if listen is not None and listen < 0:
        raise ValueError(f"{STORE_FD_ENV}={fd} on rank 0: only pipefisher's local launchers set it (to the "
                         "socket they hand rank 0); unset it when another launcher such as torchrun starts the job")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=timeout, master_listen_fd=listen)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
