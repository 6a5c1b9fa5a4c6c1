"""CLI errors: one line naming the problem, exit code != 0, no traceback (unless --debug)."""
import pytest

from helpers import cli


def assert_one_line_error(p, *needles):
    assert p.returncode != 0
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_unknown_config_key():
    p = cli("train", "--config", "small", "optim.lrr=1")
    assert_one_line_error(p, "unknown config key 'optim.lrr'")


def test_unknown_language_code(tmp_path):
    p = cli("prepare", "--langs", "de,xx", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "xx")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_package_without_catalogs(tmp_path):
    p = cli("prepare", "--package", "pytest", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "pytest")
    p = cli("prepare", "--package", "no_such_pkg_zz", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "no_such_pkg_zz")


def test_existing_output_dir_refused_then_overwrite(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    p = cli("prepare", "--langs", "de", "--out", str(out))
    assert_one_line_error(p, str(out), "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"  # nothing already written is touched
    p = cli("prepare", "--langs", "de", "--out", str(out), "--overwrite")
    assert p.returncode == 0, p.stderr
    assert (out / "manifest.json").is_file()


def test_debug_shows_traceback():
    p = cli("--debug", "train", "--config", "small", "optim.lrr=1")
    assert p.returncode != 0 and "Traceback" in p.stderr and "ScaletrainError" in p.stderr


def test_missing_checkpoint(tmp_path):
    p = cli("evaluate", "--checkpoint", str(tmp_path))
    assert_one_line_error(p, "is not a checkpoint")


def test_help_lists_commands():
    p = cli("--help")
    assert p.returncode == 0
    for c in ("prepare", "train", "evaluate"):
        assert c in p.stdout
