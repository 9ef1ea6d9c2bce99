"""Entry point of one worker process.

Started by :func:`pipefisher.runtime.launch.launch_local` with ``--spec <json>``, or by hand under
torchrun (env://, multi-node), e.g.::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 \\
        -m pipefisher.runtime.worker --config configs/bert-base.yaml --mode kfac --steps 100
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from pipefisher.errors import InputError
from pipefisher.kfac.factors import BadFactorError


def parse(argv: list[str]) -> tuple[object, object]:
    from pipefisher.runtime.config import load_config
    from pipefisher.runtime.launch import decode_spec
    from pipefisher.runtime.trainer import MODES, TrainOptions

    ap = argparse.ArgumentParser(prog="python -m pipefisher.runtime.worker")
    ap.add_argument("--spec", help="JSON of config and options (used by the local launcher)")
    ap.add_argument("--config", help="YAML run config")
    ap.add_argument("--mode", choices=MODES, default="first-order")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--schedule", help="schedule file: scheduled mode (K-FAC in the bubbles)")
    ap.add_argument("--metrics", help="CSV of step, loss, step time, mode")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--resume", help="checkpoint folder to continue from")
    a = ap.parse_args(argv)
    if a.spec:
        return decode_spec(a.spec)
    if not a.config:
        ap.error("give --config (or --spec)")
    for folder in (a.out, a.checkpoint_dir):
        if folder:
            os.makedirs(folder, exist_ok=True)
    mode = "scheduled" if a.schedule else a.mode
    return load_config(a.config), TrainOptions(mode=mode, steps=a.steps, profile=a.profile, out=a.out,
                                               log_every=a.log_every, progress=not a.no_progress,
                                               schedule=a.schedule, metrics=a.metrics,
                                               checkpoint_dir=a.checkpoint_dir or a.resume,
                                               checkpoint_every=a.checkpoint_every, resume=a.resume)


def main(argv: list[str] | None = None) -> int:
    from pipefisher.runtime.launch import run_worker

    rank = os.environ.get("RANK", "0")
    try:
        cfg, opts = parse(sys.argv[1:] if argv is None else argv)
        run_worker(cfg, opts)  # type: ignore[arg-type]
    except InputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except BadFactorError as err:  # one line naming the layer; the launcher relays it
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # one readable line last, after the traceback, for the launcher
        traceback.print_exc()
        print(f"worker rank {rank} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
