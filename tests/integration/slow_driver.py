"""dist_driver.py with slow steps (SLOW_STEP_SECONDS of sleep per micro-batch, same results) that writes
OUT/pid_rankR first: a test can kill one rank part-way through a short job.

usage (under a launcher): SLOW_STEP_SECONDS=0.2 slow_driver.py OUT_DIR RECIPE [KEY=VALUE ...]
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scaletrain.cli import _strip_launcher_args  # noqa: E402
from scaletrain.train.unit import TranslationUnit  # noqa: E402

import dist_driver  # noqa: E402

_real_loss = TranslationUnit.loss
DELAY = float(os.environ.get("SLOW_STEP_SECONDS", "0.2"))


def loss(self, batch):
    if self.engine.module.training:
        time.sleep(DELAY)
    return _real_loss(self, batch)


TranslationUnit.loss = loss

if __name__ == "__main__":
    out = _strip_launcher_args(sys.argv[1:])[0]
    with open(os.path.join(out, f"pid_rank{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    from scaletrain.engine.shutdown import finishing_distributed

    with finishing_distributed():  # as `scaletrain train` ends: groups and threads finished first
        dist_driver.main()
