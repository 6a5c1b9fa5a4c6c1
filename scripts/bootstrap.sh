#!/usr/bin/env bash
# Create .venv and install scaletrain into it (idempotent; re-runs only when pyproject.toml changes).
# torch: a machine without an NVIDIA GPU gets torch==2.13.0 (the CPU build) *before* anything
# else, so no dependency can pull the multi-GB CUDA wheels; a GPU machine that already has torch
# keeps it (the venv sees the system site-packages), else gets the registry's CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SCALETRAIN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.scaletrain-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
has_gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=1
sys_torch=0
"$PY" -c "import torch" >/dev/null 2>&1 && sys_torch=1
echo "[bootstrap] creating $VENV (gpu=$has_gpu, system torch=$sys_torch)"
if [[ $has_gpu == 1 && $sys_torch == 1 ]]; then
  "$PY" -m venv --system-site-packages "$VENV"
else
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if [[ $has_gpu == 0 ]]; then
  "${pip[@]}" "torch==2.13.0"
elif [[ $sys_torch == 0 ]]; then
  "${pip[@]}" torch
fi
"${pip[@]}" -e "$ROOT[dev]"
echo "$want" > "$stamp"
echo "[bootstrap] done"
