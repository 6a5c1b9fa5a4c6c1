"""data stats / data verify."""
from __future__ import annotations

import numpy as np
import pytest

from scaletrain.data.batch import Example
from scaletrain.data.inspect_shards import data_stats, format_stats, verify
from scaletrain.data.shards import Manifest, SplitWriter, prepare_out_dir, write_manifest
from scaletrain.errors import ScaletrainError

LANGS = ["en", "de"]


def make(tmp_path):
    exs = [Example(1, 0, b"d" * (i % 10 + 1), b"e" * 3) for i in range(60)] + \
          [Example(0, 1, b"e" * 5, b"d" * (i + 1)) for i in range(40)]
    out = prepare_out_dir(tmp_path, overwrite=True)
    w = SplitWriter(out, "train", LANGS, shard_size=40, block_size=16)
    w.add_all(exs)
    write_manifest(out, Manifest(LANGS, {"train": w.close()}, cleaning={"total": {"kept": 100, "placeholder": 7}}))
    return exs


def test_stats_counts_bytes_percentiles(tmp_path):
    make(tmp_path)
    st = data_stats(tmp_path)
    tr = st["splits"]["train"]
    assert (tr["pairs"], tr["shards"], tr["blocks"]) == (100, 3, 3 + 3 + 2)
    de_en, en_de = tr["directions"]["de-en"], tr["directions"]["en-de"]
    assert de_en["pairs"] == 60 and de_en["src_bytes"] == sum(i % 10 + 1 for i in range(60)) and de_en["tgt_bytes"] == 180
    assert de_en["src_len_pct"]["p100"] == 10 and de_en["src_len_pct"]["p50"] == int(np.percentile([i % 10 + 1 for i in range(60)], 50))
    assert en_de["tgt_len_pct"] == {"p50": 20, "p90": 36, "p99": 39, "p100": 40}
    text = format_stats(st)
    assert "de-en" in text and "placeholder 7" in text and "100 pairs" in text


def test_verify_clean_then_corrupt_and_truncated(tmp_path):
    make(tmp_path)
    rep = verify(tmp_path)
    assert rep.ok and (rep.shards, rep.blocks, rep.examples) == (3, 8, 100)
    p1 = tmp_path / "train-000001.tar"
    raw = bytearray(p1.read_bytes())
    raw[512:516] = b"XXXX"  # block magic of the first member (its data starts after one 512-byte header)
    p1.write_bytes(bytes(raw))
    p2 = tmp_path / "train-000002.tar"
    p2.write_bytes(p2.read_bytes()[:900])
    rep = verify(tmp_path)
    assert not rep.ok
    text = "\n".join(rep.problems)
    assert "train-000001.tar: sha256 differs" in text and "train-000001.tar member train-000001-000000.pairs" in text
    assert "train-000002.tar: 900 bytes" in text
    assert "train-000000.tar" not in text
    (tmp_path / "train-000000.tar").unlink()
    assert any("train-000000.tar: missing" in p for p in verify(tmp_path).problems)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(ScaletrainError, match="manifest.json not found"):
        verify(tmp_path)
