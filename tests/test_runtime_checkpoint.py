"""Checkpoints: stopping after step s and resuming gives the run that never stopped; foreign ones are refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.data.batches import DataPosition
from pipefisher.runtime.job.config import apply_overrides, load_config
from pipefisher.runtime.job.dist import single_process
from pipefisher.runtime.launch.local import decode_spec, encode_spec, run_worker, spawn_local
from pipefisher.runtime.pipeline.checks import single_iteration_schedule
from pipefisher.runtime.train.checkpoint import (FORMAT, MANIFEST, Checkpointer, StateGroup, TorchRNG, check_resumable,
                                                lr_schedule_changes)
from pipefisher.runtime.train.trainer import Trainer, TrainOptions
from pipefisher.schedule.file import save_schedule

from _schedules import TINY, packed_schedule, spread_schedule, tiny, train_whole_and_resumed


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _train(cfg, **opts) -> Trainer:
    def go() -> Trainer:
        t = Trainer(cfg, single_process(), TrainOptions.of(progress=False, log_every=10**9, **opts))
        t.run()
        return t
    return _one_thread(go)


def _params(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.stage.named_parameters()}


@pytest.mark.parametrize("mode", ["scheduled", "kfac", "first-order"])
def test_resume_in_one_process_continues_exactly(tmp_path, mode):
    # the decay's horizon is fixed (decay_steps), as it must be when a run is cut short and resumed
    cfg = tiny(pipeline={"stages": 1}, optim={"name": "adam", "lr": 0.01, "decay_steps": 8}, model={"dropout": 0.1})
    sched = None
    if mode == "scheduled":
        sched = str(tmp_path / "s.pickle")
        save_schedule(sched, spread_schedule(cfg))  # k = 3
    full = _train(cfg, mode=mode, schedule=sched, steps=8)
    ck = str(tmp_path / "ck")
    # stop after step 4 = iteration 0 of the second cycle: its saved micro-batches are still pending
    _train(cfg, mode=mode, schedule=sched, steps=5, checkpoint_dir=ck, checkpoint_every=2)
    assert sorted(e for e in os.listdir(ck) if e.startswith("step-")) == ["step-00000005"]
    if mode == "scheduled":
        state = torch.load(os.path.join(ck, "step-00000005", "stage0-replica0.pt"), weights_only=True)
        assert any(layer["inputs"] for layer in state["kfac"][0]["curvature"]["layers"].values())
    resumed = _train(cfg, mode=mode, schedule=sched, steps=8, resume=ck, checkpoint_dir=ck)
    assert resumed.start_step == 5
    for name, p in _params(full).items():
        assert torch.equal(p, _params(resumed)[name]), name
    # the curvature drift too: the refreshes after the resume measure what the uninterrupted run's did
    # (scheduled: the open cycle's samples and half-done refreshes came through the checkpoint)
    if mode != "first-order":
        after = {s: (r.drift, r.aging) for s, r in resumed.refreshes.items()}
        assert max(after) >= 5 and after == {s: (full.refreshes[s].drift, full.refreshes[s].aging) for s in after}


@pytest.mark.parametrize("mode", ["first-order", "kfac"])
def test_resume_with_muon_continues_exactly(tmp_path, mode):
    """Muon with AdamW (in kfac mode: Muon takes K-FAC's preconditioned gradients): both optimizers'
    state goes into the checkpoint and the resumed run ends bit for bit where the whole one does."""
    cfg = tiny(pipeline={"stages": 1}, model={"dropout": 0.1}, kfac={"update": "base"},
               optim={"name": "muon", "lr": 0.01, "warmup_steps": 2, "decay_steps": 6})
    full = _train(cfg, mode=mode, steps=6)
    ck = str(tmp_path / "ck")
    _train(cfg, mode=mode, steps=3, checkpoint_dir=ck)
    state = torch.load(os.path.join(ck, "step-00000003", "stage0-replica0.pt"), weights_only=True)
    assert set(state["optimizer"]["optimizer"]) == {"muon", "adamw"} and state["optimizer"]["optimizer"]["muon"]
    resumed = _train(cfg, mode=mode, steps=6, resume=ck, checkpoint_dir=ck)
    assert resumed.start_step == 3
    for name, p in _params(full).items():
        assert torch.equal(p, _params(resumed)[name]), name


@pytest.mark.parametrize("mode", ["scheduled", "kfac"])
def test_resume_with_adam_in_the_eigenbasis_continues_exactly(tmp_path, mode):
    """``kfac.update: soap``: the moments in the rotated coordinates and the bases they were taken in go
    into the checkpoint; a resumed run rotates nothing the whole one did not and ends bit for bit."""
    # kfac mode refreshes every 4 steps: steps 5-7 after the resume run on bases refreshed before it
    cfg = tiny(pipeline={"stages": 1}, model={"dropout": 0.1},
               kfac={"update": "soap", "factor_decay": 0.9, "interval": 4},
               optim={"name": "adamw", "lr": 0.01, "decay_steps": 8})
    sched = None
    if mode == "scheduled":
        sched = str(tmp_path / "s.pickle")
        save_schedule(sched, spread_schedule(cfg))  # k = 3: stops inside a cycle, bases refreshed since
    full = _train(cfg, mode=mode, schedule=sched, steps=8)
    ck = str(tmp_path / "ck")
    _train(cfg, mode=mode, schedule=sched, steps=5, checkpoint_dir=ck)
    resumed = _train(cfg, mode=mode, schedule=sched, steps=8, resume=ck, checkpoint_dir=ck)
    assert resumed.start_step == 5
    for name, p in _params(full).items():
        assert torch.equal(p, _params(resumed)[name]), name


def test_muon_resume_on_two_stages_one_without_muon_parameters(tmp_path):
    """Muon only on layer 0 (stage 0): stage 1 steps with AdamW alone, and a run stopped after step 2
    and resumed to step 4 ends with the weights of the run that never stopped, on both stages."""
    sets = ["data.text=stdlib", "optim.name=muon", "optim.lr=0.01", "optim.muon_include=[encoder.layer.0]"]
    # the config as pipefisher train --set ... hands it to its workers (through the launcher's JSON spec)
    cfg, _ = decode_spec(encode_spec(apply_overrides(load_config(TINY), sets), TrainOptions.of()))
    assert cfg.optim.muon_include == ("encoder.layer.0",)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    spawn_local(train_whole_and_resumed, 2, cfg, a, b, 4, 2, {}, timeout_s=120)
    for stage in range(2):
        fa = torch.load(os.path.join(a, "step-00000004", f"stage{stage}-replica0.pt"), weights_only=True)
        fb = torch.load(os.path.join(b, "step-00000004", f"stage{stage}-replica0.pt"), weights_only=True)
        assert (fa["optimizer"]["optimizer"]["muon"] is None) == (stage == 1)
        for name, p in fa["model"].items():
            assert torch.equal(p, fb["model"][name]), (stage, name)


def test_resume_with_two_stages_through_the_cli(tmp_path):
    """Stop after step 1 (iteration 0 of a k >= 2 cycle), resume to step 5: the parameters equal those
    of the uninterrupted run, and the metrics CSV holds every step once."""
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, packed_schedule(tiny()))
    base = ["train", "--config", TINY, "--schedule", sched, "--nproc-per-node", "2", "--no-progress"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # the uninterrupted run: what `base --steps 5 --checkpoint-dir a` has each worker run, in forked workers
    spawn_local(run_worker, 2, load_config(TINY),
                TrainOptions.of(mode="scheduled", schedule=sched, steps=5, checkpoint_dir=a, progress=False),
                timeout_s=120)
    runner = CliRunner()
    metrics = str(tmp_path / "b.csv")
    res = runner.invoke(main, base + ["--steps", "2", "--checkpoint-dir", b, "--metrics", metrics])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, base + ["--steps", "5", "--resume", b, "--metrics", metrics,
                                      "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "resuming after step 1" in res.output
    with open(os.path.join(b, MANIFEST)) as f:
        manifest = json.load(f)
    cycles = [len(node) for node in packed_schedule(tiny())]
    assert cycles[0] != cycles[1]  # so "cycle" must say which: the job's k, the longest node's
    assert manifest["cycle"] == max(cycles) and manifest["node_cycles"] == cycles
    losses = json.loads((tmp_path / "out" / "tiny_losses.json").read_text())  # the same meaning there
    assert losses["cycle"] == max(cycles) and losses["node_cycles"] == cycles
    assert f"k={max(cycles)} (per node: {cycles[0]}, {cycles[1]})" in res.output
    for stage in range(2):
        fa = torch.load(os.path.join(a, "step-00000005", f"stage{stage}-replica0.pt"), weights_only=True)
        fb = torch.load(os.path.join(b, "step-00000005", f"stage{stage}-replica0.pt"), weights_only=True)
        for name, p in fa["model"].items():
            assert torch.equal(p, fb["model"][name]), (stage, name)
    with open(metrics) as f:
        rows = f.read().splitlines()
    assert rows[0] == "step,loss,val_loss,lr,step_seconds,mode,cycle,overrun_seconds,drift,aging" and [r.split(",")[0] for r in rows[1:]] == list("01234")
    assert all(r.split(",")[5] == "scheduled" for r in rows[1:])
    # steps 1-4 ran the schedule, measured (overrun of its planned bubbles, once a job cycle is gathered:
    # here at the end of each run) under its cycle k
    assert all(r.split(",")[6] == str(max(cycles)) for r in rows[1:])
    assert all(r.split(",")[7] != "" for r in rows[2:])


def test_a_foreign_checkpoint_is_refused(tmp_path):
    cfg = tiny(pipeline={"stages": 1})
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, single_iteration_schedule(cfg))
    ck = str(tmp_path / "ck")
    t = _train(cfg, mode="scheduled", schedule=sched, steps=2, checkpoint_dir=ck)
    digest = t.schedule_digest
    check_resumable(ck, cfg, "scheduled", digest, 1, 1)  # its own run is fine
    # a manifest from before model.builder/options, data.objective and the Muon keys existed: those keys
    # at the values they stand for still resume; another builder does not
    with open(os.path.join(ck, MANIFEST)) as f:
        manifest = json.load(f)
    for sec, key in (("model", "builder"), ("model", "options"), ("data", "objective"), ("optim", "muon_momentum"),
                     ("optim", "muon_include"), ("optim", "muon_exclude"), ("kfac", "refresh_pieces"),
                     ("kfac", "cov_micro_batches")):
        del manifest["config"][sec][key]
    with open(os.path.join(ck, MANIFEST), "w") as f:
        json.dump(manifest, f)
    check_resumable(ck, cfg, "scheduled", digest, 1, 1)
    with pytest.raises(InputError, match=r"another config \(differs in model.builder: "):
        check_resumable(ck, cfg.replace(model={"builder": "examples.own_model:build"}), "scheduled", digest, 1, 1)
    with pytest.raises(InputError, match=r"another config \(differs in kfac.cov_micro_batches: "):
        check_resumable(ck, cfg.replace(kfac={"cov_micro_batches": 1}), "scheduled", digest, 1, 1)
    with pytest.raises(InputError, match=r"another config \(differs in optim.weight_decay: "):
        check_resumable(ck, cfg.replace(optim={"weight_decay": 0.5}), "scheduled", digest, 1, 1)
    check_resumable(ck, cfg.replace(optim={"lr": 0.5}), "scheduled", digest, 1, 1)  # the lr schedule may change
    with pytest.raises(InputError, match=r"another config \(differs in optim.muon_exclude: "):
        check_resumable(ck, cfg.replace(optim={"muon_exclude": ["cls"]}), "scheduled", digest, 1, 1)
    with pytest.raises(InputError, match="another schedule file"):
        check_resumable(ck, cfg, "scheduled", "0" * 16, 1, 1)
    with pytest.raises(InputError, match="mode 'scheduled', this run is 'kfac'"):
        check_resumable(ck, cfg, "kfac", None, 1, 1)
    with pytest.raises(InputError, match=r"1 stage\(s\) x 1 replica\(s\); this run has 1 x 2"):
        check_resumable(ck, cfg, "scheduled", digest, 1, 2)
    with pytest.raises(InputError, match="holds no checkpoint"):
        check_resumable(str(tmp_path), cfg, "scheduled", digest, 1, 1)
    os.remove(os.path.join(ck, "step-00000002", "stage0-replica0.pt"))
    with pytest.raises(InputError, match="incomplete: stage0-replica0.pt missing"):
        check_resumable(ck, cfg, "scheduled", digest, 1, 1)
    with open(os.path.join(ck, MANIFEST)) as f:
        assert json.load(f)["steps_done"] == 2


def test_a_checkpoint_on_synthetic_tokens_from_before_the_tokenizer_kind_was_recorded_resumes(tmp_path):
    """Only text had the older whitespace-split BPE: a run on synthetic tokens has no tokenizer, and its
    manifest without ``tokenizer_kind`` resumes as it did."""
    cfg = load_config(TINY).replace(pipeline={"stages": 1})  # data.text synthetic, data.tokenizer bpe
    ck = str(tmp_path / "ck")
    _train(cfg, steps=1, checkpoint_dir=ck)
    with open(os.path.join(ck, MANIFEST)) as f:
        manifest = json.load(f)
    del manifest["tokenizer_kind"]
    with open(os.path.join(ck, MANIFEST), "w") as f:
        json.dump(manifest, f)
    assert check_resumable(ck, cfg, "first-order", None, 1, 1)["steps_done"] == 1
    manifest["config"]["data"]["text"] = "stdlib"  # the same manifest of a run on text: it had bpe-whitespace
    with open(os.path.join(ck, MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(InputError, match=r"--set data.tokenizer=bpe-whitespace resumes it$"):
        check_resumable(ck, cfg.replace(data={"text": "stdlib"}), "first-order", None, 1, 1)


def test_cli_refuses_a_checkpoint_of_another_config_before_training(tmp_path):
    sched = str(tmp_path / "s.pickle")
    save_schedule(sched, single_iteration_schedule(tiny()))
    ck = str(tmp_path / "ck")
    cfg = load_config(TINY).replace(pipeline={"stages": 1})  # the CLI's config file, one stage
    save_schedule(str(tmp_path / "s1.pickle"), single_iteration_schedule(cfg))
    _train(cfg, mode="scheduled", schedule=str(tmp_path / "s1.pickle"), steps=1, checkpoint_dir=ck)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--schedule", sched, "--nproc-per-node", "2",
                                    "--steps", "3", "--resume", ck, "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "was written by a run with another config (differs in pipeline.stages: 1 there, 2 here); a resumed " \
        "run may change only" in res.output
    assert "pipefisher train: mode" not in res.output


def test_checkpoints_load_without_running_code(tmp_path):
    """A checkpoint file that pickles an arbitrary object is refused, not executed."""
    import pickle

    cfg = tiny(pipeline={"stages": 1})
    ck = str(tmp_path / "ck")
    _train(cfg, mode="first-order", steps=1, checkpoint_dir=ck)
    path = os.path.join(ck, "step-00000001", "stage0-replica0.pt")

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    with open(path, "wb") as f:
        torch.save({"payload": Boom()}, f, pickle_module=pickle)
    with pytest.raises(InputError, match="is not a readable checkpoint"):
        _train(cfg, mode="first-order", steps=2, resume=ck)
    assert not (tmp_path / "pwned").exists()


def test_resuming_to_the_steps_already_done_says_so(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = load_config(TINY).replace(pipeline={"stages": 1})  # the CLI's config file with --stages 1
    _train(cfg, mode="first-order", steps=2, checkpoint_dir=ck)
    base = ["train", "--config", TINY, "--stages", "1", "--no-progress", "--resume", ck + "/"]
    res = CliRunner().invoke(main, base + ["--steps", "2"])
    assert res.exit_code == 0, res.output
    assert res.output == f"nothing to do: the checkpoint in {ck} has 2 steps done, --steps is 2\n"
    res = CliRunner().invoke(main, base + ["--steps", "1"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "2 steps done, but --steps is 1: --steps counts every step" in res.output


def _lrs(metrics: str) -> list[float]:
    with open(metrics) as f:
        return [float(row.split(",")[3]) for row in f.read().splitlines()[1:]]


def test_resuming_past_the_learning_rate_decay_is_refused_unless_asked_for(tmp_path):
    """README's example: 4 steps, then --steps 8 --resume. The decay ended where the first run put it (its
    --steps, recorded in the checkpoint), so steps 4-7 would train at the final rate, 0: refused in one line
    with both fixes. With --past-decay every lr equals that of a run that never stopped with that end, and
    one line says that the steps past it keep the final rate."""
    base = ["train", "--config", TINY, "--stages", "1", "--no-progress", "--set", "optim.lr_schedule=linear"]
    ck, resumed, whole = str(tmp_path / "ck"), str(tmp_path / "resumed.csv"), str(tmp_path / "whole.csv")
    runner = CliRunner()
    res = runner.invoke(main, base + ["--steps", "4", "--checkpoint-dir", ck, "--metrics", resumed])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, base + ["--steps", "8", "--resume", ck, "--metrics", resumed])
    assert (res.exit_code, res.output) == (2, (
        f"error: {ck}: holds a run whose linear learning-rate schedule decayed to step 4: --steps 8 would train "
        "steps 4-7 at its final rate 0 (optim.min_lr_ratio x optim.lr); --set optim.decay_steps=8 decays over all "
        "8 steps instead, --past-decay trains them at the final rate\n"))
    res = runner.invoke(main, base + ["--steps", "8", "--resume", ck, "--metrics", resumed, "--past-decay"])
    assert res.exit_code == 0, res.output
    assert res.output.count("resuming: the learning rate keeps the schedule of the checkpoint's run, which "
                            "decayed to step 4; steps 4-7 run at its final rate 0 (optim.min_lr_ratio x optim.lr) "
                            "(--past-decay)") == 1, res.output
    res = runner.invoke(main, base + ["--steps", "8", "--set", "optim.decay_steps=4", "--metrics", whole])
    assert res.exit_code == 0, res.output
    assert _lrs(resumed) == _lrs(whole) == [0.1, 0.075, 0.05, 0.025, 0, 0, 0, 0]


def test_an_explicit_change_of_the_learning_rate_schedule_on_resume_is_said_in_one_line(tmp_path):
    base = ["train", "--config", TINY, "--stages", "1", "--no-progress", "--set", "optim.lr_schedule=linear"]
    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.csv")
    runner = CliRunner()
    assert runner.invoke(main, base + ["--steps", "4", "--checkpoint-dir", ck, "--metrics", metrics]).exit_code == 0
    res = runner.invoke(main, base + ["--steps", "8", "--resume", ck, "--metrics", metrics,
                                      "--set", "optim.decay_steps=8"])
    assert res.exit_code == 0, res.output
    said = [ln for ln in res.output.splitlines() if "learning-rate schedule" in ln]
    assert said == ["resuming with another learning-rate schedule than the checkpoint's run: "
                    "optim.decay_steps 0 -> 8 (decay to step 8)"], res.output
    assert _lrs(metrics) == [0.1, 0.075, 0.05, 0.025, 0.05, 0.0375, 0.025, 0.0125]  # 4-7 decay to step 8
    with open(os.path.join(ck, MANIFEST)) as f:
        assert json.load(f)["lr_horizon"] == 8  # what a further resumption keeps


def _late_manifest_worker(cfg, folder: str) -> int:
    """Rank 0 writes the manifest a second late; every worker reads it as soon as its run returns."""
    import time

    from pipefisher.runtime.train import checkpoint
    from pipefisher.runtime.job.dist import init_from_env, shutdown

    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        if ctx.grid.rank == 0:
            write = checkpoint.dump_json_atomic

            def late(*args, **kwargs):
                time.sleep(1.0)
                return write(*args, **kwargs)

            checkpoint.dump_json_atomic = late
        Trainer(cfg, ctx, TrainOptions.of(mode="first-order", steps=1, progress=False, log_every=10**9,
                                          checkpoint_dir=folder)).run()
        return checkpoint.read_manifest(folder)["steps_done"]
    finally:
        shutdown(ctx)


def test_a_checkpoint_is_complete_on_every_worker_when_its_save_returns(tmp_path):
    """A worker that resumes from the folder right away (a driver's next run) finds the manifest."""
    results = spawn_local(_late_manifest_worker, 2, tiny(pipeline=dict(stages=2)), str(tmp_path / "ck"),
                          timeout_s=120)
    assert results == [1, 1]


def test_checkpoint_keep_keeps_the_newest_checkpoints_and_export_takes_any_of_them(tmp_path):
    from safetensors.torch import load_file

    from pipefisher.runtime.models.bert import from_transformers
    from pipefisher.runtime.train.consolidate import export

    cfg = tiny(pipeline={"stages": 1}, checkpoint={"keep": 2})
    ck = str(tmp_path / "ck")
    _train(cfg, mode="first-order", steps=4, checkpoint_dir=ck, checkpoint_every=1)
    assert sorted(e for e in os.listdir(ck) if e.startswith("step-")) == ["step-00000003", "step-00000004"]
    check_resumable(ck, cfg.replace(checkpoint={"keep": 1}), "first-order", None, 1, 1)  # it may change
    line = export(os.path.join(ck, "step-00000003"), str(tmp_path / "out"))
    assert "after 3 steps" in line and line.endswith(os.path.join(ck, "step-00000003"))
    got = from_transformers(load_file(str(tmp_path / "out" / "model.safetensors")), "out")
    for name, p in _params(_train(cfg, mode="first-order", steps=3)).items():
        assert torch.equal(got[name], p), name


# ----------------------------------------------------------------------------------------------------
# The checkpointer on its own: a dict of stateful components, no Trainer


class _Counter:
    """A component of a loop of one's own: anything with state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])


def _toy(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": opt, "counter": _Counter(), "position": DataPosition(),
            "heads": StateGroup({0: torch.nn.Linear(2, 2), 1: torch.nn.Linear(2, 1)}), "rng": TorchRNG("cpu")}


def _toy_steps(parts: dict, first: int, last: int) -> None:
    for step in range(first, last):
        parts["optimizer"].zero_grad()
        x = torch.nn.functional.dropout(torch.randn(4, 3), 0.5)  # draws from the global generator
        parts["model"](x).square().sum().backward()
        parts["optimizer"].step()
        parts["counter"].seen += 1
        parts["position"].step = step + 1


def test_the_checkpointer_round_trips_components_without_a_trainer(tmp_path):
    """Three steps straight, or one step, a checkpoint, and two more in other objects that loaded it:
    the same weights, optimizer moments, counter, data position and random stream."""
    cfg = tiny(pipeline={"stages": 1})
    ckpt = Checkpointer(single_process(), cfg, "first-order")
    straight = _toy(0)
    _toy_steps(straight, 0, 3)
    first = _toy(0)
    _toy_steps(first, 0, 1)
    folder = str(tmp_path / "ck")
    ckpt.save(folder, 1, first, manifest={"note": "mine"})
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["note"] == "mine" and manifest["components"] == sorted(first) and manifest["format"] == FORMAT
    torch.manual_seed(123)  # the restored generator, not this one, draws the next dropout masks
    resumed = _toy(1)  # other initial weights: all come from the checkpoint
    assert ckpt.load(folder, resumed) == 1
    assert resumed["position"].step == 1 and resumed["counter"].seen == 1
    _toy_steps(resumed, 1, 3)
    for name in ("model", "heads"):
        a, b = straight[name].state_dict(), resumed[name].state_dict()
        assert repr(a) == repr(b), name
    assert resumed["counter"].seen == 3 and resumed["position"].step == 3
    assert torch.equal(straight["optimizer"].state_dict()["state"][0]["exp_avg"],
                       resumed["optimizer"].state_dict()["state"][0]["exp_avg"])
    # a loop that asks for a component the file lacks, or whose state does not fit, is told in one line
    with pytest.raises(InputError, match=r"holds no state of extra \(its run did not save it; it saved counter, "):
        ckpt.load(folder, {**_toy(0), "extra": _Counter()})
    with pytest.raises(InputError, match=r"holds heads state that does not fit this run \(state of \[0, 1\], "
                                         r"this run has \[0\]\)"):
        ckpt.load(folder, {"heads": StateGroup({0: torch.nn.Linear(2, 2)})})


@pytest.mark.parametrize("part,what", [(object(), "object"), ([1, 2], "list"), (torch.zeros(2), "Tensor")])
def test_a_component_without_state_dict_is_refused_in_one_line(tmp_path, part, what):
    ckpt = Checkpointer(single_process(), tiny(pipeline={"stages": 1}), "first-order")
    line = (f"checkpoint component 'mine' ({what}) has no state_dict() and load_state_dict(): give it both, "
            "or leave it out of the checkpoint")
    for call in (lambda: ckpt.save(str(tmp_path / "ck"), 1, {"mine": part}),
                 lambda: ckpt.load(str(tmp_path / "ck"), {"mine": part}),
                 lambda: StateGroup({"mine": part})):
        with pytest.raises(TypeError) as err:
            call()
        assert str(err.value) == line
    assert not (tmp_path / "ck").exists()  # refused before anything is written
    with pytest.raises(TypeError, match="checkpoint component name 'steps_done': use a string other than format"):
        ckpt.save(str(tmp_path / "ck"), 1, {"steps_done": _Counter()})


def test_a_checkpoint_of_the_previous_format_is_refused_naming_the_file_and_what_to_do(tmp_path):
    """Format 3 keeps each component's state under its own name (K-FAC: one ``{copy: state}`` entry, the
    loss scale beside the optimizers): a format 2 checkpoint does not resume, and says so; export reads it."""
    cfg = tiny(pipeline={"stages": 1})
    ck = str(tmp_path / "ck")
    _train(cfg, mode="first-order", steps=1, checkpoint_dir=ck)
    with open(os.path.join(ck, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["format"] = 2
    with open(os.path.join(ck, MANIFEST), "w") as f:
        json.dump(manifest, f)
    line = (f"{os.path.join(ck, MANIFEST)}: was written in checkpoint format 2 by an earlier pipefisher, this one "
            "resumes format 3 only: finish that run with the pipefisher that wrote it, or pipefisher export it and "
            "start a new run from the export (model.pretrained)")
    with pytest.raises(InputError) as err:
        check_resumable(ck, cfg, "first-order", None, 1, 1)
    assert str(err.value) == line
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--no-progress", "--steps", "2",
                                    "--resume", ck])
    assert (res.exit_code, res.output) == (2, f"error: {line}\n")
    from pipefisher.runtime.train.consolidate import export

    assert "after 1 step," in export(ck, str(tmp_path / "out"))


def _api_loop_worker(cfg, folder: str) -> dict:
    """A loop of one's own on the library API, 4 steps straight; and 2 steps, a checkpoint, a fresh
    worker resumed from it for 2 more: this worker's parameters and losses of both."""
    from pipefisher.runtime import api
    from pipefisher.runtime.job.dist import init_from_env, shutdown

    torch.set_num_threads(1)
    ctx = init_from_env(cfg.pipeline.stages, cfg.pipeline.timeout_s)
    try:
        def run(first: int, last: int, resume: str | None, save: str | None) -> tuple:
            worker = api.build_worker(cfg, ctx, mode="kfac", total_steps=4)
            ckpt = worker.checkpointer()
            start = ckpt.load(resume, worker.components()) if resume else 0
            assert start == first == worker.position.step
            losses = [worker.step(step) for step in range(start, last)]
            if save:
                ckpt.save(save, last, worker.components())
            return {n: p.detach().clone() for n, p in worker.stage.named_parameters()}, losses

        straight = run(0, 4, None, None)
        run(0, 2, None, folder)
        resumed = run(2, 4, folder, None)
        return {"straight": straight, "resumed": resumed}
    finally:
        shutdown(ctx)


