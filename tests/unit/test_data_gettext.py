"""gettext reader: .mo parsing, cleaning rules, locale codes, splits, the bundled django catalogs."""
from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import pytest

from scaletrain.prepare import gettext as gt
from scaletrain.errors import ScaletrainError


def write_mo(path: Path, entries: dict[str, str], big_endian: bool = False) -> None:
    """Minimal msgfmt: keys may hold ``ctx\\x04id`` and ``id\\x00plural``; values ``s0\\x00s1``."""
    items = sorted((k.encode(), v.encode()) for k, v in entries.items())
    e = ">" if big_endian else "<"
    n = len(items)
    o_orig, o_trans = 28, 28 + 8 * n
    data_off = 28 + 16 * n
    origs, trans, blob = [], [], b""
    for k, _ in items:
        origs.append((len(k), data_off + len(blob)))
        blob += k + b"\x00"
    for _, v in items:
        trans.append((len(v), data_off + len(blob)))
        blob += v + b"\x00"
    head = struct.pack(e + "7I", 0x950412DE, 0, n, o_orig, o_trans, 0, 0)
    tables = b"".join(struct.pack(e + "2I", *x) for x in origs) + b"".join(struct.pack(e + "2I", *x) for x in trans)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + tables + blob)


HEADER = "Content-Type: text/plain; charset=UTF-8\n"


def test_read_mo_parses_context_and_plurals_in_both_byte_orders(tmp_path):
    entries = {"": HEADER, "Hello": "Hallo", "month\x04May": "Mai", "one apple\x00%d apples": "ein Apfel\x00%d Äpfel"}
    for be in (False, True):
        p = tmp_path / f"x{be}.mo"
        write_mo(p, entries, big_endian=be)
        got = {(e.context, e.msgid): e for e in gt.read_mo(p)}
        assert got[(None, "Hello")].msgstrs == ("Hallo",)
        assert got[("month", "May")].msgstrs == ("Mai",)
        pl = got[(None, "one apple")]
        assert pl.msgid_plural == "%d apples" and pl.msgstrs == ("ein Apfel", "%d Äpfel")


def test_read_mo_rejects_garbage_and_truncation_naming_the_file(tmp_path):
    bad = tmp_path / "bad.mo"
    bad.write_bytes(b"\x00" * 40)
    with pytest.raises(ScaletrainError, match="bad.mo.*magic"):
        gt.read_mo(bad)
    good = tmp_path / "good.mo"
    write_mo(good, {"": HEADER, "Hello": "Hallo"})
    trunc = tmp_path / "trunc.mo"
    trunc.write_bytes(good.read_bytes()[:-8])
    with pytest.raises(ScaletrainError, match="trunc.mo.*truncated"):
        gt.read_mo(trunc)


@pytest.mark.parametrize(
    "en, xx, reason",
    [
        ("Save", "Speichern", None),
        ("  Save ", "Speichern\t", None),
        ("Save", "", "empty"),
        ("Line one\nLine two", "Zeile eins\nZeile zwei", "multiline"),
        ("Delete %s", "%s löschen", "placeholder"),
        ("%(count)d items", "%(count)d Elemente", "placeholder"),
        ("Value %.2f", "Wert", "placeholder"),
        ("Hello {name}", "Hallo {name}", "placeholder"),
        ("Item {0}", "Element", "placeholder"),
        ("Item", "Element {}", "placeholder"),
        ("50% off", "50% Rabatt", None),
        ("<b>Bold</b>", "<b>Fett</b>", "markup"),
        ("Tom &amp; Jerry", "Tom &amp; Jerry", "markup"),
        ("Quote &#39;", "Zitat", "markup"),
        ("a < b", "a < b ist wahr", None),
        ("OK", "OK", "untranslated"),
        ("_File", "_Datei", "accel_stripped"),
    ],
)
def test_clean_pair_rules(en, xx, reason):
    assert gt.clean_pair(en, xx)[0] == reason


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("_File", "File"),
        ("Save _As", "Save As"),
        ("&File", "File"),
        ("E&xit", "Exit"),
        ("Q&A", "Q&A"),
        ("R&D department", "R&D department"),
        ("AT&T", "AT&T"),
        ("Tom & Jerry", "Tom & Jerry"),
        ("Tom && Jerry", "Tom & Jerry"),
        ("snake_case name", "snake_case name"),
        ("ファイル(_F)", "ファイル"),
        ("ファイル (&F)", "ファイル"),
        ("_one _two", "_one _two"),  # more than one candidate: not an access key
    ],
)
def test_strip_accelerators(raw, clean):
    assert gt.strip_accelerators(raw) == clean


