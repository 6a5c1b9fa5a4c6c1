"""Each plot can be read without its file name: titles say what is shown (for an evaluation: split, lines,
beam, lenpen, step), axes carry units, the learning curves have the target-unigram reference line and a
training-time axis without the gap between the sessions of a resumed job. Checked on the structure the
plots save (JSON beside the PNG, and the PNG's own text chunks), not on pixels."""
from __future__ import annotations

import json

from PIL import Image

from scaletrain.tracking.plots import plot_eval_scores, plot_learning_curves


def _journal(run, records):
    d = run / "tracking"
    d.mkdir(parents=True)
    (d / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_learning_curves_labels_reference_and_training_time(tmp_path):
    day = 24 * 3600 * 1000
    _journal(tmp_path, [
        {"t": "start", "run_id": "r", "ts": 0},
        {"t": "params", "v": {"data.tokenizer": "byte"}},
        {"t": "m", "s": 0, "ts": 1000, "v": {"baseline/unigram_valid_nll": 4.25}},
        {"t": "m", "s": 0, "ts": 2000, "v": {"valid/nll": 5.5}},
        {"t": "m", "s": 2, "ts": 60000, "v": {"train/loss": 5.0}},
        {"t": "end", "status": "KILLED", "ts": 61000},
        {"t": "resume", "run_id": "r", "ts": day},  # a day later
        {"t": "m", "s": 4, "ts": day + 120000, "v": {"train/loss": 4.0, "valid/nll": 4.5}},
    ])
    png = plot_learning_curves(tmp_path, title="small · runs/x · a1b2c3")
    data = json.loads(png.with_suffix(".json").read_text())
    assert [p["minutes"] for p in data["train/loss"]] == [1.0, 3.0]  # 1 min + 2 min of the second session
    assert data["baseline/unigram_valid_nll"] == 4.25
    fig = data["figure"]
    assert fig["title"] == "learning curves: small · runs/x · a1b2c3"
    by_title = {a["title"]: a for a in fig["axes"]}
    assert set(by_title) == {"training loss by update", "training loss by training time",
                             "validation NLL by update", "validation NLL by training time"}
    for t, a in by_title.items():
        assert a["xlabel"] == ("update" if t.endswith("update") else "training time (min)")
        assert a["ylabel"].endswith("nats / target byte)")
        assert "target-unigram NLL, validation split (4.25)" in a["lines"]  # the reference, on every panel
    assert by_title["validation NLL by update"]["ylabel"] == "validation NLL (nats / target byte)"
    with Image.open(png) as im:
        assert im.size == (1000, 700) and json.loads(im.text["Description"]) == fig
        assert im.text["Title"] == fig["title"]


def test_learning_curves_subword_unit_and_no_baseline(tmp_path):
    _journal(tmp_path, [{"t": "start", "run_id": "r", "ts": 0}, {"t": "params", "v": {"data.tokenizer": "spm"}},
                        {"t": "m", "s": 2, "ts": 60000, "v": {"train/loss": 5.0}}])
    fig = json.loads(plot_learning_curves(tmp_path).with_suffix(".json").read_text())["figure"]
    assert all(a["ylabel"].endswith("nats / target subword)") for a in fig["axes"])
    assert not any(line.startswith("target-unigram") for a in fig["axes"] for line in a["lines"])
    assert "not logged" in fig["axes"][2]["texts"]  # no validation NLL: said, not an empty panel


def _eval_json(with_spec=True, bleu_all=12.5):
    avg = [{"name": "all", "bleu": bleu_all, "chrf": 40.0}, {"name": "xx->en", "bleu": 0.0, "chrf": 0.0},
           {"name": "en->xx", "bleu": None, "chrf": None}]
    out = {"split": "test", "step": 1200, "lines": 140, "beam": 4, "lenpen": 1.0, "checkpoint": "ck",
           "model": {"averages": avg}, "copy_baseline": {"averages": avg}}
    if with_spec:
        out["name"] = "test.first5.beam4.lp1.0.step1200"
        out["evaluation"] = {"description": "test, first 5 lines per direction (140), beam 4, lenpen 1.0, "
                                            "max_len 4x+200, step 1200"}
    return out


def test_eval_scores_title_names_what_was_evaluated(tmp_path):
    png = plot_eval_scores(_eval_json(), tmp_path / "scores.png")
    data = json.loads(png.with_suffix(".json").read_text())
    fig = data["figure"]
    assert fig["title"] == ("evaluation test.first5.beam4.lp1.0.step1200\n"
                            "test, first 5 lines per direction (140), beam 4, lenpen 1.0, max_len 4x+200, step 1200\n"
                            "checkpoint ck")
    bleu, chrf = fig["axes"]
    assert bleu["ylabel"] == "BLEU (sacreBLEU, 0-100)" and chrf["ylabel"] == "chrF (sacreBLEU, 0-100)"
    assert chrf["xlabel"] == "language group (mean over its directions)"
    assert bleu["bars"] == ["model", "copy the source (baseline)"]
    assert "12.5" in bleu["texts"] and "0.0" in bleu["texts"] and "no score" in bleu["texts"]  # zero != missing
    assert fig["legend"] == ["model", "copy the source (baseline)"] and not bleu["legend"]  # outside the bars
    # an older evaluation JSON (no name) still gets a title that says what it was
    old = plot_eval_scores(_eval_json(with_spec=False), tmp_path / "old.png")
    title = json.loads(old.with_suffix(".json").read_text())["figure"]["title"]
    assert title == "test, 140 lines, beam 4, lenpen 1.0, step 1200\ncheckpoint ck"
