"""`scaletrain export --format ct2`: the briefly trained tiny model of test_export_hf converted with
CTranslate2's TransformersConverter translates real test lines with our greedy output. Skipped
only where the ctranslate2 wheel is missing (it is a dev dependency: CI runs it)."""
from __future__ import annotations

import subprocess
import sys

import pytest

ctranslate2 = pytest.importorskip("ctranslate2")

from helpers import ROOT  # noqa: E402
from scaletrain.data.batch import collate  # noqa: E402
from scaletrain.data.shards import read_split  # noqa: E402
from scaletrain.eval.generate import generate  # noqa: E402
from scaletrain.vocab import LANG_OFFSET, ByteVocab  # noqa: E402
from test_export_hf import trained  # noqa: E402,F401  (the module-scoped fixture)


@pytest.fixture(scope="module")
def ct2_dir(trained, tmp_path_factory):  # noqa: F811
    ck, _, _ = trained
    out = tmp_path_factory.mktemp("ct2") / "model"
    p = subprocess.run([sys.executable, "-m", "scaletrain", "export", str(ck), "--format", "ct2", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out


def test_ct2_greedy_equals_ours(trained, ct2_dir, django_shards):  # noqa: F811
    from transformers import AutoTokenizer

    from scaletrain.export import translate_ct2

    _, ours, langs = trained
    assert (ct2_dir / "model.bin").is_file() and (ct2_dir / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(ct2_dir))
    tr = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1)
    exs = [e for e in read_split(django_shards, "test") if len(e.src) < 60][:40]
    max_len = 30
    by: dict[tuple, list] = {}
    for e in exs:
        by.setdefault((e.src_lang, e.tgt_lang), []).append(e)
    n, short = 0, 0
    for (s, t), group in by.items():
        mine = generate(ours, collate(group).src, LANG_OFFSET + t, beam=1, max_len_a=0.0, max_len_b=max_len)
        theirs = translate_ct2(tr, tok, [e.src.decode() for e in group], langs[s], langs[t], max_len=max_len)
        assert theirs == mine, (langs[s], langs[t])
        n += len(group)
        short += sum(len(m) < max_len for m in mine)
    assert n == len(exs) and short > 0
    # and the text, decoded by the exported tokenizer, is ours
    assert tok.decode(theirs[0], skip_special_tokens=True) == ByteVocab(langs).decode(mine[0])
