"""Every numeric config field is range-checked when the config is loaded, before any engine or process
starts: one line naming the key."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT
from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError

BAD = [
    ("model.n_heads=0", "n_heads"), ("model.n_heads=-4", "n_heads"), ("model.dropout=1.5", "dropout"),
    ("optim.warmup_steps=-5", "optim.warmup_steps"), ("optim.clip_norm=-1", "optim.clip_norm"),
    ("optim.lr=nan", "optim.lr"), ("optim.eps=0", "optim.eps"), ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.betas=[0.9,1.0]", "optim.betas"), ("optim.warmup_init_lr=-1e-4", "optim.warmup_init_lr"),
    ("data.max_bytes=0", "data.max_bytes"), ("data.seed=-1", "data.seed"), ("train.seed=-3", "train.seed"),
    ("train.log_every=0", "train.log_every"), ("train.keep_last=-1", "train.keep_last"),
    ("train.max_minutes=-1", "train.max_minutes"), ("train.max_minutes=inf", "train.max_minutes"),
    ("train.valid_max_batches=0", "train.valid_max_batches"), ("eval.batch_tokens=0", "eval.batch_tokens"),
    ("eval.valid_lines=0", "eval.valid_lines"), ("eval.max_len_a=-1", "eval.max_len_a"),
    ("train.on_corrupt_checkpoint=ignore", "train.on_corrupt_checkpoint"),
    ("train.on_save_error=retry", "train.on_save_error"),
]


@pytest.mark.parametrize("override,key", BAD)
def test_out_of_range_value_names_the_key(override, key):
    with pytest.raises(ScaletrainError) as e:
        load_config("small", [override])
    assert key in str(e.value) and "\n" not in str(e.value)


def test_preflight_refuses_before_any_process_starts():
    """launch.sh runs this check before the launcher: exit 2 and one line, no traceback."""
    p = subprocess.run([sys.executable, "-m", "scaletrain.engine.preflight", "--config", "small",
                        "optim.warmup_steps=-5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert lines == ["scaletrain: error: config key 'optim.warmup_steps': must be >= 0 (0 = no warm-up)"]
