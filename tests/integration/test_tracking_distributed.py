"""Run-id broadcast across two gloo ranks; the non-main rank never opens MLflow."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from mlflow import MlflowClient

from scaletrain import tracking as T
from scaletrain.tracking import tracker as tracker_module


def _worker(rank: int, world: int, tmp: str) -> None:
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        if rank != 0:
            def forbidden(uri):
                raise AssertionError("non-main rank opened MLflow")

            tracker_module.tracking_client = forbidden
        proj = Path(tmp) / "proj"
        tr = T.Tracker(None, "dist", "r", rank == 0, proj)
        started = tr.start(params={"world": world})
        assert (started is None) == (rank != 0)
        run_id = tr.sync_run_id()
        tr.log_metrics({"loss": float(rank + 1)}, step=rank)
        tr.end()
        # the plain function too: every rank gets rank 0's value
        got = T.broadcast_run_id("from-rank-0" if rank == 0 else "ignored", rank == 0)
        Path(tmp, f"out{rank}.json").write_text(json.dumps({"run_id": run_id, "got": got}))
    finally:
        dist.destroy_process_group()


def test_run_id_broadcast_two_ranks(tmp_path):
    # fork: the children reuse the imported torch/mlflow (spawn would re-import them, ~10 s on 2 cores)
    mp.start_processes(_worker, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    out = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert out[0]["run_id"] and out[0]["run_id"] == out[1]["run_id"]
    assert out[0]["got"] == out[1]["got"] == "from-rank-0"
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'proj' / 'mlruns.db'}")
    run = c.get_run(out[0]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params == {"world": "2"}
    assert [(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "loss")] == [(0, 1.0)]  # rank 0 only


def test_broadcast_without_process_group_is_identity():
    assert not dist.is_initialized()
    assert T.broadcast_run_id("abc", True) == "abc"
    assert T.broadcast_run_id(None, False) is None
