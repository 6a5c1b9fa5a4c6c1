"""The live progress line: shown on rank 0 when stdout is a terminal (a pseudo-terminal here), with step /
max_steps, loss, tokens/s and the ETA; absent with tracking.progress=false and when stdout is not a TTY."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from types import SimpleNamespace

from helpers import ROOT

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=6",
        "tracking.enabled=false"]


def _train_on_a_terminal(shards, out, *extra) -> str:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column terminal
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", "--config", "small", *TINY,
                          f"data.shards={shards}", f"train.out_dir={out}", *extra],
                         stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT, env=env)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 300)
        if not r:
            p.kill()
            raise AssertionError("no output for 300 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.wait(60) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_progress_line_at_a_terminal_and_not_when_switched_off(django_shards, tmp_path):
    text = _train_on_a_terminal(django_shards, tmp_path / "on")
    assert "train (budget 0:09:00): 6/6 steps" in text, text[-2000:]  # the recipe's train.max_minutes=9
    line = text[text.rindex("6/6 steps"):].splitlines()[0]
    assert "loss " in line and "tok/s" in line and "eta 0:00:00" in line, line
    assert "step      6 | loss" in text  # the log lines still print (above the bar)
    # in-training BLEU validation shows its own line while it decodes
    bleu = _train_on_a_terminal(django_shards, tmp_path / "bleu", "train.bleu_every=3", "eval.valid_lines=2",
                                "eval.max_len_b=8")
    assert "valid BLEU (rank 0's lines)" in bleu and "valid BLEU " in bleu, bleu[-2000:]
    off = _train_on_a_terminal(django_shards, tmp_path / "off", "tracking.progress=false")
    assert "steps |" not in off and "step      6 | loss" in off


def test_no_progress_line_when_stdout_is_not_a_terminal(monkeypatch):
    from scaletrain.config import load_config
    from scaletrain.train.components import ProgressDisplay

    cfg = load_config("small", [])
    main = SimpleNamespace(is_main=True)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert ProgressDisplay.for_run(cfg, main, SimpleNamespace(step=0)).bar is None
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    shown = ProgressDisplay.for_run(cfg, main, SimpleNamespace(step=3))
    assert shown.bar is not None and shown.bar.n == 3 and shown.bar.total == cfg.train.max_steps
    shown.close()
    assert ProgressDisplay.for_run(cfg, SimpleNamespace(is_main=False), SimpleNamespace(step=0)).bar is None
