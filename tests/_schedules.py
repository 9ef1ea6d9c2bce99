"""Schedules and a one-process replay for the runtime tests (a helper module, no tests in it)."""
from __future__ import annotations

import os

import torch

from pipefisher.runtime.config import RunConfig, load_config
from pipefisher.runtime.data import MLMData
from pipefisher.runtime.engine import BACKWARD, FORWARD, pipeline_ops
from pipefisher.runtime.executor import END, SAVE_OFF, SAVE_ON, START, stage_kfac_names
from pipefisher.runtime.model import PipelineStage
from pipefisher.runtime.update import Updater, make_kfac

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


REAL_TEXT = {"data": {"text": "stdlib"},
             "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2, "schedule": "linear", "weight_decay": 0.01}}
"""The runtime equalities run on the real data path and the transformer optimizer: configs/tiny.yaml's
model on the standard library's text (BPE, vocabulary 100), AdamW with warm-up and linear decay."""


def tiny(**sections) -> RunConfig:
    cfg = load_config(TINY).replace(**REAL_TEXT)
    return cfg.replace(**sections) if sections else cfg


def spread_schedule(cfg: RunConfig) -> list[list[list[str]]]:
    """A hand-made 3-iteration cycle per node that exercises what a packer may do.

    Iteration 0: cov A piece j right after forward j for the first half of the modules, cov B piece j
    right after backward j for the first module; the first module's inverses before ``-- end --``.
    Iteration 1: the remaining pieces between the pipeline calls; A inverses, one of them after
    ``-- end --``. Iteration 2: B inverses, before and after ``-- end --`` (pi from a cleared A).
    """
    m, stages = cfg.data.num_micro_batches, cfg.pipeline.stages
    out = []
    for node, names in enumerate(stage_kfac_names(cfg)):
        ops = pipeline_ops(cfg.pipeline.schedule, node, stages, m)
        half = names[: len(names) // 2]
        first = names[0]
        it0, nf, nb = [START], 0, 0
        for op in ops:
            it0.append(op)
            if op == FORWARD:
                it0 += [f"cov_kron_A:{n}" for n in half]
                nf += 1
            else:
                it0.append(f"cov_kron_B:{first}")
                nb += 1
        it0 += [f"inv_kron_B:{first}", f"inv_kron_A:{first}", END, SAVE_OFF]
        rest_a = [f"cov_kron_A:{n}" for n in names if n not in half for _ in range(m)]
        rest_b = [f"cov_kron_B:{n}" for n in names if n != first for _ in range(m)]
        work = rest_b + rest_a
        it1 = [START]
        chunk = -(-len(work) // len(ops))
        for i, op in enumerate(ops):
            it1.append(op)
            it1 += work[i * chunk:(i + 1) * chunk]
        later = [n for n in names if n != first]
        it1 += [f"inv_kron_A:{n}" for n in later[:-1]] + [END, f"inv_kron_A:{later[-1]}"]
        it2 = [START, *ops[:2], *[f"inv_kron_B:{n}" for n in later[:2]], *ops[2:], END,
               *[f"inv_kron_B:{n}" for n in later[2:]], SAVE_ON]
        out.append([it0, it1, it2])
    return out


def fake_timelines(cfg: RunConfig) -> list[dict]:
    """Per-node timelines of a simulated 1F1B step of ``cfg`` (forward 10, backward 20 time units per
    micro-batch), with this model's K-FAC keys and costs that need a few iterations' bubbles."""
    m, stages = cfg.data.num_micro_batches, cfg.pipeline.stages
    names = stage_kfac_names(cfg)
    done: dict = {}
    free = [0] * stages
    pending = [list(pipeline_ops(cfg.pipeline.schedule, s, stages, m)) for s in range(stages)]
    nxt = [[0, 0] for _ in range(stages)]
    raws: list[dict] = [{FORWARD: [], BACKWARD: []} for _ in range(stages)]
    while any(pending):
        for s in range(stages):
            if not pending[s]:
                continue
            op = pending[s][0]
            i = nxt[s][op == BACKWARD]
            dep = (s - 1, FORWARD, i) if op == FORWARD else (s + 1, BACKWARD, i)
            if 0 <= dep[0] < stages and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0))
            end = start + (10 if op == FORWARD else 20)
            raws[s][op].append((start, end))
            done[(s, op, i)] = free[s] = end
            nxt[s][op == BACKWARD] += 1
            pending[s].pop(0)
    for s, raw in enumerate(raws):
        t = free[s]
        for n in names[s]:
            for kind, d in (("cov_kron_A", 4 * m), ("cov_kron_B", 4 * m), ("inv_kron_A", 6), ("inv_kron_B", 6)):
                raw[f"{kind}:{n}"] = [(t, t + d)]
                t += d
        raw["start_end"] = [(0, t)]
    return raws


def packed_schedule(cfg: RunConfig) -> list[list[list[str]]]:
    from pipefisher.policies import DEFAULT_POLICY, get_policy
    from pipefisher.schedule import validate
    from pipefisher.timeline import job_from_dicts

    job = job_from_dicts(fake_timelines(cfg))
    data = get_policy(DEFAULT_POLICY).pack(job).to_file_data()
    assert validate(data, job) == []
    return data



def replay(cfg: RunConfig, schedule: list[list[list[str]]], steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """The schedule's labels in one process, no torch.distributed: every stage as its own module with
    its own K-FAC and optimizer; step 0 is naive K-FAC, step s runs iteration (s - 1) % k of each node
    (pipeline first, then the node's K-FAC labels before ``-- end --``, the optimizer, the rest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same reduction order, so the same floats
    try:
        return _replay(cfg, schedule, steps)
    finally:
        torch.set_num_threads(threads)


def _replay(cfg: RunConfig, schedule: list[list[list[str]]], steps: int) -> dict[int, dict[str, torch.Tensor]]:
    stages, m = cfg.pipeline.stages, cfg.data.num_micro_batches
    mods = [PipelineStage(cfg.model, s, stages, seed=cfg.data.seed) for s in range(stages)]
    kfacs = [make_kfac(cfg, mod) for mod in mods]
    # per stage, as the workers; with clip_norm or kl_clip the workers sum over the whole pipeline and
    # this replay would not: the tests that compare with it use neither
    updaters = [Updater(cfg, mod, k, cfg.optim.decay_steps or steps) for mod, k in zip(mods, kfacs)]
    data = MLMData(cfg.data, cfg.model.vocab_size)
    for k in kfacs:
        k.set_saving(True)
    for step in range(steps):
        for u in updaters:
            u.set_step(step)
        iters = [None if step == 0 else node[(step - 1) % len(node)] for node in schedule]
        stash = []
        for i in range(m):
            mb = data.micro_batch(step, 0, i)
            x, ins, outs = mb.input_ids, [], []
            for s, mod in enumerate(mods):
                if s > 0:
                    x = x.detach().requires_grad_(True)
                ins.append(x)
                y = mod(x, mb.labels if s == stages - 1 else None)
                outs.append(y / m if s == stages - 1 else y)
                x = y
            stash.append((ins, outs))
        for ins, outs in stash:
            grad = None
            for s in reversed(range(stages)):
                outs[s].backward(grad)
                grad = ins[s].grad if s > 0 else None
        for s in range(stages):
            if iters[s] is None:
                kfacs[s].update_curvature()
                kfacs[s].clear_saved()
            else:
                labels = iters[s]
                for label in labels[:labels.index(END)]:
                    kfacs[s].apply_label(label)
            updaters[s].step(mods[s])
            if iters[s] is not None:
                for label in iters[s][iters[s].index(END) + 1:]:
                    kfacs[s].apply_label(label)
    return {s: {n: p.detach().clone() for n, p in mod.named_parameters()} for s, mod in enumerate(mods)}
