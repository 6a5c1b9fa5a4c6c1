"""Shards checked while streaming: per-block CRC-32, data.on_corrupt=stop|skip, language ids range-checked."""
from __future__ import annotations

import json
import logging
import shutil
import zlib
from collections import Counter

import numpy as np
import pytest

from scaletrain.data.shards import CorruptShardError, load_manifest, read_block, write_manifest
from scaletrain.data.loader import ShardLoader
from scaletrain.data.stream import ShardStream
from scaletrain.vocab import BYTE_OFFSET, LANG_OFFSET

KW = dict(max_tokens=2048, max_bytes=256, buffer_size=4, epochs=1, seed=3)


@pytest.fixture
def shards(django_shards, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(django_shards, out)
    return out


def victim(shard_dir, shard=0, block=1):
    m = load_manifest(shard_dir)
    sh = m.split("train").shards[shard]
    return sh, sh.blocks[block]


def flip_text(shard_dir, shard=0, block=1, n=64):
    """Flip ``n`` bytes of a block's text (its last bytes: the header and arrays stay intact)."""
    sh, b = victim(shard_dir, shard, block)
    path = shard_dir / sh.name
    raw = bytearray(path.read_bytes())
    for i in range(b.offset + b.size - n, b.offset + b.size):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    return sh, b


def examples(batches):
    """(source bytes, target bytes) of every row (padding, tags and EOS removed)."""
    text = lambda ids: bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < LANG_OFFSET)  # noqa: E731
    return [(text(bt.src[r].tolist()), text(bt.tgt_out[r].tolist())) for bt in batches for r in range(bt.size)]


def test_manifest_records_block_checksums(shards):
    m = load_manifest(shards)
    assert m.block_checksums
    sh, b = victim(shards)
    raw = (shards / sh.name).read_bytes()
    assert b.crc32 == zlib.crc32(raw[b.offset:b.offset + b.size])


def test_flipped_text_stops_with_one_line_naming_shard_and_member(shards):
    sh, b = flip_text(shards)
    with pytest.raises(CorruptShardError) as e:
        list(ShardStream(shards, "train", **KW))
    msg = str(e.value)
    assert "\n" not in msg and sh.name in msg and f"member {b.key}.pairs" in msg and "checksum mismatch" in msg
    assert "data.on_corrupt=skip" in msg


def test_skip_counts_the_block_and_keeps_equal_batch_counts(shards, django_shards):
    sh, b = victim(shards)
    mb = KW["max_bytes"]  # collate truncates longer sides
    bad = [(ex.src[:mb], ex.tgt[:mb]) for ex in read_block(shards, sh, b).examples()]
    flip_text(shards)
    counts = []
    for rank in range(2):
        clean = list(ShardStream(django_shards, "train", rank=rank, world_size=2, **KW))
        s = ShardStream(shards, "train", rank=rank, world_size=2, on_corrupt="skip", **KW)
        got = list(s)
        assert len(got) == len(clean)  # the plan is unchanged: every rank yields as many batches as before
        counts.append(s.skipped_blocks)
        rows = examples(got)
        assert len(rows) <= sum(bt.size for bt in clean)
        assert s.state_dict()["skipped_blocks"] == s.skipped_blocks
    assert sorted(counts) == [0, 1]  # only the rank that owns the block reads (and skips) it
    # the bad block's examples never reach a batch: decode every row of the one-rank stream
    s = ShardStream(shards, "train", on_corrupt="skip", **KW)
    rows = Counter(examples(list(s)))
    assert s.skipped_blocks == 1
    clean = Counter(examples(ShardStream(django_shards, "train", **KW)))
    assert clean - rows == Counter(bad) and not rows - clean


def test_skip_count_in_the_loader_state(shards):
    flip_text(shards)
    ld = ShardLoader(shards, "train", on_corrupt="skip", **KW)
    n = sum(1 for _ in ld)
    assert n > 0 and ld.skipped_blocks == 1


