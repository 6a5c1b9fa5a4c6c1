"""Under torchrun's elastic agent a configuration error (exit 2) is not retried: the restart prints the
attempt's line and exits 2 at once; a lost peer (exit 76) restarts normally (scaletrain.cli)."""
from __future__ import annotations

import json

import pytest

from scaletrain.cli import ELASTIC_EXIT_FILE, main

LINE = "unknown config key 'engine.grad_acum'; valid keys under 'engine': "


def _attempt(monkeypatch, root, n):
    err = root / "job_x" / f"attempt_{n}" / "0" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(n))
    return err.parent / ELASTIC_EXIT_FILE


def test_a_restart_after_a_configuration_error_refuses_with_the_same_line(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("SCALETRAIN_EXIT_FILE", raising=False)
    first = _attempt(monkeypatch, tmp_path, 0)
    assert main(["train", "--config", "small", "engine.grad_acum=2", "--print-config"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"scaletrain: error: {LINE}"), line
    assert json.loads(first.read_text()) == {"code": 2, "line": line[len("scaletrain: error: "):]}
    # attempt 1: a command that would now get further (valid) is refused with attempt 0's line, at once
    second = _attempt(monkeypatch, tmp_path, 1)
    assert main(["train", "--config", "small", "--print-config"]) == 2
    assert capsys.readouterr().err.strip() == line
    assert second.is_file()  # and attempt 2 refuses too
    _attempt(monkeypatch, tmp_path, 2)
    assert main(["train", "--config", "small", "--print-config"]) == 2


@pytest.mark.parametrize("previous", [{"code": 76, "line": "lost node1 (rank 1)"}, None])
def test_a_restart_after_a_lost_peer_or_without_a_record_runs(monkeypatch, tmp_path, capsys, previous):
    prev = _attempt(monkeypatch, tmp_path, 0)
    if previous is not None:
        prev.parent.mkdir(parents=True)
        prev.write_text(json.dumps(previous))
    _attempt(monkeypatch, tmp_path, 1)
    assert main(["train", "--config", "small", "--print-config"]) == 0
    assert "name: small" in capsys.readouterr().out


def test_outside_torchrun_nothing_is_recorded(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "small", "engine.grad_acum=2"]) == 2
    assert list(tmp_path.iterdir()) == []
