"""Which logged-model records each written checkpoint calls for (``scaletrain.tracking.checkpoint_models``):
a model per checkpoint with the validation metrics of its step, the deleted ones marked once, the best one
tagged by the trainer's rule, and nothing sent twice when the list is read back (a resumed job)."""
from __future__ import annotations

import json
import shutil

from scaletrain.tracking.checkpoint_models import CheckpointModels
from scaletrain.tracking.journal import checkpoint_list
from scaletrain.tracking.models import BEST_TAG, EXISTS_TAG, PATH_TAG, model_name


def _save(tmp_path, entries_file, step, cm, last):
    d = tmp_path / "checkpoints" / f"step-{step:07d}"
    d.mkdir(parents=True)
    data = checkpoint_list(entries_file if entries_file.is_file() else None, d, step, "run")
    new = data["checkpoints"][-1]
    recs = cm.records(data["checkpoints"], new, last)
    entries_file.write_text(json.dumps(data))
    return recs


def _tags(recs):
    return [(r["key"], r["v"]) for r in recs if r["t"] == "model_tags"]


def test_each_checkpoint_is_a_model_with_its_steps_validation_metrics_and_the_best_tagged(tmp_path):
    cm = CheckpointModels(prefix="small", params={"recipe": "small"}, dataset={"name": "django5", "digest": "abc"})
    f = tmp_path / "checkpoints.json"
    last = {"valid/nll": (2, 1000, 3.0), "train/loss": (2, 1001, 4.0), "valid/bleu/all": (1, 900, 1.0)}
    recs = _save(tmp_path, f, 2, cm, last)
    model, metrics, best = recs
    assert model == {"t": "model", "key": "step-0000002", "step": 2, "name": "small-step-2", "params": {"recipe": "small"},
                     "tags": {PATH_TAG: str((tmp_path / "checkpoints" / "step-0000002").resolve()), EXISTS_TAG: "true"}}
    # only the validation metrics logged at the checkpoint's own step, with their original timestamps
    assert metrics == {"t": "model_metrics", "key": "step-0000002", "s": 2, "m": [["valid/nll", 3.0, 1000]],
                       "dataset": {"name": "django5", "digest": "abc"}}
    assert best == {"t": "model_tags", "key": "step-0000002", "v": {BEST_TAG: "true"}}

    # a worse checkpoint: a model, no change of best; a better one: the best tag moves
    recs = _save(tmp_path, f, 4, cm, {**last, "valid/nll": (4, 2000, 3.5)})
    assert [r["t"] for r in recs] == ["model", "model_metrics"]
    recs = _save(tmp_path, f, 6, cm, {**last, "valid/nll": (6, 3000, 2.5)})
    assert _tags(recs) == [("step-0000002", {BEST_TAG: "false"}), ("step-0000006", {BEST_TAG: "true"})]
    # a checkpoint saved without validation at its step gets no metrics and is never best
    recs = _save(tmp_path, f, 8, cm, {**last, "valid/nll": (6, 3000, 2.5)})
    assert [r["t"] for r in recs] == ["model"]


def test_deleted_checkpoints_are_marked_once_and_a_kept_best_copy_is_named(tmp_path):
    best_dir = tmp_path / "checkpoints" / "best"
    cm = CheckpointModels(prefix="small", best_metric="valid/bleu/all", best_mode="max", best_dir=best_dir)
    f = tmp_path / "checkpoints.json"
    _save(tmp_path, f, 2, cm, {"valid/bleu/all": (2, 10, 5.0)})
    best_dir.mkdir()
    (best_dir / "best.json").write_text(json.dumps({"source": "step-0000002"}))  # the trainer kept step 2 as best
    _save(tmp_path, f, 4, cm, {"valid/bleu/all": (4, 20, 4.0)})
    shutil.rmtree(tmp_path / "checkpoints" / "step-0000002")  # keep_last prunes both older ones at step 6's save
    shutil.rmtree(tmp_path / "checkpoints" / "step-0000004")
    recs = _save(tmp_path, f, 6, cm, {"valid/bleu/all": (6, 30, 4.5)})
    assert _tags(recs) == [("step-0000002", {EXISTS_TAG: "true", PATH_TAG: str(best_dir)}),
                           ("step-0000004", {EXISTS_TAG: "false"})]
    # read back (a resumed job): nothing changed, nothing sent again but the new checkpoint's model
    recs = _save(tmp_path, f, 8, cm, {"valid/bleu/all": (8, 40, 4.6)})
    assert [r["t"] for r in recs] == ["model", "model_metrics"]
    # a new best replaces the copy: step 2's model is now gone, the best tag moves
    (best_dir / "best.json").write_text(json.dumps({"source": "step-0000010"}))
    recs = _save(tmp_path, f, 10, cm, {"valid/bleu/all": (10, 50, 6.0)})
    assert _tags(recs) == [("step-0000002", {EXISTS_TAG: "false"}), ("step-0000002", {BEST_TAG: "false"}),
                           ("step-0000010", {BEST_TAG: "true"})]


def test_min_delta_keeps_the_earlier_best_like_the_trainer():
    cm = CheckpointModels(prefix="x", best_metric="valid/nll", best_mode="min", min_delta=0.1)
    entries = [{"model": f"s{i}", "step": i, "metrics": {"valid/nll": v}} for i, v in ((1, 2.0), (2, 1.95), (3, 1.85))]
    assert cm._best(entries)["model"] == "s3"  # 1.95 is not 0.1 better than 2.0; 1.85 is
    entries[2]["metrics"]["valid/nll"] = 1.91
    assert cm._best(entries)["model"] == "s1"


def test_model_names_are_valid_mlflow_model_names():
    assert model_name("moce_d4.lid", 1200) == "moce_d4-lid-step-1200"
    assert model_name("a/b:c", 5, "hf") == "a-b-c-step-5-hf"
