"""Peak memory of this worker process, resettable, so one process can measure several runs in turn.

On CPU the figure is the resident set's high-water mark (``VmHWM``; Linux resets it when "5" is
written to ``/proc/self/clear_refs``); on CUDA it is the allocator's peak of the device's memory.
"""
from __future__ import annotations

import resource
import sys

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then counts from the process start


def peak_bytes(device: torch.device) -> int:
    """Peak memory since the last :func:`reset_peak` (or the process start)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(usage if sys.platform == "darwin" else usage * 1024)


def mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"
