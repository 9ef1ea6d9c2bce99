"""``python -m pipefisher``: the same as the ``pipefisher`` command."""
from pipefisher.cli._common import console

console()
