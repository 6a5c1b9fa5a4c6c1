"""Validation inside the training loop: BLEU every N steps, best checkpoint, early stopping."""
import json
import sys

import pytest

from helpers import launcher_env, run, tiny_model
from scaletrain.checkpoint import load_for_inference

TINY = [
    *tiny_model(max_positions=96, dropout=None), "data.max_bytes=40", "data.max_tokens=1200", "train.log_every=5",
    "train.valid_max_batches=2", "train.save_every=0", "train.max_minutes=0", "eval.valid_lines=3",
    "eval.max_len_b=20", "eval.max_len_a=1.0", "engine.threads=2",
]


@pytest.mark.slow
def test_bleu_validation_best_checkpoint_and_early_stop(django_shards, tmp_path):
    out = tmp_path / "run"
    # lr so small the model cannot improve by 0.5 nats: the first validation is the best, then
    # two without improvement stop the run at step 15 (patience 2).
    over = [f"data.shards={django_shards}", f"train.out_dir={out}", "optim.lr=1e-9", "train.max_steps=100",
            "train.valid_every=5", "train.bleu_every=5", "train.best_metric=valid/nll", "train.best_mode=min",
            "train.patience=2", "train.best_min_delta=0.5", *TINY]
    p = run([sys.executable, "-m", "scaletrain", "train", "--config", "small", *over], launcher_env(tmp_path))
    assert "early stop at step 15" in p.stdout, p.stdout[-3000:]
    assert "valid BLEU" in p.stdout
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 15
    assert [s for s, _ in summary["valid_nll"]] == [0, 5, 10, 15]  # step 0 starts the curve
    best = out / "checkpoints" / "best"
    assert json.loads((best / "trainer_state.json").read_text())["step"] == 5
    model, cfg, vocab, state, ckpt = load_for_inference(best)
    assert state["step"] == 5 and ckpt == best
