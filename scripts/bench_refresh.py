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
builds its factor from 2048 random input rows), in ``--dtype`` (float32) on ``--device`` (cpu: one thread;
cuda: every clock read after ``torch.cuda.synchronize()``, as a GPU runs its work after the call returns),
the first call untimed; printed: the median of ``--repeat`` calls in ms and its ratio to K-FAC's Cholesky
inverse of the same size, measured in the same run.

Then each refresh in pieces (:mod:`pipefisher.kfac.refresh`, ``kfac.refresh_pieces``) against the whole
one, per ``--pieces`` count: the total time and the largest piece (medians over ``--repeat`` runs, the
whole timed between them, so that the machine's load falls on both alike), against the whole and the
largest against an even share (``total / p``: 1.00 is balanced), and the quality: for the Cholesky inverse the residual ``||(F + damping I) X - I|| / ||I||`` (Frobenius) beside
the whole inverse's; for the eigenbasis (one power step from the previous refresh's basis, the basis of
the same kind of factor from other rows) the off-diagonal mass ``||offdiag(Q^T F Q)|| / ||Q^T F Q||``
beside ``eigh``'s and the previous basis's; then each piece's median in order. Then a candidate made of
matrix products alone, Newton-Schulz iterations (:func:`newton_schulz_line`, not built).

Then, with ``--model CONFIG``, every inverse label of that config's model under ``kfac.update: soap``
against the bare ``eigh`` of the same factors' diagonal blocks (:func:`model_refresh`).

    python scripts/bench_refresh.py [--sizes 129,513] [--repeat 7] [--pieces 2,4,8] [--device cpu|cuda]
        [--dtype float32|float64] [--model configs/small.yaml [--basis-block 129]]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYNC: list[Callable[[], object]] = []  # torch.cuda.synchronize on cuda (main sets it), nothing on cpu


def now() -> float:
    """``time.perf_counter()`` once the device has finished the work queued so far: every timing reads this
    clock, so that on a GPU it times the work, not its launch."""
    for sync in SYNC:
        sync()
    return time.perf_counter()


def timed_inside(call: Callable[[], float], repeat: int) -> float:
    """The median of ``repeat`` times ``call`` measures itself (its own set-up untimed), after one untimed."""
    call()
    return statistics.median(call() for _ in range(repeat))


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The median seconds of ``repeat`` calls of ``fn``, after one untimed call."""
    def call() -> float:
        start = now()
        fn()
        return now() - start
    return timed_inside(call, repeat)


def label_call(n: int, like: Any) -> Callable[[], object]:
    """One inverse label, ``KFAC.inv("A", ...)``, of a linear layer whose factor A is ``n`` wide (``n - 1``
    inputs and a bias), on ``like``'s device and in its dtype, timed alone: its covariance is refilled
    before each call, untimed."""
    import torch
    from torch import nn

    from pipefisher.kfac import KFAC

    layer = nn.Linear(n - 1, n - 1, device=like.device, dtype=like.dtype)
    kfac = KFAC(nn.Sequential(layer), damping=1e-3, loss_scale=1, drift=False)
    name = kfac.names[0]
    rows = torch.randn(2048, n - 1, device=like.device, dtype=like.dtype)

    def refill() -> None:
        kfac.set_saving(True)
        layer(rows).square().mean().backward()
        kfac.set_saving(False)
        for factor in "AB":
            kfac.cov_all(factor, name)

    def call() -> float:
        refill()
        start = now()
        kfac.inv("A", name)
        elapsed = now() - start
        kfac.inv("B", name)
        return elapsed
    return call


def piece_times(make: Callable[[], object], repeat: int,
                whole: Callable[[], object] | None = None) -> tuple[float, float, float, list[float]]:
    """The median total and the median largest piece, in seconds, of a refresh ``make()`` builds (untimed)
    and that runs piece by piece (:meth:`pipefisher.kfac.refresh.Refresh.step`), after one untimed run,
    the median time of ``whole`` called before each run (nan without it), and each piece's median in
    order (which piece is the long one)."""
    totals, largest, wholes, each = [], [], [], []
    for i in range(repeat + 1):
        if whole is not None:
            start = now()
            whole()
            wholes.append(now() - start)
        refresh: Any = make()
        times = []
        while not refresh.finished:
            start = now()
            refresh.step()
            times.append(now() - start)
        if i:
            totals.append(sum(times))
            largest.append(max(times))
            each.append(times)
    return statistics.median(totals), statistics.median(largest), \
        statistics.median(wholes[1:]) if whole is not None else float("nan"), \
        [statistics.median(piece) for piece in zip(*each)]


def each_piece(times: list[float]) -> str:
    """Each piece's median in ms, in order."""
    return "/".join(f"{t * 1e3:.2f}" for t in times)


