"""compare(): differing config keys only, best by each metric's direction, evaluation scores per group with
the name of the evaluation they come from (the run's full one preferred), every format; plot_comparison()
with per-group bars, "not evaluated" drawn apart from zero, the legend outside the panels."""
from __future__ import annotations

import csv
import io
import json

import pytest

from scaletrain.tracking.compare import Evaluation, RunData, compare, plot_comparison


def _scores(split, bleu, chrf=None):
    chrf = 2 * bleu if chrf is None else chrf
    return {f"{split}/bleu/all": bleu, f"{split}/bleu/xx2en": bleu + 1, f"{split}/chrf/all": chrf,
            f"{split}/chrf/xx2en": chrf, f"{split}/chrf/latin_xx2en": chrf, f"{split}/bleu/de-en": bleu}


def _ev(name, bleu, *, primary=False, full=False, step=4, old=False, start=0, split="test", chrf=None):
    return Evaluation(name, split, primary, full, step, _scores(split, bleu, chrf), None if old else f"id-{name}",
                      start, old)


def _run(rid, arch, loss, evaluations=(), name=None):
    metrics = {"train/loss": loss[-1], "valid/nll": 3.0, "train/steps": 4.0, "train/seconds": 12.5,
               "train/tokens_per_s": 100.0, "train/mfu": 0.25, "baseline/unigram_valid_nll": 3.5}
    return RunData(rid, name or f"r-{arch}", "FINISHED",
                   {"model.arch": arch, "optim.lr": "0.001", "train.out_dir": rid, "data.tokenizer": "byte"},
                   {"arch": arch}, metrics, {"train/loss": list(enumerate(loss)), "valid/nll": [(0, 4.0), (4, 3.0)],
                                             "train/tokens_per_s": [(2, 90.0), (4, 110.0)],
                                             "train/mfu": [(2, 0.2), (4, 0.3)]},
                   evaluations=list(evaluations))


FULL = "test.full.beam5.lp1.0.step4"
SUBSET = "test.first5.beam4.lp1.0.step4"


def test_rows_and_formats(tmp_path):
    a = _run("a" * 32, "transformer", [5.0, 4.0, 4.5], [_ev(FULL, 10.0, primary=True, full=True)])
    b = _run("b" * 32, "moce", [6.0, 5.0])
    cmp = compare([a, b])
    rows = dict(cmp.rows)
    assert cmp.differing == ["model.arch"]  # optim.lr is equal, train.out_dir differs by construction
    assert rows["config: model.arch"] == ["transformer", "moce"]
    assert rows["train/loss final"] == [4.5, 5.0] and rows["train/loss best"] == [4.0, 5.0]  # min for a loss
    assert rows["evaluation (test)"] == [FULL, "not evaluated"]
    assert rows["test/bleu/xx2en"] == [11.0, None] and rows["test/chrf/all"] == [20.0, None]
    assert "test/bleu/de-en" not in rows and rows  # directions only with directions=True
    assert dict(compare([a, b], directions=True).rows)["test/bleu/de-en"] == [10.0, None]
    names = [n for n, _ in cmp.rows]
    assert names.index("evaluation (test)") < names.index("test/bleu/all") < names.index("test/bleu/xx2en")
    assert rows["tokens/s (mean)"] == [100.0, 100.0] and rows["wall time (s)"] == [12.5, 12.5]
    assert rows["MFU (mean)"] == [0.25, 0.25]
    table = cmp.format("table")
    assert "r-transformer (aaaaaaaa)" in table.splitlines()[0] and "test/bleu/xx2en" in table
    assert any(line.startswith("evaluation (test)") and line.split()[2:] == [FULL, "not", "evaluated"]
               for line in table.splitlines())
    data = json.loads(cmp.format("json"))
    assert data["rows"]["test/bleu/all"] == {a.run_id: 10.0, b.run_id: None}
    assert data["rows"]["evaluation (test)"] == {a.run_id: FULL, b.run_id: "not evaluated"}
    rows_csv = list(csv.reader(io.StringIO(cmp.format("csv"))))
    assert rows_csv[0] == ["field", a.run_id, b.run_id] and ["config: model.arch", "transformer", "moce"] in rows_csv
    md = cmp.format("md").splitlines()
    assert md[0].startswith("| field |") and md[1].startswith("|---|") and len({line.count("|") for line in md}) == 1
    png = plot_comparison([a, b], tmp_path / "c.png", width=9, height=3, dpi=50)
    from matplotlib.image import imread

    assert imread(png).shape[:2] == (150, 450)


