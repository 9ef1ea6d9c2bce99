#!/usr/bin/env python
"""The cost of one curvature refresh per factor size, against the Cholesky inverse of the same size.

The refreshes: the damped Cholesky inverse (K-FAC), the full eigendecomposition (``kfac.update: soap``'s
basis) and SOAP's cheaper candidate, one power-iteration step from the previous basis followed by a QR
(not built: this script is how it was judged).

The packer fits the refresh labels into bubbles, so a refresh that costs more stretches the cycle k
(docs/benchmarks.md: the eigenbasis in the bubbles packed at k = 12 where Cholesky packs at 4-5). Each
method runs on the same random PSD factor (a covariance of ``2048`` rows, as a refresh sees), in
float32, on one thread, the first call untimed; printed: the median of ``--repeat`` calls in ms and
its ratio to the Cholesky inverse of the same size, measured in the same run.

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


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The median seconds of ``repeat`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
        methods = {
            "cholesky inverse (K-FAC)": lambda: inverse_findings(factor, 1e-3, method="cholesky"),
            "eigh (soap's basis)": lambda: inverse_findings(factor, 1e-3, method="eigenbasis"),
            "power step + QR (SOAP's cheaper basis, not built)": lambda: torch.linalg.qr(factor @ previous),
        }
        base = None
        for name, fn in methods.items():
            t = timed(fn, a.repeat)
            base = base or t
            print(f"n = {n:4}: {name:50} {t * 1e3:7.2f} ms  {t / base:5.2f}x the Cholesky inverse")


if __name__ == "__main__":
    main()
