#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: the README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,exact,hf,docs,tensorboard,datasets]'
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec python3 -m pytest -q "$@"
