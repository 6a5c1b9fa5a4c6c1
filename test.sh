#!/usr/bin/env bash
# The test command: installs everything into .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q "$@"
