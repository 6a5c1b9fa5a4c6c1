"""Resuming a ZeRO-0 bf16 checkpoint of the older layout: before bf16 at ZeRO-0 ran as torch autocast over fp32
weights (``ds_config.runtime_ds_config``), DeepSpeed wrapped the optimizer in its FP16_UnfusedOptimizer, whose
saved state (loss scaler, fp32 master copies, the inner optimizer's state) today's plain optimizer cannot take.

A real checkpoint of that layout is written in this process by a 2-step run with the translation undone (the
monkeypatch that ``test_host_syncs`` uses to bring that optimizer back). Resuming it with today's code stops
with one line naming the checkpoint and what to do, leaves every file of the run directory as it was, and
the weights-only route the line names (``load_model_weights``: evaluate, translate, average, export) reads it.

Seen failing without ``deepspeed_files.refuse_unfused_layout``: DeepSpeed's ``KeyError: 'param_groups'`` from
``torch.optim.Optimizer.load_state_dict``, with a traceback and no hint."""
from __future__ import annotations

import hashlib

import pytest

from helpers import tiny_model
from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")

BASE = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "train.log_every=1", "train.valid_every=0",
        "train.valid_max_batches=1", "tracking.enabled=false", "engine.threads=1", "engine.backend=deepspeed",
        "engine.ds_config=zero0.json", "engine.precision=bf16"]


def _files(root):
    return {p.relative_to(root): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_of_an_unfused_bf16_checkpoint_fails_in_one_line(django_shards, tmp_path, monkeypatch):
    import scaletrain.engine.deepspeed_backend as dse
    from scaletrain.checkpoint import load_model_weights
    from scaletrain.train import Trainer

    run = [*BASE, f"data.shards={django_shards}", f"train.out_dir={tmp_path}"]
    with monkeypatch.context() as m:
        m.setattr(dse, "runtime_ds_config", lambda ds: ds)  # DeepSpeed's own bf16 at ZeRO-0, as it was
        tr = Trainer(load_config("small", [*run, "train.max_steps=2", "train.save_every=2", "train.resume=false"]))
        assert type(tr.engine.backend.e.optimizer).__name__ == "FP16_UnfusedOptimizer"
        tr.fit()
        tr.close()
    ckpt = tmp_path / "checkpoints" / "step-0000002"
    before = _files(tmp_path)
    assert (ckpt / "mp_rank_00_model_states.pt") in {tmp_path / p for p in before}

    tr = Trainer(load_config("small", [*run, "train.max_steps=4", "train.save_every=1"]))
    try:
        with pytest.raises(ScaletrainError) as e:
            tr.fit()
    finally:
        tr.close()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{ckpt}: ") and "FP16_UnfusedOptimizer" in msg, msg
    assert "start a new train.out_dir" in msg and "export" in msg, msg
    assert _files(tmp_path) == before  # nothing written, moved or removed

    weights = load_model_weights(ckpt)  # the route the line points to
    module = tr.engine.module.state_dict()
    assert weights.keys() == module.keys() and all(weights[k].shape == module[k].shape for k in module)
