from __future__ import annotations

import json
import math

import pytest
import sacrebleu

from scaletrain.eval import scoring as M
from scaletrain.errors import ScaletrainError

DE_REF = ["Das ist ein kleines Haus .", "Der Hund bellt laut .", "Wir gehen heute nach Hause ."]
DE_HYP = ["Das ist ein kleines Haus .", "Der Hund bellt .", "Wir gehen nach Hause ."]
EN_REF = ["This is a small house .", "The dog barks loudly .", "We are going home today ."]
EN_HYP = ["This is a small house .", "A dog is barking loudly .", "Today we go home ."]
TH_REF = ["ฉันชอบกินข้าวผัด", "วันนี้อากาศดีมาก"]
TH_HYP = ["ฉันชอบกินข้าวต้ม", "วันนี้อากาศดี"]
ZH_REF = ["我喜欢吃炒饭。", "今天天气很好。"]
ZH_HYP = ["我喜欢吃米饭。", "今天天气好。"]


def records():
    rs = []
    rs += [("en", "de", h, r) for h, r in zip(DE_HYP, DE_REF)]
    rs += [("de", "en", h, r) for h, r in zip(EN_HYP, EN_REF)]
    rs += [("en", "th", h, r) for h, r in zip(TH_HYP, TH_REF)]
    rs += [("th", "en", h, r) for h, r in zip(EN_HYP[:2], EN_REF[:2])]
    rs += [("en", "zh", h, r) for h, r in zip(ZH_HYP, ZH_REF)]
    return rs


def test_tokenizer_choice_by_target_language():
    assert M.bleu_tokenizer_for("de") == "13a"
    assert M.bleu_tokenizer_for("en") == "13a"
    for zh in ("zh", "zh_CN", "zh-tw", "zhcn", "zhtw", "yue"):
        assert M.bleu_tokenizer_for(zh) == "zh"
    for c in ("ja", "ko", "th", "lo", "km", "my", "bo", "dz"):
        assert M.bleu_tokenizer_for(c) == "char"
    assert M.bleu_tokenizer_for("ko", {"ko": "13a"}) == "13a"
    with pytest.raises(ScaletrainError, match="tokenizer"):
        M.bleu_tokenizer_for("de", {"de": "moses"})


def test_scores_equal_sacrebleu_with_the_chosen_tokenizer():
    rep = M.score_directions(records())
    assert [d.direction for d in rep.directions] == ["de-en", "en-de", "en-th", "en-zh", "th-en"]
    cases = {("en", "de"): (DE_HYP, DE_REF, "13a"), ("de", "en"): (EN_HYP, EN_REF, "13a"),
             ("en", "th"): (TH_HYP, TH_REF, "char"), ("en", "zh"): (ZH_HYP, ZH_REF, "zh")}
    for (s, t), (h, r, tok) in cases.items():
        d = rep.direction(s, t)
        assert d.tokenize == tok
        assert d.bleu == pytest.approx(sacrebleu.corpus_bleu(h, [r], tokenize=tok).score)
        assert d.chrf == pytest.approx(sacrebleu.corpus_chrf(h, [r]).score)
        assert d.n_lines == len(h)
        assert f"tok:{tok}" in d.bleu_signature and "version:2.6" in d.bleu_signature
        assert "nc:6" in d.chrf_signature
    assert rep.direction("en", "de").bleu > 50  # sanity: a close hypothesis scores high
    # Thai has no spaces: 13a makes each sentence one token, so one wrong character gives BLEU 0;
    # the char tokenizer gives partial credit
    assert sacrebleu.corpus_bleu(TH_HYP, [TH_REF], tokenize="13a").score == 0.0
    assert rep.direction("en", "th").bleu > 40
    assert set(rep.signatures) == {"BLEU[13a]", "BLEU[char]", "BLEU[zh]", "chrF"}
    assert rep.sacrebleu_version == sacrebleu.__version__


def test_averages_over_all_pivot_sides_and_groups():
    rep = M.score_directions(records(), groups={"low": ["th"], "high": ["de", "zh"]})
    d = {x.direction: x for x in rep.directions}
    mean = lambda ks, f: sum(getattr(d[k], f) for k in ks) / len(ks)  # noqa: E731
    expect = {
        "all": ["de-en", "en-de", "en-th", "en-zh", "th-en"],
        "xx->en": ["de-en", "th-en"],
        "en->xx": ["en-de", "en-th", "en-zh"],
        "low": ["en-th", "th-en"],
        "low xx->en": ["th-en"],
        "low en->xx": ["en-th"],
        "high": ["de-en", "en-de", "en-zh"],
        "high xx->en": ["de-en"],
        "high en->xx": ["en-de", "en-zh"],
    }
    assert [a.name for a in rep.averages] == list(expect)
    for name, ks in expect.items():
        a = rep.average(name)
        assert a.n_directions == len(ks)
        assert a.bleu == pytest.approx(mean(ks, "bleu"))
        assert a.chrf == pytest.approx(mean(ks, "chrf"))
        assert a.n_lines == sum(d[k].n_lines for k in ks)


def test_other_pivot_and_non_pivot_directions():
    rs = [("de", "fr", "bonjour", "bonjour"), ("fr", "de", "hallo welt", "hallo"), ("en", "de", "x", "y")]
    rep = M.score_directions(rs, pivot="de", groups={"romance": ["fr"]})
    names = [a.name for a in rep.averages]
    assert names == ["all", "xx->de", "de->xx", "romance", "romance xx->de", "romance de->xx"]
    assert rep.average("xx->de").n_directions == 2  # fr-de and en-de
    assert rep.average("romance").n_directions == 2


