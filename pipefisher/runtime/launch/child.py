"""Internal entry point of one worker process started by the local launcher.

:func:`pipefisher.runtime.launch.local.launch_local` runs ``python -m pipefisher.runtime.launch.child --spec <json>``
(config and options already checked by ``pipefisher train``). People, and torchrun, use
``pipefisher train`` itself, which has the one set of options::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 \\
        --no-python pipefisher train --config configs/bert-base.yaml --mode kfac --steps 100

What the worker logs it prints, as ``pipefisher train`` does (:class:`~pipefisher.runtime.job.progress.LineHandler`),
its progress as mark lines for the launcher. A failure ends in one line (marked for the launcher); its
traceback goes to the launcher's log.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

from pipefisher.errors import InputError

USAGE = ("error: python -m pipefisher.runtime.launch.child is the local launcher's internal entry point; run "
         "'pipefisher train --config FILE ...' (under torchrun: 'torchrun --nproc-per-node N --no-python "
         "pipefisher train --config FILE ...')")


def _say(line: str) -> None:
    """The worker's last line, marked so the launcher quotes it in its own error."""
    from pipefisher.runtime.launch.local import ERROR_MARK

    print(f"{ERROR_MARK}{line}", file=sys.stderr, flush=True)


def _log_traceback(rank: str) -> None:
    from pipefisher.runtime.launch.local import LOG_ENV

    path = os.environ.get(LOG_ENV)
    if not path:
        traceback.print_exc()
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[rank {rank}] traceback:\n{traceback.format_exc()}")
    except OSError:
        traceback.print_exc()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--spec":
        print(USAGE, file=sys.stderr, flush=True)
        return 2
    from pipefisher.runtime.launch.local import (INTERRUPTED_EXIT, LIFELINE_ENV, PEER_LOST_EXIT, decode_spec,
                                                 exit_with_launcher, run_worker)

    if LIFELINE_ENV in os.environ:  # first, before torch: a launcher gone already ends this worker at once
        exit_with_launcher(int(os.environ[LIFELINE_ENV]))
    from pipefisher.kfac.factors import BadFactorError
    from pipefisher.runtime.job.progress import PROGRESS_ENV, SUMMARY_MARK, LineHandler, showing
    from pipefisher.runtime.train.trainer import PeerLost

    rank = os.environ.get("RANK", "0")
    try:
        cfg, opts = decode_spec(args[1])
        with showing(LineHandler()):
            result = run_worker(cfg, opts)
        if result.figures is not None and os.environ.get(PROGRESS_ENV) == "1":  # for the local launcher's caller
            print(f"{SUMMARY_MARK} {json.dumps(result.figures)}", flush=True)
    except InputError as err:
        _say(f"error: {err}")
        return 2
    except BadFactorError as err:  # one line naming the layer
        _say(f"error: {err}")
        return 1
    except PeerLost as err:  # a consequence of another worker's failure (or a stall)
        _log_traceback(rank)
        _say(f"worker rank {rank} failed: PeerLost: {err}")
        return PEER_LOST_EXIT
    except KeyboardInterrupt:  # Ctrl-C reaches every worker; the launcher says how far the run got
        return INTERRUPTED_EXIT
    except Exception as err:
        _log_traceback(rank)
        _say(f"worker rank {rank} failed: {type(err).__name__}: {err}")
        return 1
    return 0


def _exit(code: int) -> None:
    """End the worker without the interpreter's finalization, as multiprocessing's children do: its outputs
    are written (atomically) and flushed here, its process groups destroyed (:func:`pipefisher.runtime.job.dist
    .shutdown`); what finalization would still do is free torch's C++ objects (gloo's threads, the TCPStore)
    in no set order, which once aborted a finished worker (``terminate called without an active exception``,
    SIGABRT after its last line) in a suite run."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach the launcher anyway
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
