"""A training run's MLflow record is complete: tags that say what ran (variant, engine, scale, corpus,
code), the engine's resolved settings and the shard manifest as artifacts, throughput / memory /
data-loader-wait metrics."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=2", "train.valid_max_batches=1", "train.save_every=2", "train.keep_last=1",
        "train.max_steps=4"]


@pytest.fixture(scope="module")
def job(django_shards, tmp_path_factory):
    """One tiny job (4 steps, validation and a checkpoint every 2, keep_last=1) into a SQLite store, started
    inside a git repository: (result, store URI, the repository's commit)."""
    from scaletrain.config import load_config
    from scaletrain.train import train

    tmp = tmp_path_factory.mktemp("contents")
    repo = tmp / "project"  # the job starts inside a git repository: its commit is a tag
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    uri = f"sqlite:///{tmp / 'store' / 'mlruns.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(repo)
        cfg = load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp / 'run'}",
                                    f"tracking.uri={uri}", "tracking.experiment=contents"])
        saved = dict(os.environ)
        try:
            res = train(cfg)
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return res, uri, commit


def test_training_run_has_tags_artifacts_and_system_metrics(job, django_shards, tmp_path):
    res, uri, commit = job
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


def _models(c, run):
    return c.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'",
                                  order_by=[{"field_name": "metrics.valid/nll", "ascending": True}])


def test_run_shows_dataset_logged_models_source_and_description(job, django_shards):
    """MLflow 3's conventions for training: the experiment's kind, the source/git/user tags and a description,
    the corpus as the run's dataset input (split as context), each checkpoint a logged model with its step,
    its validation metrics linked (so search_logged_models ranks them), deleted ones marked, the best tagged."""
    import getpass

    res, uri, commit = job
    c = MlflowClient(uri)
    run = c.get_run(res.run_id)
    tags = run.data.tags
    assert c.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert {k: tags.get(k) for k in ("mlflow.source.name", "mlflow.source.type", "mlflow.source.git.commit",
                                     "mlflow.user")} == {"mlflow.source.name": "scaletrain train",
                                                         "mlflow.source.type": "LOCAL",
                                                         "mlflow.source.git.commit": commit,
                                                         "mlflow.user": getpass.getuser()}
    note = tags["mlflow.note.content"]
    for part in ("`small` recipe", f"corpus {tags['corpus']}", "deepspeed ZeRO stage 0", "on 1 rank on 1 node (cpu;",
                 "precision fp32", f"commit {commit[:12]}", str(django_shards)):
        assert part in note, (part, note)

    manifest = Path(django_shards) / "manifest.json"
    splits = {k: v["n_examples"] for k, v in json.loads(manifest.read_text())["splits"].items()}
    (inp,) = run.inputs.dataset_inputs
    ds = inp.dataset
    assert (ds.name, ds.digest) == (tags["corpus"], hashlib.sha256(manifest.read_bytes()).hexdigest()[:12])
    assert ds.source_type == "local" and json.loads(ds.source)["uri"] == str(Path(django_shards).resolve())
    assert json.loads(ds.profile)["splits"] == splits and json.loads(ds.profile)["num_rows"] == sum(splits.values())
    assert [(t.key, t.value) for t in inp.tags] == [("mlflow.data.context", "train")]

    models = _models(c, run)  # ranked by their linked validation nll, lowest first
    by = {m.tags["scaletrain.checkpoint"]: m for m in models}
    assert sorted(by) == ["step-0000002", "step-0000004"] and len(models) == 2
    ckpts = Path(res.out_dir) / "checkpoints"
    assert by["step-0000004"].tags["scaletrain.checkpoint.path"] == str((ckpts / "step-0000004").resolve())
    assert by["step-0000004"].tags["scaletrain.checkpoint.exists"] == "true"
    assert by["step-0000002"].tags["scaletrain.checkpoint.exists"] == "false"  # keep_last=1 deleted it
    assert {m.name for m in models} == {"small-step-2", "small-step-4"} and all(m.status == "READY" for m in models)
    assert {m.tags["mlflow.model.isExternal"] for m in models} == {"true"}  # the weights stay in the run directory
    assert {(o.model_id, o.step) for o in run.outputs.model_outputs} == {(by["step-0000002"].model_id, 2),
                                                                        (by["step-0000004"].model_id, 4)}
    points = c.get_metric_history(res.run_id, "valid/nll")
    assert sorted(m.step for m in points) == [0, 2, 4]  # linking a metric to a model does not log it twice
    history = {m.step: m.value for m in points}
    for key, m in by.items():
        step = int(key.split("-")[1])
        assert [(x.key, x.step, x.value, x.dataset_name, x.dataset_digest) for x in m.metrics] == [
            ("valid/nll", step, history[step], ds.name, ds.digest)]
    assert models[0].metrics[0].value == min(history[2], history[4])
    assert [m.tags.get("scaletrain.best") for m in models] == ["true", "false" if "scaletrain.best" in models[1].tags
                                                              else None]


