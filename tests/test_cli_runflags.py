"""The flags ``train`` and ``run`` share are one definition each, and the commands are named steps."""
from __future__ import annotations

import ast
import os

import click

import pipefisher.cli as cli
from pipefisher.cli import main

SHARED = ("--nproc-per-node", "--stages", "--order", "--pipeline", "--chunks", "--timeout", "--set", "--tensorboard",
          "--past-decay", "--no-progress", "--eval-every", "--log-every")


def _options(command: str) -> dict[str, click.Option]:
    return {p.opts[0]: p for p in main.commands[command].params if isinstance(p, click.Option)}


def test_the_flags_train_and_run_share_are_defined_once():
    """Same help, type and parameter on both; ``run``'s step counts default to the resumed run's."""
    train, run = _options("train"), _options("run")
    for flag in SHARED:
        a, b = train[flag], run[flag]
        assert (a.name, a.help.split(" [default")[0], a.type.to_info_dict()) == \
               (b.name, b.help.split(" [default")[0], b.type.to_info_dict()), flag
    assert (train["--log-every"].default, run["--log-every"].default) == (5, None)
    assert "[default: 5; with --resume, the run's]" in run["--log-every"].help


def test_no_function_of_the_command_line_is_over_150_lines():
    folder = os.path.dirname(cli.__file__)
    long = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            long += [f"{name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= 150]
    assert not long
