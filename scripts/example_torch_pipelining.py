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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "interleaved": ("ScheduleInterleaved1F1B", 2),
             "zb-v": ("ScheduleZBVZeroBubble", 2), "dualpipev": ("ScheduleDualPipeV", 2)}
"""A torch schedule class (of ``torch.distributed.pipelining``) and the model chunks each rank holds."""


def schedule_class(name: str) -> tuple[Any, int]:
    """The torch schedule class of ``--schedule name`` and the chunks per rank."""
    import torch.distributed.pipelining as pipelining

    cls, per_rank = SCHEDULES[name]
    return getattr(pipelining, cls), per_rank


def make_model(chunks: int, width: int, classes: int) -> list[Any]:
    """The whole model, in ``chunks`` pieces, the same on every rank (one seed)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                          *([nn.Tanh(), nn.Linear(width, classes)] if i == chunks - 1 else []))
            for i in range(chunks)]


def batch(step: int, size: int, width: int, classes: int) -> tuple[Any, Any]:
    """A seeded batch of a learnable task: the class is which of ``classes`` fixed directions x is nearest."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    centres = torch.randn(classes, width, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, classes, (size,), generator=g)
    return centres[y] + 0.5 * torch.randn(size, width, generator=g), y


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--damping", type=float, default=0.03, help="K-FAC's damping")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="SGD's learning rate (0.1 diverged once, where the packer chose K-FAC cycles of 3 and 4 steps)")
    ap.add_argument("--out", default="torch_pp_run", help="folder for the profiled timelines and the schedule")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from pipefisher.runtime import torch_pp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule_cls, per_rank = schedule_class(args.schedule)
    width, classes, n = 32, 8, world * per_rank
    model = make_model(n, width, classes)
    # this rank's stage indices: one per rank, a loop (interleaved) or a V (zb-v, dualpipev)
    mine = [rank] if per_rank == 1 else [rank, rank + world] if args.schedule == "interleaved" else [rank, 2 * world - 1 - rank]
    stages = [PipelineStage(model[i], i, n, torch.device("cpu")) for i in mine]
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], n_microbatches=args.micro_batches,
                            loss_fn=nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=args.lr)

    pf = torch_pp.wrap(stages, schedule, folder=args.out, damping=args.damping, profile_steps=args.profile_steps)
    for step in range(args.steps):
        x, y = batch(step, 8 * args.micro_batches, width, classes)
        losses: list[Any] = []
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
