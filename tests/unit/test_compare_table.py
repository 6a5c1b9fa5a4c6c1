"""compare(): differing config keys only, best by each metric's direction, evaluation scores per group,
every format; plot_comparison() with per-group bars."""
from __future__ import annotations

import csv
import io
import json

from scaletrain.compare import RunData, compare, plot_comparison


def _run(rid, arch, loss, bleu=None):
    metrics = {"train/loss": loss[-1], "valid/nll": 3.0, "train/steps": 4.0, "train/seconds": 12.5,
               "train/tokens_per_s": 100.0, "train/mfu": 0.25}
    if bleu is not None:
        metrics.update({"test/bleu/all": bleu, "test/bleu/xx2en": bleu + 1, "test/chrf/all": 2 * bleu})
    return RunData(rid, f"r-{arch}", "FINISHED", {"model.arch": arch, "optim.lr": "0.001", "train.out_dir": rid},
                   {}, metrics, {"train/loss": list(enumerate(loss)), "valid/nll": [(0, 4.0), (4, 3.0)],
                                 "train/tokens_per_s": [(2, 90.0), (4, 110.0)],
                                 "train/mfu": [(2, 0.2), (4, 0.3)]})


def test_rows_and_formats(tmp_path):
    a, b = _run("a" * 32, "transformer", [5.0, 4.0, 4.5], bleu=10.0), _run("b" * 32, "moce", [6.0, 5.0])
    cmp = compare([a, b])
    rows = dict(cmp.rows)
    assert cmp.differing == ["model.arch"]  # optim.lr is equal, train.out_dir differs by construction
    assert rows["config: model.arch"] == ["transformer", "moce"]
    assert rows["train/loss final"] == [4.5, 5.0] and rows["train/loss best"] == [4.0, 5.0]  # min for a loss
    assert rows["test/bleu/xx2en"] == [11.0, None] and rows["test/chrf/all"] == [20.0, None]
    assert rows["tokens/s (mean)"] == [100.0, 100.0] and rows["wall time (s)"] == [12.5, 12.5]
    assert rows["MFU (mean)"] == [0.25, 0.25]
    table = cmp.format("table")
    assert "r-transformer (aaaaaaaa)" in table.splitlines()[0] and "test/bleu/xx2en" in table
    data = json.loads(cmp.format("json"))
    assert data["rows"]["test/bleu/all"] == {a.run_id: 10.0, b.run_id: None}
    rows_csv = list(csv.reader(io.StringIO(cmp.format("csv"))))
    assert rows_csv[0] == ["field", a.run_id, b.run_id] and ["config: model.arch", "transformer", "moce"] in rows_csv
    md = cmp.format("md").splitlines()
    assert md[0].startswith("| field |") and md[1].startswith("|---|") and len({line.count("|") for line in md}) == 1
    png = plot_comparison([a, b], tmp_path / "c.png", width=9, height=3, dpi=50)
    from matplotlib.image import imread

    assert imread(png).shape[:2] == (150, 450)


def test_directions_are_told_from_groups():
    from scaletrain.compare import is_direction_key

    for k in ("test/bleu/de-en", "test/chrf/zh_Hans-en", "valid/bleu/en-ast"):
        assert is_direction_key(k), k
    for k in ("test/bleu/all", "test/chrf/utf8-2byte", "test/chrf/non-latin_xx2en", "test/bleu/latin", "train/loss"):
        assert not is_direction_key(k), k