def test_a_loop_on_the_library_api_resumes_exactly_on_two_processes(tmp_path):
    cfg = tiny(pipeline={"stages": 2}, model={"dropout": 0.1}, optim={"name": "adam", "lr": 0.01, "decay_steps": 4},
               kfac={"interval": 3})  # step 3 refreshes from the factors the checkpoint carried over
    results = spawn_local(_api_loop_worker, 2, cfg, str(tmp_path / "ck"), timeout_s=120)
    for r in results:
        (p_straight, l_straight), (p_resumed, l_resumed) = r["straight"], r["resumed"]
        assert l_resumed == l_straight[2:]
        assert p_straight.keys() == p_resumed.keys()
        for name, p in p_straight.items():
            assert torch.equal(p, p_resumed[name]), name
    assert results[1]["resumed"][1][0] is not None  # the last stage reported its losses


def test_the_fp16_loss_scale_is_a_component_of_its_own_and_comes_back(tmp_path):
    from pipefisher.runtime import api

    cfg = tiny(pipeline={"stages": 1}, train={"precision": "fp16", "loss_scale": 1e30})  # every step overflows
    worker = api.build_worker(cfg, single_process(), mode="kfac", total_steps=3)
    parts = worker.components()
    assert list(parts) == ["model", "optimizer", "kfac", "loss_scale", "data", "rng"]
    _one_thread(lambda: [worker.step(s) for s in range(2)])
    worker.checkpointer().save(str(tmp_path / "ck"), 2, parts)
    fresh = api.build_worker(cfg, single_process(), mode="kfac", total_steps=3)
    assert fresh.checkpointer().load(str(tmp_path / "ck"), fresh.components()) == 2
    assert fresh.updater.scaler.state_dict() == {"scale": 1e30 / 4, "good_steps": 0, "skipped": 2}
    assert fresh.position.step == 2


