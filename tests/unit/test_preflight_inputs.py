"""Input checks before anything starts (scaletrain.engine.preflight): shards, output directory, launch plan."""
from __future__ import annotations

import json

import pytest

from scaletrain.config import load_config
from scaletrain.engine.preflight import (BUNDLED_SHARDS, check_inputs, check_out_dir, is_bundled_shards, launch_plan,
                                         main)
from scaletrain.errors import ScaletrainError


def _cfg(tmp_path, *overrides):
    return load_config("small", [f"train.out_dir={tmp_path / 'run'}", "engine.precision=fp32", *overrides])


def test_bundled_path_spellings(tmp_path):
    assert is_bundled_shards("shards/django", cwd=tmp_path)
    assert is_bundled_shards("./shards/django/", cwd=tmp_path)
    assert is_bundled_shards(str(tmp_path / "shards" / "django"), cwd=tmp_path)
    assert not is_bundled_shards("shards/djangoo", cwd=tmp_path)
    assert not is_bundled_shards("other/django", cwd=tmp_path)


def test_missing_shards_one_line_naming_key_path_and_how(tmp_path):
    cfg = _cfg(tmp_path, f"data.shards={tmp_path / 'nope'}")
    with pytest.raises(ScaletrainError) as e:
        check_inputs(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "data.shards" in msg and str(tmp_path / "nope") in msg
    assert "scaletrain prepare --out" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScaletrainError, match="no manifest.json"):
        check_inputs(_cfg(tmp_path, f"data.shards={tmp_path / 'empty'}"))
    assert not (tmp_path / "run").exists()  # nothing created


def test_manifest_must_parse_and_hold_train_and_valid(tmp_path, django_shards):
    check_inputs(_cfg(tmp_path, f"data.shards={django_shards}"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(ScaletrainError, match="cannot parse manifest"):
        check_inputs(_cfg(tmp_path, f"data.shards={bad}"))
    part = tmp_path / "part"
    part.mkdir()
    m = json.loads((django_shards / "manifest.json").read_text())
    del m["splits"]["valid"]
    (part / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ScaletrainError, match="no 'valid' split"):
        check_inputs(_cfg(tmp_path, f"data.shards={part}"))


def test_spm_tokenizer_needs_its_model(tmp_path, django_shards):
    with pytest.raises(ScaletrainError, match="no SentencePiece model"):
        check_inputs(_cfg(tmp_path, f"data.shards={django_shards}", "data.tokenizer=spm"))


def test_out_dir_checks(tmp_path):
    check_out_dir(tmp_path / "a" / "b")  # creatable
    assert not (tmp_path / "a").exists()  # and not created
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ScaletrainError, match="train.out_dir.*not a directory"):
        check_out_dir(f)
    with pytest.raises(ScaletrainError, match="cannot be created"):
        check_out_dir(f / "sub")
    with pytest.raises(ScaletrainError, match="cannot be created"):
        check_out_dir("/proc/scaletrain-test-run")  # refuses new names even to root
    assert not list(tmp_path.glob(".scaletrain-write-check-*"))


def test_launch_plan_prepares_only_the_bundled_corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = launch_plan(_cfg(tmp_path, f"data.shards={BUNDLED_SHARDS}"), world_size=2)
    assert plan["prepare"] == "1" and plan["shards"] == BUNDLED_SHARDS and plan["precision"] == "fp32"
    assert plan["ds_json"].endswith("zero0.json") and plan["cuda"] in ("0", "1")
    import os

    cores = len(os.sched_getaffinity(0))
    assert plan["threads"] == str(max(1, cores // 2))  # the ranks' rule, for the launcher's OMP_NUM_THREADS
    assert launch_plan(_cfg(tmp_path, "engine.threads=3"), world_size=2)["threads"] == "3"
    with pytest.raises(ScaletrainError, match="shards/djangoo does not exist"):
        launch_plan(_cfg(tmp_path, "data.shards=shards/djangoo"), world_size=2)
    assert not (tmp_path / "shards").exists()


def test_launch_plan_command_prints_key_values(tmp_path, django_shards, capsys):
    rc = main(["--launch-plan", "--config", "small", "--world-size", "2", f"data.shards={django_shards}",
               f"train.out_dir={tmp_path / 'run'}", "engine.precision=fp32"])
    assert rc == 0
    plan = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert plan["prepare"] == "0" and plan["shards"] == str(django_shards) and plan["backend"] == "deepspeed"
    rc = main(["--launch-plan", "--config", "small", "data.shards=shards/djangoo-x"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("scaletrain: error: config key 'data.shards'")


def test_tracking_store_made_once_atomically(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from scaletrain.engine.preflight import init_tracking_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / ".mlruns.db.init-999999999").write_text("left by a killed build")
    db = init_tracking_store(_cfg(tmp_path), tmp_path)  # the default: the project's mlruns.db
    assert db == tmp_path / "mlruns.db" and db.is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mlruns")] == []
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    assert client.create_experiment("x") and client.get_experiment_by_name("x")
    mtime = db.stat().st_mtime_ns
    assert init_tracking_store(_cfg(tmp_path), tmp_path) is None and db.stat().st_mtime_ns == mtime  # kept as is
    assert init_tracking_store(_cfg(tmp_path / "b", "tracking.enabled=false"), tmp_path / "b") is None
    assert init_tracking_store(_cfg(tmp_path / "c", "tracking.uri=http://127.0.0.1:9"), tmp_path / "c") is None
    assert not (tmp_path / "b" / "mlruns.db").exists() and not (tmp_path / "c").exists()


def test_tracking_store_of_a_rank_that_was_first_is_kept(tmp_path, monkeypatch):
    import mlflow

    from scaletrain.engine.preflight import init_tracking_store

    db = tmp_path / "store.db"
    real = mlflow.MlflowClient

    class RankFirst(real):  # rank 0 creates the store while ours is being built
        def search_experiments(self, *a, **k):
            db.write_text("the rank's store")
            return super().search_experiments(*a, **k)

    monkeypatch.setattr(mlflow, "MlflowClient", RankFirst)
    assert init_tracking_store(_cfg(tmp_path, f"tracking.uri=sqlite:///{db}"), tmp_path) is None
    assert db.read_text() == "the rank's store" and len(list(tmp_path.iterdir())) == 1
