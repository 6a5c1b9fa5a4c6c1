"""MLflow's UI, rendered in a real browser, shows a scaletrain run as MLflow users expect: the run page has the
corpus dataset (with its split), the checkpoints' logged models, the source (command and git commit), who
ran it, its description and the nested evaluation; the experiment opens on its training runs, with the
Dataset, Source and Models columns filled.

A tiny job trains into a SQLite store (what ``mlflow ui --backend-store-uri sqlite:///mlruns.db`` opens after
``./launch.sh``) while ``mlflow server`` starts on 127.0.0.1 on that store; headless Chromium (Debian's
``chromium`` package) loads the pages. The driver is Chromium itself: ``--dump-dom`` with a
``--virtual-time-budget`` prints the DOM after the React app has made its REST calls and rendered (virtual
time does not advance while requests are pending), and ``--screenshot`` in the same run draws that page. No
WebDriver (selenium, chromedriver) or DevTools client is needed: nothing is clicked, the pages are reached by
their URLs, and the assertions read the rendered text. With ``SCALETRAIN_BROWSER_SCREENSHOTS=DIR`` the
screenshots of the run page and of the runs table are also written to DIR (``docs/tracking_*.png`` were made
so).

Chromium missing: skipped with the reason, unless ``SCALETRAIN_REQUIRE_BROWSER=1`` (CI sets it), where that
is a failure. ``SCALETRAIN_CHROMIUM`` names another Chromium or Chrome binary.
"""
from __future__ import annotations

import getpass
import hashlib
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient
from tracking_server import Server  # tests/integration/tracking_server.py

