"""What the package ships for the CLI's defaults: the example job's node timelines (``examples/``) and the
simulator's cost models (``cost_models/``), in this folder so they are there in an installed package too, not
only in a clone.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from pipefisher.errors import InputError

DATA_DIR = Path(__file__).resolve().parent
EXAMPLES_DIR = DATA_DIR / "examples"
COST_MODELS_DIR = DATA_DIR / "cost_models"
DEFAULT_EXAMPLE = "bert-base-4stage-1f1b"
DEFAULT_COST_MODEL = "bert-base-4stages.yaml"


def example_timelines(name: str = DEFAULT_EXAMPLE) -> list[str]:
    """Paths of the bundled example's node timelines (regenerate them with ``scripts/make_example.py``)."""
    folder = EXAMPLES_DIR / name
    paths = sorted(glob.glob(os.path.join(folder, "*_node*_timeline.pickle")))
    if not paths:
        raise InputError(folder, "holds no bundled example timelines (run scripts/make_example.py)")
    return paths


def cost_model_names() -> list[str]:
    """Names of the bundled cost models (file names without ``.yaml``), for help texts and errors."""
    return sorted(p.stem for p in COST_MODELS_DIR.glob("*.yaml"))


def cost_model_path(config: str | None = None) -> str:
    """The cost model file ``--config`` means: an existing file as given, else a bundled model by name
    (``bert-large-8stages`` or ``bert-large-8stages.yaml``); None gives the default bundled model."""
    if config is not None and (os.path.exists(config) or os.sep in config or "/" in config):
        return config  # a user's file: load_cost_model reports it if it is missing or bad
    name = config or DEFAULT_COST_MODEL
    path = COST_MODELS_DIR / (name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if not path.is_file():
        known = ", ".join(cost_model_names()) or "none (the package's bundled/cost_models/ folder is missing)"
        raise InputError(name, f"no such file, nor a bundled cost model (bundled: {known})")
    return str(path)
