"""A training run's MLflow record is complete: tags that say what ran (variant, engine, scale, corpus,
code), the engine's resolved settings and the shard manifest as artifacts, throughput / memory /
data-loader-wait metrics."""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=4"]


def test_training_run_has_tags_artifacts_and_system_metrics(django_shards, tmp_path, monkeypatch):
    from scaletrain.config import load_config
    from scaletrain.train import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    repo = tmp_path / "project"  # the job starts inside a git repository: its commit is a tag
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(repo)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlruns.db'}"
    cfg = load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'run'}",
                                f"tracking.uri={uri}", "tracking.experiment=contents"])
    res = train(cfg)
    c = MlflowClient(uri)
    run = c.get_run(res.run_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    # the run's name: recipe, output directory, short id (also the learning curves' title)
    assert run.info.run_name.startswith("small · ") and run.info.run_name.endswith(f"run · {res.run_id[:6]}")
    curves = json.loads((Path(res.out_dir) / "plots" / "learning_curves.json").read_text())
    assert curves["figure"]["title"] == f"learning curves: {run.info.run_name}"
    assert json.loads((Path(res.out_dir) / "tracking" / "run.json").read_text())["run_name"] == run.info.run_name
    import deepspeed
    import torch

    import scaletrain

    manifest = Path(django_shards) / "manifest.json"
    expected = {
        "arch": "transformer", "engine": "deepspeed", "zero_stage": "0", "precision": "fp32", "world_size": "1",
        "nodes": "1", "tokenizer": "byte", "corpus.manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
        "git_commit": commit, "version.scaletrain": scaletrain.__version__, "version.torch": torch.__version__,
        "version.deepspeed": deepspeed.__version__, "recipe": "small",
    }
    assert {k: tags.get(k) for k in expected} == expected
    assert tags["corpus"] and "version.accelerate" in tags

    def artifacts(path=None):
        out = set()
        for a in c.list_artifacts(res.run_id, path):
            out |= artifacts(a.path) if a.is_dir else {a.path}
        return out

    assert {"config.yaml", "engine/ds_config.json", "data/manifest.json", "plots/learning_curves.png"} <= artifacts()
    from matplotlib.image import imread

    assert imread(Path(res.out_dir) / "plots" / "learning_curves.png").shape[:2] == (700, 1000)
    ds = json.loads(Path(c.download_artifacts(res.run_id, "engine/ds_config.json", str(tmp_path))).read_text())
    assert ds["train_batch_size"] == 1 and ds["train_micro_batch_size_per_gpu"] == 1  # filled in, not "auto"
    m = run.data.metrics
    for key in ("train/tokens_per_s", "train/src_tgt_tokens_per_s", "train/bytes_per_s", "train/data_wait_s",
                "train/data_wait_frac", "sys/max_rss_mb"):
        assert key in m and m[key] >= 0, key
    assert m["train/bytes_per_s"] > m["train/tokens_per_s"] > 0  # source + target bytes vs target tokens
    assert m["sys/max_rss_mb"] > 50
    assert 0 <= m["system/node0/cpu_utilization_percentage"] <= 100 and tags["node0.host"]  # this node's sampler
    assert m["system/node0/system_memory_usage_megabytes"] > 0
    assert [x.step for x in c.get_metric_history(res.run_id, "train/data_wait_s")] == [2, 4]


def test_moce_tags_name_delta_and_lid():
    from scaletrain.config import load_config
    from scaletrain.train.recorder import run_tags

    cfg = load_config("moce_d4_lid", [])
    engine = SimpleNamespace(world_size=4, rank=0, zero_stage=2)
    tags = run_tags(cfg, engine, SimpleNamespace(source={"name": "ted59"}))
    assert tags["arch"] == "moce" and tags["moce.delta"] == "4" and tags["moce.lid"] == "True"
    assert tags["zero_stage"] == "2" and tags["world_size"] == "4" and tags["corpus"] == "ted59"


@pytest.mark.parametrize("local,nodes", [("2", "2"), ("4", "1")])
def test_nodes_from_local_world_size(monkeypatch, local, nodes):
    from scaletrain.config import load_config
    from scaletrain.train.recorder import run_tags

    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    tags = run_tags(load_config("small", []), SimpleNamespace(world_size=4, rank=0, zero_stage=0),
                    SimpleNamespace(source={}))
    assert tags["nodes"] == nodes and tags["zero_stage"] == "0"


def test_evaluate_logs_to_the_recipes_tracking_store(tmp_path, monkeypatch):
    """``evaluate`` writes to the store of the training run's recipe, not the defaults: a run nested under
    the training run, in its experiment; the training run's status is left as it was."""
    from scaletrain import tracking as T
    from scaletrain.eval.evaluate import log_to_mlflow
    from scaletrain.tracking.records import EvalSpec

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'elsewhere' / 'mlruns.db'}"
    tr = T.Tracker(uri, "recipe-exp", "r", True, tmp_path)
    rid = tr.start()
    tr.end("KILLED")
    score = SimpleNamespace(name="all", bleu=12.5, chrf=40.0)
    spec = EvalSpec("test", 10, 0, True, 1, 1.0, 4.0, 200, True, True, 4, "ck", "", "sh", "")
    result = {"run_id": rid, "split": "test", "step": 4, "tracking": {"uri": uri, "experiment": "recipe-exp"},
              "evaluation": spec.to_json(), "report": SimpleNamespace(averages=[score], directions=[]),
              "baseline": SimpleNamespace(averages=[score], directions=[])}
    logged = log_to_mlflow(result)
    c = MlflowClient(uri)
    run = c.get_run(rid)
    assert run.data.metrics["test/bleu/all"] == 12.5 and run.info.status == "KILLED"
    nested = c.get_run(logged.run_id)
    assert nested.data.tags["mlflow.parentRunId"] == rid and nested.info.experiment_id == run.info.experiment_id
    assert nested.info.run_name == spec.name and nested.data.metrics["test/copy_baseline/chrf"] == 40.0
    assert not (tmp_path / "mlruns.db").exists()  # nothing went to the default store of the working directory
