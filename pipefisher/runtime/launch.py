"""Starting workers: as this process (torchrun or a single process) or as local child processes.

``pipefisher train --nproc-per-node N`` runs :func:`launch_local`, which starts N workers on
127.0.0.1 with torchrun's environment variables, relays their output, and stops them all with a
clear error as soon as one fails (the others would otherwise wait for it until their timeout).
:func:`spawn_local` does the same for a Python function (tests, the benchmark).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from pipefisher.runtime.config import RunConfig, config_from_dict
from pipefisher.runtime.trainer import TrainOptions, WorkerResult


class WorkerFailed(RuntimeError):
    """A worker process exited with an error (or was killed)."""


def worker_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    # Children must import this very pipefisher, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


def encode_spec(cfg: RunConfig, opts: TrainOptions) -> str:
    return json.dumps({"config": cfg.to_dict(), "options": opts.__dict__})


def decode_spec(text: str) -> tuple[RunConfig, TrainOptions]:
    raw = json.loads(text)
    return config_from_dict(raw["config"]), TrainOptions(**raw["options"])


def run_worker(cfg: RunConfig, opts: TrainOptions) -> WorkerResult:
    """This process is one worker: join the job (env://) or, alone, run without torch.distributed."""
    import torch

    from pipefisher.runtime.dist import check_agreement, init_from_env, shutdown, single_process
    from pipefisher.runtime.trainer import Trainer

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s,
                            chimera=cfg.pipeline.schedule == "chimera")
    else:
        if cfg.pipeline.stages != 1:
            raise ValueError("a pipeline of several stages needs several workers (use --nproc-per-node)")
        torch.set_num_threads(1)
        ctx = single_process()
    try:
        check_agreement(ctx, cfg.fingerprint() + json.dumps(opts.__dict__, sort_keys=True))
        return Trainer(cfg, ctx, opts).run()
    finally:
        shutdown(ctx)


def launch_local(cfg: RunConfig, opts: TrainOptions, nproc: int, echo: Callable[[str], None] = print,
                 grace_s: float = 3.0) -> None:
    """Run ``nproc`` workers as child processes; raise :class:`WorkerFailed` if any of them fails."""
    from pipefisher.runtime.dist import free_port

    from pipefisher.runtime.trainer import PROGRESS_ENV, PROGRESS_MARK

    port = free_port()
    spec = encode_spec(cfg, opts)
    bar = _RelayBar(opts.steps, echo) if opts.progress else None
    lock = threading.Lock()
    procs = [subprocess.Popen([sys.executable, "-m", "pipefisher.runtime.worker", "--spec", spec],
                              env={**worker_env(r, nproc, port), PROGRESS_ENV: "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, bufsize=1)
             for r in range(nproc)]
    tails: list[list[str]] = [[] for _ in procs]

    def relay(r: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            line = line.rstrip("\n")
            with lock:
                if line.startswith(PROGRESS_MARK):
                    if bar is not None:
                        bar.advance()
                    continue
                tails[r] = (tails[r] + [line])[-20:]
                if bar is not None:
                    bar.clear()
                echo(line)

    threads = [threading.Thread(target=relay, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for t in threads:
        t.start()
    failed: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in procs):
            bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad:
                failed = bad[0]
                deadline = time.monotonic() + grace_s  # let the others report their own errors
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in threads:
            t.join(timeout=2)
        if bar is not None:
            bar.clear()
    if failed is None:
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        failed = bad[0] if bad else None
    if failed is not None:
        r, code = failed
        last = next((ln for ln in reversed(tails[r]) if ln.strip()), "")
        raise WorkerFailed(f"worker rank {r} of {nproc} exited with code {code}"
                           + (f": {last.strip()}" if last else "") + "; the other workers were stopped")


class _RelayBar:
    """A one-line progress bar over steps, drawn by the launcher from the reporting worker's marks.

    On a terminal it is redrawn in place (and wiped before other output); elsewhere it stays silent,
    since the loss lines already show progress.
    """

    def __init__(self, total: int, echo: Callable[[str], None]) -> None:
        self.total, self.done, self.echo = total, 0, echo
        self.tty = sys.stdout.isatty()

    def advance(self) -> None:
        self.done += 1
        if self.tty:
            width = 30
            fill = int(width * self.done / max(1, self.total))
            sys.stdout.write(f"\rtraining [{'#' * fill}{'-' * (width - fill)}] {self.done}/{self.total}")
            sys.stdout.flush()

    def clear(self) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def _spawn_entry(fn: Callable[..., Any], rank: int, world: int, port: int, folder: str,
                 args: Sequence[Any]) -> None:
    os.environ.update(worker_env(rank, world, port))
    try:
        import torch

        torch.set_num_threads(1)
        value = fn(*args)
        with open(os.path.join(folder, f"rank{rank}.pt"), "wb") as f:
            torch.save(value, f)
    except BaseException:
        with open(os.path.join(folder, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


def spawn_local(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes set up like torchrun workers; their return values.

    ``fn`` must be importable by name (a module-level function). The first failure is raised with the
    worker's traceback; the remaining workers are stopped.
    """
    import torch

    from pipefisher.runtime.dist import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pipefisher-spawn-") as folder:
        procs = [ctx.Process(target=_spawn_entry, args=(fn, r, nprocs, port, folder, args), daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    time.sleep(0.5)
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(10)
        errors = []
        for r in range(nprocs):
            err = os.path.join(folder, f"rank{r}.err")
            if os.path.exists(err):
                with open(err) as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors:
            raise WorkerFailed("\n".join(errors))
        if any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise WorkerFailed(f"workers did not finish within {timeout_s:.0f} s (exit codes {codes})")
        out = []
        for r in range(nprocs):
            path = os.path.join(folder, f"rank{r}.pt")
            if not os.path.exists(path):
                raise WorkerFailed(f"worker rank {r} of {nprocs} exited without a result")
            with open(path, "rb") as f:
                out.append(torch.load(f, weights_only=False))
        return out
