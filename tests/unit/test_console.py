"""Console set-up (scaletrain.console): library noise filtered unless verbose, progress redraws as lines."""
from __future__ import annotations

import io
import logging

import pytest

from scaletrain import console
from scaletrain.console import LibraryFilter, LineProgress, quiet_libraries


def _record(name, level, msg):
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_library_filter_keeps_facts_drops_noise():
    f = LibraryFilter()
    assert not f.filter(_record("DeepSpeed", logging.INFO, "cmd = python -u -m deepspeed.launcher.launch"))
    assert not f.filter(_record("DeepSpeed", logging.WARNING, "Setting accelerator to CPU. If you have GPU ..."))
    assert not f.filter(_record("matplotlib.font_manager", logging.WARNING,
                                "Matplotlib is building the font cache; this may take a moment."))
    assert f.filter(_record("DeepSpeed", logging.WARNING, "overflow detected, skipping step"))
    assert f.filter(_record("DeepSpeed", logging.ERROR, "Setting accelerator to CPU"))  # errors always pass


@pytest.fixture
def restore_loggers():
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in console.LIBRARY_LOGGERS}
    yield
    for n, (level, filters) in saved.items():
        lg = logging.getLogger(n)
        lg.setLevel(level)
        lg.filters[:] = filters


def test_quiet_then_verbose(restore_loggers, monkeypatch):
    monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    quiet_libraries(verbose=False)
    ds = logging.getLogger("DeepSpeed")
    # DeepSpeed's own logger set-up (at import) resets the level but keeps our filter
    ds.setLevel(logging.INFO)
    assert not any(f.filter(_record("DeepSpeed", logging.INFO, "x")) for f in ds.filters)
    import os

    assert os.environ["MLFLOW_LOGGING_LEVEL"] == "WARNING"
    quiet_libraries(verbose=True)
    assert not any(isinstance(f, LibraryFilter) for f in ds.filters)


def test_verbose_from_env():
    assert console.verbose_from_env({"SCALETRAIN_VERBOSE": "1"})
    assert not console.verbose_from_env({"SCALETRAIN_VERBOSE": "0"})
    assert not console.verbose_from_env({})


def _through(writes, flush_each=True):
    raw = io.StringIO()
    lp = LineProgress(raw)
    for w in writes:
        lp.write(w)
        if flush_each:
            lp.flush()
    return raw.getvalue()


def test_progress_redraws_become_lines_and_the_next_output_starts_a_line():
    # tqdm into a file: redraws separated by \r, a clearing redraw of spaces at close (leave=False)
    out = _through(["decoding test:   0%|  | 0/276", "\rdecoding test:  38%|# | 106/276",
                    "\r" + " " * 40 + "\r", "checkpoint runs/x (step 3), split test\n"])
    assert out.splitlines() == ["decoding test:   0%|  | 0/276", "decoding test:  38%|# | 106/276",
                                "checkpoint runs/x (step 3), split test"]


def test_progress_first_draw_and_leave_true():
    out = _through(["header\n", "\rbar 0%", "\rbar 100%", "\n", "after\n"])
    assert out == "header\nbar 0%\nbar 100%\nafter\n"


def test_plain_text_and_partial_lines_pass_unchanged():
    assert _through(["a warning\n", "two\nlines\n"]) == "a warning\ntwo\nlines\n"
    assert _through(["no end yet", " still", "\n"], flush_each=False) == "no end yet still\n"
    # a partial line already flushed, then a redraw: the partial line is ended first
    assert _through(["prompt", "\rbar 5%", "\n"]) == "prompt\nbar 5%\n"
