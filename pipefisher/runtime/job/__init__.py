"""The job and this process's place in it: the run config (plain dataclasses, no torch), torchrun's
variables and the cores, the torch.distributed groups, peak memory and progress lines. The bottom of
the runtime: every layer above reads these, and nothing here knows about models, data or pipelines."""
from __future__ import annotations
