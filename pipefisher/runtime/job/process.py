"""This process in its job: torchrun's variables, its share of the machine's cores, Ctrl-C or SIGTERM,
and the port a local launch's workers meet on.

No torch here: the CLI reads these before it refuses a bad launch, and every layer above (the process
set-up, the trainer, the launcher) takes them from here.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from pipefisher.errors import InputError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops a run: Ctrl-C, and SIGTERM (what a cluster scheduler sends before it preempts a job)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) while a run worked: how many steps of its ``phase`` were done (None: the first
    had not ended) of ``total`` (None: the run's ``--steps``); from the local launcher, where the workers'
    output was kept (None: nowhere); from ``pipefisher run``, the run's files (``paths``, its
    :class:`~pipefisher.runtime.job.files.RunPaths`; None before it had any). ``phase``: ``training``,
    ``profiling``, ``packing`` or ``starting`` (before the first of them)."""

    def __init__(self, steps_done: int | None, log: str | None = None, phase: str = "training",
                 total: int | None = None, paths: Any = None) -> None:
        super().__init__(steps_done)
        self.steps_done, self.log, self.phase, self.total, self.paths = steps_done, log, phase, total, paths

    @classmethod
    def of(cls, err: KeyboardInterrupt, phase: str = "training", total: int | None = None,
           paths: Any = None) -> "Interrupted":
        """``err`` as an :class:`Interrupted` of ``phase`` (a bare Ctrl-C: no step done yet), keeping the
        steps and log it knows."""
        if isinstance(err, Interrupted):
            return cls(err.steps_done, err.log, phase, total, paths if paths is not None else err.paths)
        return cls(None, None, phase, total, paths)


class StopRequest:
    """SIGINT and SIGTERM while in the ``with`` block: with ``defer``, the first only asks the run to stop
    (:attr:`requested`; the loop stops at its next step boundary, checkpointing there), a later one stops
    it at once; without, every one stops it at once (``KeyboardInterrupt``). A signal within
    :attr:`REPEAT_S` seconds of the first is the same stop: a terminal's Ctrl-C reaches every process of
    the job, and a launcher forwards what it got to its workers too. A signal the process ignores (a
    job started in the background) stays ignored. Outside the main thread it changes nothing."""

    REPEAT_S = 1.0

    def __init__(self, defer: bool = True) -> None:
        self.defer = defer
        self.signum: int | None = None  # the first stop signal received
        self._at = 0.0
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is not None and now - self._at < self.REPEAT_S:
            return  # the same stop, from another sender
        first = self.signum is None
        if first:
            self.signum, self._at = signum, now
        if not (first and self.defer):
            raise KeyboardInterrupt


@dataclass(frozen=True)
class JobEnv:
    """This process's place in a job started by torchrun (or any launcher setting its variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(env: Mapping[str, str] | None = None) -> JobEnv | None:
    """This worker's place when torchrun started this process, else None.

    torchrun sets ``TORCHELASTIC_RUN_ID``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; either the first or ``RANK`` with ``WORLD_SIZE`` means "you are one worker", and
    then the rest must be there too (an :class:`InputError` naming what is missing, not a hang).
    """
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env and not ("RANK" in env and "WORLD_SIZE" in env):
        return None
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if missing:
        raise InputError(None, f"this process runs under torchrun (or has its variables set) but "
                               f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; "
                               "start it with torchrun, or unset RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID")
    values = {}
    for var, fallback in (("RANK", None), ("WORLD_SIZE", None), ("LOCAL_RANK", "RANK"),
                          ("LOCAL_WORLD_SIZE", "WORLD_SIZE")):
        text = env.get(var) or env[fallback or var]
        try:
            values[var] = int(text)
        except ValueError:
            raise InputError(None, f"environment variable {var}={text!r} is not a whole number") from None
    job = JobEnv(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
    if job.world_size < 1 or not 0 <= job.rank < job.world_size:
        raise InputError(None, f"environment variables RANK={job.rank} and WORLD_SIZE={job.world_size} do "
                               "not fit together")
    return job


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def threads_per_worker(workers: int, env: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """Torch threads for each of ``workers`` processes on this machine: the user's ``OMP_NUM_THREADS``
    if set, else the cores shared out (at least one), so workers neither idle cores nor fight over them."""
    env = os.environ if env is None else env
    text = env.get("OMP_NUM_THREADS", "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise InputError(None, f"environment variable OMP_NUM_THREADS={text!r} must be a positive whole number")
        return n
    return max(1, (cpu_count() if cores is None else cores) // max(1, workers))


STORE_FD_ENV = "PIPEFISHER_STORE_FD"
"""Set on every worker of a local launch (:func:`pipefisher.runtime.launch.local.worker_env`): on rank 0,
the file descriptor of the launcher's :func:`store_socket`, which rank 0's store adopts; ``-1`` on the
others, which connect to it as clients."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for a launch of one's own (as
    ``examples/own_model.py``'s ``mp.spawn``). Another process may take it before rank 0's store binds
    it: the project's own launchers hold theirs from the start instead (:func:`store_socket`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def store_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 and listening: the port of a local launch, held from the
    moment it is chosen. Rank 0's store adopts the socket (:data:`STORE_FD_ENV`), so no other process can
    take the port between its choice and the store's start, as two test suites side by side once did
    (``EADDRINUSE``). Workers that connect before rank 0 adopts it wait in its backlog."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(128)
    except BaseException:
        s.close()
        raise
    return s
