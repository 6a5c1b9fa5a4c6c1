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


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _through(writes, clock=None, flush_each=True):
    """``writes``: strings, or numbers = seconds to advance the clock."""
    raw = io.StringIO()
    clock = clock or Clock()
    lp = LineProgress(raw, interval=15, delay=5, clock=clock)
    for w in writes:
        if isinstance(w, (int, float)):
            clock.t += w
            continue
        lp.write(w)
        if flush_each:
            lp.flush()
    return raw.getvalue()


CLEAR = "\r" + " " * 40 + "\r"  # tqdm clearing its bar at close (leave=False)


def test_a_short_bar_leaves_nothing_and_the_next_output_starts_a_line():
    out = _through(["\rdecoding test:   0%|  | 0/276", 0.5, "\rdecoding test:  38%|# | 106/276", 1, CLEAR,
                    "checkpoint runs/x (step 3), split test\n"])
    assert out == "checkpoint runs/x (step 3), split test\n"


def test_a_long_bar_one_line_per_interval_and_its_last_state():
    w = ["header\n"]
    for i in range(60):  # a state per second for a minute
        w += [f"\rbar {i}s", 1]
    out = _through(w + [CLEAR, "after\n"])
    # states complete when the next redraw starts: the first at t=1 s; written once 5 s into the bar, then
    # at most every 15 s; the last state (59 s) when the bar is cleared
    assert out.splitlines() == ["header", "bar 5s", "bar 20s", "bar 35s", "bar 50s", "bar 59s", "after"]


def test_a_bar_closed_on_its_own_line_keeps_its_final_state():
    assert _through(["header\n", "\rbar 0%", "\rbar 100%", "\n", "after\n"]) == "header\nbar 100%\nafter\n"


def test_plain_text_and_partial_lines_pass_unchanged():
    assert _through(["a warning\n", "two\nlines\n"]) == "a warning\ntwo\nlines\n"
    assert _through(["no end yet", " still", "\n"], flush_each=False) == "no end yet still\n"
    # a partial line already flushed, then a bar: the partial line is ended first
    assert _through(["prompt", "\rbar 5%", "\n"]) == "prompt\nbar 5%\n"
