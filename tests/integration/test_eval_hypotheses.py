"""`scaletrain evaluate` writes every hypothesis under the run directory (src/ref/hyp per direction,
line-aligned) and sacrebleu run on those files reproduces the reported BLEU/chrF; the files are logged to
the training run."""
from __future__ import annotations

import pytest

import json
from pathlib import Path

import sacrebleu
from mlflow import MlflowClient

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=2",
        "eval.max_len_a=0", "eval.max_len_b=12"]


def test_evaluate_writes_hypothesis_files_that_reproduce_the_scores(django_shards, tmp_path, monkeypatch, capsys):
    from scaletrain.cli import main
    from scaletrain.config import load_config
    from scaletrain.data.shards import read_split
    from scaletrain.train import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'store' / 'mlruns.db'}"
    res = train(load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={run}",
                                      f"tracking.uri={uri}"]))
    assert main(["evaluate", "--checkpoint", str(run), "--max-lines", "4", "--beam", "1",
                 "--json", str(tmp_path / "eval.json")]) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "eval.json").read_text())["model"]
    hyp_dir = run / "eval" / "test"
    langs = json.loads((Path(django_shards) / "manifest.json").read_text())["languages"]
    expected_lines: dict[str, int] = {}
    expected_text: dict[str, list] = {}
    for ex in read_split(django_shards, "test"):
        d = f"{langs[ex.src_lang]}-{langs[ex.tgt_lang]}"
        expected_lines[d] = min(expected_lines.get(d, 0) + 1, 4)
        if len(expected_text.setdefault(d, [])) < 4:
            expected_text[d].append(tuple(" ".join(x.decode("utf-8", errors="replace").splitlines())
                                          for x in (ex.src, ex.tgt)))
    assert sorted(p.name for p in hyp_dir.glob("hyp.*.txt")) == sorted(f"hyp.{d}.txt" for d in expected_lines)
    for d in report["directions"]:
        name = f"{d['src_lang']}-{d['tgt_lang']}"
        files = {k: (hyp_dir / f"{k}.{name}.txt").read_text(encoding="utf-8").split("\n")[:-1]
                 for k in ("src", "ref", "hyp")}
        assert len(files["src"]) == len(files["ref"]) == len(files["hyp"]) == expected_lines[name] == d["n_lines"]
        assert list(zip(files["src"], files["ref"])) == expected_text[name]  # the split's lines, in order
        bleu = sacrebleu.BLEU(tokenize=d["tokenize"]).corpus_score(files["hyp"], [files["ref"]]).score
        chrf = sacrebleu.CHRF().corpus_score(files["hyp"], [files["ref"]]).score
        assert abs(bleu - d["bleu"]) < 1e-6 and abs(chrf - d["chrf"]) < 1e-6, name
    c = MlflowClient(uri)
    logged = {a.path for a in c.list_artifacts(res.run_id, "eval/test")}
    assert f"eval/test/hyp.{report['directions'][0]['src_lang']}-{report['directions'][0]['tgt_lang']}.txt" in logged
    assert "eval_test.json" in {a.path for a in c.list_artifacts(res.run_id)}
    # the per-group BLEU/chrF bars: a PNG, and beside it the numbers drawn, which are the logged ones
    from PIL import Image

    png = run / "plots" / "eval_test_scores.png"
    with Image.open(png) as im:
        im.verify()
    drawn = json.loads(png.with_suffix(".json").read_text())
    logged = c.get_run(res.run_id).data.metrics
    groups = [a["name"] for a in json.loads((tmp_path / "eval.json").read_text())["model"]["averages"]]
    assert drawn["groups"] == groups and "all" in groups and len(groups) > 1
    for g, bleu, chrf in zip(groups, drawn["bleu"], drawn["chrf"]):
        key = g.replace("->", "2").replace(" ", "_")
        assert (bleu, chrf) == (logged[f"test/bleu/{key}"], logged[f"test/chrf/{key}"]), g
    assert drawn["copy_baseline"]["bleu"][groups.index("all")] == logged["test/copy_baseline/bleu"]
    assert {"plots/eval_test_scores.png", "plots/eval_test_scores.json"} <= {
        a.path for a in c.list_artifacts(res.run_id, "plots")}
