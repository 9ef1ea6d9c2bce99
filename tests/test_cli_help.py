"""Help texts say what the options take; scripts answer -h quickly; a missing torch is one line."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import click
import pytest
from click.testing import CliRunner

from pipefisher.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py")))


def _runner() -> CliRunner:
    """stdout and stderr apart (click < 8.2 needs asking)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def _help(*command: str) -> str:
    res = CliRunner().invoke(main, [*command, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())  # wrapping aside


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_option_of_every_command_has_help(name):
    command = main.commands[name]
    bare = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not p.help]
    assert not bare, f"pipefisher {name}: options without help: {bare}"


@pytest.mark.parametrize("name", ["schedule", "demo", "compare", "run", "plot", "trace"])
def test_policy_help_lists_the_registry(name):
    from pipefisher.policies import DEFAULT_POLICY, POLICIES

    text = _help(name)
    assert f"packing policy: {', '.join(sorted(POLICIES))} (default: {DEFAULT_POLICY})" in text


def test_compare_refuses_order_and_orders_together_in_one_line():
    res = _runner().invoke(main, ["compare", "--order", "1f1b", "--orders", "gpipe,1f1b"])
    assert res.exit_code == 2
    assert res.stderr == "error: give --order (one) or --orders (several), not both\n"


def test_the_old_names_of_order_options_still_work_saying_the_new_name(tmp_path):
    """``simulate --schedule`` and ``compare --schedules`` (before --order/--orders): the same result, one
    notice line each; an old name beside its new one is refused in one line."""
    new = _runner().invoke(main, ["simulate", "--order", "gpipe", "-m", "4", "--out", str(tmp_path / "N")])
    old = _runner().invoke(main, ["simulate", "--schedule", "gpipe", "-m", "4", "--out", str(tmp_path / "O")])
    assert (new.exit_code, old.exit_code) == (0, 0)
    assert old.stdout.replace(str(tmp_path / "O"), str(tmp_path / "N")) == new.stdout
    assert old.stderr == "note: --schedule is now --order (the old name still works)\n"
    res = _runner().invoke(main, ["compare", "--schedules", "gpipe", "-m", "4"])
    assert res.exit_code == 0 and "gpipe" in res.stdout
    assert res.stderr == "note: --schedules is now --orders (the old name still works)\n"
    both = _runner().invoke(main, ["simulate", "--order", "gpipe", "--schedule", "1f1b", "--out", str(tmp_path / "b")])
    assert (both.exit_code, both.stderr) == (2, "error: --schedule: is the old name of --order: give --order only\n")


def test_every_command_takes_one_order_option_with_the_orders_pipeline_orders_generates(tmp_path):
    """train, run, simulate, compare and demo: one ``--order`` (:func:`pipefisher.cli._common.order_option`),
    its choices ``order_names()``, an alias taken as its order; its old name there still one line away."""
    from pipefisher.cli._common import ORDER_HELP, OrderChoice
    from pipefisher.pipeline_orders import order_names

    for command, old in (("train", "--pipeline"), ("run", "--pipeline"), ("simulate", "--schedule"),
                         ("compare", "--schedule"), ("demo", "--schedule")):
        params = main.commands[command].params
        [opt] = [p for p in params if p.opts == ["--order"]]
        [former] = [p for p in params if p.opts == [old]]
        assert isinstance(opt.type, OrderChoice) and list(opt.type.choices) == order_names(), command
        assert isinstance(former.type, OrderChoice) and former.hidden, command
        assert ORDER_HELP in opt.help, command
        assert opt.type.convert("ZB_V", opt, None) == "zb-v" and opt.type.convert("dapple", opt, None) == "1f1b"
    bad = _runner().invoke(main, ["simulate", "--order", "zigzag", "--out", str(tmp_path / "z")])
    assert bad.exit_code == 2 and "unknown pipeline order 'zigzag' (known: gpipe, 1f1b, interleaved" in bad.stderr, \
        bad.stderr
    assert not (tmp_path / "z").exists()


def test_the_help_texts_a_new_user_read_say_what_the_commands_do():
    train, run = _help("train"), _help("run")
    for text in (train, run):
        assert "forward/backward order (gpipe; 1f1b; chimera:" in text and "zb-h1 and zb-v: zero bubble" in text
        assert "--no-progress / --progress no start-up phase lines and no progress bar" in text
    assert "Train the masked-language model" not in train and "a Hugging Face BERT, GPT-2 or Llama" in train
    for name in ("schedule", "run"):  # the default policy may pack at a larger margin than --margin's
        assert "the least one: policy target packs at larger ones too" in _help(name)


