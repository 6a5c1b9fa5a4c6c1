"""launch.sh forwards a signal sent to it alone (a container runtime's SIGTERM to PID 1) to the launcher's
whole process group, and exits 75 when the job wrote OUT/preempted.json (preemption); under a launcher that
exits 1 whatever its ranks' codes (torchrun, ``accelerate launch``), launch.sh exits with the code a rank
wrote to $SCALETRAIN_EXIT_FILE (76: retry, 2: fix the input, 71: out of memory).

Runs launch.sh's own launch block (cut from the script between its markers) around a stub launcher whose
rank-like child checkpoints on SIGTERM: the full script would first install and prepare data."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT

STUB = """
import os, signal, subprocess, sys, time
out = sys.argv[1]
rank = subprocess.Popen([sys.executable, "-c", '''
import json, signal, sys, time
def h(s, f):
    open(sys.argv[1] + "/rank_got_" + signal.Signals(s).name, "w").close()
    json.dump({"step": 7}, open(sys.argv[1] + "/preempted.json", "w"))
    sys.exit(75)
signal.signal(signal.SIGTERM, h)
open(sys.argv[1] + "/rank_started", "w").close()
time.sleep(120)
''', out])
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(1))   # like DeepSpeed's launcher: exits 1 on a signal
rank.wait()
sys.exit(rank.returncode)
"""


def _launch_block() -> str:
    text = (ROOT / "launch.sh").read_text()
    start = text.index('rm -f "$out/preempted.json"')
    end = text.index('[[ $rc -eq 0 ]] || exit "$rc"') + len('[[ $rc -eq 0 ]] || exit "$rc"')
    return text[start:end]


def test_sigterm_to_launch_sh_alone_reaches_the_ranks_and_exits_75(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    script = tmp_path / "block.sh"
    script.write_text(f"set -euo pipefail\nout={tmp_path}\nlaunch_cmd=({sys.executable} {stub} {tmp_path})\n"
                      f"{_launch_block()}\necho finished-normally\n")
    p = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "rank_started").exists():
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)  # to the script only, not its process group
    stdout, stderr = p.communicate(timeout=60)
    assert (tmp_path / "rank_got_SIGTERM").exists()
    assert p.returncode == 75 and "preempted" in stderr and "finished-normally" not in stdout


RANK_CODE_STUB = '''
import subprocess, sys
rank = subprocess.run([sys.executable, "-c", """
import os, sys
print("scaletrain: error: the rank's own line", file=sys.stderr)
open(os.environ["SCALETRAIN_EXIT_FILE"], "w").write(sys.argv[1] + chr(10))
sys.exit(int(sys.argv[1]))
""", sys.argv[1]])
sys.exit(1)   # like torchrun and `accelerate launch`: 1 whatever code the rank ended with
'''


@pytest.mark.parametrize("code", [76, 2, 71])
def test_a_rank_s_exit_code_comes_through_a_launcher_that_exits_1(tmp_path, code):
    stub = tmp_path / "stub.py"
    stub.write_text(RANK_CODE_STUB)
    script = tmp_path / "block.sh"
    script.write_text(f"set -euo pipefail\nout={tmp_path}\nlaunch_cmd=({sys.executable} {stub} {code})\n"
                      f"{_launch_block()}\necho finished-normally\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert "finished-normally" not in p.stdout and "the rank's own line" in p.stderr
    assert ("exit 76: retry" in p.stderr) == (code == 76)
    assert not list(tmp_path.glob("scaletrain-exit.*"))  # the code's file removed
