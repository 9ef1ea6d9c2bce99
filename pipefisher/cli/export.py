"""``pipefisher export``: a checkpoint's model as one consolidated model folder.

torch is imported inside the command only (after the paths are checked), so the other commands never
pay for it.
"""
from __future__ import annotations

import click

from pipefisher.cli._common import require_runtime
from pipefisher.cli.group import main


@main.command("export")
@click.argument("source", metavar="RUN_OR_CHECKPOINT", type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="folder to write the model into (created; written whole or not at all)")
@click.option("--force", is_flag=True, help="replace the contents of a --out folder that is not empty")
def export_command(source: str, out_dir: str, force: bool) -> None:
    """Write the model of a checkpoint as one model: a Hugging Face builder's as a transformers folder
    (from_pretrained loads it without pipefisher), the built-in model's as model.safetensors and
    config.json (model.pretrained trains from it).

    RUN_OR_CHECKPOINT is a checkpoint folder (pipefisher train --checkpoint-dir) or a run folder
    (pipefisher run --out) holding one run's <run>_checkpoints/. The latest step's stage files of
    replica 0 are merged, one copy of every stage.
    """
    require_runtime("export")
    from pipefisher.cli._outputs import check_out_folder
    from pipefisher.runtime.train.export import check_out, export, find_checkpoint

    check_out_folder(out_dir, "--out")
    check_out(out_dir, force, find_checkpoint(source))  # bad paths: one line, before torch loads
    click.echo(export(source, out_dir, force))
