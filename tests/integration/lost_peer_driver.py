"""dist_driver.py as ``scaletrain train`` ends a rank (one error line, its exit code: 76 for a lost peer), with
slow steps (SLOW_STEP_SECONDS) and OUT/pid_rankR written first; SAVE_PAUSE_STEP=N makes every rank, once
its files of checkpoint N are written, create OUT/saving_rankR and sleep SAVE_PAUSE_SECONDS before the save's
closing all-reduce: a test kills a peer while a checkpoint is being written.

usage (under a launcher): lost_peer_driver.py OUT_DIR RECIPE [KEY=VALUE ...]
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import slow_driver  # noqa: E402,F401 - slow steps
from scaletrain.checkpoint.manager import CheckpointManager  # noqa: E402
from scaletrain.cli import _strip_launcher_args  # noqa: E402
from scaletrain.errors import ScaletrainError  # noqa: E402

import dist_driver  # noqa: E402

OUT = _strip_launcher_args(sys.argv[1:])[0]
PAUSE_STEP = int(os.environ.get("SAVE_PAUSE_STEP", "0"))
_save, _any = CheckpointManager.save, CheckpointManager._any


def save(self, step, contents):
    self._pause_now = step == PAUSE_STEP
    return _save(self, step, contents)


def any_(self, failed):
    if getattr(self, "_pause_now", False):
        self._pause_now = False
        open(os.path.join(OUT, f"saving_rank{self.engine.rank}"), "w").close()
        time.sleep(float(os.environ.get("SAVE_PAUSE_SECONDS", "5")))
    return _any(self, failed)


CheckpointManager.save, CheckpointManager._any = save, any_

if __name__ == "__main__":
    with open(os.path.join(OUT, f"pid_rank{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    from scaletrain.engine.shutdown import finishing_distributed

    try:
        with finishing_distributed():
            dist_driver.main()
    except ScaletrainError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr, flush=True)
        sys.exit(getattr(e, "exit_code", 2))
