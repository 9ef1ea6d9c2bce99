#!/usr/bin/env python
"""A torchtitan-style ``torch.distributed.pipelining`` training loop, with K-FAC packed into its bubbles.

The loop is what a torch pipeline user already has: the model cut into chunks, this rank's chunks as
``PipelineStage``\\ s, a torch schedule class, an optimizer, ``schedule.step(x, target=y)``. The only
change is :func:`pipefisher.runtime.torch_pp.wrap` and calling its ``step`` instead of the schedule's:
step 0 is a plain step, the next ``--profile-steps`` run and profile K-FAC after the pipeline, then
the K-FAC work runs in the bubbles of the packed schedule (written to ``--out``).

    torchrun --nproc-per-node 2 scripts/example_torch_pipelining.py --schedule interleaved --steps 30 --out pf
    torchrun --nproc-per-node 2 scripts/example_torch_pipelining.py --schedule zb-v   # or 1f1b, dualpipev

(``python -m torch.distributed.run`` is the same as ``torchrun``.) On CPU the ranks talk over gloo.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,  # noqa: E402
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

from pipefisher.runtime import torch_pp  # noqa: E402

SCHEDULES = {"1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2), "zb-v": (ScheduleZBVZeroBubble, 2),
             "dualpipev": (ScheduleDualPipeV, 2)}
"""A torch schedule class and the model chunks each rank holds."""


def make_model(chunks: int, width: int, classes: int) -> list[nn.Module]:
    """The whole model, in ``chunks`` pieces, the same on every rank (one seed)."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                          *([nn.Tanh(), nn.Linear(width, classes)] if i == chunks - 1 else []))
            for i in range(chunks)]


def batch(step: int, size: int, width: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of a learnable task: the class is which of ``classes`` fixed directions x is nearest."""
    g = torch.Generator().manual_seed(1000 + step)
    centres = torch.randn(classes, width, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, classes, (size,), generator=g)
    return centres[y] + 0.5 * torch.randn(size, width, generator=g), y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--out", default="torch_pp_run", help="folder for the profiled timelines and the schedule")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule_cls, per_rank = SCHEDULES[args.schedule]
    width, classes, n = 32, 8, world * per_rank
    model = make_model(n, width, classes)
    # this rank's stage indices: one per rank, a loop (interleaved) or a V (zb-v, dualpipev)
    mine = [rank] if per_rank == 1 else [rank, rank + world] if args.schedule == "interleaved" else [rank, 2 * world - 1 - rank]
    device = torch.device("cpu")
    stages = [PipelineStage(model[i], i, n, device) for i in mine]
    loss_fn = nn.CrossEntropyLoss()
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], n_microbatches=args.micro_batches, loss_fn=loss_fn)
    params = [p for st in stages for p in st.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)

    pf = torch_pp.wrap(stages, schedule, folder=args.out, damping=1e-2, profile_steps=args.profile_steps)
    for step in range(args.steps):
        x, y = batch(step, 8 * args.micro_batches, width, classes)
        losses: list[torch.Tensor] = []
        pf.step(x, target=y, losses=losses)  # was: schedule.step(x, target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        if losses and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {sum(float(v) for v in losses) / len(losses):.4f}", flush=True)
    if rank == 0:
        print(f"K-FAC cycle k={pf.cycle}, schedule {pf.schedule_path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