def test_trace_title_is_the_trace_title_not_a_chart_title():
    assert "--title TEXT trace title (the process name Perfetto shows)" in _help("trace")
    assert "--title TEXT chart title" in _help("plot")


def test_validate_usage_and_help_agree():
    text = _help("validate")
    assert "validate --schedule FILE [OPTIONS] TIMELINES..." in text
    assert "Check SCHEDULE" not in text and "SCHEDULE.meta.json" not in text
    assert "Check the schedule file (--schedule FILE) against the job's TIMELINES" in text


def test_sim_commands_name_their_bundled_cost_models():
    from pipefisher.bundled import cost_model_names

    assert cost_model_names() == ["bert-base-4stages", "bert-large-8stages"]
    for name in ("simulate", "compare", "demo"):
        assert "a bundled one by name (bert-base-4stages, bert-large-8stages)" in _help(name)


def test_an_unknown_cost_model_name_is_one_line():
    res = _runner().invoke(main, ["compare", "--config", "bert-huge"])
    assert res.exit_code == 2
    assert res.stderr == ("error: bert-huge: no such file, nor a bundled cost model (bundled: bert-base-4stages, "
                          "bert-large-8stages)\n")


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_every_script_answers_dash_h_quickly_without_torch(script):
    # torch made unimportable: parsing the arguments must not need it (nor any other heavy work)
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[1], '-h']; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, script], capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout.lower()
    assert took < 10, f"{os.path.basename(script)} -h took {took:.1f} s"
    description = res.stdout.split("\n\n")[1]  # after the usage lines: whole sentences, not cut at a line end
    assert description.rstrip().endswith("."), description


_NO_TORCH = ("import sys; sys.modules['torch'] = None; from pipefisher.cli import main; "
             "main(sys.argv[1:], prog_name='pipefisher')")


@pytest.mark.parametrize("command", [["train", "--config", TINY, "--steps", "1"],
                                     ["run", "--config", TINY, "--out", "never-written"]])
def test_train_and_run_without_torch_say_how_to_install_it(command, tmp_path):
    res = subprocess.run([sys.executable, "-c", _NO_TORCH, *command], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert res.returncode == 2  # as every missing extra
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        f"error: pipefisher {command[0]} needs torch (the runtime extra), not installed here: "
        "pip install 'pipefisher[runtime]' (in a clone: pip install -c constraints.txt -e '.[runtime]')"]
    assert not os.path.exists(tmp_path / "never-written")


def test_the_scheduling_path_works_without_torch(tmp_path):
    res = subprocess.run([sys.executable, "-c", _NO_TORCH, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "train" in res.stdout
    res = subprocess.run([sys.executable, "-c", _NO_TORCH, "schedule"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_published_script_loads_no_other_command():
    # scripts/auto_schedule.py needs the schedule command's code only: the other commands' imports
    # (train's run configuration, the simulator's) are no part of its run
    script = os.path.join(ROOT, "scripts", "auto_schedule.py")
    code = ("import runpy, sys; sys.argv = [sys.argv[1], '-h']\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint(' '.join(m for m in sys.modules if m.startswith('pipefisher.cli.')))")
    res = subprocess.run([sys.executable, "-c", code, script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = set(res.stdout.splitlines()[-1].split())
    assert "pipefisher.cli.schedule" in loaded
    assert not loaded & {"pipefisher.cli.train", "pipefisher.cli.sim", "pipefisher.cli.run",
                         "pipefisher.cli.export", "pipefisher.cli.validate"}


def test_the_group_has_every_command_module_registered():
    code = "from pipefisher.cli import main; print(' '.join(main.commands))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["schedule", "validate", "train", "simulate", "compare", "plot", "trace", "demo",
                                  "run", "export"]


TINY_ARGS = {"train": ["--config", "configs/tiny.yaml"], "run": ["--config", "configs/tiny.yaml", "--out", "never"],
             "compare": [], "demo": [], "simulate": []}


@pytest.mark.parametrize("command,flag", [(c, f) for c in TINY_ARGS for f in
                                          ("--order", "--pipeline" if c in ("train", "run") else "--schedule")])
def test_an_unknown_order_is_refused_in_the_projects_one_line(command, flag, monkeypatch):
    """Every command's --order (and its former name) refuses an unknown order in one line, exit 2."""
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = CliRunner().invoke(main, [command, *TINY_ARGS[command], flag, "nope"])
    assert res.exit_code == 2 and "error: unknown pipeline order 'nope'" in res.output, res.output
    assert res.output.count("\n") == 1, res.output
    assert not os.path.exists("never")