def test_the_full_evaluation_is_preferred_and_each_number_is_named():
    subset_later = _ev("test.first5.beam4.lp1.0.step8", 30.0, step=8, start=9)
    other_beam_full = _ev("test.full.beam4.lp1.0.step4", 20.0, full=True, start=5)
    primary = _ev(FULL, 10.0, primary=True, full=True, start=1)
    old = _ev("test (old record, settings not recorded)", 40.0, old=True, start=0)
    run = _run("c" * 32, "transformer", [5.0], [subset_later, other_beam_full, primary, old])
    assert run.evaluation("test") is primary  # the run's full evaluation wins over newer and better ones
    run.evaluations.remove(primary)
    assert run.evaluation("test") is other_beam_full  # then a full split with other settings
    run.evaluations.remove(other_beam_full)
    assert run.evaluation("test") is old  # then what an evaluation before names left on the run
    run.evaluations.remove(old)
    assert run.evaluation("test") is subset_later
    assert run.evaluation("valid") is None
    # a later checkpoint's full evaluation wins over an earlier one's
    late = _ev("test.full.beam5.lp1.0.step8", 12.0, primary=True, full=True, step=8)
    run.evaluations = [primary, late]
    assert run.evaluation("test") is late
    # a glob picks by name
    run.evaluations = [primary, subset_later, other_beam_full]
    assert run.evaluation("test", "test.first5.*") is subset_later
    rows = dict(compare([run], evaluation="test.full.beam4.*").rows)
    assert rows["evaluation (test)"] == ["test.full.beam4.lp1.0.step4"] and rows["test/bleu/all"] == [20.0]
    rows = dict(compare([run], evaluation="nothing*").rows)
    assert rows["evaluation (test)"] == ["not evaluated"] and rows.get("test/bleu/all", [None]) == [None]


def test_splits_each_get_their_evaluation_row():
    run = _run("d" * 32, "transformer", [5.0], [_ev(FULL, 10.0, primary=True, full=True),
                                                _ev("valid.full.beam5.lp1.0.step4", 7.0, split="valid", full=True)])
    names = [n for n, _ in compare([run]).rows]
    assert names.index("evaluation (test)") < names.index("evaluation (valid)")
    assert dict(compare([run]).rows)["valid/bleu/all"] == [7.0]


def test_labels_use_the_run_name_with_its_short_id():
    new = _run("a1b2c3" + "0" * 26, "moce", [5.0], name="small · runs/small-20261126-1412 · a1b2c3")
    assert new.label == "small · runs/small-20261126-1412 · a1b2c3 [moce]"
    old = _run("e" * 32, "moce", [5.0], name="small")
    assert old.label == "small/moce (eeeeeeee)"


def test_directions_are_told_from_groups():
    from scaletrain.tracking.compare import is_direction_key

    for k in ("test/bleu/de-en", "test/chrf/zh_Hans-en", "valid/bleu/en-ast", "test/chrf/pt-br-en",
              "test/chrf/en-zh-hant", "test/bleu/sr-latn-en", "test/chrf/es-419-en"):
        assert is_direction_key(k), k
    for k in ("test/bleu/all", "test/chrf/utf8-2byte", "test/chrf/non-latin_xx2en", "test/bleu/latin", "train/loss",
              "test/chrf/low-resource", "test/chrf/Long", "test/chrf/OPUS4"):
        assert not is_direction_key(k), k


def test_parameter_counts_are_shown_even_when_equal():
    a, b = _run("a" * 32, "transformer", [3.0, 2.0]), _run("b" * 32, "moce", [3.0, 2.5])
    for r in (a, b):
        r.params["params.total"] = "5600000"
    rows = dict(compare([a, b]).rows)
    assert rows["parameters"] == [5600000, 5600000]
    b.params["params.total"] = "5703104"
    rows = dict(compare([a, b]).rows)
    assert "parameters" not in rows and rows["config: params.total"] == ["5600000", "5703104"]


