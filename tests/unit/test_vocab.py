import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from scaletrain.errors import ScaletrainError
from scaletrain.vocab import BOS, BYTE_OFFSET, EOS, LANG_OFFSET, PAD, UNK, ByteVocab

V = ByteVocab(["en", "de", "zh", "ar"])

# arbitrary Unicode incl. emoji, NUL, combining marks, RTL text; surrogates cannot be UTF-8 encoded
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
special = st.sampled_from(["\x00", "e\u0301", "\u05e9\u05dc\u05d5\u05dd", "\u0645\u0631\u062d\u0628\u0627",
                           "\U0001F469\u200d\U0001F4BB", "\u202e", "\ufeff", "\ufffd", "a\u0308\u0304"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(texts, special), max_size=4).map("".join))
def test_round_trip_any_unicode(s):
    ids = V.encode(s)
    assert ids[-1] == EOS
    assert len(ids) == len(s.encode("utf-8")) + 1
    assert all(BYTE_OFFSET <= i < LANG_OFFSET for i in ids[:-1])
    r = V.decode_counting(ids)
    assert r.text == s and r.invalid == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_invalid_utf8_replaced_and_counted(raw):
    ids = [b + BYTE_OFFSET for b in raw]
    r = V.decode_counting(ids)
    assert r.text == raw.decode("utf-8", errors="replace")
    try:
        raw.decode("utf-8")
        assert r.invalid == 0
    except UnicodeDecodeError:
        assert r.invalid >= 1
    # every malformed sequence becomes exactly one U+FFFD (none present in valid input here)
    assert r.invalid == r.text.count("\ufffd") - raw.decode("utf-8", "ignore").count("\ufffd")


def test_invalid_counts_exact():
    bad = b"ok\xff\xfe" + "é".encode()[:1] + b"!"
    r = V.decode_counting([b + BYTE_OFFSET for b in bad])
    assert r.text == "ok\ufffd\ufffd\ufffd!" and r.invalid == 3


def test_layout_and_tags():
    assert (PAD, BOS, EOS, UNK) == (0, 1, 2, 3)
    assert V.encode("A", add_eos=False) == [ord("A") + 4]
    assert V.lang_id("en") == 260 and V.lang_id("ar") == 263 and V.size == 264
    assert V.token_str(V.lang_id("zh")) == "__zh__"
    # decoding stops at EOS and drops specials and language tags
    ids = [V.lang_id("de"), BOS] + V.encode("hi") + V.encode("tail")
    assert V.decode(ids) == "hi"
    with pytest.raises(ScaletrainError, match="unknown language code 'xx'"):
        V.lang_id("xx")
    with pytest.raises(ScaletrainError, match="duplicate"):
        ByteVocab(["en", "en"])


def test_bytes_to_ids_vectorised():
    raw = "naïve 日本".encode()
    assert ByteVocab.bytes_to_ids(raw).tolist() == V.encode("naïve 日本", add_eos=False)
    assert ByteVocab.bytes_to_ids(np.frombuffer(raw, np.uint8)).dtype == np.int64
