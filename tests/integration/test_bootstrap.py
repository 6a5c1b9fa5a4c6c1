"""scripts/bootstrap.sh on a GPU machine whose python3 is itself a virtual environment (or a conda env)
holding a CUDA torch: that torch is used as it is, never downloaded or replaced.

Simulated on the CPU: the "GPU image" is a venv with a stand-in torch package (a module and its
dist-info, version 2.11.0+cu130, CUDA 13.0), the GPU comes from SCALETRAIN_BOOTSTRAP_ASSUME_GPU=1 or an
``nvidia-smi`` shim on PATH, and pip sees no package index (as on a machine without registry access),
so the dependencies cannot be installed and the bootstrap takes its documented fallback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, make_wheel

FAKE = "2.11.0+cu130"


def gpu_image(tmp: Path, conda: bool) -> Path:
    """A venv (with conda-meta/ when ``conda``) whose site-packages hold the stand-in CUDA torch."""
    env = tmp / "image"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"from . import version\n__version__ = {FAKE!r}\n")
    (site / "torch" / "version.py").write_text("cuda = '13.0'\n")
    dist = site / f"torch-{FAKE}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {FAKE}\n")
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "RECORD").write_text("")
    if conda:
        (env / "conda-meta").mkdir()
    return env


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["venv", "conda"])
def test_gpu_image_torch_is_used_as_it_is(tmp_path, kind):
    image = gpu_image(tmp_path, conda=kind == "conda")
    venv = tmp_path / "ours"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHON=str(image / "bin" / "python"), SCALETRAIN_VENV=str(venv), PIP_CONFIG_FILE=os.devnull,
               PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if kind == "venv":
        env["SCALETRAIN_BOOTSTRAP_ASSUME_GPU"] = "1"
    else:  # the other way to say "GPU": an nvidia-smi that lists one
        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
        (shim / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{shim}:{env['PATH']}"
    p = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert f"using torch {FAKE} (CUDA 13.0) of the {kind} environment {image}" in out
    assert "missing: numpy" in out and "deepspeed" in out  # the fallback names what pip could not install
    assert not (venv / ".scaletrain-installed").exists()  # incomplete: the next run tries again
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import torch, scaletrain; print(torch.__version__, torch.__file__, "
                            "scaletrain.__file__)"], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert probe[0] == FAKE and probe[1].startswith(str(image)) and probe[2].startswith(str(ROOT))
    assert (venv / "constraints.txt").read_text().strip() == f"torch=={FAKE}"
    # pip in our venv counts the image's torch as installed: nothing to fetch, and no other version allowed
    pip = [py, "-m", "pip", "install", "--no-index", "-c", str(venv / "constraints.txt")]
    ok = subprocess.run(pip + ["torch>=2.4"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "already satisfied: torch" in ok.stdout, ok.stdout + ok.stderr
    clash = subprocess.run(pip + ["torch>=2.12"], capture_output=True, text=True, env=env)
    assert clash.returncode != 0
    site = next((image / "lib").glob("python*/site-packages"))
    assert sorted(x.name for x in site.iterdir() if "torch" in x.name) == ["torch", f"torch-{FAKE}.dist-info"]


@pytest.mark.slow
def test_gpu_image_without_index_installs_the_wheels_brought_along(tmp_path):
    """No index: the wheel directory (scripts/gpu_wheels.sh's) is installed into .venv, its dependencies met by
    the image's packages; the `scaletrain` command exists for launch.sh; one line names what is still missing."""
    image = gpu_image(tmp_path, conda=False)
    venv = tmp_path / "ours"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHON=str(image / "bin" / "python"), SCALETRAIN_VENV=str(venv), PIP_CONFIG_FILE=os.devnull,
               PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", SCALETRAIN_BOOTSTRAP_ASSUME_GPU="1",
               SCALETRAIN_WHEELS=str(make_wheel(tmp_path / "wheels", "wheelprobe", ("torch>=2.4",)).parent))
    p = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert f"no package index: installing the wheels of {tmp_path / 'wheels'}" in out
    missing = next(line for line in out.splitlines() if "missing:" in line)
    assert "mlflow" in missing and "wheelprobe" not in missing and "train with tracking.enabled=false" in missing
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import wheelprobe, torch; print(wheelprobe.__file__, torch.__version__)"],
                           capture_output=True, text=True, env=env, check=True).stdout.split()
    assert probe[0].startswith(str(venv)) and probe[1] == FAKE  # in .venv; torch still the image's
    cmd = venv / "bin" / "scaletrain"
    assert os.access(cmd, os.X_OK) and cmd.read_text().startswith(f"#!{py}\n") and "scaletrain.cli" in cmd.read_text()