def residual(damped: Any, inverse: Any) -> float:
    """``||damped @ inverse - I|| / ||I||`` (Frobenius): how far an inverse is from exact."""
    import torch

    eye = torch.eye(damped.shape[0], dtype=torch.float64, device=damped.device)
    return float((damped.double() @ inverse.double() - eye).norm() / eye.norm())


def off_diagonal(factor: Any, basis: Any) -> float:
    """``||offdiag(Q^T F Q)|| / ||Q^T F Q||``: 0 for F's eigenbasis."""
    import torch

    rotated = basis.double().t() @ factor.double() @ basis.double()
    return float((rotated - torch.diag(rotated.diagonal())).norm() / rotated.norm())


def pieces_table(n: int, factor: Any, previous: Any, pieces: list[int], repeat: int) -> tuple[float, float]:
    """Each refresh in ``pieces`` pieces against the whole (see the module's docstring); one line each.
    Returns the whole Cholesky inverse's median seconds and its residual, which the next line compares with."""
    import torch

    from pipefisher.kfac.factors import inverse_findings
    from pipefisher.kfac.refresh import Refresh

    damped = factor + 1e-3 * torch.eye(n, device=factor.device, dtype=factor.dtype)
    invert = lambda: inverse_findings(factor, 1e-3, method="cholesky", dtype=factor.dtype)  # the whole inverse
    whole_inv = timed(invert, repeat)
    whole_res = residual(damped, invert()[0])
    eigh_off = off_diagonal(factor, inverse_findings(factor, 1e-3, method="eigenbasis", dtype=factor.dtype)[0])
    prev_off = off_diagonal(factor, previous)
    power = lambda p: Refresh(factor, 1e-3, method="eigenbasis", dtype=factor.dtype, pieces=p, basis=previous)
    for p in pieces:
        make = lambda p=p: Refresh(factor, 1e-3, method="cholesky", dtype=factor.dtype, pieces=p)
        total, big, whole, each = piece_times(make, repeat, invert)
        done = make()
        done.finish()
        print(f"n = {n:4}: cholesky inverse in {p:2} pieces: total {total * 1e3:7.2f} ms ({total / whole:4.2f}x "
              f"whole), largest piece {big * 1e3:6.2f} ms ({big / whole:4.2f}x whole, {big * p / total:4.2f}x "
              f"total/p), residual {residual(damped, done.result()[0]):.2e} (whole {whole_res:.2e}), "
              f"each {each_piece(each)} ms")
    for p in pieces:
        total, big, _, each = piece_times(lambda p=p: power(p), repeat)
        done = power(p)
        done.finish()
        print(f"n = {n:4}: eigenbasis power step in {p} pieces: total {total * 1e3:7.2f} ms, largest piece "
              f"{big * 1e3:6.2f} ms ({big / whole_inv:4.2f}x the whole Cholesky inverse), off-diagonal mass "
              f"{off_diagonal(factor, done.result()[0]):.2e} (eigh {eigh_off:.2e}, previous basis {prev_off:.2e}), "
              f"each {each_piece(each)} ms")
    return whole_inv, whole_res


