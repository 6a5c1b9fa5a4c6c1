"""The vectorised collate gives exactly the batches of the per-example reference loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.data.batch import Batch, Example, collate, collate_arrays
from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET, PAD


def reference_collate(examples, max_bytes=None, pad_to_multiple=1) -> Batch:
    """The original one-example-at-a-time collate, kept here as the specification."""
    B = len(examples)
    S = max(min(len(e.src), max_bytes or 10**9) + 2 for e in examples)
    T = max(min(len(e.tgt), max_bytes or 10**9) + 1 for e in examples)
    if pad_to_multiple > 1:
        S = -(-S // pad_to_multiple) * pad_to_multiple
        T = -(-T // pad_to_multiple) * pad_to_multiple
    src = np.full((B, S), PAD, dtype=np.int64)
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    ns = nt = 0
    for i, e in enumerate(examples):
        s = np.frombuffer(e.src[:max_bytes] if max_bytes else e.src, dtype=np.uint8)
        t = np.frombuffer(e.tgt[:max_bytes] if max_bytes else e.tgt, dtype=np.uint8)
        src[i, 0] = LANG_OFFSET + e.src_lang
        src[i, 1 : 1 + len(s)] = s.astype(np.int64) + BYTE_OFFSET
        src[i, 1 + len(s)] = EOS
        tgt_in[i, 0] = LANG_OFFSET + e.tgt_lang
        tgt_in[i, 1 : 1 + len(t)] = t.astype(np.int64) + BYTE_OFFSET
        tgt_out[i, : len(t)] = t.astype(np.int64) + BYTE_OFFSET
        tgt_out[i, len(t)] = EOS
        ns += len(s) + 2
        nt += len(t) + 1
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 torch.tensor([e.src_lang for e in examples]), torch.tensor([e.tgt_lang for e in examples]), ns, nt)


def assert_same(a: Batch, b: Batch):
    for name in ("src", "tgt_in", "tgt_out", "src_lang", "tgt_lang"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and torch.equal(x, y), name
    assert (a.n_src_tokens, a.n_tgt_tokens) == (b.n_src_tokens, b.n_tgt_tokens)


examples_st = st.lists(
    st.builds(Example, st.integers(0, 300), st.integers(0, 300), st.binary(max_size=50), st.binary(max_size=50)),
    min_size=1, max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(examples_st, st.sampled_from([None, 1, 3, 17, 64]), st.sampled_from([1, 2, 8]))
def test_collate_identical_to_reference(exs, max_bytes, mult):
    assert_same(collate(exs, max_bytes, mult), reference_collate(exs, max_bytes, mult))


def test_collate_arrays_from_a_shared_buffer_with_gaps():
    # examples taken out of order from one concatenated buffer (as the stream does with a window)
    exs = [Example(1, 0, b"hello", b"hallo!"), Example(0, 2, b"", b"x"), Example(2, 1, b"abc", b"")]
    blob_s = b"##" + b"".join(e.src + b"|" for e in exs)
    blob_t = b"".join(b"~" + e.tgt for e in exs)
    s_start = np.array([2, 8, 9]); t_start = np.array([1, 8, 10])
    order = [2, 0, 1]
    b = collate_arrays(np.array([e.src_lang for e in exs])[order], np.array([e.tgt_lang for e in exs])[order],
                       np.frombuffer(blob_s, np.uint8), s_start[order], np.array([len(e.src) for e in exs])[order],
                       np.frombuffer(blob_t, np.uint8), t_start[order], np.array([len(e.tgt) for e in exs])[order],
                       max_bytes=4)
    assert_same(b, reference_collate([exs[i] for i in order], 4))
    assert b.src[1].tolist() == [LANG_OFFSET + 1, *(c + BYTE_OFFSET for c in b"hell"), EOS]
    assert b.tgt_in[2].tolist() == [LANG_OFFSET + 2, ord("x") + BYTE_OFFSET, PAD, PAD, PAD]


def test_collate_empty_batch_rejected():
    with pytest.raises(ValueError):
        collate([])
