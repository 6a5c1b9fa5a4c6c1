"""Fixtures shared by tests/unit and tests/integration; shared functions and constants are in helpers.py."""
import gc
import os
from pathlib import Path

import pytest

from helpers import TEST_LANGS

# engine.precision=auto (the default) resolves to fp32 in tests, on every kind of CPU; subprocesses inherit it.
os.environ["SCALETRAIN_AUTO_PRECISION"] = "fp32"


@pytest.fixture(scope="session")
def django_shards(tmp_path_factory) -> Path:
    from scaletrain.prepare import prepare_gettext

    out = tmp_path_factory.mktemp("shards") / "django5"
    prepare_gettext(package="django", langs=TEST_LANGS, out=out, progress=False)
    return out


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


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps one process-wide state (mixed precision, the DeepSpeed plugin) that a second Accelerator
    with other settings refuses: a test training through Accelerate in this process starts and ends without it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
