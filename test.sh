#!/usr/bin/env bash
# The test command: installs everything into .venv if needed, then runs the whole suite.
#
#   ./test.sh                 # the whole suite; the 10 slowest tests are listed at the end
#   ./test.sh --quick         # the in-process tests and one launched job (a few minutes, for iterating)
#   ./test.sh tests/unit/test_config.py -k ranges    # any pytest arguments
#
# Test files run in SCALETRAIN_TEST_WORKERS processes (pytest-xdist; default 2, 0 = in this process), each
# file whole in one worker (its module fixtures launch their jobs once). Most tests run one process of one
# thread (OMP_NUM_THREADS=1), so two workers keep both cores of a small machine busy.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
args=()
if [[ "${1:-}" == --quick ]]; then
  shift
  args=(-m "not integration or quick")
fi
workers="${SCALETRAIN_TEST_WORKERS:-2}"
par=()
if [[ "$workers" != 0 ]]; then
  # file order as tests/conftest.py sets it (the longest launched jobs first), not xdist's own
  par=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q --durations=10 "${par[@]}" "${args[@]}" "$@"
