"""Our shards are valid WebDataset tars: ``webdataset.WebDataset`` iterates them (one sample per block) and
``scaletrain.data.decode_webdataset_sample`` turns each sample into the pairs our own reader yields."""
from __future__ import annotations

import pytest

from scaletrain.data import decode_webdataset_sample
from scaletrain.data.shards import iter_split, load_manifest
from scaletrain.errors import CorruptShardError, ScaletrainError


def _samples(shards, split: str) -> list[dict]:
    import webdataset as wds

    urls = [str(shards / sh.name) for sh in load_manifest(shards).split(split).shards]
    return list(wds.WebDataset(urls, shardshuffle=False))


@pytest.mark.parametrize("split", ["train", "valid"])
def test_webdataset_reads_our_shards_as_our_reader_does(django_shards, split):
    m = load_manifest(django_shards)
    samples = _samples(django_shards, split)
    assert [s["__key__"] for s in samples] == [b.key for sh in m.split(split).shards for b in sh.blocks]
    assert all(s["__url__"].endswith(".tar") for s in samples)
    pairs = [p for s in samples for p in decode_webdataset_sample(s)]
    ours = [(e.src_lang, e.tgt_lang, e.src, e.tgt) for e in iter_split(django_shards, split)]
    assert len(ours) > 100 and pairs == ours
    named = decode_webdataset_sample(samples[-1], m.languages)
    last = decode_webdataset_sample(samples[-1])
    assert named == [(m.languages[a], m.languages[b], s, t) for a, b, s, t in last]
    assert {p[1] for p in named} <= set(m.languages) and len({p[0] for p in named} | {p[1] for p in named}) > 1


def test_a_sample_that_is_not_our_block_is_named(django_shards):
    sample = _samples(django_shards, "valid")[0]
    with pytest.raises(ScaletrainError, match=r"valid-000000\.tar member valid-000000-000000\.pairs: no 'pairs'"):
        decode_webdataset_sample({k: v for k, v in sample.items() if k != "pairs"})
    with pytest.raises(CorruptShardError, match="valid-000000-000000.pairs"):
        decode_webdataset_sample({**sample, "pairs": b"XXXX" + sample["pairs"][4:]})
    with pytest.raises(CorruptShardError, match="out of range"):
        decode_webdataset_sample(sample, ["de"])
