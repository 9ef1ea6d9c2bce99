#!/usr/bin/env python
"""A torchtitan-style ``torch.distributed.pipelining`` training loop, with K-FAC packed into its bubbles.

The loop is what a torch pipeline user already has: the model cut into chunks, this rank's chunks as
``PipelineStage``\\ s, a torch schedule class, an optimizer, ``schedule.step(x, target=y)``. The only
change is :func:`pipefisher.runtime.torch_pp.wrap` and calling its ``step`` instead of the schedule's:
step 0 is a plain step, the next ``--profile-steps`` run and profile K-FAC after the pipeline, then
the K-FAC work runs in the bubbles of the packed schedule (written to ``--out``).

    python scripts/example_torch_pipelining.py --order interleaved --steps 30 --out pf
    torchrun --nproc-per-node 2 scripts/example_torch_pipelining.py --order zb-v   # or 1f1b, gpipe, dualpipev

Run with plain ``python``, it checks ``--out`` and starts its ``--ranks`` ranks itself, under torch's
launcher (the command it runs is printed: ``python -m torch.distributed.run`` is ``torchrun``); under
``torchrun`` it is one rank. A ``--out`` that holds an earlier run's schedule is refused unless
``--overwrite``. On CPU the ranks talk over gloo.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipefisher.cli._common import add_renamed_argument  # noqa: E402

SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "gpipe": ("ScheduleGPipe", 1), "interleaved": ("ScheduleInterleaved1F1B", 2),
             "zb-v": ("ScheduleZBVZeroBubble", 2), "dualpipev": ("ScheduleDualPipeV", 2)}
"""A torch schedule class (of ``torch.distributed.pipelining``) and the model chunks each rank holds."""


def schedule_class(name: str) -> tuple[Any, int]:
    """The torch schedule class of ``--order name`` and the chunks per rank."""
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


def check_or_launch(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any rank trains, a ``--out`` the run cannot write or that holds an
    earlier run's schedule (without ``--overwrite``); under torchrun only rank 0 says it. Run with
    plain ``python``, then become torch's launcher (``torchrun``) of this script with these arguments."""
    from pipefisher.errors import InputError
    from pipefisher.runtime import torch_pp
    from pipefisher.runtime.job.process import threads_per_worker

    try:
        torch_pp.check_folder(args.out, overwrite=args.overwrite, options=("--out", "--overwrite"))
        threads = threads_per_worker(args.ranks)  # refuses a bad OMP_NUM_THREADS
    except InputError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if "RANK" in os.environ:  # a rank under torchrun
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--standalone",
               os.path.relpath(os.path.abspath(__file__)), *sys.argv[1:]]
    print(f"starting {args.ranks} ranks: {shlex.join(command)}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # torchrun warns when it is unset
    os.execv(sys.executable, command)


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_renamed_argument(ap, "--order", "--schedule", choices=sorted(SCHEDULES), default="interleaved")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--damping", type=float, default=0.03, help="K-FAC's damping")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="SGD's learning rate (0.1 diverged once, where the packer chose K-FAC cycles of 3 and 4 steps)")
    ap.add_argument("--out", default="torch_pp_run", help="folder for the profiled timelines and the schedule")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the schedule (and timelines) an earlier run wrote to --out, instead of refusing")
    ap.add_argument("--ranks", type=int, default=2,
                    help="ranks to start when run with plain python (under torchrun: its --nproc-per-node)")
    args = ap.parse_args()
    if args.ranks < 2:
        ap.error("--ranks must be at least 2 (a pipeline of one stage has no bubbles)")
    check_or_launch(args)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from pipefisher.runtime import torch_pp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule_cls, per_rank = schedule_class(args.order)
    width, classes, n = 32, 8, world * per_rank
    model = make_model(n, width, classes)
    # this rank's stage indices: one per rank, a loop (interleaved) or a V (zb-v, dualpipev)
    mine = [rank] if per_rank == 1 else [rank, rank + world] if args.order == "interleaved" else [rank, 2 * world - 1 - rank]
    stages = [PipelineStage(model[i], i, n, torch.device("cpu")) for i in mine]
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], n_microbatches=args.micro_batches,
                            loss_fn=nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=args.lr)

    pf = torch_pp.wrap(stages, schedule, folder=args.out, kfac={"damping": args.damping}, optimizer=optimizer,
                       profile_steps=args.profile_steps, overwrite=args.overwrite)
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