def test_plot_reads_alone(tmp_path):
    """Axis labels with units, the unigram reference, bars named by their evaluation, "not evaluated"
    hatched and labelled (not a zero bar), a zero labelled "0", the legend outside the panels."""
    from PIL import Image

    evaluated = _run("a" * 32, "transformer", [5.0, 4.0], [_ev(FULL, 10.0, primary=True, full=True)])
    zero = _run("b" * 32, "msc", [5.0, 4.5], [_ev(SUBSET, 0.0, chrf=0.0)])
    missing = _run("c" * 32, "moce", [6.0, 5.0])
    png = plot_comparison([evaluated, zero, missing], tmp_path / "c.png")
    with Image.open(png) as im:
        assert im.size == (1200, 400)
        fig = json.loads(im.text["Description"])
    loss, nll, bars = fig["axes"]
    assert loss["xlabel"] == nll["xlabel"] == "update"
    assert "nats / target byte" in loss["ylabel"] and nll["ylabel"] == "validation NLL (nats / target byte)"
    assert bars["ylabel"].startswith("chrF") and bars["title"] == "test chrF per group"
    assert nll["lines"].count("target-unigram NLL (every run)") == 1  # the same shards: one line
    assert bars["texts"].count("not evaluated") == 2 and bars["texts"].count("0") == 2  # groups: all, xx2en
    assert all(not a["legend"] for a in fig["axes"])  # no legend inside a panel
    legend = fig["legend"]
    assert any(FULL in e and evaluated.label in e for e in legend) and any(SUBSET in e for e in legend)
    assert any(missing.label in e and "not evaluated" in e for e in legend)
    missing.metrics["baseline/unigram_valid_nll"] = 4.0  # other shards: one dashed line per run
    with Image.open(plot_comparison([evaluated, zero, missing], tmp_path / "d.png")) as im:
        nll = json.loads(im.text["Description"])["axes"][1]
    assert sum(label.startswith("target-unigram NLL (") for label in nll["lines"]) == 3
    from scaletrain.tracking.compare import _bar_groups

    assert _bar_groups([evaluated.evaluation("test")]) == ["all", "xx2en"]  # halves of groups are left out


def test_plot_marks_each_runs_copy_the_source_chrf(tmp_path):
    """Runs on different corpora: each chrF bar is marked at the copy-the-source chrF of that run's own test
    lines (per group where the evaluation logged it, else for "all"); the .plot.json beside the PNG holds
    the bars and marks drawn, the figure says what the marks are."""
    from scaletrain.tracking.compare import COPY_MARK, plot_data_path

    a = _run("a" * 32, "transformer", [5.0, 4.0], [_ev(FULL, 10.0, primary=True, full=True)])
    a.evaluations[0].copy_chrf = {"all": 31.5, "xx2en": 12.25}
    b = _run("b" * 32, "msc", [5.0, 4.5], [_ev(FULL, 12.0, primary=True, full=True)])
    b.evaluations[0].copy_chrf = {"all": 4.75}  # another corpus, a lower floor; logged for all lines only
    c = _run("c" * 32, "moce", [6.0, 5.0])  # not evaluated: no bar, no mark
    png = plot_comparison([a, b, c], tmp_path / "c.png")
    data = json.loads(plot_data_path(png).read_text())
    assert plot_data_path(png).name == "c.plot.json" and data["groups"] == ["all", "xx2en"]
    by_run = {r["run_id"]: r for r in data["bars"]}
    assert by_run[a.run_id]["chrf"] == {"all": 20.0, "xx2en": 20.0}
    assert by_run[a.run_id]["copy_source_chrf"] == {"all": 31.5, "xx2en": 12.25}
    assert by_run[b.run_id]["copy_source_chrf"] == {"all": 4.75, "xx2en": None}
    assert by_run[c.run_id]["evaluation"] is None and by_run[c.run_id]["copy_source_chrf"] == {"all": None, "xx2en": None}
    bars = data["figure"]["axes"][2]
    assert bars["lines"] == [COPY_MARK]  # one legend label for the three marks drawn
    assert any(COPY_MARK in e for e in data["figure"]["legend"])
    from PIL import Image

    with Image.open(png) as im:
        assert json.loads(im.text["Description"]) == data["figure"]
    # the marks are drawn at those heights across their bars
    import matplotlib

    matplotlib.use("Agg", force=True)
    from scaletrain.tracking.compare import _chrf_panel
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _chrf_panel(ax, [a, b, c], ["C0", "C1", "C2"], [r.evaluation("test") for r in (a, b, c)], ["all", "xx2en"])
    ticks = sorted((round(ln.get_xdata()[0], 3), ln.get_ydata()[0]) for ln in ax.get_lines())
    bw = 0.8 / 3
    assert ticks == [(round(-1.5 * bw, 3), 31.5), (round(-0.5 * bw, 3), 4.75), (round(1 - 1.5 * bw, 3), 12.25)]
    assert ax.get_ylim()[1] >= 31.5  # a mark above every bar still fits
    plt.close(fig)
    # no copy-the-source numbers at all: no marks and no legend entry for them
    for r in (a, b):
        r.evaluations[0].copy_chrf = {}
    data = json.loads(plot_data_path(plot_comparison([a, b], tmp_path / "d.png")).read_text())
    assert data["figure"]["axes"][2]["lines"] == [] and not any(COPY_MARK in e for e in data["figure"]["legend"])


