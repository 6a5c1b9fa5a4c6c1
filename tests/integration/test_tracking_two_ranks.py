"""2 ranks under the ``deepspeed`` launcher against a real ``mlflow server``: one job = one run, params are
the resolved config, tags and artifacts are there, metrics come from rank 0 only (each step once)."""
from __future__ import annotations

import json

import pytest
from helpers import deepspeed_cmd, launcher_env, run
from mlflow import MlflowClient
from tracking_server import Server  # tests/integration/tracking_server.py

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=4", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=8",
        "train.max_minutes=0"]


@pytest.mark.slow
def test_two_ranks_one_run_on_a_real_server(django_shards, tmp_path):
    from scaletrain.config import flatten, load_config, to_dict
    from scaletrain.engine.precision import apply_precision

    server = Server(tmp_path / "server")
    server.start()
    try:
        out = tmp_path / "run"
        out.mkdir()
        overrides = [f"data.shards={django_shards}", f"train.out_dir={out}", *TINY, f"tracking.uri={server.uri}",
                     "tracking.experiment=two-ranks"]
        env = launcher_env(tmp_path)
        env.pop("MLFLOW_TRACKING_URI")
        run(deepspeed_cmd(2, "tests/integration/dist_driver.py", str(out), "small", *overrides), env)
        res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
        assert res[0]["run_id"] and res[0]["run_id"] == res[1]["run_id"]  # broadcast from rank 0
        c = MlflowClient(server.uri)
        exp = c.get_experiment_by_name("two-ranks")
        runs = c.search_runs([exp.experiment_id])
        assert [r.info.run_id for r in runs] == [res[0]["run_id"]]  # one job, one run
        r = runs[0]
        assert r.info.status == "FINISHED"
        resolved = load_config("small", overrides)
        apply_precision(resolved)  # what every rank runs: engine.precision auto resolved (pinned in conftest)
        cfg = flatten(to_dict(resolved))
        assert {k: r.data.params.get(k) for k in cfg} == {k: str(v) for k, v in cfg.items()}
        assert r.data.params["world_size"] == "2"
        tags = r.data.tags
        assert tags["world_size"] == "2" and tags["nodes"] == "1" and tags["engine"] == "deepspeed"
        assert tags["zero_stage"] == "0" and tags["arch"] == "transformer" and tags["corpus.manifest_sha256"]
        arts = {a.path for a in c.list_artifacts(r.info.run_id)}
        assert {"config.yaml", "engine", "data", "plots"} <= arts
        loss = c.get_metric_history(r.info.run_id, "train/loss")
        assert sorted(m.step for m in loss) == [2, 4, 6, 8]  # rank 0 only: each logged step once
        assert sorted(m.step for m in c.get_metric_history(r.info.run_id, "valid/nll")) == [0, 4, 8]
        assert [p.name for p in (out / "tracking").iterdir() if p.suffix == ".jsonl"] == ["journal.jsonl"]
    finally:
        server.stop()
