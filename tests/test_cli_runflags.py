"""The flags ``train`` and ``run`` share are one definition each. (That no function, the commands' included,
is over 150 lines is checked package-wide in ``tests/test_layers.py``.)"""
from __future__ import annotations

import click

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

