"""Run by the checkpoint-safety tests in a fresh process (one engine per run; Accelerate's process-wide
state, its DeepSpeed plugin included, is cleared before each).

usage: ckpt_driver.py train BASE SHARDS STEPS RUNS_JSON
       ckpt_driver.py resume-planted OUT SHARDS OVERRIDES_JSON FILES_JSON RESULT_JSON

``train``: for each NAME: OVERRIDES of RUNS_JSON, train the tiny model STEPS updates into BASE/NAME (resuming
from its checkpoint if there is one).
``resume-planted``: for each file name in FILES_JSON, restore OUT's newest checkpoint from its pristine
copy, plant a ``__reduce__`` payload in that file (see :func:`plant`) and try to resume; record the
error message of each attempt in RESULT_JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]

from test_engine_replay import TINY  # noqa: E402


class Payload:
    """Creates ``marker`` when unpickled (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant(path: Path, marker: str) -> None:
    """Add a payload object to the dict stored in ``path`` (a torch.save file) and rewrite ``index.json``'s
    checksum of it when there is one, as an attacker who edits a checkpoint would."""
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=False)  # our own pristine file
    obj["__payload__"] = Payload(marker)
    torch.save(obj, path)
    index = path.parent / "index.json"
    if index.is_file():
        from scaletrain.fileio import sha256_file

        data = json.loads(index.read_text())
        data["files"][path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        index.write_text(json.dumps(data))


def _cfg(out, shards, steps, overrides):
    from scaletrain.config import load_config

    return load_config("small", [*TINY, f"data.shards={shards}", f"train.out_dir={out}", f"train.max_steps={steps}",
                                 *overrides])


def _fresh_accelerate() -> None:
    """Accelerate takes one Accelerator with the DeepSpeed plugin per process: each run starts without it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def main():
    mode, out, shards = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    from scaletrain.errors import ScaletrainError
    from scaletrain.train import Trainer

    if mode == "train":
        steps = int(sys.argv[4])
        for name, overrides in json.loads(sys.argv[5]).items():
            _fresh_accelerate()
            t = Trainer(_cfg(out / name, shards, steps, overrides))
            t.fit()
            t.close()
        return
    overrides, files, result = json.loads(sys.argv[4]), json.loads(sys.argv[5]), Path(sys.argv[6])
    root = out / "checkpoints"
    tag = (root / "latest").read_text().strip()
    pristine = out / "pristine"
    shutil.copytree(root / tag, pristine)
    res = {}
    for name in files:
        shutil.rmtree(root / tag)
        shutil.copytree(pristine, root / tag)
        marker = out / f"marker-{name}"
        plant(root / tag / name, str(marker))
        _fresh_accelerate()
        t = Trainer(_cfg(out, shards, 3, overrides))
        try:
            t.fit()
            res[name] = {"error": None}
        except ScaletrainError as e:
            res[name] = {"error": str(e)}
        t.close()
        res[name]["ran"] = marker.exists()
    shutil.rmtree(root / tag)
    os.replace(pristine, root / tag)  # leave the checkpoint as it was
    result.write_text(json.dumps(res))


if __name__ == "__main__":
    from scaletrain.engine.shutdown import finishing_distributed

    with finishing_distributed():  # as `scaletrain train` ends: groups and threads finished first
        main()
