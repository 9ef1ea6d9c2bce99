"""Starting workers: as this process (torchrun or a single process) or as local child processes.

``pipefisher train --nproc-per-node N`` runs :func:`launch_local`, which starts N workers on
127.0.0.1 with torchrun's environment variables, relays their output, and stops them all with a
clear error as soon as one fails (the others would otherwise wait for it until their timeout). The
error names the worker that failed first (not a peer that merely lost it) and how; tracebacks go to a
log file, not the terminal. Under torchrun (:func:`pipefisher.runtime.job.process.torchrun_env`), ``pipefisher train`` is one worker.
:func:`spawn_local` does the same for a Python function (tests, the benchmark).

Nothing here imports torch at module level, so the CLI can check its launch options first.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pipefisher.runtime.job.config import RunConfig, config_from_dict
from pipefisher.runtime.job.process import STORE_FD_ENV, Interrupted, StopRequest, store_socket, threads_per_worker

if TYPE_CHECKING:
    from pipefisher.runtime.train.trainer import TrainOptions, WorkerResult

logger = logging.getLogger(__name__)

LOG_ENV = "PIPEFISHER_WORKER_LOG"
"""Set by :func:`launch_local`: the file a worker appends its traceback to (the terminal gets one line)."""
LIFELINE_ENV = "PIPEFISHER_LIFELINE_FD"
"""Set by :func:`launch_local`: the descriptor of the lifeline a worker watches (:func:`exit_with_launcher`)."""
ERROR_MARK = "@@pipefisher-error "
"""Starts a worker's one-line error, so the launcher can quote it instead of relaying it."""
PEER_LOST_EXIT = 3
"""Exit code of a worker that failed because a peer went away: a consequence, never the first cause."""
INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C (128 + SIGINT, as shells report it), of ``pipefisher train`` and its workers."""
LAUNCHER_GONE_EXIT = 4
"""Exit code of a worker that stopped because its launcher had gone (:func:`exit_with_launcher`)."""


class WorkerFailed(RuntimeError):
    """A worker process exited with an error (or was killed)."""


_LAUNCHER_VARS = ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def worker_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of worker ``rank`` of a local launch on ``port``: torchrun's variables, and
    :data:`STORE_FD_ENV` as a client's (the launcher's rank 0 gets its socket's descriptor there)."""
    # Nothing of an outer torchrun may leak in: its agent store would make the workers wait for a
    # rendezvous that never comes.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k not in _LAUNCHER_VARS}
    # Children must import this very pipefisher, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), **{STORE_FD_ENV: "-1"},
               OMP_NUM_THREADS=str(threads_per_worker(world)), PYTHONUNBUFFERED="1")
    return env


def encode_spec(cfg: RunConfig, opts: TrainOptions) -> str:
    return json.dumps({"config": cfg.to_dict(), "options": opts.flags()})


def decode_spec(text: str) -> tuple[RunConfig, TrainOptions]:
    from pipefisher.runtime.job.options import TrainOptions

    raw = json.loads(text)
    return config_from_dict(raw["config"]), TrainOptions.of(**raw["options"])


def pin_to_one_core() -> int:
    """Pin this worker (a process ``spawn_local`` or torchrun started) to one CPU core, its rank's, so
    benchmark workers on one machine never share a core; returns the rank.

    The core is the rank's among those the process may use, so benchmarks started side by side under
    ``taskset -c 0,1`` and ``taskset -c 2,3`` keep to their own cores."""
    rank = int(os.environ["RANK"])
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {allowed[rank % len(allowed)]})
    return rank


