"""Fixed set of batch shapes (data.pad_to_multiple, data.max_rows): lengths padded to multiples, rows capped,
the budget counting the padded lengths; an epoch still reads every example once and resumes exactly."""
from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from scaletrain.config import load_config
from scaletrain.data.batch import Example
from scaletrain.data.shards import Manifest, SplitWriter, prepare_out_dir, write_manifest
from scaletrain.data.stream import ShardStream
from scaletrain.errors import ScaletrainError
from scaletrain.vocab import EOS

LANGS = ["en", "de", "ja", "ru"]
MAX_BYTES, MAX_TOKENS = 160, 4096


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """8000 examples, both sides 0..170 bytes long (uniform: every length occurs, the worst case for shapes)."""
    rng = np.random.default_rng(0)
    exs = [Example(int(rng.integers(0, 3)), 3, b"%d:" % i + b"a" * int(rng.integers(0, 170)),
                   b"b" * int(rng.integers(0, 170))) for i in range(8000)]
    out = prepare_out_dir(tmp_path_factory.mktemp("shapes") / "synth", overwrite=True)
    w = SplitWriter(out, "train", LANGS, shard_size=2000, block_size=256)
    w.add_all(exs)
    write_manifest(out, Manifest(LANGS, {"train": w.close()}))
    return out, exs


def epoch(d, **kw):
    return list(ShardStream(d, max_tokens=MAX_TOKENS, max_bytes=MAX_BYTES, epochs=1, buffer_size=8, **kw))


def shapes(batches):
    return Counter((b.size, b.src.shape[1], b.tgt_in.shape[1]) for b in batches)


def test_padded_lengths_capped_rows_and_the_bound_on_distinct_shapes(shards):
    d, exs = shards
    m, rows = 16, 48
    plain, fixed = epoch(d), epoch(d, pad_to_multiple=m, max_rows=rows)
    n_s, n_t = math.ceil((MAX_BYTES + 2) / m), math.ceil((MAX_BYTES + 1) / m)  # possible padded lengths per side
    seen = shapes(fixed)
    for (B, S, T) in seen:
        assert S % m == 0 and T % m == 0 and S <= n_s * m and T <= n_t * m and 1 <= B <= rows
    assert all(b.padded_tokens <= MAX_TOKENS for b in fixed)  # the budget counts the padded lengths
    st = {(S, T) for _, S, T in seen}
    assert len(st) <= n_s * n_t  # at most 11 x 11 = 121 (source, target) lengths, whatever the data
    # measured on this data: 8-9x fewer (source, target) lengths, 4x fewer shapes than without padding
    plain_st = {(b.src.shape[1], b.tgt_in.shape[1]) for b in plain}
    assert len(plain_st) > 3 * len(st) and len(shapes(plain)) > 2 * len(seen)
    # every example exactly once, with its tokens
    got = Counter(bytes(b.src[i, 1:int((b.src[i] == EOS).nonzero()[0])].add(-4).tolist())
                  for b in fixed for i in range(b.size))
    assert sum(got.values()) == len(exs) and all(v == 1 for v in got.values())


def test_the_row_cap_binds(shards):
    d, _ = shards
    fixed = epoch(d, max_rows=8)
    assert max(b.size for b in fixed) == 8
    assert sum(b.size for b in fixed) == 8000


def test_exact_resume_with_fixed_shapes_and_old_states_still_load(shards):
    d, _ = shards
    kw = dict(max_tokens=MAX_TOKENS, max_bytes=MAX_BYTES, buffer_size=8, epochs=2, pad_to_multiple=8, max_rows=32)
    full = list(ShardStream(d, **kw))
    s = ShardStream(d, **kw)
    head = list(itertools.islice(iter(s), 37))
    r = ShardStream(d, **kw)
    r.load_state_dict(json.loads(json.dumps(s.state_dict())))
    rest = list(r)
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out) for a, b in zip(head + rest, full))
    # the settings are part of the state once set; a stream without them keeps the old state layout
    other = ShardStream(d, **{**kw, "pad_to_multiple": 16})
    with pytest.raises(ScaletrainError, match="pad_to_multiple: saved 8 now 16"):
        other.load_state_dict(s.state_dict())
    plain = ShardStream(d, max_tokens=MAX_TOKENS, max_bytes=MAX_BYTES, buffer_size=8)
    assert "pad_to_multiple" not in plain.state_dict()["config"]


def test_settings_are_checked(shards):
    d, _ = shards
    with pytest.raises(ScaletrainError, match="pad_to_multiple must be >= 1"):
        ShardStream(d, max_tokens=MAX_TOKENS, max_bytes=MAX_BYTES, pad_to_multiple=0)
    # one example at max_bytes, padded: (160 + 2 -> 176) + (160 + 1 -> 176) = 352 > 330
    with pytest.raises(ScaletrainError, match="rounded up to multiples of 16: 352"):
        ShardStream(d, max_tokens=330, max_bytes=MAX_BYTES, pad_to_multiple=16)
    cfg = load_config("small", ["data.pad_to_multiple=8", "data.max_rows=64"])
    assert (cfg.data.pad_to_multiple, cfg.data.max_rows) == (8, 64)
    with pytest.raises(ScaletrainError, match="data.pad_to_multiple"):
        load_config("small", ["data.pad_to_multiple=0"])
    with pytest.raises(ScaletrainError, match="data.max_tokens"):
        load_config("small", ["data.pad_to_multiple=128", "data.max_tokens=330"])