def test_empty_hypotheses_and_invalid_utf8_are_counted_not_fatal():
    rs = [("en", "de", "", "Das ist ein Haus ."), ("en", "de", "   ", "Ein Hund ."),
          ("en", "de", "Das \ufffd Haus", "Das Haus", None), ("en", "de", "Haus", "Haus", 3),
          ("en", "fr", "", "Bonjour le monde ."), ("en", "fr", "", "Merci .")]
    rep = M.score_directions(rs)
    de, fr = rep.direction("en", "de"), rep.direction("en", "fr")
    assert (de.n_lines, de.n_empty, de.n_invalid, de.n_invalid_lines) == (4, 2, 4, 2)
    assert (fr.n_empty, fr.bleu, fr.chrf) == (2, 0.0, 0.0)
    assert 0 < de.chrf < 100 and de.bleu == pytest.approx(sacrebleu.corpus_bleu([r[2] for r in rs[:4]], [[r[3] for r in rs[:4]]]).score)


def test_bad_records_raise():
    with pytest.raises(ScaletrainError, match="no records"):
        M.score_directions([])
    with pytest.raises(ScaletrainError, match="record 1"):
        M.score_directions([("en", "de", "a", "b"), ("en", "de", "a")])
    with pytest.raises(ScaletrainError, match="hypothesis must be a str"):
        M.score_directions([("en", "de", None, "b")])
    with pytest.raises(ScaletrainError, match="group"):
        M.score_directions([("en", "de", "a", "b")], groups={"g": "de"})


def test_copy_source_baseline():
    src = [("en", "de", "Berlin , 2024", "Berlin , 2024"), ("en", "de", "The house", "Das Haus")]
    base = M.score_copy_baseline(src)
    d = base.direction("en", "de")
    assert d.bleu == pytest.approx(sacrebleu.corpus_bleu(["Berlin , 2024", "The house"],
                                                         [["Berlin , 2024", "Das Haus"]]).score)
    assert M.copy_source_records(src)[1].hypothesis == "The house"
    table = M.format_table(M.score_directions([("en", "de", "Das Haus", "Das Haus")]), baseline=base)
    assert "base BLEU" in table
    row = [l for l in table.splitlines() if l.startswith("en-de")][0]
    assert row.split()[-2:] == [f"{d.bleu:.2f}", f"{d.chrf:.2f}"]


def test_format_table_is_aligned_and_complete():
    rep = M.score_directions(records(), groups={"low": ["th"]})
    table = M.format_table(rep)
    lines = table.splitlines()
    header = lines[0]
    assert header.split() == ["direction", "tok", "lines", "BLEU", "chrF", "empty", "invalid"]
    rows = lines[2 : 2 + len(rep.directions)]
    bleu_end = header.index("BLEU") + len("BLEU")
    for r, d in zip(rows, rep.directions):
        assert r.startswith(d.direction)
        # right-aligned numeric column: the BLEU value ends where the header's BLEU ends
        assert r[:bleu_end].endswith(f"{d.bleu:.2f}")
    for a in rep.averages:
        assert any(l.startswith(a.name + " ") and f"{a.bleu:.2f}" in l for l in lines)
    for sig in rep.signatures.values():
        assert sig in table


def test_report_to_json_roundtrip():
    rep = M.score_directions(records(), groups={"empty": ["xx"]})
    js = M.report_to_json(rep)
    text = json.dumps(js, allow_nan=False)  # strict JSON: the empty group's NaN became null
    back = json.loads(text)
    assert back["sacrebleu_version"] == sacrebleu.__version__ and back["pivot"] == "en"
    assert [d["direction"] for d in back["directions"]] == [d.direction for d in rep.directions]
    assert back["directions"][0]["bleu"] == pytest.approx(rep.directions[0].bleu)
    empty = [a for a in back["averages"] if a["name"] == "empty"][0]
    assert empty["n_directions"] == 0 and empty["bleu"] is None
    assert math.isnan(rep.average("empty").bleu)


def test_write_report_json_atomic(tmp_path):
    rep = M.score_directions(records())
    p = tmp_path / "sub" / "scores.json"
    M.write_report_json(rep, p)
    assert json.loads(p.read_text())["averages"][0]["name"] == "all"
    assert [f.name for f in p.parent.iterdir()] == ["scores.json"]  # no temp file left behind


def test_report_to_metrics_keys_are_mlflow_safe_after_tracker_sanitising():
    from scaletrain.tracking import safe_key

    rep = M.score_directions(records(), groups={"low": ["th"], "none": ["xx"]})
    m = M.report_to_metrics(rep, prefix="test")
    assert m["test/bleu/en-de"] == rep.direction("en", "de").bleu
    assert m["test/chrf/th-en"] == rep.direction("th", "en").chrf
    assert m["test/bleu_avg/xx->en"] == rep.average("xx->en").bleu
    assert m["test/chrf_avg/low en->xx"] == rep.average("low en->xx").chrf
    assert "test/bleu_avg/none" not in m  # NaN averages are left out
    assert m["test/invalid_utf8"] == 0.0 and m["test/empty"] == 0.0
    keys = {safe_key(k) for k in m}
    assert len(keys) == len(m)  # sanitising does not merge two metrics
    assert "test/bleu_avg/low en-xx" in keys
