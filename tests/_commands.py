"""Running ``pipefisher`` commands the way a user does, for the tests that check what they print."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_free(commands: list[list[str]]) -> list[tuple[int, str, bool]]:
    """Each ``pipefisher ARGS`` of ``commands`` in one fresh interpreter, one after the other: per command
    (exit code, its output: standard output and error together, whether torch was imported by then)."""
    code = ("import contextlib, io, json, sys\nfrom pipefisher.cli import main\nout = []\n"
            "for args in json.loads(sys.argv[1]):\n    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):\n        try:\n            main(args)\n"
            "        except SystemExit as e:\n            code = e.code\n"
            "    out.append((code, err.getvalue(), 'torch' in sys.modules))\nprint(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    return [tuple(r) for r in json.loads(res.stdout.splitlines()[-1])]
