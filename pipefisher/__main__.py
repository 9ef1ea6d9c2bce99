"""``python -m pipefisher``: the same as the ``pipefisher`` command."""
from pipefisher.cli import console

console()