def test_locale_codes_are_stable():
    assert gt.locale_to_code("de") == "de"
    assert gt.locale_to_code("zh_Hans") == "zh"
    assert gt.locale_to_code("zh_Hant") == "zh-hant"
    assert gt.locale_to_code("pt_BR") == "pt-br"
    assert gt.locale_to_code("sr_Latn") == "sr-latn"
    assert gt.locale_to_code("sr@latin") == "sr-latn"
    assert gt.locale_to_code("de_DE.UTF-8") == "de-de"


def test_split_is_stable_hash_and_fractions_hold():
    words = [f"string number {i}" for i in range(20000)]
    splits = Counter(gt.split_of(w, 0.05, 0.10, seed=0) for w in words)
    assert abs(splits["valid"] / 20000 - 0.05) < 0.01
    assert abs(splits["test"] / 20000 - 0.10) < 0.01
    # stable across calls (and interpreter runs: sha256, not hash()); seed changes the assignment
    assert [gt.split_of(w) for w in words[:200]] == [gt.split_of(w) for w in words[:200]]
    assert gt.split_of("Save", 0.05, 0.05, 0) == "train"  # a pinned value: guards against silent changes
    assert sum(gt.split_of(w, seed=0) != gt.split_of(w, seed=1) for w in words[:2000]) > 50
    with pytest.raises(ScaletrainError, match="valid_frac"):
        gt.check_fracs(0.6, 0.5)


def test_locale_dir_reader_counts_and_dedupes(tmp_path):
    root = tmp_path / "locale"
    write_mo(root / "de/LC_MESSAGES/app.mo", {"": HEADER, "Save": "Speichern", "Open": "Öffnen", "OK": "OK",
                                               "Delete %s": "%s löschen", "one\x00many": "eins\x00viele",
                                               "<i>x</i>": "<i>y</i>", "Two\nlines": "Zwei\nZeilen"})
    write_mo(root / "de/LC_MESSAGES/other.mo", {"": HEADER, "Save": "Speichern", "ctx\x04Save": "Sichern"})
    write_mo(root / "en_GB/LC_MESSAGES/app.mo", {"": HEADER, "Color": "Colour"})
    write_mo(root / "pt_BR/LC_MESSAGES/app.mo", {"": HEADER, "Save": "Salvar"})
    assert gt.available_langs(locale_dir=root) == ["de", "pt-br"]  # English variants are the pivot
    c = gt.read_gettext(langs=["de", "pt-br"], locale_dir=root)
    assert c.pairs["de"] == [("Open", "Öffnen"), ("Save", "Speichern"), ("Save", "Sichern")]
    assert c.pairs["pt-br"] == [("Save", "Salvar")]
    de = c.counters["de"]
    assert (de["entries"], de["kept"], de["untranslated"], de["placeholder"], de["plural"], de["markup"],
            de["multiline"], de["duplicate"]) == (9, 3, 1, 1, 1, 1, 1, 1)
    assert c.total_counters()["kept"] == 4
    assert c.source["type"] == "gettext" and c.source["catalogs"]["de"] == ["de/LC_MESSAGES/app.mo", "de/LC_MESSAGES/other.mo"]


def test_unknown_language_lists_available_codes():
    with pytest.raises(ScaletrainError, match=r"xx.*available codes:.*\bde\b.*\bja\b"):
        gt.read_gettext("django", ["de", "xx"])


def test_package_without_catalogs_or_not_installed():
    with pytest.raises(ScaletrainError, match="pytest.*no gettext catalogs"):
        gt.find_catalogs("pytest")
    with pytest.raises(ScaletrainError, match="not installed"):
        gt.find_catalogs("no_such_package_scaletrain_test")


def test_django_default_languages_give_clean_pairs():
    c = gt.read_gettext("django")
    assert c.langs == list(gt.DEFAULT_LANGS) and len(c.langs) >= 12
    for lang in c.langs:
        pairs = c.pairs[lang]
        assert len(pairs) >= 100, lang
        assert len(set(pairs)) == len(pairs)
        for en, xx in pairs:
            assert en == en.strip() and xx and en != xx and "\n" not in en + xx
            assert not gt.has_placeholder(en + " " + xx) and not gt.has_markup(en + " " + xx)
    # scripts really are there: one character of each expected Unicode block on the target side
    script_ranges = {"ru": (0x400, 0x4FF), "el": (0x370, 0x3FF), "ar": (0x600, 0x6FF), "he": (0x590, 0x5FF),
                     "hi": (0x900, 0x97F), "zh": (0x4E00, 0x9FFF), "ja": (0x3040, 0x30FF), "ko": (0xAC00, 0xD7AF),
                     "th": (0xE00, 0xE7F), "ka": (0x10A0, 0x10FF), "my": (0x1000, 0x109F)}
    for lang, (lo, hi) in script_ranges.items():
        assert any(lo <= ord(ch) <= hi for _, xx in c.pairs[lang] for ch in xx), lang
    tot = c.total_counters()
    assert tot["placeholder"] > 0 and tot["plural"] > 0 and tot["kept"] == sum(len(p) for p in c.pairs.values())
