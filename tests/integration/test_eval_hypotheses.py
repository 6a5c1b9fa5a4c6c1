"""`scaletrain evaluate` records each evaluation under a name that says what was evaluated: its hypotheses
under ``RUN/eval/<name>/`` (src/ref/hyp per direction, line-aligned; sacrebleu on those files reproduces the
reported BLEU/chrF), its plot and JSON there, and an MLflow run nested under the training run. A subset or
differently decoded evaluation after the run's full one leaves the full one's metrics, files and plot
byte for byte as they were; the same evaluation run again replaces only its own record; `compare` shows the
full one's numbers with its name."""
from __future__ import annotations

import pytest

import hashlib
import json
from pathlib import Path

import sacrebleu
from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=2",
        "eval.beam=1", "eval.max_len_a=0", "eval.max_len_b=12"]
FULL = "test.full.beam1.lp1.0.step2"
SUBSET = "test.first4.beam2.lp1.0.step2"


def _tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _nested(c, run_id, name, view=None):
    from mlflow.entities import ViewType

    exp = c.get_run(run_id).info.experiment_id
    return c.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}' and tags.`scaletrain.eval.name` = '{name}'",
                         run_view_type=view or ViewType.ACTIVE_ONLY)


@pytest.fixture(scope="module")
def trained(django_shards, tmp_path_factory):
    import os

    from scaletrain.config import load_config
    from scaletrain.train import train

    tmp = tmp_path_factory.mktemp("evalrec")
    mp = pytest.MonkeyPatch()
    saved = dict(os.environ)
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.chdir(tmp)
    try:
        uri = f"sqlite:///{tmp / 'store' / 'mlruns.db'}"
        res = train(load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp / 'run'}",
                                          f"tracking.uri={uri}"]))
        yield tmp, res, uri
    finally:
        mp.undo()
        os.environ.clear()
        os.environ.update(saved)


def _check_hypothesis_files(hyp_dir: Path, report: dict, django_shards, per_direction: int | None) -> None:
    from scaletrain.data.shards import read_split

    langs = json.loads((Path(django_shards) / "manifest.json").read_text())["languages"]
    expected: dict[str, list] = {}
    for ex in read_split(django_shards, "test"):
        rows = expected.setdefault(f"{langs[ex.src_lang]}-{langs[ex.tgt_lang]}", [])
        if per_direction is None or len(rows) < per_direction:
            rows.append(tuple(" ".join(x.decode("utf-8", errors="replace").splitlines()) for x in (ex.src, ex.tgt)))
    assert sorted(p.name for p in hyp_dir.glob("hyp.*.txt")) == sorted(f"hyp.{d}.txt" for d in expected)
    for d in report["directions"]:
        files = {k: (hyp_dir / f"{k}.{d['direction']}.txt").read_text(encoding="utf-8").split("\n")[:-1]
                 for k in ("src", "ref", "hyp")}
        assert list(zip(files["src"], files["ref"])) == expected[d["direction"]] and len(files["hyp"]) == d["n_lines"]
        bleu = sacrebleu.BLEU(tokenize=d["tokenize"]).corpus_score(files["hyp"], [files["ref"]]).score
        chrf = sacrebleu.CHRF().corpus_score(files["hyp"], [files["ref"]]).score
        assert abs(bleu - d["bleu"]) < 1e-6 and abs(chrf - d["chrf"]) < 1e-6, d["direction"]


