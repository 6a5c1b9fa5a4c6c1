"""scaletrain.engine.launch: DeepSpeed's per-node launcher started in-process for single-node jobs."""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from scaletrain.engine.launch import launcher_argv, local_slots, world_info
from scaletrain.errors import ScaletrainError


def test_slots_follow_cuda_visible_devices():
    assert local_slots(2, None) == [0, 1]
    assert local_slots(2, "") == [0, 1]
    assert local_slots(2, "3,5,7") == [3, 5]
    assert local_slots(1, "GPU-8e7c,GPU-1a2b") is None  # UUIDs: left to the deepspeed command
    with pytest.raises(ScaletrainError, match="lists 1 device"):
        local_slots(2, "4")


def test_world_info_is_what_deepspeeds_launcher_decodes():
    enc = world_info([0, 1])
    assert json.loads(base64.urlsafe_b64decode(enc)) == {"localhost": [0, 1]}
    argv = launcher_argv([0, 1], 29999, "error", ["scaletrain", "train", "--config", "small"])
    assert argv[:6] == [f"--world_info={enc}", "--master_addr=127.0.0.1", "--master_port=29999", "--module",
                        "--no_local_rank", "--log_level=error"]
    assert argv[6:] == ["scaletrain", "train", "--config", "small"]
    argv = launcher_argv([0, 1], 29999, "info", ["tests/integration/dist_driver.py", "OUT"])
    assert "--module" not in argv and argv[-2:] == ["tests/integration/dist_driver.py", "OUT"]


def test_launcher_imported_without_mlflow_which_still_imports_later():
    code = ("import sys; from scaletrain.engine.launch import _import_launcher; l = _import_launcher(); "
            "print('mlflow' in sys.modules, hasattr(l, 'main')); import mlflow; print(mlflow.__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True", "mlflow"]


def test_ranks_watch_this_launcher_like_deepspeeds():
    """A rank whose parent is this launcher watches it (scaletrain.train.preemption.LauncherWatch): if the
    launcher dies the ranks checkpoint and stop instead of training on orphaned."""
    child = ("from scaletrain.train.preemption import LauncherWatch; w = LauncherWatch(lambda what: None); "
             "print(len(w.chain), w.broken())")
    parent = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"
    for launcher in ("scaletrain.engine.launch", "deepspeed.launcher.launch", "something.else"):
        p = subprocess.run([sys.executable, "-c", parent, child, launcher], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        n = int(p.stdout.split()[0])
        assert n == (0 if launcher == "something.else" else 2), (launcher, p.stdout)
