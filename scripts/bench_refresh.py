#!/usr/bin/env python
"""The cost of one curvature refresh per factor size, against the Cholesky inverse of the same size.

The refreshes: the damped Cholesky inverse as K-FAC computes it (with the findings that say whether it is
honest), the same Cholesky inverse bare (torch's two calls, nothing else: the floor), a whole inverse
label as the runtime runs it (``KFAC.inv`` on factor A of one linear layer: the running average, the pi
damping split, the inverse and its fallback, no drift measurement), the full eigendecomposition
(``kfac.update: soap``'s basis) and SOAP's cheaper candidate, one power-iteration step from the previous
basis followed by a QR (not built: this script is how it was judged).

The packer fits the refresh labels into bubbles, so a refresh that costs more stretches the cycle k
(docs/benchmarks.md: the eigenbasis in the bubbles packed at k = 12 where Cholesky packs at 4-5). Each
method runs on the same random PSD factor (a covariance of ``2048`` rows, as a refresh sees; the label
builds its factor from 2048 random input rows), in float32, on one thread, the first call untimed;
printed: the median of ``--repeat`` calls in ms and its ratio to K-FAC's Cholesky inverse of the same
size, measured in the same run.

    python scripts/bench_refresh.py [--sizes 129,513] [--repeat 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed_inside(call: Callable[[], float], repeat: int) -> float:
    """The median of ``repeat`` times ``call`` measures itself (its own set-up untimed), after one untimed."""
    call()
    return statistics.median(call() for _ in range(repeat))


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The median seconds of ``repeat`` calls of ``fn``, after one untimed call."""
    def call() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed_inside(call, repeat)


def label_call(n: int) -> Callable[[], object]:
    """One inverse label, ``KFAC.inv("A", ...)``, of a linear layer whose factor A is ``n`` wide (``n - 1``
    inputs and a bias), timed alone: its covariance is refilled before each call, untimed."""
    import torch
    from torch import nn

    from pipefisher.kfac import KFAC

    layer = nn.Linear(n - 1, n - 1)
    kfac = KFAC(nn.Sequential(layer), damping=1e-3, loss_scale=1, drift=False)
    name = kfac.names[0]
    rows = torch.randn(2048, n - 1)

    def refill() -> None:
        kfac.set_saving(True)
        layer(rows).square().mean().backward()
        kfac.set_saving(False)
        for factor in "AB":
            kfac.cov_all(factor, name)

    def call() -> float:
        refill()
        start = time.perf_counter()
        kfac.inv("A", name)
        elapsed = time.perf_counter() - start
        kfac.inv("B", name)
        return elapsed
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="129,513", help="factor sizes (small.yaml's K-FAC factors are 128-513)")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    import torch

    from pipefisher.kfac.factors import inverse_findings

    torch.set_num_threads(1)  # one core per stage, as the benchmarks run
    torch.manual_seed(0)
    for n in (int(x) for x in a.sizes.split(",")):
        rows = torch.randn(2048, n)
        factor = rows.t() @ rows / rows.shape[0]
        previous = torch.linalg.eigh(factor)[1]  # the basis a power step starts from
        damped = factor + 1e-3 * torch.eye(n)
        methods = {
            "cholesky inverse (K-FAC)": lambda: inverse_findings(factor, 1e-3, method="cholesky"),
            "cholesky inverse, bare (torch's two calls)": lambda: torch.cholesky_inverse(torch.linalg.cholesky(damped)),
            "eigh (soap's basis)": lambda: inverse_findings(factor, 1e-3, method="eigenbasis"),
            "power step + QR (SOAP's cheaper basis, not built)": lambda: torch.linalg.qr(factor @ previous),
        }
        base = None
        for name, fn in methods.items():
            t = timed(fn, a.repeat)
            base = base or t
            print(f"n = {n:4}: {name:50} {t * 1e3:7.2f} ms  {t / base:5.2f}x the Cholesky inverse")
            if name.startswith("cholesky inverse, bare"):
                t = timed_inside(label_call(n), a.repeat)
                print(f"n = {n:4}: {'inverse label (KFAC.inv, factor A, no drift)':50} {t * 1e3:7.2f} ms  "
                      f"{t / base:5.2f}x the Cholesky inverse")


if __name__ == "__main__":
    main()
