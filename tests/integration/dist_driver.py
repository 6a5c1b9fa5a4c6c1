"""Run by tests under a launcher (deepspeed / accelerate): train, then save this rank's parameters.

usage: dist_driver.py OUT_DIR RECIPE [KEY=VALUE ...]
"""
import json
import os
import sys

import torch

from scaletrain.cli import _setup_logging, _strip_launcher_args
from scaletrain.config import load_config
from scaletrain.train import Trainer


def main():
    argv = _strip_launcher_args(sys.argv[1:])
    out, recipe, overrides = argv[0], argv[1], argv[2:]
    _setup_logging(False)
    cfg = load_config(recipe, overrides)
    trainer = Trainer(cfg)
    res = trainer.fit()
    trainer.close()
    eng = trainer.engine
    params = {k: v.detach().float().cpu().clone() for k, v in eng.module.state_dict().items()}
    torch.save(params, os.path.join(out, f"params_rank{eng.rank}.pt"))
    with open(os.path.join(out, f"result_rank{eng.rank}.json"), "w") as f:
        json.dump({**res.__dict__, "world_size": eng.world_size, "rank": eng.rank}, f)


if __name__ == "__main__":
    from scaletrain.engine.shutdown import finishing_distributed

    with finishing_distributed():  # as `scaletrain train` ends: groups and threads finished first
        main()