def test_old_records_still_show(tmp_path, monkeypatch):
    """A run evaluated before evaluations were named: its own test/* metrics are shown, labelled as an old
    record with what its eval_test.json says; nested evaluation runs are not listed as runs."""
    from scaletrain import tracking as T
    from scaletrain.tracking.compare import load_runs
    from scaletrain.tracking.records import EvalSpec

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    tr = T.Tracker(uri, "old", "small", True, tmp_path)
    rid = tr.start()
    tr.log_metrics({"test/bleu/all": 12.6, "test/chrf/all": 30.0, "train/loss": 3.0}, step=1200)
    tr.log_dict({"split": "test", "lines": 140, "beam": 4, "lenpen": 1.0, "step": 1200}, "eval_test.json")
    tr.end()
    plain = T.Tracker(uri, "old", "small", True, tmp_path)
    rid2 = plain.start()
    plain.log_metrics({"train/loss": 3.0}, step=4)
    plain.end()
    (run,) = load_runs([rid], uri=uri)
    (ev,) = run.evaluations
    assert ev.old and ev.name == "test (old record: 140 lines, beam 4, lenpen 1.0, step 1200)" and ev.step == 1200
    rows = dict(compare([run]).rows)
    assert rows["evaluation (test)"] == [ev.name] and rows["test/bleu/all"] == [12.6]
    # a nested evaluation under the second run: listed under it, not as a run of the experiment
    spec = EvalSpec("test", 10, 0, True, 5, 1.0, 4.0, 200, True, True, 4, "ck", "", "sh", "")
    T.log_evaluation(uri, rid2, spec.name, tags=spec.tags(), metrics={"test/bleu/all": 5.0}, step=4,
                     headline=True, headline_tag="scaletrain.full_eval.test", headline_metric="test/bleu/all")
    runs = load_runs(experiment="old", uri=uri)
    assert sorted(r.run_id for r in runs) == sorted([rid, rid2])
    second = next(r for r in runs if r.run_id == rid2)
    assert [e.name for e in second.evaluations] == [spec.name] and second.evaluation("test").primary
    with pytest.raises(Exception):
        T.log_evaluation(uri, "0" * 32, spec.name, tags=spec.tags(), metrics={}, step=4)


def test_chosen_metrics_and_params_of_an_experiment(tmp_path, monkeypatch):
    """Any metric's final / min / max and chosen config keys, from a real store: MLflow-safe keys, "-" where a
    run has no value, an experiment that does not exist named in one line."""
    from scaletrain import tracking as T
    from scaletrain.errors import ScaletrainError
    from scaletrain.tracking.compare import load_runs

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, lr, losses in [("a", 1e-3, [3.0, 2.0, 2.5]), ("b", 5e-4, [4.0, 1.0, 1.2])]:
        tr = T.Tracker(None, "cmp", name, True, tmp_path)
        tr.start(params={"optim": {"lr": lr}, "seed": 1})
        for s, v in enumerate(losses):
            tr.log_metrics({"valid/loss": v, "bleu/xx->en": 10 * s}, step=s)
        tr.end()
    keys = ["valid/loss", "bleu/xx->en", "absent"]
    runs = load_runs(experiment="cmp", project_dir=tmp_path, metrics=keys)
    assert [r.run_name for r in runs] == ["b", "a"]  # newest first
    cmp = compare(runs, metrics=keys, params=["optim.lr", "seed"])
    names = [n for n, _ in cmp.rows]
    assert names[:2] == ["config: optim.lr", "config: seed"]  # seed: asked for, shown although the runs agree
    assert "config: seed" not in dict(compare(runs).rows)
    for k in ("valid/loss", "bleu/xx-en", "absent"):
        assert [f"{k} final", f"{k} min", f"{k} max"] == names[names.index(f"{k} final"):][:3]
    by = {r.run_name: {n: v for n, v in zip(names, vals)} for r, vals in zip(runs, zip(*(v for _, v in cmp.rows)))}
    assert by["a"]["valid/loss final"] == 2.5 and by["b"]["valid/loss final"] == 1.2
    assert by["a"]["config: optim.lr"] == "0.001" and by["a"]["absent final"] is None and by["b"]["bleu/xx-en final"] == 20
    assert {n: by[n]["valid/loss min"] for n in by} == {"a": 2.0, "b": 1.0}
    assert {n: by[n]["valid/loss max"] for n in by} == {"a": 3.0, "b": 4.0}
    assert by["b"]["absent min"] is None and by["b"]["absent max"] is None
    lines = cmp.format("table").splitlines()
    assert "b (" in lines[0] and "a (" in lines[0] and "2.5" in "\n".join(lines)
    assert next(line for line in lines if line.startswith("absent final")).split()[2:] == ["-", "-"]
    with pytest.raises(ScaletrainError, match="no experiment"):
        load_runs(experiment="nope", project_dir=tmp_path)
