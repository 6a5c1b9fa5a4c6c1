"""Shards from URLs: a real HTTP server on 127.0.0.1 (Range requests), pipe: commands, the cache, retries."""
from __future__ import annotations

import logging
import shutil
import time

import pytest
import torch

from helpers import cli
from shard_server import ShardServer

from scaletrain.data.inspect_shards import data_stats, verify
from scaletrain.data.shards import load_manifest
from scaletrain.data.sources import FetchOptions, open_source
from scaletrain.data.loader import ShardLoader
from scaletrain.data.stream import ShardStream
from scaletrain.errors import CorruptShardError, ScaletrainError

KW = dict(max_tokens=2048, max_bytes=256, buffer_size=2, epochs=1, seed=5)
FAST = FetchOptions(retries=10, max_seconds=60, timeout=10)


@pytest.fixture
def served(django_shards, tmp_path):
    root = tmp_path / "www" / "shards"
    shutil.copytree(django_shards, root)
    with ShardServer(root.parent) as srv:
        yield srv, root, f"{srv.url}/shards"


def same(a, b) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        for name in ("src", "tgt_in", "tgt_out", "src_lang", "tgt_lang"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def test_url_stream_equals_the_local_stream_on_every_rank(served, django_shards):
    srv, _, url = served
    for rank in range(2):
        local = list(ShardStream(django_shards, "train", rank=rank, world_size=2, **KW))
        same(list(ShardStream(url, "train", rank=rank, world_size=2, fetch=FAST, **KW)), local)
    assert srv.counter["ranges"] > 0  # one range request per block (headers of the other rank's blocks too)
    want = list(ShardStream(django_shards, "train", **KW))
    same(list(ShardLoader(url + "/", "train", fetch=FAST, **KW)), want)
    same(list(ShardLoader(url, "train", fetch=FAST, num_workers=1, **KW)), want)  # a worker process fetches


def test_exact_resume_from_a_url(served, django_shards):
    _, _, url = served
    local = list(ShardStream(django_shards, "train", **KW))
    s = ShardStream(url, "train", fetch=FAST, **KW)
    it = iter(s)
    head = [next(it) for _ in range(5)]
    state = s.state_dict()
    r = ShardStream(url, "train", fetch=FAST, **KW)
    r.load_state_dict(state)
    same(head + list(r), local)


def test_server_restarted_mid_epoch_training_goes_on_with_the_same_batches(served, django_shards, caplog):
    srv, _, url = served
    local = list(ShardStream(django_shards, "train", **KW))
    s = ShardStream(url, "train", fetch=FAST, **KW)
    caplog.set_level(logging.WARNING)
    got = []
    t0 = time.monotonic()
    for i, b in enumerate(s):
        got.append(b)
        if i == 3:  # mid-epoch: later windows still have to be read
            srv.stop()
            timer = srv.restart_after(2.0)
    timer.join()
    assert time.monotonic() - t0 >= 2.0
    same(got, local)
    assert any("retry 1/10" in r.getMessage() and url in r.getMessage() for r in caplog.records)


def test_server_gone_for_good_stops_with_one_line_naming_the_url(served):
    srv, _, url = served
    opts = FetchOptions(retries=2, max_seconds=5, timeout=2)
    s = ShardStream(url, "train", fetch=opts, **KW)
    srv.stop()
    t0 = time.monotonic()
    with pytest.raises(ScaletrainError) as e:
        list(s)
    msg = str(e.value)
    assert time.monotonic() - t0 < 10
    assert "\n" not in msg and msg.startswith(f"{url}/train-0000") and ".tar: unreachable after 3 tries" in msg
    with pytest.raises(ScaletrainError, match=r"manifest.json: unreachable after 3 tries"):
        load_manifest(open_source(url, opts))


def test_missing_url_is_one_line_at_once(served):
    _, _, url = served
    with pytest.raises(ScaletrainError, match=r"/nowhere/manifest.json: HTTP 404"):
        ShardStream(url.replace("/shards", "/nowhere"), "train", fetch=FAST, **KW)


def test_pipe_cat_equals_the_local_stream(django_shards, tmp_path):
    local = list(ShardStream(django_shards, "train", **KW))
    spec = f"pipe:cat {django_shards}/{{name}}"
    same(list(ShardStream(spec, "train", **KW)), local)
    cache = tmp_path / "cache"
    opts = FetchOptions(cache_dir=str(cache), cache_max_gb=150e3 / 2**30)  # room for one shard
    same(list(ShardStream(spec, "train", fetch=opts, **KW)), local)
    assert len(list(cache.glob("*.tar"))) == 1 and not list(cache.glob(".*tmp*"))  # LRU, atomic
    with pytest.raises(ScaletrainError, match=r"needs \{name\}"):
        ShardStream(f"pipe:cat {django_shards}/manifest.json", "train", **KW)


def test_pipe_shard_with_a_wrong_size_is_named(django_shards, tmp_path):
    d = tmp_path / "s"
    shutil.copytree(django_shards, d)
    name = load_manifest(d).split("train").shards[0].name
    (d / name).write_bytes((d / name).read_bytes()[:-1000])
    spec = f"pipe:cat {d}/{{name}}"
    with pytest.raises(CorruptShardError, match=rf"pipe:cat .*{name}: .* bytes, the manifest says"):
        list(ShardStream(spec, "train", **KW))
    # skip: every block of that shard is left out, the shard is fetched once (then remembered as corrupt)
    s = ShardStream(spec, "train", on_corrupt="skip", fetch=FetchOptions(retries=1), **KW)
    calls = []
    run = s.source._run
    s.source._run = lambda n: calls.append(n) or run(n)
    assert len(list(s)) > 0
    shard0 = load_manifest(d).split("train").shards[0]
    assert s.skipped_blocks == shard0.n_blocks and calls.count(name) == 1


def test_http_cache_and_corrupt_block_named_by_url(served, django_shards, tmp_path):
    srv, root, url = served
    local = list(ShardStream(django_shards, "train", **KW))
    opts = FetchOptions(cache_dir=str(tmp_path / "c"), retries=2, max_seconds=10)
    same(list(ShardStream(url, "train", fetch=opts, **KW)), local)
    assert len(list((tmp_path / "c").glob("*.tar"))) == 3
    n = srv.counter["requests"]
    same(list(ShardStream(url, "train", fetch=opts, **KW)), local)
    assert srv.counter["requests"] == n + 1  # only the manifest: shards come from the cache
    # a block changed on the server: its range read fails its CRC-32, named by URL and member
    sh = load_manifest(root).split("train").shards[2]
    b = sh.blocks[0]
    raw = bytearray((root / sh.name).read_bytes())
    raw[b.offset + b.size - 10] ^= 0xFF
    (root / sh.name).write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError) as e:
        list(ShardStream(url, "train", fetch=FAST, **KW))
    assert f"{url}/{sh.name} member {b.key}.pairs: checksum mismatch" in str(e.value)
    s = ShardStream(url, "train", fetch=FAST, on_corrupt="skip", **KW)
    assert len(list(s)) == len(local) and s.skipped_blocks == 1


def test_data_stats_and_verify_take_urls(served, django_shards):
    _, root, url = served
    assert data_stats(url) == data_stats(django_shards)
    p = cli("data", "verify", url)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
    rep = verify(url)
    assert rep.ok and rep.blocks == verify(django_shards).blocks
    pipe = verify(f"pipe:cat {root}/{{name}}")
    assert pipe.ok and pipe.examples == rep.examples
    sh = load_manifest(root).split("valid").shards[0]
    raw = bytearray((root / sh.name).read_bytes())
    raw[sh.blocks[0].offset + 40] ^= 0xFF
    (root / sh.name).write_bytes(bytes(raw))
    bad = verify(url)
    assert not bad.ok and any(p.startswith(f"{url}/{sh.name}: sha256 differs") for p in bad.problems)
