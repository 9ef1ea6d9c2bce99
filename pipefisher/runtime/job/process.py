"""This process in its job: torchrun's variables, its share of the machine's cores, and Ctrl-C.

No torch here: the CLI reads these before it refuses a bad launch, and every layer above (the process
set-up, the trainer, the launcher) takes them from here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from pipefisher.errors import InputError


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while training: how many steps were done (None: the first had not ended) and, from the local
    launcher, where the workers' output was kept (None: nowhere)."""

    def __init__(self, steps_done: int | None, log: str | None = None) -> None:
        super().__init__(steps_done)
        self.steps_done, self.log = steps_done, log


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
