#!/usr/bin/env python
"""What splitting a backward costs: one stage's full backward against its zero-bubble B and W passes.

Zero-bubble orders (ZB-H1, ZB-V) run each backward as a B pass (the input gradient) and a later W pass
(the weight gradients, :mod:`pipefisher.runtime.pipeline.split_backward`). The split is worth its
bubbles only if B + W costs about what one backward does. On one device (CUDA when there is one, else
the CPU with one thread), for the first, a middle and the last stage of the config's model split into
``--stages`` stages, this times the forward, the full backward, B and W (the median of ``--repeat``
runs after warm-up), checks that B then W gives the full backward's gradients, and prints per stage
``B + W / full``.

    python scripts/bench_split_backward.py [--config configs/small.yaml] [--stages 4] [--repeat 20] \
        [--set model.hidden_size=768 ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _timed(fn, device) -> float:  # noqa: ANN001
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_stage(cfg, index: int, stages: int, repeat: int, device) -> dict:  # noqa: ANN001
    import torch

    from pipefisher.runtime.models.builders import make_stage
    from pipefisher.runtime.pipeline.split_backward import backward_input

    stage = make_stage(cfg, index, stages).to(device)
    stage.train()
    params = [p for p in stage.parameters() if p.requires_grad]
    d = cfg.data
    gen = torch.Generator().manual_seed(index)
    ids = torch.randint(0, cfg.model.vocab_size, (d.micro_batch_size, d.seq_len), generator=gen).to(device)
    hidden = torch.randn(d.micro_batch_size, d.seq_len, stage.hidden_size, generator=gen).to(device)

    def forward():  # noqa: ANN202
        torch.manual_seed(0)  # the same dropout masks every time
        x = ids if stage.is_first else hidden.clone().requires_grad_(True)
        out = stage(x, ids if stage.is_last else None)
        grad = None if stage.is_last else torch.ones_like(out) / out.numel()
        return x, out, grad

    def full() -> dict:
        stage.zero_grad(set_to_none=True)
        x, out, grad = forward()
        t = _timed(lambda: out.backward(grad), device)
        return {"full": t, "grads": {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}}

    def split() -> dict:
        stage.zero_grad(set_to_none=True)
        x, out, grad = forward()
        box: list = []
        tb = _timed(lambda: box.append(backward_input([out], [grad], [] if stage.is_first else [x], params)), device)
        tw = _timed(lambda: box[0][1].run(), device)
        grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
        return {"B": tb, "W": tw, "grads": grads}

    for _ in range(3):
        full(), split()
    fwd = [_timed(forward, device) for _ in range(repeat)]
    fulls = [full() for _ in range(repeat)]
    splits = [split() for _ in range(repeat)]
    want, got = fulls[-1]["grads"], splits[-1]["grads"]
    worst = max(float((got[n].double() - want[n].double()).abs().max() / max(1e-30, float(want[n].abs().max())))
                for n in want)
    return {"forward": statistics.median(fwd), "full": statistics.median(r["full"] for r in fulls),
            "B": statistics.median(r["B"] for r in splits), "W": statistics.median(r["W"] for r in splits),
            "same_params": set(got) == set(want), "bit_equal": all(torch.equal(got[n], want[n]) for n in want),
            "worst_relative_difference": worst}


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(root, "configs", "small.yaml"), help="YAML run config")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages the model is split into")
    ap.add_argument("--repeat", type=int, default=20, help="timed runs of each (median reported)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. model.hidden_size=768 (repeatable)")
    a = ap.parse_args()
    import torch  # only once the arguments are good

    from pipefisher.runtime.job.config import apply_overrides, load_config

    cfg = apply_overrides(load_config(a.config), a.set)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    what = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 1 thread"
    m = cfg.model
    print(f"{os.path.basename(a.config)}: hidden {m.hidden_size}, {m.num_layers} layers in {a.stages} stages, "
          f"micro-batch {cfg.data.micro_batch_size} x {cfg.data.seq_len} tokens, on {what}, torch {torch.__version__}")
    print(f"{'stage':>5} {'forward':>9} {'full bwd':>9} {'B':>9} {'W':>9} {'B+W/full':>9}  gradients")
    ratios = []
    for index in sorted({0, a.stages // 2, a.stages - 1}):
        r = bench_stage(cfg, index, a.stages, a.repeat, device)
        ratios.append((r["B"] + r["W"]) / r["full"])
        same = ("bit-equal" if r["bit_equal"] else f"max relative difference {r['worst_relative_difference']:.1e}") \
            if r["same_params"] else "DIFFERENT PARAMETERS"
        print(f"{index:>5} {r['forward'] * 1e3:7.2f}ms {r['full'] * 1e3:7.2f}ms {r['B'] * 1e3:7.2f}ms "
              f"{r['W'] * 1e3:7.2f}ms {ratios[-1]:9.3f}  {same}")
    print(f"split backward / full backward: {statistics.mean(ratios):.3f} (mean over the stages above)")


if __name__ == "__main__":
    main()
