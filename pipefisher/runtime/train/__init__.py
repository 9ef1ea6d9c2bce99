"""Training and its state: a worker's share of the job and its step (``worker``), the update rule and
optimizers (``update``, ``optim``), the trainer's loop (``trainer``), checkpoints, the profiler that
writes timelines, the always-on recorder of scheduled steps, and the closed loop that switches schedules
between steps (``adapt``). K-FAC state lives here, made by ``update.make_kfac`` from :mod:`pipefisher.kfac`."""
from __future__ import annotations
