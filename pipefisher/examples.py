"""The bundled example job: simulated node timelines shipped in the repository's ``examples/``."""
from __future__ import annotations

import glob
import os
from pathlib import Path

from pipefisher.errors import InputError

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
DEFAULT_EXAMPLE = "bert-base-4stage-1f1b"


def example_timelines(name: str = DEFAULT_EXAMPLE) -> list[str]:
    """Paths of the bundled example's node timelines (regenerate them with ``scripts/make_example.py``)."""
    folder = EXAMPLES_DIR / name
    paths = sorted(glob.glob(os.path.join(folder, "*_node*_timeline.pickle")))
    if not paths:
        raise InputError(folder, "holds no bundled example timelines (run scripts/make_example.py)")
    return paths
