"""scripts/bootstrap.sh on a GPU machine whose python3 is itself a virtual environment (or a conda env)
holding a CUDA torch: that torch is used as it is, never downloaded or replaced.

Simulated on the CPU: the "GPU image" is a venv with a stand-in torch package (a module and its
dist-info, version 2.11.0+cu130, CUDA 13.0), the GPU comes from SCALETRAIN_BOOTSTRAP_ASSUME_GPU=1 or an
``nvidia-smi`` shim on PATH. Without a package index (as on a machine without registry access) the
dependencies cannot be installed and the bootstrap takes its documented fallback. The success path runs
against a local index (``--find-links``, no network) built at test time: a tiny fake wheel at the lowest
allowed version of every requirement in pyproject.toml, a newer "torch" as a trap, and a stand-in for
setuptools' editable-install backend; the dependencies go into .venv, then (``SCALETRAIN_VENV=none``) into the
image itself, beside its torch."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, make_wheel

FAKE = "2.11.0+cu130"


def gpu_image(tmp: Path, conda: bool, pip: bool = False) -> Path:
    """A venv (with conda-meta/ when ``conda``, with pip when ``pip``) whose site-packages hold the stand-in
    CUDA torch."""
    env = tmp / "image"
    subprocess.run([sys.executable, "-m", "venv", *([] if pip else ["--without-pip"]), str(env)], check=True)
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


# ---------------------------------------------------------------------------------------------------------------
# the success path: a package index that has every dependency (a local directory of tiny fake wheels)

BACKEND = '''"""A stand-in for setuptools' PEP 660 backend: an editable wheel of the project (a .pth to its source, its
metadata from pyproject.toml, the console script), built offline in milliseconds."""
import base64, hashlib, os, re, tomllib, zipfile


def _metadata():
    project = tomllib.load(open("pyproject.toml", "rb"))["project"]
    init = open(os.path.join(project["name"], "__init__.py"), encoding="utf-8").read()
    version = re.search(r"__version__ = [\\"']([^\\"']+)", init).group(1)
    lines = ["Metadata-Version: 2.1", "Name: " + project["name"], "Version: " + version]
    lines += ["Requires-Dist: " + r for r in project["dependencies"]]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in reqs]
    scripts = "".join("%s = %s\\n" % kv for kv in project.get("scripts", {}).items())
    return project["name"], version, "\\n".join(lines) + "\\n", "[console_scripts]\\n" + scripts


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    name, version, meta, _ = _metadata()
    info = "%s-%s.dist-info" % (name, version)
    os.makedirs(os.path.join(metadata_directory, info))
    open(os.path.join(metadata_directory, info, "METADATA"), "w").write(meta)
    return info


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name, version, meta, scripts = _metadata()
    info = "%s-%s.dist-info" % (name, version)
    files = {"__editable__.%s.pth" % name: os.getcwd() + "\\n", info + "/METADATA": meta,
             info + "/entry_points.txt": scripts,
             info + "/WHEEL": "Wheel-Version: 1.0\\nGenerator: fake\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    whl = "%s-%s-py3-none-any.whl" % (name, version)
    with zipfile.ZipFile(os.path.join(wheel_directory, whl), "w") as z:
        record = []
        for path, text in files.items():
            data = text.encode()
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
        z.writestr(info + "/RECORD", "\\n".join(record + [info + "/RECORD,,"]) + "\\n")
    return whl
'''


def fake_wheel(index: Path, name: str, version: str, files: dict[str, str] | None = None) -> Path:
    """A pure-Python wheel of distribution ``name`` ``version`` holding ``files`` (path -> text) and its
    dist-info (no dependencies of its own)."""
    import base64
    import hashlib
    import zipfile

    dist = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{dist}-{version}.dist-info"
    files = {**(files or {}), f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: fake\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = index / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        record = []
        for p, text in files.items():
            data = text.encode()
            z.writestr(p, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{p},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def requirements() -> dict[str, str]:
    """Every requirement of pyproject.toml (runtime and every extra): distribution -> the lowest version it
    allows (``==X`` and ``>=X`` alike give X)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for rs in project.get("optional-dependencies", {}).values() for r in rs)]
    out = {}
    for r in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==|>=)\s*([0-9][0-9.]*)\s*", r)
        assert m, f"pyproject requirement {r!r}: teach this test's fake index its form"
        out[m[1].lower()] = m[2]
    return out


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A --find-links directory holding a fake wheel at the lowest allowed version of every dependency (torch
    excepted: a newer "torch" sits there as a trap, which must never be installed), and the build backend."""
    index = tmp_path_factory.mktemp("index")
    versions = requirements()
    for name, version in versions.items():
        if name != "torch":
            fake_wheel(index, name, version)
    fake_wheel(index, "torch", "2.13.0", {"torch/__init__.py": "__version__ = '2.13.0'\n"})
    fake_wheel(index, "setuptools", "68.0.0", {"setuptools/__init__.py": "", "setuptools/build_meta.py": BACKEND})
    return index, versions


def installed(site: Path) -> dict[str, str]:
    """Distribution -> version of what ``site`` holds (its dist-info directories)."""
    out = {}
    for d in site.glob("*.dist-info"):
        meta = (d / "METADATA").read_text().splitlines()
        name = next(x.split(": ", 1)[1] for x in meta if x.startswith("Name: "))
        out[re.sub(r"[-_.]+", "-", name).lower()] = next(x.split(": ", 1)[1] for x in meta if x.startswith("Version: "))
    return out


def purelib(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


@pytest.mark.slow
def test_gpu_image_success_path_with_a_local_index(tmp_path, fake_index):
    """With an index that has every dependency, the bootstrap installs them beside the image's CUDA torch
    (into .venv, and with SCALETRAIN_VENV=none into the image itself), pinned to it, and writes its stamp."""
    index, versions = fake_index
    image = gpu_image(tmp_path, conda=False, pip=True)
    site = purelib(image / "bin" / "python")
    before = installed(site)
    venv = tmp_path / "ours"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHON=str(image / "bin" / "python"), SCALETRAIN_VENV=str(venv), PIP_CONFIG_FILE=os.devnull,
               PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index), PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1",
               SCALETRAIN_BOOTSTRAP_ASSUME_GPU="1")
    p = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.rstrip().endswith("[bootstrap] done"), out
    assert "warning" not in out, out
    stamp = (venv / ".scaletrain-installed").read_text().strip()
    assert stamp == hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    ours = installed(purelib(venv / "bin" / "python"))
    want = {k: v for k, v in versions.items() if k != "torch"}
    assert {k: ours.get(k) for k in want} == want  # every dependency, the dev extra's too, from the index
    assert "torch" not in ours and installed(site) == before  # the image's torch is the one, untouched
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, scaletrain; print(torch.__version__, "
                            "torch.__file__, scaletrain.__file__)"], capture_output=True, text=True, check=True,
                           env=env).stdout.split()
    assert probe[0] == FAKE and probe[1].startswith(str(image)) and probe[2].startswith(str(ROOT))
    assert (venv / "bin" / "scaletrain").is_file()  # the console script
    # the index offers a newer torch; the constraint the bootstrap left in .venv refuses it
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run", "torch>=2.12"]
    free = subprocess.run(pip, capture_output=True, text=True, env=env)
    assert free.returncode == 0 and "Would install torch-2.13.0" in free.stdout, free.stdout + free.stderr
    assert subprocess.run(pip + ["-c", str(venv / "constraints.txt")], capture_output=True, env=env).returncode != 0
    again = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == again.stderr == ""  # the stamp holds: nothing to do

    # SCALETRAIN_VENV=none: into the image's own environment, torch pinned the same way
    env["SCALETRAIN_VENV"] = "none"
    p = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and f"[bootstrap] done (installed into {image})" in out, out
    now = installed(site)
    assert {k: now.get(k) for k in want} == want and now["torch"] == FAKE and now["scaletrain"]
    assert not (ROOT / "none").exists()
