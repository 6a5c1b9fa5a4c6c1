"""After a crash the resumed job re-does the steps since its last checkpoint; their metrics were logged before
the crash and must not be logged again: every step's train/ metrics are in the MLflow run exactly once."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from scaletrain.config import load_config
from test_nonfinite import TINY

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process


class Crash(Exception):
    pass


def test_redone_steps_are_logged_once(django_shards, tmp_path, monkeypatch):
    from scaletrain.train import Trainer

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    over = [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'run'}", "train.resume=true",
            "train.save_every=3", "tracking.enabled=true", f"tracking.uri={uri}", "train.max_steps=7"]
    first = Trainer(load_config("small", over))
    real = first.logger.after_step

    def after_step(*a):
        real(*a)
        if first.state.step == 5:  # logged step 5; the last checkpoint is step 3
            raise Crash
    first.logger.after_step = after_step
    with pytest.raises(Crash):
        first.fit()
    first.close("FAILED")
    second = Trainer(load_config("small", over))
    res = second.fit()
    second.close()
    assert res.steps == 7
    hist = MlflowClient(uri).get_metric_history(res.run_id, "train/loss")
    assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5, 6, 7]