def newton_schulz_line(n: int, factor: Any, previous: Any, whole: float, whole_res: float, repeat: int,
                       most: int = 30) -> None:
    """A candidate for pieces made of matrix products alone (not built: this line is how it is judged):
    Newton-Schulz iterations ``X <- X (2I - M X)`` towards ``M^-1`` (``M`` the damped factor), each
    iteration a piece of two products, started from the previous refresh's inverse (``previous``: the
    same kind of factor from other rows) or from ``I / ||M||`` (always converges, slowly). Printed: one
    iteration's time against the whole Cholesky inverse (``whole`` seconds, residual ``whole_res``, as
    :func:`pieces_table` measured them), and the iterations each start needs to reach twice that residual
    (at most ``most``)."""
    import torch

    from pipefisher.kfac.factors import inverse_findings

    eye = torch.eye(n, device=factor.device, dtype=factor.dtype)
    damped = factor + 1e-3 * eye
    target = 2 * whole_res
    step = lambda x: x @ (2 * eye - damped @ x)
    one = timed(lambda: step(eye), repeat)

    def iterations(x: Any) -> str:
        for i in range(1, most + 1):
            x = step(x)
            r = residual(damped, x)
            if r <= target:
                return str(i)
            if not r < 1e6:  # nan or growing: M X has eigenvalues beyond (0, 2)
                return f"none (diverges: residual {r:.1e} at {i})"
        return f"not within {most} (residual {r:.1e})"
    start = inverse_findings(previous, 1e-3, method="cholesky", dtype=factor.dtype)[0]
    print(f"n = {n:4}: Newton-Schulz (not built): one iteration {one * 1e3:7.2f} ms ({one / whole:4.2f}x the whole "
          f"Cholesky inverse); iterations to twice its residual: from the previous inverse "
          f"{iterations(start)}, from I / ||M|| {iterations(eye / damped.norm())}")


