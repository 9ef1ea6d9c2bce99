"""Schedules and a one-process replay for the runtime tests (a helper module, no tests in it)."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from pipefisher.schedule.format import END, SAVE_OFF, SAVE_ON, START
from pipefisher.runtime.data.batches import MLMData
from pipefisher.runtime.job.config import RunConfig, load_config
from pipefisher.runtime.models.bert import PipelineStage
from pipefisher.runtime.pipeline.engine import pipeline_ops
from pipefisher.runtime.pipeline.labels import BACKWARD, FORWARD
from pipefisher.runtime.pipeline.layout import stage_kfac_names
from pipefisher.runtime.train.update import Updater, make_kfac

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


REAL_TEXT = {"data": {"text": "stdlib"},
             "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2, "lr_schedule": "linear", "weight_decay": 0.01}}
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
        ops = pipeline_ops(cfg.pipeline.order, node, stages, m)
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
    pending = [list(pipeline_ops(cfg.pipeline.order, s, stages, m)) for s in range(stages)]
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


def packed_job_schedule(cfg: RunConfig, overlap: bool = False):  # -> pipefisher.schedule.packed.JobSchedule
    """The default policy's packing of :func:`fake_timelines`, checked by ``validate``. Without overlapping
    cycles unless asked (on these timelines they would overlap): the tests save and hand over the plain
    schedule, without the metadata that says so, and the runtime checks such a schedule by the rules
    of a cycle that does not overlap."""
    from pipefisher.policies import DEFAULT_POLICY, get_policy
    from pipefisher.rules import validate
    from pipefisher.schedule.timeline import job_from_dicts

    job = job_from_dicts(fake_timelines(cfg))
    packed = get_policy(DEFAULT_POLICY, overlap=overlap).pack(job)
    assert packed.overlap is overlap and validate(packed.to_file_data(), job, overlap=overlap) == []
    return packed


def packed_schedule(cfg: RunConfig) -> list[list[list[str]]]:
    return packed_job_schedule(cfg).to_file_data()



def replay(cfg: RunConfig, schedule: list[list[list[str]]] | None, steps: int,
           labels_at: Callable[[int, int], list[str]] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """The schedule's labels in one process, no torch.distributed: every stage as its own module with
    its own K-FAC and optimizer; step 0 is naive K-FAC, step s runs iteration (s - 1) % k of each node
    (pipeline first, then the node's K-FAC labels before ``-- end --``, the optimizer, the rest).
    ``labels_at(step, node)``, where given instead of a schedule, names the labels each step ran (a run
    whose schedule changed); one-pipe runs only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same reduction order, so the same floats
    try:
        if cfg.pipeline.order == "chimera":
            assert schedule is not None and labels_at is None
            return _replay_chimera(cfg, schedule, steps)
        chunks = cfg.pipeline.chunks if cfg.pipeline.chunked else 1
        if labels_at is None:
            assert schedule is not None
            sched = schedule

            def labels_at(step: int, node: int) -> list[str]:
                return sched[node][(step - 1) % len(sched[node])]
        return _replay_virtual_stages(cfg, labels_at, steps, chunks)
    finally:
        torch.set_num_threads(threads)


def _forward_backward(mods: list, data: MLMData, step: int, micro_batches, m: int) -> None:
    """All forwards of the given micro-batches through the stage modules, then their backwards in the
    same order (as each pipe's engine does), each loss divided by the step's ``m`` micro-batches."""
    last = len(mods) - 1
    stash = []
    for j in micro_batches:
        mb = data.micro_batch(step, 0, j)
        x, ins, outs = mb.input_ids, [], []
        for s, mod in enumerate(mods):
            if s > 0:
                x = x.detach().requires_grad_(True)
            ins.append(x)
            y = mod(x, mb.labels if s == last else None)
            outs.append(y / m if s == last else y)
            x = y
        stash.append((ins, outs))
    for ins, outs in stash:
        grad = None
        for s in reversed(range(len(mods))):
            outs[s].backward(grad)
            grad = ins[s].grad if s > 0 else None


# ----------------------------------------------------------------------------------------------------
# Chimera: a hand-made cycle and the one-process replay of two stage copies per stage


def chimera_spread_schedule(cfg: RunConfig) -> list[list[list[str]]]:
    """A 3-iteration Chimera cycle per device that exercises what a packer may do, with the shared
    labels (syncs, inverses, ``-- end --``) in one canonical order on both devices of a pair.

    Iteration 0: cov A piece j of the first half of a pipe's modules right after that pipe's forward j,
    cov B of its first module after each backward. Iteration 1: the remaining pieces between the
    pipeline calls, then the first half of the syncs and inverses before ``-- end --``. Iteration 2:
    a quarter before ``-- end --``, the rest after it.
    """
    from pipefisher.runtime.pipeline.engine import device_plan
    from pipefisher.runtime.pipeline.labels import labelled
    from pipefisher.runtime.pipeline.layout import node_kfac_names

    m, stages = cfg.data.num_micro_batches, cfg.pipeline.stages
    out = []
    for node, by_pipe in enumerate(node_kfac_names(cfg)):
        plan = device_plan("chimera", node, stages, m)
        calls = [label for label, _, _ in plan]
        mods = {p: [labelled(n, p) for n in names] for p, names in by_pipe.items()}
        it0, done = [START], []
        for label, pipe, _ in plan:
            it0.append(label)
            half = mods[pipe][: len(mods[pipe]) // 2]
            new = [f"cov_kron_A:{n}" for n in half] if label.startswith(FORWARD) else [f"cov_kron_B:{mods[pipe][0]}"]
            it0 += new
            done += new
        it0 += [END, SAVE_OFF]
        rest = []
        per_pipe = m // len(by_pipe)
        for p, names in mods.items():
            for n in names:
                for f in "AB":
                    rest += [f"cov_kron_{f}:{n}"] * (per_pipe - done.count(f"cov_kron_{f}:{n}"))
        it1 = [START]
        chunk = -(-len(rest) // len(calls))
        for i, label in enumerate(calls):
            it1.append(label)
            it1 += rest[i * chunk:(i + 1) * chunk]
        shared = [f"{kind}_{f}:{n}" for ns in mods.values() for n in ns for kind in ("sync_kron", "inv_kron")
                  for f in "AB"]
        a, b = len(shared) // 2, (3 * len(shared)) // 4
        it1 += shared[:a] + [END]
        it2 = [START, *calls, *shared[a:b], END, *shared[b:], SAVE_ON]
        out.append([it0, it1, it2])
    return out


def _replay_chimera(cfg: RunConfig, schedule: list[list[list[str]]], steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every stage as two copies (down and up pipe), each with its own K-FAC and optimizer, fed its
    pipe's micro-batches; a sync averages the two copies' factors where the pair's shared labels say."""
    from pipefisher.runtime.pipeline.engine import pipe_micro_batches
    from pipefisher.runtime.pipeline.labels import parse_label

    stages, m = cfg.pipeline.stages, cfg.data.num_micro_batches
    pipes = pipe_micro_batches("chimera", 0, stages, m)  # the same split on every device
    mods = [{p: PipelineStage(cfg.model, s, stages, seed=cfg.data.seed) for p in (0, 1)} for s in range(stages)]
    # dp_size 2: K-FAC's pi treats a factor not yet averaged with the other copy as the workers do
    kfacs = [{p: make_kfac(cfg, mod[p], dp_size=2) for p in (0, 1)} for mod in mods]
    updaters = [{p: Updater(cfg, mod[p], kfacs[s][p], cfg.optim.decay_steps or steps) for p in (0, 1)}
                for s, mod in enumerate(mods)]
    data = MLMData(cfg.data, cfg.model.vocab_size)

    def copy_of(node: int, pipe: int) -> tuple[int, int]:
        return (node if pipe == 0 else stages - 1 - node), pipe

    def average(stage: int, factor: str, name: str) -> None:
        a, b = (kfacs[stage][p].stats.state[name] for p in (0, 1))
        avg = (a.factor(factor) + b.factor(factor)) / 2
        for st in (a, b):
            st.sums[factor], st.counts[factor], st.synced[factor] = avg.clone(), 1, True

    for k in (kf for pair in kfacs for kf in pair.values()):
        k.set_saving(True)
    for step in range(steps):
        for u in (u for pair in updaters for u in pair.values()):
            u.set_step(step)
        for pipe, mbs in pipes.items():
            _forward_backward([mod[pipe] for mod in mods], data, step, mbs, m)
        for s in range(stages):  # the pair's gradient all-reduce: both pipes' gradients summed
            for (n, a), b in zip(mods[s][0].named_parameters(), mods[s][1].parameters()):
                total = a.grad + b.grad
                a.grad, b.grad = total.clone(), total.clone()
        if step == 0:
            for s in range(stages):
                names = kfacs[s][0].names
                for p in (0, 1):
                    for n in names:
                        for f in "AB":
                            kfacs[s][p].cov_all(f, n)
                for n in names:
                    for f in "AB":
                        average(s, f, n)
                for p in (0, 1):
                    for n in names:
                        for f in "AB":
                            kfacs[s][p].inv(f, n)
                    kfacs[s][p].clear_saved()
        iters = None if step == 0 else [node[(step - 1) % len(node)] for node in schedule]

        def apply(node: int, label: str) -> None:
            kind, factor, module, pipe = parse_label(label)
            s, p = copy_of(node, pipe)
            if kind == "cov_kron":
                kfacs[s][p].cov(factor, module)
            elif kind == "inv_kron":
                kfacs[s][p].inv(factor, module)
            elif kind == "sync_kron" and p == 0:  # once per pair: the two copies' factors averaged
                average(s, factor, module)
            elif kind in (SAVE_ON, SAVE_OFF):
                for q in (0, 1):
                    kfacs[copy_of(node, q)[0]][q].set_saving(kind == SAVE_ON)

        def walk(before_end: bool) -> None:
            """Both devices of a pair in lockstep: local labels up to each shared label, then that one."""
            for a in range(stages // 2):
                pair = (a, stages - 1 - a)
                chunks = {}
                for node in pair:
                    labels = iters[node]
                    cut = labels.index(END)
                    part = labels[:cut] if before_end else labels[cut + 1:]
                    chunks[node] = [[]]
                    for label in part:
                        chunks[node][-1].append(label)
                        if label.startswith(("sync_kron", "inv_kron")):
                            chunks[node].append([])
                for k in range(len(chunks[pair[0]])):
                    shared = {node: chunks[node][k][-1:] if k < len(chunks[node]) - 1 else [] for node in pair}
                    for node in pair:  # local work first (a sync needs both copies' pieces)
                        for label in chunks[node][k][: len(chunks[node][k]) - len(shared[node])]:
                            apply(node, label)
                    for node in pair:
                        for label in shared[node]:
                            apply(node, label)

        if iters is not None:
            walk(True)
        for s in range(stages):
            for p in (0, 1):
                updaters[s][p].step(mods[s][p])
        if iters is not None:
            walk(False)
    out = {}
    for s in range(stages):
        down, up = (dict(mods[s][p].named_parameters()) for p in (0, 1))
        assert all(torch.equal(down[n], up[n]) for n in down), f"stage {s}: the replay's copies drifted"
        out[s] = {n: t.detach().clone() for n, t in down.items()}
    return out


# ----------------------------------------------------------------------------------------------------
# Interleaved 1F1B: a hand-made two-iteration cycle and the one-process replay of the virtual stages


def interleaved_spread_schedule(cfg: RunConfig) -> list[list[list[str]]]:
    """A 2-iteration cycle per device: iteration 0 takes each copy's covariance pieces right after that
    copy's own forwards (A) and backwards (B; the B pass, before its W, in zero-bubble orders), saving
    off at its end; iteration 1 inverts half the factors before ``-- end --`` and half after it, saving
    back on at the end of the cycle. For any one-pipe order (chunks or not)."""
    from pipefisher.runtime.pipeline.labels import chunk_suffix, parse_label
    from pipefisher.runtime.pipeline.layout import node_kfac_names

    stages, m, v = cfg.pipeline.stages, cfg.data.num_micro_batches, cfg.pipeline.chunks
    out = []
    for node, by_chunk in enumerate(node_kfac_names(cfg)):
        ops = pipeline_ops(cfg.pipeline.order, node, stages, m, v)
        it0 = [START]
        for label in ops:
            it0.append(label)
            kind, _, _, chunk = parse_label(label)
            if kind not in (FORWARD, BACKWARD):
                continue
            f = "A" if kind == FORWARD else "B"
            it0 += [f"cov_kron_{f}:{n}{chunk_suffix(chunk) if cfg.pipeline.chunked else ''}" for n in by_chunk[chunk]]
        it0 += [END, SAVE_OFF]
        invs = [f"inv_kron_{f}:{n}{chunk_suffix(j)}" for j, names in by_chunk.items() for n in names for f in "AB"]
        half = len(invs) // 2
        it1 = [START, *ops, *invs[:half], END, *invs[half:], SAVE_ON]
        out.append([it0, it1])
    return out


def _replay_virtual_stages(cfg: RunConfig, labels_at: Callable[[int, int], list[str]], steps: int,
                           chunks: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every virtual stage (chunk j of device d: ``stage_on(d, j, D, layout)``, d + j*D interleaved; one
    chunk per device without chunks) as its own module, K-FAC and optimizer; each node's labels run on
    the virtual stage their ``:chunk<j>`` suffix names. With clip_norm or kl_clip the workers sum over
    the whole pipeline and this replay would not: the tests that compare with it use neither."""
    from pipefisher.pipeline_orders import layout_of, stage_on
    from pipefisher.runtime.pipeline.labels import parse_label

    p, v, m = cfg.pipeline.stages, chunks, cfg.data.num_micro_batches

    def at(node: int, j: int) -> int:
        return stage_on(node, j, p, layout_of(cfg.pipeline.order))
    n = p * v
    mods = [PipelineStage(cfg.model, s, n, seed=cfg.data.seed) for s in range(n)]
    kfacs = [make_kfac(cfg, mod) for mod in mods]
    updaters = [Updater(cfg, mod, k, cfg.optim.decay_steps or steps) for mod, k in zip(mods, kfacs)]
    data = MLMData(cfg.data, cfg.model.vocab_size)

    def apply(node: int, label: str) -> None:
        kind, factor, module, chunk = parse_label(label)
        if factor is not None:
            kfacs[at(node, chunk)].apply_label(f"{kind}_{factor}:{module}")
        else:
            for j in range(v):
                kfacs[at(node, j)].apply_label(label)

    for k in kfacs:
        k.set_saving(True)
    for step in range(steps):
        for u in updaters:
            u.set_step(step)
        iters = [None if step == 0 else labels_at(step, node) for node in range(p)]
        _forward_backward(mods, data, step, range(m), m)
        for node in range(p):
            labels = iters[node]
            for j in range(v):
                s = at(node, j)
                if labels is None:
                    kfacs[s].update_curvature()
                    kfacs[s].clear_saved()
            if labels is not None:
                for label in labels[:labels.index(END)]:
                    apply(node, label)
            for j in range(v):
                updaters[at(node, j)].step(mods[at(node, j)])
            if labels is not None:
                for label in labels[labels.index(END) + 1:]:
                    apply(node, label)
    return {s: {k: t.detach().clone() for k, t in mod.named_parameters()} for s, mod in enumerate(mods)}


# ----------------------------------------------------------------------------------------------------
# Training a device's stage copies (Chimera's two pipes, interleaving's chunks), step by step


def train_copies_every_step(cfg: RunConfig, runs: list[tuple[str, str | None]], steps: int) -> dict:
    """In each worker, one Trainer per (mode, schedule) run, from the same seed; every stage copy's
    parameters after every step (copies: Chimera's pipes 0 and 1, or the interleaved chunks)."""
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    chimera = cfg.pipeline.order == "chimera"
    copies = (0, 1) if chimera else range(cfg.pipeline.chunks) if cfg.pipeline.chunked else (0,)
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s, chimera=chimera)
    out: dict = {"device": ctx.grid.stage, "replica": ctx.grid.replica}
    try:
        for mode, schedule in runs:
            torch.manual_seed(0)
            trainer = Trainer(cfg, ctx, TrainOptions.of(mode=mode, schedule=schedule, steps=steps, progress=False,
                                                        log_every=10**9))
            trainer.stage.train()
            def copy(c: int):  # noqa: ANN202
                return trainer.stage.copy(c) if hasattr(trainer.stage, "copy") else trainer.stage
            index = {c: copy(c).index for c in copies}
            history, losses = [], []
            for step in range(steps):
                loss = trainer.train_step(step)  # a 0-dim tensor on the last stage (read here, not on the step path)
                losses.append(None if loss is None else float(loss))
                history.append({c: {n: t.detach().clone() for n, t in copy(c).named_parameters()} for c in copies})
            out[mode if schedule is None else os.path.basename(schedule)] = (index, history, losses)
    finally:
        shutdown(ctx)
    return out


# ----------------------------------------------------------------------------------------------------
# Training several runs in the same workers


def train_runs(cfg_path: str, runs: list[tuple[str, str | None]], steps: int, overrides: dict) -> dict:
    """In each worker (spawn_local), one Trainer per (mode, schedule) run, one after the other, each from
    the same seed: their parameters and losses, keyed by mode (or the schedule file's name)."""
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    cfg = load_config(cfg_path).replace(**overrides).replace(pipeline={"timeout_s": 30.0})
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    out = {"stage": ctx.grid.stage, "replica": ctx.grid.replica}
    try:
        for mode, schedule in runs:
            torch.manual_seed(0)
            trainer = Trainer(cfg, ctx, TrainOptions.of(mode=mode, schedule=schedule, steps=steps, progress=False,
                                                        log_every=10**9))
            res = trainer.run()
            params = {n: p.detach().clone() for n, p in trainer.stage.named_parameters()}
            out[mode if schedule is None else os.path.basename(schedule)] = (params, res.losses)
    finally:
        shutdown(ctx)
    return out


def train_whole_and_resumed(cfg: RunConfig, whole: str, stopped: str, steps: int, stop: int, options: dict) -> None:
    """In each worker (spawn_local), one launch for a resume check: ``steps`` steps checkpointed to
    ``whole``; ``stop`` steps checkpointed to ``stopped``, then resumed from there to ``steps`` into the
    same folder (as ``pipefisher train --resume``). ``options``: more :class:`TrainOptions` (mode, schedule)."""
    from pipefisher.runtime.job.dist import init_from_env, shutdown
    from pipefisher.runtime.train.trainer import Trainer, TrainOptions

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s, chimera=cfg.pipeline.order == "chimera")
    try:
        for last, folder, resume in ((steps, whole, None), (stop, stopped, None), (steps, stopped, stopped)):
            Trainer(cfg, ctx, TrainOptions.of(steps=last, checkpoint_dir=folder, resume=resume, progress=False,
                                              log_every=10**9, **options)).run()
    finally:
        shutdown(ctx)


# ----------------------------------------------------------------------------------------------------
# What every one-pipe layout of copies (interleaved chunks, zero-bubble orders) must show


def train_one_and_spread_schedules(cfg: RunConfig, folder: Any, steps: int) -> tuple[list[dict], dict[str, str]]:
    """Workers train ``first-order``, ``kfac``, a one-iteration schedule (``one``) and
    :func:`interleaved_spread_schedule` (``spread``), both checked and saved in ``folder``: the
    results of :func:`train_copies_every_step` and the schedule files by name."""
    from pipefisher.runtime.launch.local import spawn_local
    from pipefisher.runtime.pipeline.checks import check_schedule, single_iteration_schedule
    from pipefisher.schedule.file import save_schedule

    files = {}
    for name, data in (("one", single_iteration_schedule(cfg)), ("spread", interleaved_spread_schedule(cfg))):
        check_schedule(data, cfg)
        files[name] = str(folder / f"{name}.pickle")
        save_schedule(files[name], data)
    runs = [("first-order", None), ("kfac", None)] + [("scheduled", files[n]) for n in ("one", "spread")]
    return spawn_local(train_copies_every_step, 2, cfg, runs, steps, timeout_s=180), files


def assert_one_iteration_schedule_trains_as_kfac_mode(results: list[dict], steps: int) -> None:
    """Results of :func:`train_copies_every_step` with runs ``kfac`` and ``one.pickle`` (a one-iteration
    schedule): every copy's parameters after every step agree, and so does the loss, which K-FAC moved
    away from the ``first-order`` run's."""
    import pytest

    from test_runtime_executor import _close

    for res in results:
        for step in range(steps):
            for j in res["kfac"][1][step]:
                _close(res["one.pickle"][1][step][j], res["kfac"][1][step][j])
    last = [res for res in results if res["kfac"][2][0] is not None]
    assert len(last) == 1 and last[0]["one.pickle"][2] == pytest.approx(last[0]["kfac"][2], rel=1e-6)
    assert last[0]["kfac"][2] != pytest.approx(last[0]["first-order"][2], rel=1e-4)  # K-FAC changed the run


def assert_schedule_trains_as_its_replay(cfg: RunConfig, results: list[dict], path: str, steps: int) -> None:
    """The run of schedule file ``path`` ends with every virtual stage's parameters equal to a
    one-process :func:`replay` of its labels."""
    from pipefisher.schedule.file import load_schedule

    from test_runtime_executor import _close

    want = replay(cfg, load_schedule(path), steps)
    seen = set()
    for res in results:
        index, history, _ = res[os.path.basename(path)]
        for j, s in index.items():
            _close(history[-1][j], want[s], 1e-4)
            seen.add(s)
    assert seen == set(want)