def exit_reason(code: int) -> str:
    """How a process ended, in words: a signal by name (negative codes), else the exit code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def first_failure(exits: Sequence[tuple[int, int | None, float]], stopped: Sequence[int] = ()) -> int | None:
    """The rank whose failure ended the job, from (rank, exit code, when its exit was seen).

    A worker that only lost a peer (:data:`PEER_LOST_EXIT`) or that the launcher stopped is a
    consequence: the cause is the earliest other failure; only without one are those blamed.
    """
    bad = [(r, c, t) for r, c, t in exits if c not in (None, 0)]
    causes = [e for e in bad if e[0] not in stopped] or bad
    if not causes:
        return None
    return min(causes, key=lambda e: (e[1] == PEER_LOST_EXIT, e[2], e[0]))[0]


def failure_message(rank: int, nproc: int, code: int, error_line: str, log: str | None) -> str:
    """The one line a failed local run ends with."""
    if error_line:
        what = f": {error_line.strip()}"
    elif code < 0:
        what = ": no error message (stopped from outside: out of memory, a job scheduler, or kill)"
    else:
        what = ""
    return (f"worker rank {rank} of {nproc} {exit_reason(code)}{what}; the other workers were stopped"
            + (f"; worker output and tracebacks in {log}" if log else ""))


def run_worker(cfg: RunConfig, opts: TrainOptions) -> WorkerResult:
    """This process is one worker: join the job (env://) or, alone, run without torch.distributed."""
    from pipefisher.runtime.job.dist import init_context, shutdown
    from pipefisher.runtime.train.trainer import Trainer

    with StopRequest(defer=False):  # SIGTERM as Ctrl-C, also before the steps (which may defer it)
        ctx = init_context(cfg, json.dumps(opts.flags(), sort_keys=True))
        try:
            return Trainer(cfg, ctx, opts).run()
        finally:
            shutdown(ctx)


def launch_local(cfg: RunConfig, opts: TrainOptions, nproc: int, echo: Callable[[str], None] | None = None,
                 grace_s: float = 3.0, log_path: str | None = None) -> dict[str, list[float]] | None:
    """Run ``nproc`` workers as child processes; raise :class:`WorkerFailed` if any of them fails. Returns
    the reporting worker's run figures (:attr:`WorkerResult.figures`, passed on as a
    :data:`~pipefisher.runtime.job.progress.SUMMARY_MARK` line).

    Worker output is relayed to ``echo`` (default: logged) and kept in a log; tracebacks go to the log
    only; the reporting worker's progress marks become progress records (with ``opts.log.progress``). On
    failure the log is appended to ``log_path`` (or kept as a temp file) and the error names it; a run
    that succeeds leaves no log behind.
    """
    from pipefisher.runtime.job.progress import (PROGRESS_ENV, PROGRESS_MARK, SUMMARY_MARK, parse_mark, phase,
                                                 report_progress, report_steps_over)

    echo = echo or logger.info
    if opts.log.progress:  # the seconds until a worker speaks (python, torch, the process group) are not silent
        phase(f"spawning {nproc} workers (each starts python, imports torch and joins the process group)", echo)
    spec = encode_spec(cfg, opts)
    lock = threading.Lock()
    fd, tmp_log = tempfile.mkstemp(prefix="pipefisher-workers-", suffix=".log")
    os.close(fd)
    log = open(tmp_log, "a", encoding="utf-8")  # O_APPEND: the workers append their tracebacks too
    log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {nproc} workers of '{cfg.name}', mode {opts.mode}, "
              f"{opts.steps} steps\n")
    log.flush()
    lifeline, held = os.pipe()  # the workers watch one end; this process holds the other until they ended
    with store_socket() as sock:  # rank 0 holds the port from here (its store adopts the socket)
        port, store_fd = int(sock.getsockname()[1]), sock.fileno()
        try:
            procs = [subprocess.Popen([sys.executable, "-m", "pipefisher.runtime.launch.child", "--spec", spec],
                                      env={**worker_env(r, nproc, port), PROGRESS_ENV: "1", LOG_ENV: tmp_log,
                                           LIFELINE_ENV: str(lifeline),
                                           **({STORE_FD_ENV: str(store_fd)} if r == 0 else {})},
                                      pass_fds=(lifeline, store_fd) if r == 0 else (lifeline,),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
                     for r in range(nproc)]
        except BaseException:
            os.close(held)
            raise
        finally:
            os.close(lifeline)
    tails: list[list[str]] = [[] for _ in procs]
    errors = [""] * nproc
    done: list[int] = []  # steps done, from the reporting worker's marks (for the line after Ctrl-C)
    figures: list[dict[str, list[float]]] = []  # the reporting worker's, from its summary line
    quiet = threading.Event()  # set once a worker failed: what follows is aftermath, for the log only

    def relay(r: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            line = line.rstrip("\n")
            with lock:
                if line.startswith(PROGRESS_MARK):
                    mark = parse_mark(line)
                    if mark is not None:
                        done[:] = [opts.steps - mark[1] + mark[0]]  # the marks count this run's steps
                    if opts.log.progress and mark is not None and not quiet.is_set():
                        report_progress(*mark)
                    continue
                if line.startswith(SUMMARY_MARK):
                    figures[:] = [json.loads(line[len(SUMMARY_MARK):])]
                    continue
                if not log.closed:  # a straggler after the launcher gave up on this worker
                    log.write(f"[rank {r}] {line[len(ERROR_MARK):] if line.startswith(ERROR_MARK) else line}\n")
                    log.flush()
                if line.startswith(ERROR_MARK):
                    errors[r] = line[len(ERROR_MARK):]
                    quiet.set()
                    continue
                tails[r] = (tails[r] + [line])[-20:]
                if quiet.is_set():
                    continue
                echo(line)

    threads = [threading.Thread(target=relay, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for t in threads:
        t.start()
    seen: dict[int, float] = {}  # rank -> when its exit was first seen: who died first
    stopped: list[int] = []

    def look() -> bool:
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in seen and p.poll() is not None:
                seen[r] = now
        return len(seen) == nproc

    failed = interrupted = False
    stop = StopRequest(defer=True)  # Ctrl-C or SIGTERM: the workers stop at their next step boundary

    def bad(code: int | None) -> bool:  # after a stop, a worker's exit on it is how it should end
        return code != 0 and not (interrupted and code == INTERRUPTED_EXIT)

    try:
        try:
            with stop:
                while not look():
                    if stop.requested and not interrupted:
                        interrupted = True  # passed on: a scheduler's SIGTERM may reach this process only
                        quiet.set()
                        for p in procs:
                            if p.poll() is None:
                                try:
                                    p.send_signal(stop.signum)
                                except OSError:  # it has just exited
                                    pass
                    if any(bad(procs[r].returncode) for r in seen):
                        failed = True
                        quiet.set()
                        deadline = time.monotonic() + grace_s  # let the others exit and log their errors
                        while time.monotonic() < deadline and not look() \
                                and not all(errors[r] for r in range(nproc) if r not in seen):  # said: stop them
                            time.sleep(0.02)
                        break
                    time.sleep(0.02)
        except KeyboardInterrupt:  # a second Ctrl-C: the workers are stopped below, the caller says how far it got
            interrupted = True
            quiet.set()
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                stopped.append(r)
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        os.close(held)  # every worker has ended
        for t in threads:
            t.join(timeout=2)
        if opts.log.progress:
            report_steps_over()
        look()
        rank = first_failure([(r, p.returncode, seen.get(r, float("inf"))) for r, p in enumerate(procs)
                              if not (interrupted and p.returncode == INTERRUPTED_EXIT)], stopped)
        with lock:
            log.close()
        kept = _keep_log(tmp_log, log_path) if rank is not None or failed or interrupted else None
        if kept is None:
            os.unlink(tmp_log)
    if interrupted:
        raise Interrupted(done[0] if done else None, kept)
    if rank is not None:
        code = procs[rank].returncode
        line = errors[rank] or (next((ln for ln in reversed(tails[rank]) if ln.strip()), "") if code > 0 else "")
        raise WorkerFailed(failure_message(rank, nproc, code, line, kept))
    return figures[0] if figures else None


def _keep_log(tmp_log: str, log_path: str | None) -> str:
    """Where a failed run's worker log ends up: appended to ``log_path``, else the temp file itself."""
    if log_path is None:
        return tmp_log
    try:
        with open(tmp_log, encoding="utf-8") as src, open(log_path, "a", encoding="utf-8") as dst:
            shutil.copyfileobj(src, dst)
    except OSError:
        return tmp_log
    os.unlink(tmp_log)
    return log_path


WORKER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pipefisher.runtime.train.trainer")
"""What :func:`spawn_local`'s fork server imports once, so that no worker pays for it (seconds of torch
import per worker otherwise, which dominated short multi-process tests on 2 cores). ``torch._dynamo``:
torch imports it lazily at the first optimizer a process builds, 2 s more per worker."""


def _worker_context() -> mp.context.BaseContext:
    """A fork server that has imported :data:`WORKER_PRELOAD` where the platform has one, else spawn.

    Each worker is a fork of that server, a fresh single-threaded process that never ran the caller's
    code (as a spawned one), started in a fraction of a second. The server starts with the first call
    and serves every later one of this process."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))  # no effect once the server runs: it keeps its own
    return ctx


class _CallersFd:
    """A file descriptor of the caller that a worker receives as it starts (``Process.start`` pickles it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _detach, (DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def exit_with_launcher(lifeline: int) -> None:
    """Start a thread that waits until the launcher's end of the lifeline (a pipe only the launcher holds
    open) closes, then exits this worker at once. The kernel closes it however the launcher ends, SIGKILL
    and crashes too, where no handler of its own runs: without this, the workers of a killed ``pipefisher
    train`` (or of a benchmark's :func:`spawn_local`, the fork server's children, not its own) trained on
    to the end, unseen, beside the next run."""
    def watch() -> None:
        while os.read(lifeline, 1):
            pass
        os._exit(LAUNCHER_GONE_EXIT)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _spawn_entry(fn: Callable[..., Any], rank: int, world: int, port: int, folder: str,
                 args: Sequence[Any], env: dict[str, str], stdio: Sequence[int], store: int | None,
                 lifeline: int) -> None:
    exit_with_launcher(lifeline)
    # A fork server's child has the server's environment and output: take the caller's, as a spawned
    # worker would have inherited them.
    os.environ.clear()
    os.environ.update(env)
    for fd, theirs in zip((1, 2), stdio):
        os.dup2(theirs, fd)
        os.close(theirs)
    os.environ.update(worker_env(rank, world, port), OMP_NUM_THREADS="1")  # tests: one thread each
    if store is not None:  # rank 0: the launcher's socket, which its store adopts
        os.environ[STORE_FD_ENV] = str(store)
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

    The workers are forks of a server that imported torch once (:func:`_worker_context`), with this
    process's environment and standard output and error, as spawned processes would have.

    ``fn`` must be importable by name (a module-level function). The first failure is raised with the
    worker's traceback; the remaining workers are stopped. The workers also stop when this process ends,
    however it ends (:func:`exit_with_launcher`).
    """
    import torch

    ctx = _worker_context()
    env = dict(os.environ)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    stdio = [_CallersFd(fd) for fd in (1, 2)]
    lifeline, held = os.pipe()  # the workers read one end; this process holds the other while it lives
    with os.fdopen(held, "wb"), tempfile.TemporaryDirectory(prefix="pipefisher-spawn-") as folder:
        with store_socket() as sock:  # rank 0 holds the port from here (its store adopts the socket)
            port, store = int(sock.getsockname()[1]), _CallersFd(sock.fileno())
            procs = [ctx.Process(target=_spawn_entry, daemon=True,
                                 args=(fn, r, nprocs, port, folder, args, env, stdio, store if r == 0 else None,
                                       _CallersFd(lifeline)))
                     for r in range(nprocs)]
            try:
                for p in procs:
                    p.start()
            finally:
                os.close(lifeline)
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
