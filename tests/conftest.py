import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A small but real corpus for integration tests: scripts Latin, Cyrillic, Arabic, Devanagari, Japanese.
TEST_LANGS = ["de", "ru", "ar", "hi", "ja"]


@pytest.fixture(scope="session")
def django_shards(tmp_path_factory) -> Path:
    from scaletrain.data.prepare import prepare_gettext

    out = tmp_path_factory.mktemp("shards") / "django5"
    prepare_gettext(package="django", langs=TEST_LANGS, out=out, progress=False)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlruns.db",
               PYTHONUNBUFFERED="1")
    return env


def deepspeed_cmd(nproc: int, script: str, *args: str, extra: tuple = ()) -> list[str]:
    exe = Path(sys.executable).with_name("deepspeed")
    return [str(exe), "--num_gpus", str(nproc), "--master_port", str(free_port()), *extra, "--no_local_rank", script, *args]


def run(cmd, env, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="module")
def in_process_training():
    """For modules that run Trainers in the test process: they share one gloo group of one (DeepSpeed
    caches it); remove it, and DeepSpeed's cached backend, when the module is done so later tests start
    without a process group. Use as ``pytestmark = pytest.mark.usefixtures("in_process_training")``."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    for name, value in list(vars(groups).items()):  # DeepSpeed's cached groups belong to the old world
        if name.startswith("_") and (name.endswith("_GROUP") or name.endswith("_GROUP_RANKS")):
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(groups, name, None)
    # Free the dropped process groups now, in this process: left to a later garbage collection, a
    # gloo group's destructor can run in a forked child (whose gloo threads do not exist) and hang it.
    gc.collect()


@pytest.fixture
def isolated_env():
    """Training in this process sets the launcher's environment variables: restore them afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
