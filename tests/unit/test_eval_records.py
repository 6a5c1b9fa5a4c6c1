"""Evaluation names say what was evaluated (split, lines, beam, lenpen, length limit, shards, step,
checkpoint), are stable, and tell the run's full evaluation from every other; a record directory is
swapped in whole and files keep the usual mode."""
from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest

from scaletrain.tracking.records import EvalSpec, checkpoint_label, shards_label


def _spec(**kw) -> EvalSpec:
    base = dict(split="test", lines=290, max_lines=0, full=True, beam=5, lenpen=1.0, max_len_a=4.0, max_len_b=200,
                recipe_max_len=True, recipe_decoding=True, step=1200, checkpoint="runs/x/checkpoints/step-0001200",
                checkpoint_label="", shards="shards/django", shards_label="")
    base.update(kw)
    return EvalSpec(**base)


def test_names_say_what_was_evaluated():
    full = _spec()
    assert full.name == "test.full.beam5.lp1.0.step1200" and full.primary and full.headline
    sub = _spec(lines=50, max_lines=5, full=False, beam=4, recipe_decoding=False)
    assert sub.name == "test.first5.beam4.lp1.0.step1200" and not sub.primary and not sub.headline
    assert _spec(lenpen=0.6, recipe_decoding=False).name == "test.full.beam5.lp0.6.step1200"
    other_len = _spec(max_len_a=1.5, max_len_b=10, recipe_max_len=False, recipe_decoding=False)
    assert other_len.name == "test.full.beam5.lp1.0.len1.5x+10.step1200" and not other_len.primary
    avg = _spec(checkpoint_label="avg5")
    assert avg.name == "test.full.beam5.lp1.0.step1200-avg5" and avg.name != full.name
    elsewhere = _spec(shards_label="flores-abc123")
    assert elsewhere.name == "test@flores-abc123.full.beam5.lp1.0.step1200" and not elsewhere.primary
    # the full validation evaluation does not take the trainer's own valid/... keys
    valid = _spec(split="valid")
    assert valid.primary and not valid.headline
    # every differing field differs in the name (or in the tags, for the paths)
    names = {s.name for s in (full, sub, other_len, avg, elsewhere, valid, _spec(step=600), _spec(beam=1))}
    assert len(names) == 8
    assert _spec().name == full.name  # stable


def test_tags_and_description():
    sub = _spec(lines=50, max_lines=5, full=False, beam=4, recipe_decoding=False)
    tags = sub.tags()
    assert tags["scaletrain.kind"] == "evaluation" and tags["scaletrain.eval.name"] == sub.name
    assert tags["scaletrain.eval.beam"] == "4" and tags["scaletrain.eval.max_lines"] == "5"
    assert tags["scaletrain.eval.primary"] == "false" and tags["scaletrain.eval.checkpoint"].endswith("step-0001200")
    d = sub.describe()
    assert d == "test, first 5 lines per direction (50), beam 4, lenpen 1.0, max_len 4x+200, step 1200"
    assert _spec().describe().startswith("test, all 290 lines, beam 5")
    assert EvalSpec(**{k: v for k, v in sub.to_json().items() if k in EvalSpec.__dataclass_fields__}) == sub


def test_checkpoint_and_shard_labels(tmp_path):
    run = tmp_path / "run" / "checkpoints"
    (run / "step-0000040").mkdir(parents=True)
    (run / "best").symlink_to(run / "step-0000040")
    assert checkpoint_label(run / "step-0000040") == "" and checkpoint_label(run / "best") == ""
    assert checkpoint_label(tmp_path / "run" / "avg 5") == "avg_5"
    assert checkpoint_label(tmp_path / "model.safetensors") == "model"
    sh = tmp_path / "shards" / "django"
    assert shards_label(str(sh), str(sh)) == ""
    assert shards_label(str(sh) + "/", str(sh)) == ""
    a, b = shards_label(str(tmp_path / "a" / "django"), str(sh)), shards_label(str(tmp_path / "b" / "django"), str(sh))
    assert a.startswith("django-") and b.startswith("django-") and a != b


def test_replace_dir_swaps_in_whole(tmp_path):
    from scaletrain.fileio import replace_dir

    old, new = tmp_path / "rec", tmp_path / ".rec.tmp"
    old.mkdir()
    (old / "a.txt").write_text("old")
    (old / "gone.txt").write_text("old")
    new.mkdir()
    (new / "a.txt").write_text("new")
    replace_dir(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]
    assert sorted(p.name for p in old.iterdir()) == ["a.txt"] and (old / "a.txt").read_text() == "new"
    if os.uname().sysname == "Linux":  # the kernel swaps the two names in one step
        from scaletrain.fileio import _exchange

        (tmp_path / "p").mkdir()
        (tmp_path / "q").write_text("q")
        assert _exchange(tmp_path / "p", tmp_path / "q")
        assert (tmp_path / "p").read_text() == "q" and (tmp_path / "q").is_dir()
    fresh = tmp_path / ".x"
    fresh.mkdir()
    replace_dir(fresh, tmp_path / "x")  # nothing there yet
    assert (tmp_path / "x").is_dir() and not fresh.exists()


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_default_mode_follows_the_umask(tmp_path, mask):
    from scaletrain.fileio import default_mode, umask

    old = os.umask(mask)
    try:
        assert umask() == mask
        d = tmp_path / "d"
        d.mkdir(mode=0o700)
        f = d / "model.safetensors"
        f.write_bytes(b"x")
        os.chmod(f, 0o600)
        default_mode(d)
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 | (0o666 & ~mask)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 | (0o777 & ~mask)
    finally:
        os.umask(old)


def test_exported_safetensors_and_checkpoint_files_are_world_readable(tmp_path):
    """safetensors' save_file writes 0600; the export and checkpoint paths give the mode open() gives."""
    import torch
    from safetensors.torch import save_file

    from scaletrain.checkpoint import save_safetensors, write_index

    old = os.umask(0o022)
    try:
        out = tmp_path / "export" / "model.safetensors"
        save_safetensors({"w": torch.zeros(2)}, out, {"format": "pt"})
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        ck = tmp_path / "step-1.partial"
        ck.mkdir()
        save_file({"w": torch.zeros(2)}, str(ck / "model.safetensors"))  # as Accelerate's save_state does
        assert stat.S_IMODE((ck / "model.safetensors").stat().st_mode) == 0o600
        write_index(ck)
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in ck.iterdir()} == {
            "model.safetensors": 0o644, "index.json": 0o644}
    finally:
        os.umask(old)


def test_write_report_json_mode(tmp_path):
    from scaletrain.eval.scoring import score_directions, write_report_json

    old = os.umask(0o022)
    try:
        p = tmp_path / "r.json"
        write_report_json(score_directions([("de", "en", "a b", "a b")]), p)
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
    finally:
        os.umask(old)


def test_spec_replace_keeps_name_rules():
    s = _spec()
    assert replace(s, step=None).name == "test.full.beam5.lp1.0.step_"
