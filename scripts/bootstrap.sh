#!/usr/bin/env bash
# Create .venv and install scaletrain into it (idempotent; re-runs only when pyproject.toml changes).
#
# torch is never replaced:
# - no NVIDIA GPU: torch==2.13.0 (the CPU build) is installed *before* anything else, so no dependency can
#   pull the multi-GB CUDA wheels;
# - a GPU and a torch that imports in $PYTHON's environment (the system python, a virtual environment or
#   a conda env: the python3 of a GPU image is often a venv itself, whose packages a
#   `venv --system-site-packages` would not see): that torch is used as it is. .venv is created without
#   it, a .pth file appends that environment's site-packages to .venv's path, and pip runs with a
#   constraint pinning torch to the version found there, so it neither downloads nor replaces it (a
#   dependency wanting another torch fails the install instead). What pip installs goes into .venv and
#   shadows that environment's copies; that environment is not changed;
# - a GPU and no torch anywhere: the registry's (CUDA) torch.
# If pip cannot install the dependencies (no package index reachable), the wheels of $SCALETRAIN_WHEELS (made by
# scripts/gpu_wheels.sh where an index is reachable: DeepSpeed and what a GPU image lacks) are installed
# when there are any, scaletrain is put on .venv's path with a `scaletrain` command, and the modules still
# missing are listed in one line (the GPU suite's model checks need only torch, numpy and pyyaml); no stamp
# is written, so the next run tries again.
#
# Environment: PYTHON (default python3); SCALETRAIN_VENV (default ROOT/.venv; "none" installs into
# $PYTHON's own environment, torch pinned the same way); SCALETRAIN_WHEELS (default ROOT/wheels: the wheel
# directory used when no index is reachable); SCALETRAIN_BOOTSTRAP_ASSUME_GPU=1 treats the machine as a GPU
# machine without asking nvidia-smi (tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SCALETRAIN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.scaletrain-installed"
want="$(sha256sum < "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [[ "$VENV" != none && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
has_gpu=0
if [[ "${SCALETRAIN_BOOTSTRAP_ASSUME_GPU:-0}" == 1 ]]; then
  has_gpu=1
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
fi
# what $PYTHON's environment holds: "torch version|cuda version|prefix|kind", then its site-packages dirs
facts="$("$PY" - <<'EOF'
import os, site, sys
kind = "conda" if os.path.isdir(os.path.join(sys.prefix, "conda-meta")) else (
    "venv" if sys.prefix != sys.base_prefix else "system")
try:
    import torch
    ver, cuda = torch.__version__, torch.version.cuda or ""
except Exception:
    ver = cuda = ""
print(f"{ver}|{cuda}|{sys.prefix}|{kind}")
for p in site.getsitepackages():
    if os.path.isdir(p):
        print(p)
EOF
)"
IFS='|' read -r torch_ver torch_cuda env_prefix env_kind <<< "$(head -n1 <<< "$facts")"
env_sites="$(tail -n +2 <<< "$facts")"
pip_flags=(--disable-pip-version-check -q)

install_deps() {  # $1: python of the target environment; pip may use $constraints
  local py="$1" extra=()
  [[ -n "${constraints:-}" ]] && extra=(-c "$constraints")
  "$py" -m pip install "${pip_flags[@]}" "${extra[@]}" -e "$ROOT[dev]"
}

without_deps() {  # pip failed: the wheels brought along, scaletrain on the path, the missing modules named
  local py="$1" site wheels="${SCALETRAIN_WHEELS:-$ROOT/wheels}"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$ROOT" > "$site/_scaletrain_src.pth"
  if compgen -G "$wheels/*.whl" > /dev/null; then  # scripts/gpu_wheels.sh: what a GPU image lacks
    echo "[bootstrap] no package index: installing the wheels of $wheels"
    "$py" -m pip install "${pip_flags[@]}" --no-index --find-links "$wheels" "$wheels"/*.whl \
      || echo "[bootstrap] warning: the wheels of $wheels did not install (made for another Python?)"
  fi
  local cmd; cmd="$(dirname "$py")/scaletrain"  # the command pip makes, for launch.sh and the user
  if [[ ! -e "$cmd" ]]; then
    printf '#!%s\nimport sys\nfrom scaletrain.cli import main\nsys.exit(main())\n' "$py" > "$cmd"
    chmod +x "$cmd"
  fi
  local missing
  missing="$("$py" - <<'EOF'
import importlib.util
mods = ["numpy", "yaml", "deepspeed", "accelerate", "transformers", "webdataset", "sacrebleu", "mlflow",
        "safetensors", "tqdm", "matplotlib", "django", "sentencepiece", "pyarrow", "pytest"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
EOF
)"
  echo "[bootstrap] warning: pip could not install scaletrain's dependencies (no package index reachable?);"
  echo "[bootstrap] scaletrain is importable from $ROOT without them; missing: ${missing:-none}.$(
    [[ " $missing " == *" mlflow "* ]] && echo " Without mlflow, train with tracking.enabled=false.")"
  echo "[bootstrap] make an index reachable and re-run, or install those into $VENV by hand"
}

if [[ $has_gpu == 1 && -n "$torch_ver" ]]; then
  echo "[bootstrap] using torch $torch_ver (CUDA ${torch_cuda:-none}) of the $env_kind environment $env_prefix as it is"
  [[ -z "$torch_cuda" ]] && echo "[bootstrap] warning: that torch is a CPU build; install a CUDA torch there to train on the GPU"
  if [[ "$VENV" == none ]]; then
    constraints="$(mktemp)"
    echo "torch==$torch_ver" > "$constraints"
    install_deps "$PY"
    rm -f "$constraints"
    echo "[bootstrap] done (installed into $env_prefix)"
    exit 0
  fi
  "$PY" -m venv "$VENV"
  vsite="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$env_sites" > "$vsite/_scaletrain_base_env.pth"  # after .venv's own site-packages on sys.path
  constraints="$VENV/constraints.txt"
  echo "torch==$torch_ver" > "$constraints"
  got="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  if [[ "$got" != "$torch_ver" ]]; then
    echo "[bootstrap] error: $VENV sees torch $got, not $torch_ver of $env_prefix" >&2
    exit 1
  fi
  if ! install_deps "$VENV/bin/python"; then
    without_deps "$VENV/bin/python"
    exit 0
  fi
else
  echo "[bootstrap] creating $VENV (gpu=$has_gpu, torch in $PY's environment: ${torch_ver:-none})"
  [[ "$VENV" == none ]] && { echo "[bootstrap] error: SCALETRAIN_VENV=none needs a GPU machine whose python has torch" >&2; exit 1; }
  "$PY" -m venv "$VENV"
  if [[ $has_gpu == 0 ]]; then
    "$VENV/bin/python" -m pip install "${pip_flags[@]}" "torch==2.13.0"
  else
    "$VENV/bin/python" -m pip install "${pip_flags[@]}" torch
  fi
  install_deps "$VENV/bin/python"
fi
echo "$want" > "$stamp"
echo "[bootstrap] done"
