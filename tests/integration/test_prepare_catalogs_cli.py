"""`scaletrain prepare --catalogs system,packages` end to end on real catalogs, small (--max-per-lang).

What the catalog sets find depends on the machine: /usr/share/locale may hold thousands of catalogs or none
(a bare CI image). The assertions hold on either: the ``packages`` set always finds Django (the project
installs it), every catalog of Django for the chosen languages is read, each source's counters add up, the
cap is reached, and the splits hold every kept pair. The command runs twice: as a user runs it (a subprocess,
the machine's own system catalogs), and in-process with the system directories made empty, as on a machine
that has only what the project installs, where Django alone must fill every language."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from helpers import ROOT

LANGS = ("de", "ru", "ja")
CAP = 40
ARGS = ["prepare", "--catalogs", "system,packages", "--langs", ",".join(LANGS), "--max-per-lang", str(CAP),
        "--valid-frac", "0.1", "--test-frac", "0.1", "--no-progress"]
REASONS = ("plural", "empty", "multiline", "placeholder", "markup", "too_long", "untranslated", "duplicate",
           "over_cap")


def django_catalogs() -> int:
    """Django's catalogs of LANGS, counted from its installed files."""
    django = Path(importlib.util.find_spec("django").origin).parent
    return sum(len(list(django.glob(f"**/locale/{lang}/LC_MESSAGES/*.mo"))) for lang in LANGS)


def check_shards(out: Path, text: str) -> dict:
    """What holds on any machine; returns the manifest's per-source counters."""
    from scaletrain.data.shards import load_manifest, read_split

    m = load_manifest(out)
    assert m.languages == ["en", *LANGS]
    roots = [r["label"] for r in m.source["roots"]]
    assert roots[-1] == "package:django" and m.source["roots"][-1]["version"] == version("django")
    per_source = m.cleaning["per_source"]
    assert list(per_source) == roots
    for label, c in per_source.items():  # every entry read is kept or dropped for one reason
        assert c["entries"] == c["kept"] + sum(c[r] for r in REASONS), label
        assert f"source {label}: {c['catalogs']} catalogs" in text
    dj = per_source["package:django"]
    assert dj["catalogs"] == django_catalogs() > 0 and dj["entries"] > 1000
    assert dj["kept"] + dj["duplicate"] + dj["over_cap"] > 3 * CAP  # Django's pairs were merged, not skipped
    assert all(v["kept"] == CAP for v in m.cleaning["per_lang"].values())  # the cap is reached for each
    assert sum(c["kept"] for c in per_source.values()) == m.cleaning["total"]["kept"] == len(LANGS) * CAP
    counts = {split: len(read_split(out, split)) for split in ("train", "valid", "test")}  # both directions
    assert sum(counts.values()) == 2 * len(LANGS) * CAP and min(counts.values()) > 0, counts
    assert {s: 2 * sum(v.values()) for s, v in m.cleaning["pairs_per_split"].items()} == counts
    return per_source


def test_prepare_catalogs_system_packages_on_this_machine(tmp_path):
    from scaletrain.prepare import gettext as gt

    out = tmp_path / "shards"
    p = subprocess.run([sys.executable, "-m", "scaletrain", *ARGS, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    per_source = check_shards(out, p.stdout)
    system = gt.system_locale_dirs()
    assert [label for label in per_source if label.startswith("system:")] == [f"system:{d}" for d in system]
    if not system:  # a bare machine: the set says it found nothing, and Django fills every language
        assert "catalog set 'system': no catalogs" in p.stdout + p.stderr
        assert per_source["package:django"]["kept"] == len(LANGS) * CAP


def test_prepare_catalogs_with_only_the_projects_packages(tmp_path, monkeypatch, capsys):
    """No system catalogs at all (an empty /usr/share/locale): the command still builds the corpus, from the
    packages set alone, and says the system set found nothing."""
    from scaletrain.cli import main
    from scaletrain.prepare import gettext as gt

    empty = tmp_path / "locale"
    empty.mkdir()
    monkeypatch.setattr(gt, "SYSTEM_LOCALE_DIRS", (str(empty),))
    monkeypatch.setattr(gt, "system_locale_dirs", lambda candidates=(str(empty),): [])
    out = tmp_path / "shards"
    assert main([*ARGS, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert f"catalog set 'system': no catalogs in {empty}" in text
    per_source = check_shards(out, text)
    assert list(per_source) == ["package:django"] and per_source["package:django"]["kept"] == len(LANGS) * CAP
    assert json.loads((out / "manifest.json").read_text())["cleaning"]["notes"]
