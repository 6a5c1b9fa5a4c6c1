"""A resumed job continues the same MLflow run and step axis (its dataset input and checkpoints' logged
models are not made twice); the journal records both sessions, and syncing it afterwards adds nothing."""
from __future__ import annotations

import pytest

from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0"]


def test_resume_continues_the_run_with_monotone_steps(django_shards, tmp_path, monkeypatch):
    from scaletrain import tracking as T
    from scaletrain.config import load_config
    from scaletrain.train import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlruns.db'}"
    common = [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'run'}", f"tracking.uri={uri}"]
    first = train(load_config("small", [*common, "train.max_steps=4"]))
    second = train(load_config("small", [*common, "train.max_steps=8"]))  # resumes from the step-4 checkpoint
    assert second.run_id == first.run_id
    c = MlflowClient(uri)
    run = c.get_run(first.run_id)
    assert run.info.status == "FINISHED" and len(c.search_runs([run.info.experiment_id])) == 1
    assert run.info.run_name == f"small · run · {first.run_id[:6]}"  # named at the start, kept by the resume
    hist = c.get_metric_history(first.run_id, "train/loss")
    assert sorted(m.step for m in hist) == [2, 4, 6, 8]
    by_time = [m.step for m in sorted(hist, key=lambda m: (m.timestamp, m.step))]
    assert by_time == sorted(by_time)  # the step axis only moves forward
    events = [r["t"] for r in T.read_journal(tmp_path / "run" / "tracking" / "journal.jsonl") if r["t"] != "m"]
    assert events[0] == "start" and "resume" in events and events[-1] == "end"
    # the resumed session logged the dataset again and read its checkpoint list back: one input, one model
    # per checkpoint (step 4 of the first session, step 8 of the second), each a run output once
    assert len(run.inputs.dataset_inputs) == 1
    models = c.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{first.run_id}'")
    assert sorted(m.name for m in models) == ["small-step-4", "small-step-8"]
    assert sorted(o.step for o in run.outputs.model_outputs) == [4, 8]
    assert [m.tags["scaletrain.best"] for m in sorted(models, key=lambda m: m.metrics[0].value)] == ["true", "false"]
    (rep,) = T.sync_run(tmp_path / "run")
    assert rep.metrics_sent == 0 and rep.status is None
    assert (rep.datasets, rep.models, rep.model_updates) == (0, 0, 0)
