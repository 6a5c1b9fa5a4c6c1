#!/usr/bin/env bash
# The GPU suite in one command (see benchmarks/gpu_suite.py): tests + benchmarks on CUDA, one table;
# on a machine without CUDA it says so, runs the CPU parts and exits 0.
#   bash benchmarks/gpu_suite.sh [--cpu] [--no-bench] [--variants transformer,moce_d5]
set -euo pipefail
cd "$(dirname "$0")/.."
py=python
[[ -x .venv/bin/python ]] && py=.venv/bin/python
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$py" benchmarks/gpu_suite.py "$@"
