#!/usr/bin/env python3
"""Regenerate the bundled example job in ``pipefisher/bundled/examples/`` from a simulator cost model.

The example is what ``pipefisher schedule`` packs when given no timelines: BERT-Base on 4 stages,
1F1B, 8 micro-batches, simulated from ``pipefisher/bundled/cost_models/bert-base-4stages.yaml``.
"""
from __future__ import annotations

import os
import shutil
import sys

import click

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipefisher.bundled import COST_MODELS_DIR, DEFAULT_EXAMPLE, EXAMPLES_DIR  # noqa: E402
from pipefisher.sim.costs import load_cost_model  # noqa: E402
from pipefisher.sim.simulator import simulate_timelines, write_timelines  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", default=str(COST_MODELS_DIR / "bert-base-4stages.yaml"), show_default=True,
              help="simulator cost model the example is simulated from")
def main(config: str) -> None:
    """Regenerate the bundled example job (what `pipefisher schedule` packs without timelines)."""
    timelines, _ = simulate_timelines(load_cost_model(config), order="1f1b", chunks=1)
    folder = EXAMPLES_DIR / DEFAULT_EXAMPLE
    shutil.rmtree(folder, ignore_errors=True)
    for path in write_timelines(folder, "bert-base", timelines):
        click.echo(path)


if __name__ == "__main__":
    main()