def test_a_checkpoint_whose_manifest_has_the_old_key_names_still_resumes(tmp_path):
    """Manifests before ``pipeline.order`` and ``optim.lr_schedule`` recorded ``pipeline.schedule`` and
    ``optim.schedule``: such a checkpoint resumes, silently, and a changed learning-rate schedule is still
    said under its new name."""
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    ck = str(tmp_path / "ck")
    _train(cfg, steps=1, checkpoint_dir=ck)
    with open(os.path.join(ck, MANIFEST)) as f:
        manifest = json.load(f)
    config = manifest["config"]
    config["pipeline"]["schedule"] = config["pipeline"].pop("order")
    config["optim"]["schedule"] = config["optim"].pop("lr_schedule")
    with open(os.path.join(ck, MANIFEST), "w") as f:
        json.dump(manifest, f)
    assert check_resumable(ck, cfg, "first-order", None, 1, 1)["steps_done"] == 1
    assert lr_schedule_changes(manifest, cfg.replace(optim={"lr_schedule": "linear"})) == [
        "optim.lr_schedule constant -> linear"]
    assert _train(cfg, steps=2, resume=ck, checkpoint_dir=ck).start_step == 1


def test_a_checkpoint_whose_kfac_state_is_of_another_format_is_refused_in_one_line(tmp_path):
    """A K-FAC state of a format this code does not read (a newer pipefisher's, say) stops the resume with
    one line naming the file, the format found and those known, before it is loaded as one of ours."""
    cfg = load_config(TINY).replace(pipeline={"stages": 1})  # the CLI's config file with --stages 1
    ck = str(tmp_path / "ck")
    _train(cfg, mode="kfac", steps=1, checkpoint_dir=ck)
    path = os.path.join(ck, "step-00000001", "stage0-replica0.pt")
    state = torch.load(path, weights_only=True)
    [copy] = state["kfac"]
    state["kfac"][copy]["format"] = 3
    torch.save(state, path)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--stages", "1", "--mode", "kfac", "--no-progress",
                                    "--steps", "2", "--resume", ck])
    assert (res.exit_code, res.output) == (2, (
        f"error: {path}: holds kfac state that does not fit this run (K-FAC state of format 3: this pipefisher "
        "reads format 2 and the flat layout before it (no format, one record per layer))\n"))
