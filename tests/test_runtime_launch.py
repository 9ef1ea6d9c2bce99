"""Launching workers: torchrun detection, one-line refusals, who died first, threads per worker, the port
they meet on."""
from __future__ import annotations

import os
import signal
import socket
import time
from typing import Callable

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.job.config import load_config
from pipefisher.runtime.job.process import JobEnv, free_port, threads_per_worker, torchrun_env
from pipefisher.runtime.launch.local import (PEER_LOST_EXIT, WorkerFailed, failure_message, first_failure,
                                             launch_local, spawn_local, worker_env)
from pipefisher.runtime.train.trainer import TrainOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "none"}


def _as_torchrun(monkeypatch: pytest.MonkeyPatch, **changes: str) -> None:
    for key, value in {**TORCHRUN, **changes}.items():
        monkeypatch.setenv(key, value)


def test_torchrun_is_detected_from_its_environment():
    assert torchrun_env({}) is None
    assert torchrun_env({"RANK": "0"}) is None  # half a job is no job: a stray RANK alone is ignored
    assert torchrun_env(TORCHRUN) == JobEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    bare = {k: TORCHRUN[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert torchrun_env(bare) == JobEnv(1, 2, 1, 2)  # local rank and size default to the global ones
    with pytest.raises(InputError, match="MASTER_ADDR, MASTER_PORT are not set"):
        torchrun_env({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(InputError, match="RANK='one' is not a whole number"):
        torchrun_env({**TORCHRUN, "RANK": "one"})


def test_train_under_torchrun_refuses_nproc_per_node_in_one_line(monkeypatch):
    _as_torchrun(monkeypatch, RANK="0", LOCAL_RANK="0")
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--nproc-per-node", "2", "--steps", "1"])
    assert res.exit_code == 2, res.output  # at once: before torch loads, before any progress line
    assert res.output.count("\n") == 1 and "Traceback" not in res.output
    assert res.output.startswith("error: --nproc-per-node: this process already is worker 0 of 2 started by "
                                 "torchrun") and "torchrun --nproc-per-node N --no-python pipefisher train" in res.output
    _as_torchrun(monkeypatch)  # local rank 1 of that machine: same exit, the line is local rank 0's
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--nproc-per-node", "2", "--steps", "1",
                                    "--no-progress"])
    assert res.exit_code == 2 and res.output == ""


def test_a_world_size_that_does_not_fit_the_stages_is_one_line(monkeypatch):
    _as_torchrun(monkeypatch, RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--steps", "1", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: {TINY}: torchrun started 3 workers (WORLD_SIZE), not a multiple of the 2 "
                          "pipeline stages; start stages x replicas workers (torchrun --nnodes x --nproc-per-node)\n")


def test_the_worker_module_points_people_to_pipefisher_train(capsys):
    from pipefisher.runtime.launch.child import main as worker_main

    assert worker_main(["--config", TINY, "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchrun --nproc-per-node N --no-python pipefisher train" in err


def test_the_first_worker_to_die_is_blamed_not_the_peer_that_lost_it():
    # rank 0 lost its peer (and may even be seen first); rank 1 was killed; rank 2 was stopped by us
    exits = [(0, PEER_LOST_EXIT, 1.00), (1, -signal.SIGKILL, 1.02), (2, -signal.SIGTERM, 4.0)]
    assert first_failure(exits, stopped=[2]) == 1
    assert first_failure([(0, 1, 2.0), (1, 2, 1.0)]) == 1  # two real errors: the earlier one
    assert first_failure([(0, PEER_LOST_EXIT, 2.0), (1, PEER_LOST_EXIT, 1.0)]) == 1  # a stall: the earliest
    assert first_failure([(0, -15, 3.0), (1, 0, 1.0)], stopped=[0]) == 0  # only a stopped one failed
    assert first_failure([(0, 0, 1.0), (1, None, 2.0)]) is None
    line = failure_message(1, 2, -9, "", "/runs/x_workers.log")
    assert line == ("worker rank 1 of 2 was killed by SIGKILL (exit code -9): no error message (stopped from "
                    "outside: out of memory, a job scheduler, or kill); the other workers were stopped; "
                    "worker output and tracebacks in /runs/x_workers.log")
    assert failure_message(0, 2, 2, "error: x.yaml: bad", None) == (
        "worker rank 0 of 2 exited with code 2: error: x.yaml: bad; the other workers were stopped")


def _stat(pid: int | str) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (state, ppid, ...); [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _children(parent: int) -> list[int]:
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if _stat(pid)[1:2] == [str(parent)]]


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent does not)."""
    return _stat(pid)[:1] not in ([], ["Z"], ["X"])


def _child_with_rank(rank: int) -> int:
    """The pid of this test's own worker process of ``rank`` (children of this process only)."""
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"RANK") == str(rank).encode() and b"PIPEFISHER_WORKER_LOG" in env:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} among this process's children")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds its worker processes in /proc")
def test_a_killed_worker_is_named_with_its_signal_and_tracebacks_go_to_the_log(tmp_path):
    cfg = load_config(TINY)
    killed: list[float] = []
    shown: list[str] = []

    def echo(line: str) -> None:
        shown.append(line)
        if line.startswith("step") and not killed:  # training runs: kill the last stage
            os.kill(_child_with_rank(1), signal.SIGKILL)
            killed.append(time.monotonic())

    log = tmp_path / "tiny_workers.log"
    with pytest.raises(WorkerFailed) as err:
        launch_local(cfg, TrainOptions.of(steps=100_000, progress=False, log_every=1), 2, echo=echo,
                     log_path=str(log))
    assert killed and time.monotonic() - killed[0] < 5  # not the peers' timeout, nor a slow teardown
    assert str(err.value) == ("worker rank 1 of 2 was killed by SIGKILL (exit code -9): no error message "
                              "(stopped from outside: out of memory, a job scheduler, or kill); the other "
                              f"workers were stopped; worker output and tracebacks in {log}")
    assert not any("Traceback" in line or "PeerLost" in line for line in shown)
    text = log.read_text()
    assert "[rank 0] traceback:" in text and "PeerLost" in text and "[rank 1] step" in text


def test_omp_threads_respect_the_user_and_default_to_the_cores_shared_out(monkeypatch):
    assert threads_per_worker(2, {"OMP_NUM_THREADS": "3"}, cores=8) == 3
    assert threads_per_worker(2, {}, cores=8) == 4
    assert threads_per_worker(4, {}, cores=2) == 1
    with pytest.raises(InputError, match="OMP_NUM_THREADS='0' must be a positive whole number"):
        threads_per_worker(2, {"OMP_NUM_THREADS": "0"})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # an outer torchrun's: must not leak in
    env = worker_env(0, 2, 1234)
    assert env["OMP_NUM_THREADS"] == "3" and "TORCHELASTIC_USE_AGENT_STORE" not in env
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert worker_env(0, 2, 1234)["OMP_NUM_THREADS"] == str(threads_per_worker(2))


def test_a_torchrun_worker_keeps_the_users_omp_threads(monkeypatch):
    import torch

    from pipefisher.runtime.job.dist import init_from_env, shutdown

    before = torch.get_num_threads()
    _as_torchrun(monkeypatch, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                 MASTER_PORT=str(free_port()), OMP_NUM_THREADS="2")
    ctx = init_from_env(1, 10.0)
    try:
        assert torch.get_num_threads() == 2
    finally:
        shutdown(ctx)
        torch.set_num_threads(before)


def test_run_under_torchrun_is_refused_in_one_line(tmp_path, monkeypatch):
    _as_torchrun(monkeypatch, RANK="0", LOCAL_RANK="0")
    res = CliRunner().invoke(main, ["run", "--config", TINY, "--out", str(tmp_path / "r"), "--steps", "1"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "pipefisher run launches its own workers" in res.output and not (tmp_path / "r").exists()


def test_a_run_alone_takes_the_device_a_launched_worker_would(monkeypatch):
    """One stage without a launcher trains in this process: on the GPU where there is one (it used to
    stay on the CPU), on the CPU with this machine's threads otherwise."""
    import torch

    import pipefisher.runtime.job.dist as dist_mod

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(TINY).replace(pipeline={"stages": 1})
    assert dist_mod.init_context(cfg).device == dist_mod.pick_device(0)[0]
    monkeypatch.setattr(dist_mod, "pick_device", lambda local_rank: (torch.device("meta"), "nccl"))
    assert dist_mod.init_context(cfg).device == torch.device("meta")


def test_more_workers_than_gpus_is_one_line_before_nccl_sees_it(monkeypatch):
    """NCCL refuses two ranks on one GPU only at the first collective, in its own words: say it at start."""
    import torch

    import pipefisher.runtime.job.dist as dist_mod

    assert dist_mod.gpu_of(1, 2, 2) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"2 workers on this machine but 1 GPU\(s\).*CUDA_VISIBLE_DEVICES"):
        dist_mod.pick_device(0, local_workers=2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_benchmark_worker_pins_to_its_ranks_core_among_those_it_was_given(monkeypatch):
    """Two benchmarks side by side under taskset keep to their own cores (they used to pin to core 0, 1)."""
    from pipefisher.runtime.launch.local import pin_to_one_core

    before = os.sched_getaffinity(0)
    first = min(before)  # rank 1 given only the first core: the old rule took core 1 all the same
    try:
        os.sched_setaffinity(0, {first})
        monkeypatch.setenv("RANK", "1")
        assert pin_to_one_core() == 1 and os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, before)


def _meet_and_sum() -> tuple[int, float]:
    """A worker of spawn_local: join through the launcher's store and add up the ranks (1 + 2)."""
    import torch
    import torch.distributed as dist

    from pipefisher.runtime.job.dist import join_process_group

    join_process_group("gloo")
    try:
        x = torch.full((1,), float(dist.get_rank() + 1))
        dist.all_reduce(x)
        return int(os.environ["MASTER_PORT"]), float(x.item())
    finally:
        dist.destroy_process_group()


def test_a_local_launch_holds_its_port_until_rank_0s_store_takes_it(monkeypatch):
    """The port a launch chose stays bound from its choice on, so a process that binds it meanwhile fails,
    not the launch (a port found free and released could be taken in between: two suites side by side
    did, and rank 0 died on EADDRINUSE); the workers then meet on that very port."""
    import pipefisher.runtime.launch.local as local

    chosen, other_bound = [], []

    def chosen_then_raced() -> socket.socket:
        sock = local_store_socket()
        chosen.append(sock.getsockname()[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            try:
                other.bind(("127.0.0.1", chosen[0]))
                other_bound.append(True)
            except OSError:
                other_bound.append(False)
        return sock

    local_store_socket = local.store_socket
    monkeypatch.setattr(local, "store_socket", chosen_then_raced)
    results = spawn_local(_meet_and_sum, 2, timeout_s=60)
    assert other_bound == [False]
    assert results == [(chosen[0], 3.0), (chosen[0], 3.0)]


def test_every_worker_of_a_local_launch_joins_through_the_launchers_store():
    """Rank 0 adopts the socket (its descriptor is set by the launcher); the others are its clients."""
    from pipefisher.runtime.job.process import STORE_FD_ENV

    assert worker_env(0, 2, 1234)[STORE_FD_ENV] == worker_env(1, 2, 1234)[STORE_FD_ENV] == "-1"


def test_a_leaked_store_variable_under_another_launcher_is_one_clear_error(monkeypatch):
    """Rank 0 given the clients' value (the variable leaked into a torchrun job) says what to unset."""
    from pipefisher.runtime.job.dist import join_process_group
    from pipefisher.runtime.job.process import STORE_FD_ENV

    monkeypatch.setenv(STORE_FD_ENV, "-1")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{STORE_FD_ENV}=-1 on rank 0: only pipefisher's local launchers"):
        join_process_group("gloo")


def _say_pid_and_sleep(folder: str) -> None:
    """A worker of spawn_local that says its pid, then sleeps far longer than the test waits."""
    path = os.path.join(folder, f"{os.environ['RANK']}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole when the test sees it
    time.sleep(120)


def _outliving_a_killed_launcher(code: str, args: list[str], workers_of: Callable[[int], list[int]]) -> list[int]:
    """Run a launcher (``python -c code args``), wait for ``workers_of(its pid)`` to name its 2 workers,
    SIGKILL it, and return those still running 10 s later (then killed, so none outlives the test)."""
    import subprocess
    import sys

    launcher = subprocess.Popen([sys.executable, "-c", code, *args])
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the workers did not start"
            time.sleep(0.1)
            workers = workers_of(launcher.pid)
        time.sleep(1.0)  # past their start: the lifeline, not a launcher already gone at start, ends them
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in workers if _running(pid)]
    finally:
        launcher.kill()
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds its worker processes in /proc")
def test_the_workers_of_pipefisher_train_stop_when_its_launcher_is_killed():
    """SIGKILL reaches no handler of the launcher, and with nothing to print the workers would not notice
    its pipe had closed: they trained on for minutes, unseen (measured: still running 120 s later)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pipefisher.runtime.job.config import load_config; "
            "from pipefisher.runtime.launch.local import launch_local; "
            "from pipefisher.runtime.train.trainer import TrainOptions; "
            "launch_local(load_config(sys.argv[2]), TrainOptions.of(steps=10**6, progress=False, log_every=10**9), 2)")
    assert _outliving_a_killed_launcher(code, [ROOT, TINY], _children) == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds its worker processes in /proc")
def test_spawn_local_workers_stop_when_their_caller_is_killed(tmp_path):
    """A caller killed outright (SIGKILL: no handler, no finally) takes its workers with it: they are the fork
    server's children, not its own, and a killed benchmark's workers used to train on beside the next run."""
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import test_runtime_launch as t; "
            "from pipefisher.runtime.launch.local import spawn_local; "
            "spawn_local(t._say_pid_and_sleep, 2, sys.argv[3], timeout_s=300)")
    def said(_caller: int) -> list[int]:  # the fork server's children say their pids themselves
        return [int(p.read_text()) for p in tmp_path.glob("*.pid")]

    assert _outliving_a_killed_launcher(code, [ROOT, os.path.join(ROOT, "tests"), str(tmp_path)], said) == []
