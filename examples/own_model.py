"""Bring your own model: a tiny causal transformer of your own, trained by pipefisher's pipeline + K-FAC.

Run from the repository root (2 processes, gloo on the CPU, a few seconds)::

    python examples/own_model.py --steps 20

It builds the model stage by stage with :func:`build` (a *stage builder*) and trains it with the
library API (:mod:`pipefisher.runtime.api`) in its own step-at-a-time loop, which checkpoints and
resumes exactly (``--checkpoint-dir DIR``, then ``--resume DIR`` with more ``--steps``). The same builder
works with ``pipefisher train``, from the repository root::

    pipefisher train --config configs/tiny.yaml --nproc-per-node 2 --mode kfac --steps 20 \\
        --set model.builder=examples.own_model:build --set data.objective=clm --set model.options='{mlp_ratio: 2}'

A stage builder returns, for stage ``index`` of ``num_stages``, an ``nn.Module`` with ``is_first``,
``is_last``, ``hidden_size`` and ``forward(x, labels=None, sample=None)``: token ids in on the first
stage, hidden states ``(batch, seq, hidden_size)`` between stages, and on the last the mean loss over
the micro-batch (with ``sample``, a generator: also the loss against labels drawn from the model's own
predictions, for true-Fisher K-FAC). K-FAC preconditions its ``nn.Linear`` layers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, written out with nn.Linear so K-FAC sees every layer."""

    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, mlp)
        self.down = nn.Linear(mlp, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + self.proj(a)
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class TinyStage(nn.Module):
    """One stage: embeddings on the first, some blocks, the head and the loss on the last."""

    def __init__(self, vocab: int, hidden: int, heads: int, mlp: int, max_len: int, blocks: int,
                 is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last, self.hidden_size = is_first, is_last, hidden
        self.embed = nn.Embedding(vocab, hidden) if is_first else None
        self.pos = nn.Parameter(torch.zeros(max_len, hidden)) if is_first else None
        self.blocks = nn.ModuleList(Block(hidden, heads, mlp) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden) if is_last else None
        self.head = nn.Linear(hidden, vocab) if is_last else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                sample: torch.Generator | None = None) -> Any:
        h = self.embed(x) + self.pos[: x.shape[1]] if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        if self.head is None:
            return h
        logits = self.head(self.norm(h))
        if labels is None:
            return logits
        keep = labels.reshape(-1) != IGNORE_INDEX
        logits = logits.reshape(-1, logits.shape[-1])[keep]
        loss = F.cross_entropy(logits, labels.reshape(-1)[keep])
        if sample is None:
            return loss
        with torch.no_grad():  # true Fisher: labels drawn from the model's own predictions
            drawn = torch.multinomial(torch.softmax(logits.float(), -1).cpu(), 1, generator=sample).squeeze(1)
        return loss, F.cross_entropy(logits, drawn.to(logits.device))


def build(cfg: Any, index: int, num_stages: int, seed: int) -> nn.Module:
    """The stage builder: ``model.builder: "examples.own_model:build"``.

    Reads the run config's model sizes, and its own setting ``model.options.mlp_ratio`` (default 4).
    Every stage seeds its weights from (seed, index), so every worker builds the same model.
    """
    m = cfg.model
    per_stage, extra = divmod(m.num_layers, num_stages)
    torch.manual_seed(seed * 1_009 + index)
    return TinyStage(m.vocab_size, m.hidden_size, m.num_heads, int(m.options.get("mlp_ratio", 4)) * m.hidden_size,
                     m.max_position, per_stage + (index < extra), index == 0, index == num_stages - 1)


def config(steps: int) -> Any:
    """A tiny causal-LM job: 2 stages x 1 replica, synthetic tokens, K-FAC every step."""
    from pipefisher.runtime.api import RunConfig

    return RunConfig(name="own_model").replace(
        model={"builder": "examples.own_model:build", "vocab_size": 64, "hidden_size": 32, "num_layers": 2,
               "num_heads": 2, "max_position": 16, "options": {"mlp_ratio": 2}},
        data={"text": "synthetic", "objective": "clm", "seq_len": 16, "micro_batch_size": 4,
              "num_micro_batches": 4},
        optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.0},
        kfac={"damping": 0.01, "interval": 1, "ignore": ["head"], "lr": 0.05},
        pipeline={"stages": 2, "order": "1f1b"})


def worker(rank: int, world: int, port: int, steps: int, out: str | None, checkpoint_dir: str | None = None,
           every: int = 0, resume: str | None = None) -> None:
    """One process of the job: the user's own loop around pipefisher's step, checkpointed every ``every``
    steps and at the end into ``checkpoint_dir``, continued from ``resume``'s checkpoint."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from pipefisher.runtime import api

    cfg = config(steps)
    ctx = api.init_context(cfg)
    try:
        w = api.build_worker(cfg, ctx, mode="kfac", total_steps=steps)
        # the worker's state by name (model, optimizer, each K-FAC copy, data position, RNG), plus our own
        parts = w.components()
        ckpt = w.checkpointer()  # knows the job (config, mode, grid), not this loop
        first = ckpt.load(resume, parts) if resume else 0  # the steps done: the next step to run
        losses = []
        for step in range(first, steps):
            loss = w.step(step)  # a 0-dim tensor on the device (None off the last stage)
            if loss is not None:  # the last stage: read it (the host waits for the device here)
                loss = float(loss)
                losses.append(loss)
                print(f"step {step:>3}  loss {loss:.4f}", flush=True)
            if checkpoint_dir and ((every and (step + 1) % every == 0) or step == steps - 1):
                ckpt.save(checkpoint_dir, step + 1, parts)  # collective: every worker calls it
        if out is not None and losses:
            with open(out, "w", encoding="utf-8") as f:
                json.dump({"losses": losses}, f)
    finally:
        api.shutdown(ctx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a tiny model of your own with pipefisher (2 CPU processes).")
    parser.add_argument("--steps", type=int, default=20, help="training steps, those of a resumed run included "
                                                               "(default 20)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the losses here")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="write checkpoints here (after the "
                                                                              "last step, and see --checkpoint-every)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="also every N steps")
    parser.add_argument("--resume", default=None, metavar="DIR", help="continue from the checkpoint in DIR")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    from pipefisher.runtime.job.process import free_port

    mp.spawn(worker, args=(2, free_port(), args.steps, args.json, args.checkpoint_dir, args.checkpoint_every,
                           args.resume), nprocs=2, join=True)
    return 0


# ``examples.own_model:build`` must import in every worker: the repository root goes on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.exit(main())
