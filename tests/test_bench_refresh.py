"""The refresh benchmark times each method against the Cholesky inverse measured in the same run."""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_method_is_timed_against_the_cholesky_inverse_of_the_same_size() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_refresh.py"), "--sizes", "8,16",
                          "--repeat", "1", "--pieces", ""], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 10  # 5 methods x 2 sizes
    assert out[0].startswith("n =    8: cholesky inverse") and out[0].endswith("1.00x the Cholesky inverse")
    assert all("ms" in line and line.endswith("x the Cholesky inverse") for line in out)
    for method in ("bare", "inverse label (KFAC.inv", "eigh", "power step + QR"):
        assert sum(method in line for line in out) == 2, method


@pytest.mark.parametrize("where", [[], ["--device", "cpu", "--dtype", "float64"]])
def test_the_refresh_in_pieces_is_timed_and_judged_against_the_whole_one(where: list[str]) -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_refresh.py"), "--sizes", "9",
                          "--repeat", "1", "--pieces", "2,3", *where], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == 5 + 4 + 1  # the methods, then each refresh in 2 and 3 pieces, then Newton-Schulz
    pieces, newton = out[5:9], out[9]
    assert [line.split(":")[1].split(" in ")[0].strip() for line in pieces] == \
        ["cholesky inverse", "cholesky inverse", "eigenbasis power step", "eigenbasis power step"]
    assert all("largest piece" in line and "ms" in line for line in pieces)
    assert all("residual" in line and "(whole" in line for line in pieces[:2])
    assert all("off-diagonal mass" in line and "(eigh" in line for line in pieces[2:])
    assert [len(line.split(" each ")[1].split("/")) for line in pieces] == [2, 3, 2, 3]  # each piece's time
    assert "Newton-Schulz (not built): one iteration" in newton and "from I / ||M|| " in newton


def test_every_inverse_label_of_a_model_is_timed_against_the_bare_eigh_of_its_blocks() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_refresh.py"), "--sizes", "8",
                          "--repeat", "1", "--pieces", "", "--model", os.path.join(ROOT, "configs", "tiny.yaml"),
                          "--basis-block", "16"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 5 + 2
    bare, labels = out[5:]
    assert bare.startswith("tiny.yaml (kfac.basis_block 16), ") and "diagonal blocks, bare" in bare
    assert "every inverse label (KFAC.inv, soap)" in labels and labels.endswith("x the bare eigh")
    assert float(labels.split()[-4].rstrip("x")) >= 1.0  # the label does the eigh and more


def _script() -> Any:
    """The script as a module, to call its ``main`` in-process."""
    spec = importlib.util.spec_from_file_location("bench_refresh", os.path.join(ROOT, "scripts", "bench_refresh.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_cuda_without_cuda_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    module = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_refresh.py", "--device", "cuda", "--sizes", "8", "--pieces", ""])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code not in (0, None)
    assert str(exit_.value.code) == \
        "bench_refresh.py: --device cuda: no CUDA device here (torch.cuda.is_available() is False)"
    assert capsys.readouterr().out == ""  # nothing timed before the refusal


def test_a_block_width_below_zero_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_refresh.py", "--sizes", "8", "--max-block", "-1"])
    with pytest.raises(SystemExit) as exit_:
        _script().main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == \
        "bench_refresh.py: error: --max-block must be a width >= 1 (0: as built), not -1"


def test_a_wider_block_is_the_one_each_refresh_on_that_device_plans_with(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipefisher.kfac import refresh

    monkeypatch.setattr(refresh, "MAX_BLOCK", dict(refresh.MAX_BLOCK))  # main() sets it for the run
    monkeypatch.setattr(sys, "argv", ["bench_refresh.py", "--sizes", "40", "--pieces", "2", "--repeat", "1",
                                      "--max-block", "16"])
    _script().main()
    assert refresh.MAX_BLOCK["cpu"] == 16


def test_every_clock_read_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _script()
    waits: list[int] = []
    monkeypatch.setattr(module, "SYNC", [lambda: waits.append(1)])
    module.timed(lambda: None, 3)
    assert len(waits) == 2 * (1 + 3)  # before and after each call, the untimed one included
    waits.clear()
    module.piece_times(lambda: _TwoPieces(), 2, whole=lambda: None)
    assert len(waits) == (1 + 2) * 2 * (1 + 2)  # each run, the untimed one included: the whole and two pieces


class _TwoPieces:
    """A refresh of two pieces that do nothing: what piece_times times."""

    def __init__(self) -> None:
        self.left = 2

    @property
    def finished(self) -> bool:
        return self.left == 0

    def step(self) -> None:
        self.left -= 1


def test_gpu_check_times_the_refresh_in_pieces_with_flags_the_script_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    lines = [line for line in open(os.path.join(ROOT, "scripts", "gpu_check.sh"))
             if line.split()[2:3] == ["refresh-pieces"]]
    assert len(lines) == 1
    words = shlex.split(lines[0])
    at = words.index("step")
    assert 0 < int(words[at + 2]) <= 120 and words[at + 3] == "$PY"  # bounded: seconds on a GPU
    argv = words[at + 4:]
    assert argv[:3] == ["scripts/bench_refresh.py", "--device", "cuda"] and "1024,4096" in argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # past argparse, refused before timing
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        _script().main()
    assert str(exit_.value.code).startswith("bench_refresh.py: --device cuda: no CUDA device here")


def test_gpu_check_runs_only_the_steps_named_in_only(tmp_path) -> None:
    """The whole script outlasts one device call: ONLY=refresh-pieces runs that step alone."""
    import subprocess

    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    fake.chmod(0o755)
    env = {**os.environ, "ONLY": "refresh-pieces", "OUT": str(tmp_path / "out"), "PYTHON": str(fake),
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    steps = [line for line in out.stdout.splitlines() if line.startswith("== ")]
    assert [s.split(":")[0] for s in steps] == ["== refresh-pieces"], out.stdout + out.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if c.startswith("scripts/")] == [c for c in calls if "bench_refresh.py" in c]
