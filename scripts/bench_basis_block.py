#!/usr/bin/env python
"""What kfac.basis_block saves: the eigenbasis update's work per stage, whole factors against blocks.

Factors whole and cut into diagonal blocks, against Muon's and AdamW's step on the same weights,
measured in the same run.

A stage of ``configs/small.yaml``'s shape (``--layers`` transformer layers of ``--hidden`` width: four
``hidden x hidden`` attention matrices and the ``hidden x intermediate`` feed-forward pair, each with its
bias) on one thread, random gradients each call, the first calls untimed; per ``--blocks`` value:

- ``update``: one step of :class:`pipefisher.kfac.eigenbasis.EigenbasisAdam` (Adam in K-FAC's eigenbases,
  ``kfac.update: soap``), its bases the eigenbases of random factors (block-diagonal where cut): the work
  every step pays at its end, on the critical path; again with its products in bfloat16
  (``kfac.rotation_dtype``);
- ``refresh``: every factor's basis refreshed once (:func:`pipefisher.kfac.factors.eigenbasis`): the work
  the packer places in bubbles once per cycle;
- ``covariance``: every factor's covariance of one micro-batch (``--rows`` token rows; factor B's
  formula for all, factor A's is the same product per block), as the covariance labels add it, also in
  bubbles, once per micro-batch per cycle.

Printed: the median of ``--repeat`` calls in ms, and for each the ratio to the whole factors'
(``update`` in float32 and in bfloat16 also to Muon's step: torch's Muon on the matrices, AdamW on the
biases).

    python scripts/bench_basis_block.py [--blocks 0,128,129,256] [--repeat 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_ms(fn: Callable[[], object], before: Callable[[], object], repeat: int) -> float:
    for _ in range(2):
        before()
        fn()
    times = []
    for _ in range(repeat):
        before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="0,128,129,256", help="kfac.basis_block values (0: whole factors)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2, help="transformer layers on the stage")
    ap.add_argument("--rows", type=int, default=512, help="token rows of one micro-batch (8 x 64 on small.yaml)")
    ap.add_argument("--repeat", type=int, default=40)
    a = ap.parse_args()
    try:
        blocks = [int(b) for b in a.blocks.split(",")]
    except ValueError:
        ap.error(f"--blocks: integers >= 0, not {a.blocks!r}")
    if any(b < 0 for b in blocks) or a.repeat < 1:
        ap.error("--blocks must be >= 0 and --repeat >= 1")
    blocks = [0] + [b for b in blocks if b]  # whole factors first: the baseline of every ratio

    import torch
    from torch import nn

    from pipefisher.kfac import KFAC
    from pipefisher.kfac import factors as fx
    from pipefisher.kfac.eigenbasis import EigenbasisAdam

    torch.set_num_threads(1)
    h, m = a.hidden, a.intermediate

    def stage() -> nn.Sequential:
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(a.layers):
            mods += [nn.Linear(h, h) for _ in range(4)] + [nn.Linear(h, m), nn.Linear(m, h)]
        return nn.Sequential(*mods)

    def grads(model: nn.Module) -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)

    widths = [w for _ in range(a.layers) for w in [h + 1, h] * 4 + [h + 1, m, m + 1, h]]  # (A, B) per layer
    factors = {}
    for w in sorted(set(widths)):
        x = torch.randn(a.rows, w)
        factors[w] = x.t() @ x / a.rows
    samples = {w: torch.randn(a.rows, w) for w in set(widths)}

    ref = stage()
    mats = [p for p in ref.parameters() if p.ndim == 2]
    muon, adamw = torch.optim.Muon(mats, lr=1e-3), torch.optim.AdamW([p for p in ref.parameters() if p.ndim == 1])
    muon_ms = _median_ms(lambda: (muon.step(), adamw.step()), lambda: grads(ref), a.repeat)
    plain = stage()
    adam_all = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    adamw_ms = _median_ms(adam_all.step, lambda: grads(plain), a.repeat)
    print(f"stage: {a.layers} layers of hidden {h}, intermediate {m} ({len(widths)} factors), one thread, "
          f"median of {a.repeat}; Muon's step {muon_ms:.2f} ms, AdamW's {adamw_ms:.2f} ms")
    print("| basis_block | update (ms) | x whole | x Muon | update in bfloat16 (ms) | x Muon | refresh (ms) | x whole "
          "| covariance (ms) | x whole |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    whole: tuple[float, float, float] | None = None
    for block in blocks:
        model = stage()
        kfac = KFAC(model, inverse="eigenbasis", ignore=(), basis_block=block)
        for name, st in kfac.refresher.state.items():
            for f in "AB":
                st.installed[f] = fx.eigenbasis(factors[kfac.layers[name].factor_size(f)], block=block)
                st.inversions[f] = 1
        opt = EigenbasisAdam(kfac, lr=1e-3, weight_decay=0.01, basis_block=block)
        update = _median_ms(opt.step, lambda: grads(model), a.repeat)
        low = EigenbasisAdam(kfac, lr=1e-3, weight_decay=0.01, basis_block=block, rotation_dtype=torch.bfloat16)
        update_low = _median_ms(low.step, lambda: grads(model), a.repeat)
        refresh = _median_ms(lambda: [fx.eigenbasis(factors[w], block=block) for w in widths], lambda: None,
                             max(3, a.repeat // 8))
        cov = _median_ms(lambda: [fx.cov_b(samples[w], 1.0, block) for w in widths], lambda: None, a.repeat)
        whole = whole or (update, refresh, cov)
        print(f"| {block or 'whole'} | {update:.2f} | {update / whole[0]:.2f} | {update / muon_ms:.2f} | "
              f"{update_low:.2f} | {update_low / muon_ms:.2f} | {refresh:.2f} | {refresh / whole[1]:.2f} | "
              f"{cov:.2f} | {cov / whole[2]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