def model_refresh(config: str, basis_block: int, repeat: int) -> None:
    """Every inverse label of ``config``'s model on one stage under ``kfac.update: soap`` (``KFAC.inv`` on
    each factor, the refresh's own work around the ``eigh``: the running average, pi, the findings, the
    fallback), against the bare ``eigh`` of the same factors' diagonal blocks: what the label adds to the
    decomposition it cannot avoid, measured in the same run. Each refresh's covariance is refilled by one
    pipeline step, untimed."""
    import torch

    from pipefisher.kfac.factors import diagonal_blocks, scaled_factor
    from pipefisher.runtime.data.batches import MLMData
    from pipefisher.runtime.job.config import apply_overrides, load_config
    from pipefisher.runtime.job.dist import single_process
    from pipefisher.runtime.models.bert import PipelineStage
    from pipefisher.runtime.pipeline.engine import PipelineEngine, pipeline_ops
    from pipefisher.runtime.train.update import make_kfac

    cfg = apply_overrides(load_config(config), ["pipeline.stages=1", "kfac.update=soap", "kfac.refresh_pieces=1",
                                                   f"kfac.basis_block={basis_block}"])
    stage = PipelineStage(cfg.model, 0, 1, seed=cfg.data.seed)
    kfac = make_kfac(cfg, stage)
    engine = PipelineEngine(stage, single_process(), MLMData(cfg.data, cfg.model.vocab_size),
                            cfg.data.num_micro_batches, kfac=kfac)
    labels = [(f, name) for name in kfac.names for f in "AB"]

    def refill() -> None:
        kfac.set_saving(True)
        engine.begin_step(0)
        for op in pipeline_ops(cfg.pipeline.order, 0, 1, cfg.data.num_micro_batches):
            engine.op(op)()
        engine.finish_step()
        for f, name in labels:
            kfac.cov_all(f, name)
            kfac.complete(f, name)

    def every_label() -> float:
        refill()
        start = now()
        for f, name in labels:
            kfac.inv(f, name)
        kfac.settle_all()
        return now() - start

    kfac.plan_refresh()
    every_label()  # the first refresh: no previous basis, nothing to fall back on
    refill()
    blocks = []
    for f, name in labels:
        factor = kfac.stats.averaged(name, f)
        blocks += [scaled_factor(factor[j0:j1, j0:j1])[0] for j0, j1 in diagonal_blocks(factor.shape[0], cfg.kfac.basis_block)]
    bare = timed(lambda: [torch.linalg.eigh(b) for b in blocks], repeat)
    t = timed_inside(every_label, repeat)
    where = f"{os.path.basename(config)} (kfac.basis_block {cfg.kfac.basis_block}), {len(labels)} factors"
    print(f"{where}: eigh of their {len(blocks)} diagonal blocks, bare {bare * 1e3:7.2f} ms")
    print(f"{where}: every inverse label (KFAC.inv, soap)    {t * 1e3:7.2f} ms  {t / bare:5.2f}x the bare eigh")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="129,513", help="factor sizes (small.yaml's K-FAC factors are 128-513)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--pieces", default="2,4,8", help="piece counts to time against the whole refresh ('' for none)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live (cuda: the current GPU, each timing synchronized)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="the factors' and the refreshes' dtype")
    ap.add_argument("--model", metavar="CONFIG", default="",
                    help="also every inverse label of this config's model under soap against its bare eigh "
                         "(e.g. configs/small.yaml; cpu only)")
    ap.add_argument("--basis-block", type=int, default=129, metavar="N",
                    help="--model's kfac.basis_block (default 129, the convergence race's; 0: whole factors)")
    ap.add_argument("--max-block", type=int, default=0, metavar="N",
                    help="the Cholesky pieces' widest column block on --device (pipefisher.kfac.refresh.MAX_BLOCK; "
                         "0: as built), to judge another width")
    a = ap.parse_args()
    if a.model and a.device != "cpu":
        ap.error("--model runs on the CPU only")
    if a.max_block < 0:
        ap.error(f"--max-block must be a width >= 1 (0: as built), not {a.max_block}")
    import torch

    from pipefisher.kfac.factors import inverse_findings

    if a.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_refresh.py: --device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        SYNC[:] = [torch.cuda.synchronize]
    if a.max_block:
        from pipefisher.kfac import refresh

        refresh.MAX_BLOCK[a.device] = a.max_block  # read by each refresh as it is made
    like = torch.empty(0, device=a.device, dtype=getattr(torch, a.dtype))
    torch.set_num_threads(1)  # one core per stage, as the benchmarks run
    torch.manual_seed(0)
    for n in (int(x) for x in a.sizes.split(",")):
        rows = torch.randn(2048, n, device=like.device, dtype=like.dtype)
        factor = rows.t() @ rows / rows.shape[0]
        previous = torch.linalg.eigh(factor)[1]  # the basis a power step starts from
        damped = factor + 1e-3 * torch.eye(n, device=like.device, dtype=like.dtype)
        methods = {
            "cholesky inverse (K-FAC)":
                lambda: inverse_findings(factor, 1e-3, method="cholesky", dtype=factor.dtype),
            "cholesky inverse, bare (torch's two calls)": lambda: torch.cholesky_inverse(torch.linalg.cholesky(damped)),
            "eigh (soap's basis)": lambda: inverse_findings(factor, 1e-3, method="eigenbasis", dtype=factor.dtype),
            "power step + QR (SOAP's cheaper basis, not built)": lambda: torch.linalg.qr(factor @ previous),
        }
        base = None
        for name, fn in methods.items():
            t = timed(fn, a.repeat)
            base = base or t
            print(f"n = {n:4}: {name:50} {t * 1e3:7.2f} ms  {t / base:5.2f}x the Cholesky inverse")
            if name.startswith("cholesky inverse, bare"):
                t = timed_inside(label_call(n, like), a.repeat)
                print(f"n = {n:4}: {'inverse label (KFAC.inv, factor A, no drift)':50} {t * 1e3:7.2f} ms  "
                      f"{t / base:5.2f}x the Cholesky inverse")
        if a.pieces:
            # the previous refresh's factor: the same kind, other rows
            other = torch.randn(2048, n, device=like.device, dtype=like.dtype)
            before_factor = other.t() @ other / other.shape[0]
            before = torch.linalg.eigh(before_factor)[1]
            whole, whole_res = pieces_table(n, factor, before, [int(p) for p in a.pieces.split(",")], a.repeat)
            newton_schulz_line(n, factor, before_factor, whole, whole_res, a.repeat)
    if a.model:
        model_refresh(a.model, a.basis_block, a.repeat)


if __name__ == "__main__":
    main()
