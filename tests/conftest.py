import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# engine.precision=auto (the default) resolves to fp32 in tests, on every kind of CPU; subprocesses inherit it.
os.environ["SCALETRAIN_AUTO_PRECISION"] = "fp32"
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


def two_rank_training(out: Path, recipe: str, *overrides: str, tmp_path: Path, steps: int = 10):
    """Train ``recipe`` on 2 ranks under the ``deepspeed`` launcher (tests/dist_driver.py), check what every
    2-rank run must show (world size 2, ``steps`` steps on both ranks, falling loss, identical parameters on
    both ranks, the final checkpoint loads as exactly those parameters) and return
    ``(model, cfg, vocab, trainer_state)`` of that checkpoint."""
    import json

    import torch

    from scaletrain.checkpoint import load_for_inference

    out.mkdir(exist_ok=True)
    cmd = deepspeed_cmd(2, "tests/dist_driver.py", str(out), recipe, *overrides)
    run(cmd, launcher_env(tmp_path))
    # DeepSpeed's per-rank shared-memory allreduce segments of this run were unlinked (RAM in /dev/shm)
    port = cmd[cmd.index("--master_port") + 1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2] and res[0]["steps"] == res[1]["steps"] == steps
    assert res[0]["train_loss"][-1][1] < res[0]["train_loss"][0][1]
    p0, p1 = torch.load(out / "params_rank0.pt"), torch.load(out / "params_rank1.pt")
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    model, cfg, vocab, state, _ = load_for_inference(out)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], p0[k]) for k in p0)
    return model, cfg, vocab, state