from helpers import ROOT, tiny_model

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
JOB = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "train.log_every=2", "train.valid_every=2",
       "train.valid_max_batches=1", "train.save_every=2", "train.keep_last=1", "train.max_steps=4",
       "tracking.system_metrics=false", "tracking.experiment=browser"]


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium binary; skip (or, with SCALETRAIN_REQUIRE_BROWSER=1, fail) when there is none. Session
    scope, listed first: decided before the corpus fixture is built."""
    names = [os.environ.get("SCALETRAIN_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"]
    exe = next((shutil.which(n) for n in names if n and shutil.which(n)), None)
    if exe is None:
        why = ("no Chromium found (install Debian's `chromium` package, or set SCALETRAIN_CHROMIUM): this test "
               "renders MLflow's UI in headless Chromium")
        if os.environ.get("SCALETRAIN_REQUIRE_BROWSER") == "1":
            pytest.fail(why + "; SCALETRAIN_REQUIRE_BROWSER=1 requires it")
        pytest.skip(why)
    return exe


class _Text(HTMLParser):
    """The text a page shows: the DOM's text outside <script>, <style> and <noscript>, whitespace collapsed."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style", "noscript")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style", "noscript") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def render(exe: str, url: str, tmp: Path, screenshot: Path | None = None, size: tuple[int, int] = (1400, 1250)) -> str:
    """The text of ``url`` once MLflow's UI has rendered it (a fresh browser profile each time); with
    ``screenshot``, the page drawn in a window of ``size`` (width, height) too."""
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    cmd = [exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=30000",
           *([f"--screenshot={screenshot}"] if screenshot else []), "--dump-dom", url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    p = _Text()
    p.feed(r.stdout)
    return re.sub(r"\s+", " ", " ".join(p.parts)).strip()


def _train_and_evaluate(shards, out: Path, uri: str):
    """The tiny job (4 steps, validation and a checkpoint every 2, keep_last=1) and an evaluation of its last
    checkpoint on the first line of each direction of the test split; returns the job's result."""
    from scaletrain.cli import main
    from scaletrain.config import load_config
    from scaletrain.train import train

    res = train(load_config("small", [*JOB, f"data.shards={shards}", f"train.out_dir={out}", f"tracking.uri={uri}"]))
    assert main(["evaluate", "--checkpoint", str(out), "--max-lines", "1", "--beam", "1", "--max-len-b", "8"]) == 0
    return res


def test_run_page_and_experiment_in_a_real_browser(chromium, django_shards, tmp_path, monkeypatch):
    exe = chromium
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "mlruns.db"
    uri = f"sqlite:///{store}"
    MlflowClient(uri).search_experiments()  # the schema, before the server and the job open the store
    server = Server(tmp_path / "server", backend=uri)
    server.launch()  # boots while the job trains
    try:
        res = _train_and_evaluate(django_shards, tmp_path / "run", uri)
        server.wait()
        c = MlflowClient(server.uri)
        run = c.get_run(res.run_id)
        eid, tags = run.info.experiment_id, run.data.tags
        assert c.get_experiment(eid).tags["mlflow.experimentKind"] == "custom_model_development"  # over REST
        (child,) = c.search_runs([eid], filter_string=f"tags.mlflow.parentRunId = '{res.run_id}'")
        # the dataset the pages must show: the corpus, named and digested from its manifest
        ds = SimpleNamespace(name=tags["corpus"], digest=hashlib.sha256(
            (Path(django_shards) / "manifest.json").read_bytes()).hexdigest()[:12])
        # the links scaletrain prints: MLflow 3.17's UI opens an experiment on the view of its GenAI / Model
        # training switch (GenAI unless the browser remembers otherwise); workflowType picks the training one
        view = "?workflowType=machine_learning"
        shots = {"run_page": tmp_path / "run_page.png", "runs_table": tmp_path / "runs_table.png"}
        page = render(exe, f"{server.uri}/#/experiments/{eid}/runs/{res.run_id}{view}", tmp_path, shots["run_page"])
        runs = render(exe, f"{server.uri}/#/experiments/{eid}{view}", tmp_path, shots["runs_table"], (1920, 400))
    finally:
        server.stop()
    _check_run_page(page, run, child, ds)
    _check_experiment_page(runs, run, ds)
    from PIL import Image

    assert Image.open(shots["run_page"]).size == (1400, 1250)  # drawn at the window's size
    if os.environ.get("SCALETRAIN_BROWSER_SCREENSHOTS"):  # docs/: small PNGs (a 64-colour palette)
        for name, png in shots.items():
            img = Image.open(png).convert("RGB").quantize(colors=64)
            img.save(Path(os.environ["SCALETRAIN_BROWSER_SCREENSHOTS"]) / f"tracking_{name}.png", optimize=True)


def _check_run_page(page: str, run, child, ds) -> None:
    tags = run.data.tags
    expect = [
        run.info.run_name,
        f"Created by {getpass.getuser()}",
        f"Datasets {ds.name} ({ds.digest}) train",  # the corpus, read as its train split
        f"Child runs {child.info.run_name}",  # the nested evaluation
        "Description Training of the small recipe (transformer",  # the note, as markdown
        "Logged models (2) Model attributes Type Step Model name Status Created Registered models Dataset",
    ]
    missing = [e for e in expect if e not in page]
    assert not missing, (missing, page)
    for step in (2, 4):  # a model per checkpoint (keep_last deleted step 2's), at its step, validated on the corpus
        row = rf"Output {step} #\w+ small-step-{step} Ready .{{0,40}} - {re.escape(ds.name)} \(#{ds.digest}\)"
        assert re.search(row, page), (row, page)
    # the command, with the branch and commit beside it: the commit this checkout is at (a missing tag fails)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = tags.get("mlflow.source.git.commit", "")
    assert commit == head and len(head) == 40, (commit, head)
    assert re.search(rf"Source scaletrain train (\S+ )?{commit[:7]}\b", page), page


def _check_experiment_page(runs: str, run, ds) -> None:
    # the training runs, with their Dataset, Source and Models columns filled; not the GenAI overview
    assert runs.startswith(f"Runs - Experiment {run.info.experiment_id}"), runs[:2000]
    assert "Run Name Created Dataset Duration Source Models" in runs, runs[:2000]
    row = runs[runs.index(run.info.run_name):][:400]
    assert re.search(rf"{re.escape(ds.name)} \({ds.digest}\) train .* scaletrain train small-step-\d", row), row
    assert "Token Usage" not in runs and "Traces 0" not in runs