def test_evaluation_run_reads_the_test_split_and_scores_the_checkpoints_model(job, django_shards):
    """An evaluation of the job's last checkpoint: a nested run whose input is the corpus dataset with the
    test split as context and the checkpoint's logged model, scores linked to that model, source tags and a
    description."""
    from scaletrain.eval.evaluate import log_to_mlflow
    from scaletrain.tracking.records import EvalSpec

    res, uri, _ = job
    ckpt = Path(res.out_dir) / "checkpoints" / "step-0000004"
    score = SimpleNamespace(name="all", bleu=3.5, chrf=20.0)
    spec = EvalSpec("test", 10, 0, True, 1, 1.0, 1.2, 10, True, True, 4, str(ckpt), "", str(django_shards), "")
    result = {"run_id": res.run_id, "split": "test", "step": 4, "tracking": {"uri": uri}, "evaluation": spec.to_json(),
              "report": SimpleNamespace(averages=[score], directions=[]),
              "baseline": SimpleNamespace(averages=[score], directions=[])}
    logged = log_to_mlflow(result)
    c = MlflowClient(uri)
    nested, parent = c.get_run(logged.run_id), c.get_run(res.run_id)
    tags = nested.data.tags
    assert tags["mlflow.parentRunId"] == res.run_id and tags["mlflow.source.name"] == "scaletrain evaluate"
    assert f"Evaluation `{spec.name}` of checkpoint {ckpt} (step 4)" in tags["mlflow.note.content"]
    (inp,) = nested.inputs.dataset_inputs
    (train_input,) = parent.inputs.dataset_inputs
    assert (inp.dataset.name, inp.dataset.digest) == (train_input.dataset.name, train_input.dataset.digest)
    assert [(t.key, t.value) for t in inp.tags] == [("mlflow.data.context", "test")]
    model = next(m for m in _models(c, parent) if m.tags["scaletrain.checkpoint"] == "step-0000004")
    assert [m.model_id for m in nested.inputs.model_inputs] == [model.model_id]
    linked = {x.key: (x.value, x.run_id, x.dataset_name) for x in c.get_logged_model(model.model_id).metrics}
    assert linked["test/bleu/all"] == (3.5, logged.run_id, inp.dataset.name)
    assert "valid/nll" in linked
    assert parent.data.metrics["test/bleu/all"] == 3.5  # the full evaluation's headline on the training run


def test_export_register_adds_a_model_registry_version(job, tmp_path, capsys):
    """``export --register NAME``: the export's files as a logged model of the training run, a new version
    of NAME each time; a tracking server that is down is one line, the export stays."""
    from helpers import free_port

    from scaletrain.cli import main
    from scaletrain.errors import ScaletrainError
    from scaletrain.tracking.models import register_export

    res, uri, _ = job
    out = tmp_path / "model.safetensors"
    for version in (1, 2):
        assert main(["export", res.out_dir, "--out", str(out), "--register", "nmt-tiny"]) == 0
        assert f"as version {version} of model 'nmt-tiny' (models:/nmt-tiny/{version})" in capsys.readouterr().out
    c = MlflowClient(uri)
    mv = c.get_model_version("nmt-tiny", "2")
    assert mv.run_id == res.run_id and mv.source.startswith("models:/m-")  # the logged model is its source
    model = c.get_logged_model(mv.source[len("models:/"):])
    assert model.source_run_id == res.run_id and model.model_type == "scaletrain-export"
    assert model.tags["scaletrain.checkpoint.step"] == "4" and model.tags["scaletrain.export.format"] == "safetensors"
    assert {f.path for f in c.list_logged_model_artifacts(model.model_id)} == {"MLmodel", "model.safetensors"}
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(f"models:/nmt-tiny/{mv.version}", dst_path=str(tmp_path / "dl")))
    finally:
        mlflow.set_tracking_uri(None)
    assert (local / "model.safetensors").read_bytes() == out.read_bytes()  # what one deploys, from the registry
    with pytest.raises(ScaletrainError, match=r"unreachable .*the export is written at"):
        register_export(f"http://127.0.0.1:{free_port()}", "x", out, run_id=res.run_id, experiment="e", step=4,
                        fmt="safetensors", checkpoint=res.final_checkpoint, model_prefix="small")