def plant_language(shard_dir, lang: int, fix_crc: bool):
    """Set the first example's source language id of block 1 of shard 0; optionally update the manifest's
    CRC so only the language check can catch it (a writer bug, or a manifest without block checksums)."""
    sh, b = victim(shard_dir)
    path = shard_dir / sh.name
    raw = bytearray(path.read_bytes())
    flags = int(np.frombuffer(bytes(raw[b.offset + 6:b.offset + 8]), "<u2")[0])
    assert flags & 1  # u8 language ids
    raw[b.offset + 12] = lang
    path.write_bytes(bytes(raw))
    if fix_crc:
        m = load_manifest(shard_dir)
        t = m.split("train").shards[0].blocks
        t.crc32[1] = zlib.crc32(bytes(raw[b.offset:b.offset + b.size]))
        write_manifest(shard_dir, m)
    return sh, b


def test_out_of_range_language_id_names_shard_and_member(shards):
    sh, b = plant_language(shards, 200, fix_crc=True)
    with pytest.raises(CorruptShardError) as e:
        list(ShardStream(shards, "train", **KW))
    msg = str(e.value)
    assert "\n" not in msg and sh.name in msg and b.key in msg and "language id 200 out of range" in msg
    # with skip, the block is dropped alike on every rank (its header is what the plan reads)
    s = ShardStream(shards, "train", on_corrupt="skip", **KW)
    assert len(list(s)) > 0


def test_manifest_without_block_checksums_loads_and_says_so(shards, caplog):
    d = json.loads((shards / "manifest.json").read_text())
    d["format_version"] = 2
    for sp in d["splits"].values():
        for sh in sp["shards"]:
            del sh["blocks"]["crc32"]
    (shards / "manifest.json").write_text(json.dumps(d))
    assert not load_manifest(shards).block_checksums
    with caplog.at_level(logging.WARNING):
        assert len(list(ShardStream(shards, "train", **KW))) > 0
    assert sum("no per-block checksums" in r.getMessage() for r in caplog.records) == 1


def test_bad_on_corrupt_value(shards):
    from scaletrain.errors import ScaletrainError

    with pytest.raises(ScaletrainError, match="on_corrupt must be stop or skip"):
        ShardStream(shards, "train", on_corrupt="ignore", **KW)


def test_skip_count_survives_a_resume_inside_the_bad_window(shards):
    flip_text(shards)
    s = ShardStream(shards, "train", on_corrupt="skip", **KW)
    it = iter(s)
    states = []
    for _ in it:
        states.append(s.state_dict())
        if s.skipped_blocks:
            break
    state = states[-1]
    assert state["batch"] > 0 and state["skipped_total"] == 1  # still inside the window holding the bad block
    r = ShardStream(shards, "train", on_corrupt="skip", **KW)
    r.load_state_dict(state)
    assert sum(1 for _ in r) > 0 and r.skipped_blocks == 1  # the window is planned again, not counted twice


def test_skip_count_from_a_worker_process(shards):
    flip_text(shards)
    ld = ShardLoader(shards, "train", on_corrupt="skip", num_workers=1, **KW)
    assert sum(1 for _ in ld) > 0 and ld.skipped_blocks == 1


def test_config_keys_validated():
    from scaletrain.config import load_config
    from scaletrain.errors import ScaletrainError

    cfg = load_config("small", ["data.on_corrupt=skip", "data.cache_dir=/tmp/x", "data.fetch_retries=0"])
    assert cfg.data.on_corrupt == "skip"
    for bad, key in (("data.on_corrupt=ignore", "data.on_corrupt"), ("data.fetch_retries=-1", "data.fetch_retries"),
                     ("data.fetch_timeout=0", "data.fetch_timeout"), ("data.cache_max_gb=-2", "data.cache_max_gb"),
                     ("data.fetch_max_seconds=0", "data.fetch_max_seconds")):
        with pytest.raises(ScaletrainError, match=f"config key '{key}'"):
            load_config("small", [bad])
