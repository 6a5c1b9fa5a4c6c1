"""`scaletrain compare` on two real short trainings of different variants in the default local store
(no server, no MLFLOW_TRACKING_URI): the differing config keys are found, every format parses, the PNG
has the expected size."""
from __future__ import annotations

import csv
import io
import json
import os

import pytest

pytestmark = pytest.mark.usefixtures("in_process_training")  # trains in this process (two_runs restores the env)

TINY = ["model.d_model=32", "model.n_heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "model.dropout=0.0", "model.max_positions=64", "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2",
        "train.valid_every=2", "train.valid_max_batches=1", "train.save_every=0", "train.max_steps=4"]


@pytest.fixture(scope="module")
def two_runs(django_shards, tmp_path_factory):
    from scaletrain.config import load_config
    from scaletrain.train import train

    proj = tmp_path_factory.mktemp("proj")
    saved_env = dict(os.environ)  # training in this process sets the launcher's variables
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.chdir(proj)
    try:
        runs = []
        for name, extra in (("tf", []), ("msc", ["model.arch=msc", "model.conv.kernels=[0,3]"])):
            cfg = load_config("small", [*TINY, *extra, f"data.shards={django_shards}",
                                        f"train.out_dir={proj / 'runs' / name}", f"tracking.run_name={name}"])
            runs.append(train(cfg))
        yield proj, runs
    finally:
        mp.undo()
        os.environ.clear()
        os.environ.update(saved_env)


def test_compare_run_dirs_table_formats_and_plot(two_runs, monkeypatch, capsys):
    from matplotlib.image import imread

    from scaletrain.cli import main

    proj, (a, b) = two_runs
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(proj)  # the default store ./mlruns.db
    png = proj / "cmp.png"
    assert main(["compare", a.out_dir, b.out_dir, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[0]
    assert "tf/transformer (" in header and "msc (" in header  # run name / arch tag
    row = next(line for line in lines if line.startswith("config: model.arch"))
    assert row.split()[2:] == ["transformer", "msc"]
    assert any(line.startswith("config: model.conv.kernels") for line in lines)
    assert not any(line.startswith(("config: train.max_steps", "config: train.out_dir")) for line in lines)
    for field in ("status", "train/loss final", "valid/nll best", "tokens/s (mean)", "wall time (s)"):
        assert any(line.startswith(field) for line in lines), field
    assert next(line for line in lines if line.startswith("status")).split()[1:] == ["FINISHED", "FINISHED"]
    img = imread(png)
    assert img.shape[:2] == (400, 1200)  # 12 x 4 inches at 100 dpi

    # by run id, as JSON
    assert main(["compare", a.run_id, b.run_id, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in data["runs"]] == [a.run_id, b.run_id]
    assert "model.arch" in data["differing_config"]
    assert data["rows"]["config: model.arch"] == {a.run_id: "transformer", b.run_id: "msc"}
    assert data["rows"]["valid/nll final"][a.run_id] == pytest.approx(a.valid_nll[-1][1], rel=1e-6)

    # by experiment, as CSV and Markdown
    assert main(["compare", "--experiment", "scaletrain", "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert set(rows[0][1:]) == {a.run_id, b.run_id}
    assert main(["compare", "--experiment", "scaletrain", "--filter", "tags.arch = 'msc'", "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("| field | msc (") and "config: model.arch" not in md  # one run: nothing differs


def test_compare_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from scaletrain.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(tmp_path)]) == 2
    assert "without tracking/run.json" in capsys.readouterr().err
    assert main(["compare"]) == 2
    assert "no runs" in capsys.readouterr().err
