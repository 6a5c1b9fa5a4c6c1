#!/usr/bin/env bash
# Build the wheel directory a GPU machine without a package index needs (run it here, where PyPI is reachable):
#
#   bash scripts/gpu_wheels.sh [DIR]        # default: wheels/ (git-ignored); prints what it holds and its size
#
# The GPU image this is made for runs Python 3.12 on x86_64 with torch (CUDA), accelerate, transformers,
# sacrebleu, pyarrow, matplotlib and sentencepiece (and their own dependencies: numpy, pyyaml, tqdm,
# safetensors, psutil, packaging, requests) but without DeepSpeed, webdataset or Django. This brings those
# and every dependency they have beyond that list, each as a wheel for that Python:
#   - DeepSpeed 0.19.8 (pure Python: `pip wheel` from its source release; its C++/CUDA ops build at run time
#     only when used, and scaletrain uses none) and hjson, py-cpuinfo, einops, ninja, msgpack, pydantic,
#     pydantic-core, annotated-types, typing-inspection, typing-extensions;
#   - webdataset 1.0.2 and braceexpand (the shard format);
#   - Django 5.2.19, asgiref, sqlparse (its gettext catalogs: the bundled corpus, and the catalogs corpus's
#     "packages" source);
#   - setuptools (the build backend, for `pip install -e .` of scaletrain itself from this directory).
# MLflow is left out: the local store (sqlite) needs the full mlflow package, whose dependencies (SQLAlchemy,
# alembic, Flask, pandas, scikit-learn, scipy) do not fit beside the rest in what the GPU machine is sent;
# jobs there run with tracking.enabled=false.
#
# benchmarks/gpu_check.sh installs the directory with
#   pip install --no-index --no-deps --target DIR wheels/*.whl      (then PYTHONPATH=DIR)
# (--no-deps: pip's --target ignores what the environment has installed and would fetch torch again).
# Environment: PIP_PYTHON (default python3: the pip that downloads; any Python >= 3.9 will do),
# WHEEL_PYTHON_VERSION (default 3.12), WHEEL_PLATFORM (default manylinux2014_x86_64).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/wheels}"
PY="${PIP_PYTHON:-python3}"
PYVER="${WHEEL_PYTHON_VERSION:-3.12}"
PLAT="${WHEEL_PLATFORM:-manylinux2014_x86_64}"
mkdir -p "$DIR"
pip=("$PY" -m pip --disable-pip-version-check)

# resolved with their dependencies, as binary wheels for the GPU machine's Python and platform (not this
# machine's): pydantic pins the pydantic-core build it needs; none of these depends on what the image has
binary=("pydantic>=2" msgpack ninja)
# pure Python, without dependencies (webdataset's numpy and pyyaml are in the image; Django's are listed)
pure=(hjson py-cpuinfo einops webdataset==1.0.2 braceexpand django==5.2.19 "asgiref>=3.8" "sqlparse>=0.5"
      "setuptools>=68")

echo "[gpu_wheels] DeepSpeed 0.19.8 (built from its source release, no dependencies) -> $DIR"
"${pip[@]}" wheel -q --no-deps deepspeed==0.19.8 -w "$DIR"
echo "[gpu_wheels] wheels for CPython $PYVER on $PLAT, with their dependencies: ${binary[*]}"
"${pip[@]}" download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform "$PLAT" --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$DIR" "${binary[@]}"
echo "[gpu_wheels] pure-Python wheels: ${pure[*]}"
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation py \
  --platform any -d "$DIR" "${pure[@]}"

# one version of each project (a re-run with newer releases would leave two)
"$PY" - "$DIR" <<'EOF'
import re, sys
from pathlib import Path
seen = {}
for w in sorted(Path(sys.argv[1]).glob("*.whl"), key=lambda p: p.stat().st_mtime, reverse=True):
    name = re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower()
    if name in seen:
        print(f"[gpu_wheels] removing an older {w.name} (kept {seen[name]})")
        w.unlink()
    else:
        seen[name] = w.name
EOF
ls -1 "$DIR"/*.whl | sed 's|.*/|  |'
size=$(du -sb "$DIR" | cut -f1)
echo "[gpu_wheels] $(ls "$DIR"/*.whl | wc -l) wheels, $((size / 1024)) KiB in $DIR (the device machine takes at most 64 MiB of carried paths)"