def test_full_evaluation_is_recorded_under_its_name(trained, django_shards, monkeypatch, capsys):
    from PIL import Image

    from scaletrain.cli import main

    tmp, res, uri = trained
    monkeypatch.chdir(tmp)
    assert main(["evaluate", "--checkpoint", str(tmp / "run"), "--json", str(tmp / "eval.json")]) == 0
    out = capsys.readouterr().out
    rec = tmp / "run" / "eval" / FULL
    assert f"evaluation {FULL}: test, all " in out and f"{rec}/ (eval.json" in out
    assert f"nested under training run {res.run_id}" in out and "updated: this is its full test evaluation" in out
    data = json.loads((rec / "eval.json").read_text())
    assert data == json.loads((tmp / "eval.json").read_text()) and data["name"] == FULL
    assert data["evaluation"]["primary"] and data["evaluation"]["full"]
    _check_hypothesis_files(rec, data["model"], django_shards, None)
    drawn = json.loads((rec / "scores.json").read_text())
    assert drawn["figure"]["title"].startswith(f"evaluation {FULL}\ntest, all {data['lines']} lines, beam 1")
    with Image.open(rec / "scores.png") as im:
        im.verify()
    c = MlflowClient(uri)
    (nested,) = _nested(c, res.run_id, FULL)
    assert nested.info.run_name == FULL and nested.data.tags["scaletrain.eval.beam"] == "1"
    parent = c.get_run(res.run_id)
    assert parent.data.tags["scaletrain.full_eval.test"] == FULL
    all_bleu = next(a for a in data["model"]["averages"] if a["name"] == "all")["bleu"]
    assert parent.data.metrics["test/bleu/all"] == nested.data.metrics["test/bleu/all"] == all_bleu
    arts = {a.path for a in c.list_artifacts(nested.info.run_id)}
    assert {"eval.json", "scores.png", "scores.json", "hyp.de-en.txt"} <= arts


def test_a_subset_after_the_full_evaluation_replaces_nothing(trained, django_shards, monkeypatch, capsys):
    from mlflow.entities import ViewType

    from scaletrain.cli import main

    tmp, res, uri = trained
    monkeypatch.chdir(tmp)
    c = MlflowClient(uri)
    full_dir = tmp / "run" / "eval" / FULL
    before_files = _tree(full_dir)
    before_parent = c.get_run(res.run_id).data
    (full_run,) = _nested(c, res.run_id, FULL)
    assert main(["evaluate", "--checkpoint", str(tmp / "run"), "--max-lines", "4", "--beam", "2",
                 "--json", str(tmp / "eval.json")]) == 0
    out = capsys.readouterr().out
    assert f"evaluation {SUBSET}: test, first 4 lines per direction" in out
    assert "metrics left as they are: not its full test evaluation" in out
    assert f"{tmp / 'eval.json'} (replaced {FULL})" in out  # the --json file the user named: said, not silent
    # the full evaluation: files, plot, the training run's metrics and tags, its nested run, as they were
    assert _tree(full_dir) == before_files
    after_parent = c.get_run(res.run_id).data
    assert after_parent.metrics == before_parent.metrics and after_parent.tags == before_parent.tags
    (still,) = _nested(c, res.run_id, FULL)
    assert still.info.run_id == full_run.info.run_id and still.data.metrics == full_run.data.metrics
    # the subset: its own files and its own nested run, findable by name
    sub_dir = tmp / "run" / "eval" / SUBSET
    sub = json.loads((sub_dir / "eval.json").read_text())
    _check_hypothesis_files(sub_dir, sub["model"], django_shards, 4)
    (sub_run,) = _nested(c, res.run_id, SUBSET)
    assert sub_run.data.metrics["test/bleu/all"] == next(a for a in sub["model"]["averages"] if a["name"] == "all")["bleu"]
    assert sub_run.data.tags["scaletrain.eval.primary"] == "false"
    # the same evaluation again replaces its own record only
    assert main(["evaluate", "--checkpoint", str(tmp / "run"), "--max-lines", "4", "--beam", "2"]) == 0
    assert f"replaced the earlier record of this same evaluation: run {sub_run.info.run_id}" in capsys.readouterr().out
    (again,) = _nested(c, res.run_id, SUBSET)
    assert again.info.run_id != sub_run.info.run_id
    assert [r.info.run_id for r in _nested(c, res.run_id, SUBSET, ViewType.DELETED_ONLY)] == [sub_run.info.run_id]
    assert _tree(full_dir) == before_files and c.get_run(res.run_id).data.metrics == before_parent.metrics
    assert sorted(p.name for p in (tmp / "run" / "eval").iterdir()) == sorted([FULL, SUBSET])  # no leftovers
    # compare: the full evaluation's numbers, named
    assert main(["compare", str(tmp / "run"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows["evaluation (test)"] == {res.run_id: FULL}
    assert rows["test/bleu/all"] == {res.run_id: before_parent.metrics["test/bleu/all"]}
    assert main(["compare", str(tmp / "run"), "--format", "json", "--evaluation", "test.first4.*"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"]["evaluation (test)"] == {res.run_id: SUBSET}
