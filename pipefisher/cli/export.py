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
@click.option("--out", "out_dir", required=True, type=click.Path(),
              help="folder to write the model into (created; written whole or not at all)")
@click.option("--force", is_flag=True,
              help="write into a --out folder that is not empty, replacing only the files an export writes "
                   "(config.json, model.safetensors, tokenizer.json, ...); the rest stays")
def export_command(source: str, out_dir: str, force: bool) -> None:
    """Write the model of a checkpoint as one model, with the run's tokenizer, as a transformers folder:
    from_pretrained loads it without pipefisher (AutoModelForMaskedLM for BERT and the built-in model,
    AutoModelForCausalLM for GPT-2 and Llama; AutoTokenizer for the tokenizer), and model.pretrained
    trains from it.

    RUN_OR_CHECKPOINT is a checkpoint folder (pipefisher train --checkpoint-dir), one of its step-NNNNNNNN
    folders (a checkpoint that checkpoint.keep kept), or a run folder (pipefisher run --out) holding one
    run's <run>_checkpoints/. The stage files of replica 0 of the latest step (or that step) are merged,
    one copy of every stage. The checkpoint holds all an export needs: it runs from any folder, also
    once a model.pretrained folder the run started from is gone.
    """
    require_runtime("export")
    from pipefisher.cli._outputs import check_out_folder
    from pipefisher.runtime.train.consolidate import check_out, export, find_checkpoint

    check_out_folder(out_dir, "--out")
    check_out(out_dir, force, find_checkpoint(source))  # bad paths: one line, before torch loads
    click.echo(export(source, out_dir, force))
