"""Merged gettext catalogs on real data: a few system catalogs (/usr/share/locale) and Django's, merged,
deduplicated across roots, capped, split by English string across roots, counted per root/language/rule."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from scaletrain.prepare import gettext as gt
from scaletrain.prepare import prepare_from_args, prepare_gettext
from scaletrain.prepare.args import add_prepare_arguments
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.errors import ScaletrainError

SYSTEM = Path("/usr/share/locale")
LANGS = ("de", "ru", "ja")
# small real catalogs: GNU sed and grep messages, XDG folder names, ISO 639-2 language names (which overlap
# Django's language names), and ISO 639-3 (excluded by default)
DOMAINS = ("sed", "grep", "xdg-user-dirs", "iso_639-2", "iso_639-3")


def _system_subset(root: Path, domains=DOMAINS, langs=LANGS) -> list[Path]:
    linked = []
    for lang in langs:
        for d in domains:
            src = SYSTEM / lang / "LC_MESSAGES" / f"{d}.mo"
            if src.is_file():
                dst = root / lang / "LC_MESSAGES" / src.name
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src.resolve())
                linked.append(dst)
    return linked


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """(system subset, a second tree holding German sed.mo again, django): three real roots."""
    if not gt.system_locale_dirs([str(SYSTEM)]):
        pytest.skip(f"{SYSTEM} holds no gettext catalogs on this machine")
    base = tmp_path_factory.mktemp("catalogs")
    linked = _system_subset(base / "system")
    if not any(p.stem == "sed" and p.parent.parent.name == "de" for p in linked) or len(linked) < 6:
        pytest.skip(f"{SYSTEM} lacks the catalogs this test reads ({', '.join(DOMAINS)} for {', '.join(LANGS)})")
    _system_subset(base / "mirror", ("sed",), ("de",))
    return [gt.locale_dir_root(base / "system", "system"), gt.locale_dir_root(base / "mirror"), gt.package_root("django")]


def test_merge_dedups_across_roots_and_counts_per_root_lang_rule(roots):
    c = gt.read_catalogs(roots, list(LANGS))
    system, mirror, django = (r.label for r in roots)
    # the mirror's German sed.mo is the system's: every pair it has is a duplicate, none kept
    m = c.per_source[mirror]
    assert m["catalogs"] == 1 and m["kept"] == 0 and m["duplicate"] > 20
    # Django's language names repeat ISO 639-2's: real cross-root duplicates, counted under Django
    assert c.per_source[django]["duplicate"] > 0 and c.per_source[django]["kept"] > 1000
    # ISO 639-3 is excluded by default, and counted
    assert c.per_source[system]["excluded_catalogs"] == len(LANGS)
    assert not any("iso_639-3" in p for v in c.source["catalogs"].values() for p in v)
    for lang in LANGS:
        pairs = c.pairs[lang]
        assert len(set(pairs)) == len(pairs) and c.counters[lang]["kept"] == len(pairs)
        assert c.counters[lang]["entries"] == sum(c.counters[lang][k] for k in ("kept", *gt.CLEAN_REASONS))
    # per-root counters add up to the per-language ones, rule by rule
    for k in ("entries", "kept", *gt.CLEAN_REASONS):
        assert sum(s[k] for s in c.per_source.values()) == sum(v[k] for v in c.counters.values()), k
    assert c.scripts == {"de": "Latin", "ru": "Cyrillic", "ja": "Kana"}
    # including the name lists adds ISO 639-3's names
    c_all = gt.read_catalogs(roots, ["de"], exclude_domains=())
    assert len(c_all.pairs["de"]) > len(c.pairs["de"]) + 1000


def test_caps_keep_the_first_english_strings_by_seeded_hash(roots):
    full = gt.read_catalogs(roots, list(LANGS))
    cap = 200
    c = gt.read_catalogs(roots, list(LANGS), max_per_lang=cap, seed=3)
    for lang in LANGS:
        assert len(c.pairs[lang]) == cap
        assert c.counters[lang]["over_cap"] == len(full.pairs[lang]) - cap and c.counters[lang]["kept"] == cap
        assert set(c.pairs[lang]) <= set(full.pairs[lang])
        keep = gt.cap_pairs(full.pairs[lang], cap, seed=3)
        assert c.pairs[lang] == [full.pairs[lang][i] for i in keep]  # catalog order kept
    assert sum(s["over_cap"] for s in c.per_source.values()) == sum(v["over_cap"] for v in c.counters.values())
    assert sum(s["kept"] for s in c.per_source.values()) == cap * len(LANGS)
    # the same English strings survive in several languages (ranked by the English side only)
    en = [{e for e, _ in c.pairs[l]} for l in LANGS]
    en_full = [{e for e, _ in full.pairs[l]} for l in LANGS]
    # of the capped German strings that Russian has at all, far more survive Russian's cap than an
    # independent draw of cap / n_ru would keep
    could = en[0] & en_full[1]
    assert len(could) > 50 and len(en[0] & en[1]) / len(could) > 2 * cap / len(full.pairs["ru"])
    assert gt.read_catalogs(roots, list(LANGS), max_per_lang=cap, seed=4).pairs["de"] != c.pairs["de"]


def test_langs_choice_default_all_and_unknown(roots):
    c = gt.read_catalogs(roots, None, default_langs=("ja", "de", "xx-none"))
    assert c.langs == ["ja", "de"] and any("xx-none" in n for n in c.notes)
    everything = gt.read_catalogs(roots[2:], ["all"])
    assert len(everything.langs) > 80 and "en" not in everything.langs
    with pytest.raises(ScaletrainError, match=r"xx-none.*available codes:.*\bde\b"):
        gt.read_catalogs(roots, ["de", "xx-none"])
    with pytest.raises(ScaletrainError, match="pivot"):
        gt.read_catalogs(roots, ["en"])


def test_shards_keep_every_english_string_in_one_split_across_roots(roots, tmp_path):
    m = prepare_gettext(langs=list(LANGS), out=tmp_path / "s", roots=roots, valid_frac=0.1, test_frac=0.1,
                        progress=False)
    keys: dict[str, set] = {}
    for split in ("train", "valid", "test"):
        en = set()
        for ex in read_split(tmp_path / "s", split):
            side = ex.src if ex.src_lang == 0 else ex.tgt
            en.add(gt.split_key(side.decode("utf-8")))
        keys[split] = en
    assert all(keys.values())
    assert not (keys["train"] & keys["test"]) and not (keys["train"] & keys["valid"]) and not (keys["valid"] & keys["test"])
    # near-identical spellings share a key, so they cannot straddle splits
    assert gt.split_key("Open…") == gt.split_key("open:") == gt.split_key("  OPEN ") == "open"
    assert gt.split_key("...") == "..."
    cl = m.cleaning
    assert set(cl["per_source"]) == {r.label for r in roots} and cl["scripts"]["ru"] == "Cyrillic"
    assert sum(sum(v.values()) for v in cl["pairs_per_split"].values()) == cl["total"]["kept"]
    assert [r["label"] for r in m.source["roots"]] == [r.label for r in roots]


def test_prepare_cli_merges_roots_caps_and_prints_counters(roots, tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_prepare_arguments(p)
    out = tmp_path / "cli"
    args = p.parse_args(["--no-progress", "--locale-dir", str(roots[0].root), "--locale-dir", str(roots[1].root),
                         "--package", "django", "--langs", "de,ru,ja", "--max-per-lang", "150", "--max-bytes", "60",
                         "--out", str(out)])
    assert prepare_from_args(args) == 0
    text = capsys.readouterr().out
    assert f"source dir:{roots[0].root}:" in text and "source package:django:" in text
    assert "3 languages (+ en) in 3 scripts" in text and "over_cap" in text and "too_long" in text
    m = load_manifest(out)
    assert m.languages == ["en", "de", "ru", "ja"]
    assert all(v["kept"] == 150 for v in m.cleaning["per_lang"].values())
    for split in ("train", "valid", "test"):
        assert all(len(ex.src) <= 60 and len(ex.tgt) <= 60 for ex in read_split(out, split))
    json.dumps(m.cleaning)  # the counters are plain JSON


def test_resolve_roots_sets_and_defaults(monkeypatch, tmp_path):
    roots, notes = gt.resolve_roots()
    assert [r.label for r in roots] == ["package:django"] and not notes
    roots, notes = gt.resolve_roots(["packages"])
    assert "package:django" in [r.label for r in roots]
    monkeypatch.setattr(gt, "SYSTEM_LOCALE_DIRS", (str(tmp_path / "none"),))
    monkeypatch.setattr(gt, "system_locale_dirs", lambda candidates=(): [])
    roots, notes = gt.resolve_roots(["system", "packages"], packages=["django"])
    assert [r.label for r in roots] == ["package:django"] and any("system" in n for n in notes)
    with pytest.raises(ScaletrainError, match="--catalogs: unknown set"):
        gt.resolve_roots(["sytem"])
    with pytest.raises(ScaletrainError, match="does not exist"):
        gt.resolve_roots(locale_dirs=[tmp_path / "missing"])


@pytest.mark.parametrize("text, script", [("Datei öffnen", "Latin"), ("Открыть файл", "Cyrillic"),
                                          ("ファイルを開く", "Kana"), ("打开文件", "Han"), ("파일 열기", "Hangul"),
                                          ("פתח קובץ Git", "Hebrew"), ("ფაილის გახსნა", "Georgian"),
                                          ("123 !?", "none")])
def test_dominant_script(text, script):
    assert gt.dominant_script([text]) == script


def test_locale_script_modifiers_keep_scripts_apart():
    assert gt.locale_to_code("sr@ijekavianlatin") == "sr-latn"
    assert gt.locale_to_code("uz@cyrillic") == "uz-cyrl"
    assert gt.locale_to_code("be@latin") == "be-latn"
    assert gt.locale_to_code("ca@valencia") == "ca"
    assert gt.locale_to_code("zh_CN") == gt.locale_to_code("zh_Hans") == "zh"
