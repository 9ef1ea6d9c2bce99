"""The installed package, not the clone: the CLI's defaults must come from package data; and what the
README's commands write stays out of git.

Builds a wheel, installs it into a fresh venv that sees the packages of the interpreter running the tests
(numpy, click, matplotlib, ...), and runs the commands that read bundled files from a folder outside the
repository. About 10-20 s; set
PIPEFISHER_SKIP_SLOW=1 to skip it.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

slow = pytest.mark.skipif(os.environ.get("PIPEFISHER_SKIP_SLOW") == "1",
                                reason="builds and installs a wheel (PIPEFISHER_SKIP_SLOW=1)")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the venv's pipefisher executable, a working folder outside the repository)."""
    base = tmp_path_factory.mktemp("wheel")
    wheels = base / "wheels"
    src = base / "src"  # a copy: building in the clone would leave build/ there, and stale files in it
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", ".hypothesis", ".venv", ".whl",
                                                              "runs", "out", "pipefisher-demo", "bench-convergence"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels)], capture_output=True, text=True, cwd=base)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("pipefisher-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    _see_running_packages(py)
    inst = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True)
    assert inst.returncode == 0, inst.stderr
    work = base / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import pipefisher; print(pipefisher.__file__)"], capture_output=True,
                           text=True, cwd=work, env=_env())
    assert str(venv) in where.stdout, "the venv must run the installed wheel, not the clone"
    import matplotlib  # the dependency the base interpreter of a venv may lack
    seen = subprocess.run([str(py), "-c", "import matplotlib; print(matplotlib.__file__)"], capture_output=True,
                          text=True, cwd=work, env=_env())
    assert seen.stdout.strip() == matplotlib.__file__, "the venv must see the running interpreter's packages"
    return venv / "bin" / "pipefisher", work


def _see_running_packages(py: Path) -> None:
    """Let the new venv import what the running interpreter can (its dependencies), and nothing of the clone.

    ``--system-site-packages`` is not that: from inside a venv it means the *base* interpreter's packages,
    which may lack matplotlib. A ``.pth`` file listing the running interpreter's site directories is: its
    plain lines only extend ``sys.path``, so the editable install's own ``.pth`` hooks there stay unrun.
    """
    dirs = [*site.getsitepackages()] + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_running_interpreter.pth").write_text("".join(f"{d}\n" for d in dirs if os.path.isdir(d)))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing may point back at the clone
    return env


@slow
def test_demo_and_bare_schedule_work_from_an_installed_wheel(installed: tuple[Path, Path]) -> None:
    exe, work = installed
    demo = subprocess.run([str(exe), "demo", "--out", "demo-out"], capture_output=True, text=True, cwd=work,
                          env=_env(), timeout=120)
    assert demo.returncode == 0, demo.stderr
    assert (work / "demo-out" / "report.txt").is_file() and (work / "demo-out" / "chart.png").is_file()
    sched = subprocess.run([str(exe), "schedule"], capture_output=True, text=True, cwd=work, env=_env(), timeout=120)
    assert sched.returncode == 0, sched.stderr
    assert "bundled example" in sched.stdout
    named = subprocess.run([str(exe), "simulate", "--config", "bert-large-8stages", "--out", "sim"],
                           capture_output=True, text=True, cwd=work, env=_env(), timeout=120)
    assert named.returncode == 0, named.stderr
    assert list((work / "sim").glob("*_node*_timeline.pickle"))


@slow
def test_wheel_lists_the_package_data(installed: tuple[Path, Path]) -> None:
    wheel = next((installed[1].parent / "wheels").glob("pipefisher-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "pipefisher/bundled/cost_models/bert-base-4stages.yaml" in names
    assert any(n.startswith("pipefisher/bundled/examples/") and n.endswith("_timeline.pickle") for n in names)


README_OUTPUTS = ["pipefisher-demo/chart.png", "runs/x_schedule.pickle", "prof/small_node0_timeline.pickle",
                  "sim/a_node0_timeline.pickle", "ck/rank0.pt", "schedule.pickle", "schedule.pickle.meta.json",
                  "chart.png", "chart.svg", "trace.json", "report.json", "metrics.csv", "zoom.png",
                  "measured.png", "measured.json", "s.pickle", "s.pickle.meta.json", "out/x.csv",
                  "bench-convergence/chart.png", "bench-staleness/staleness.png", "build/lib/x.py", "pipefisher.egg-info/PKG-INFO",
                  "site/index.html"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git clone")
def test_what_the_readme_commands_write_is_ignored() -> None:
    res = subprocess.run(["git", "check-ignore", "--no-index", *README_OUTPUTS], capture_output=True, text=True,
                         cwd=ROOT)
    assert sorted(res.stdout.split()) == sorted(README_OUTPUTS)
