"""The loop's read-ahead (``scaletrain/train/prefetch.py``): the next step's batches are read and their copy
started at ``fetch()`` (after the current step was launched) and waited for at ``take()``; a checkpoint stores
the position before the first batches no update has used. Here with the CPU copy and a recording twin of the
CUDA one (same protocol: start the copy, wait at take)."""
from __future__ import annotations

import torch

from scaletrain.data.batch import Batch
from scaletrain.train.prefetch import HostCopy, Prefetcher, _map_tensors


class Stream:
    """Batches 0, 1, 2, ... with their index as the state."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        while True:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, st):
        self.pos = st["pos"]


class Recorder:
    def __init__(self):
        self.log = []

    def start(self, host):
        self.log.append(("start", list(host)))
        return [("dev", b) for b in host]

    def ready(self, micro):
        self.log.append(("ready", list(micro)))
        return micro


def test_one_step_ahead_with_the_stream_position_before_each_step():
    s, rec = Stream(), Recorder()
    p = Prefetcher(s, iter(s), 2, torch.device("cpu"), copy=rec)
    assert p.resume_position() == {"pos": 0}
    p.fetch()
    p.fetch()  # already fetched: nothing more is read
    assert rec.log == [("start", [0, 1])] and s.pos == 2 and p.resume_position() == {"pos": 0}
    got = p.take()
    assert got.micro == [("dev", 0), ("dev", 1)] and got.host == [0, 1] and got.position == {"pos": 0}
    assert rec.log[-1] == ("ready", got.micro) and got.wait >= 0
    assert p.resume_position() == {"pos": 2}  # nothing read ahead: the stream's own position
    p.fetch()  # while step 1 computes
    assert s.pos == 4 and p.resume_position() == {"pos": 2}  # batches 2, 3 are read but not trained on
    assert p.take().position == {"pos": 2}
    got = p.take()  # without fetch(): read now
    assert got.host == [4, 5] and got.position == {"pos": 4}


def test_host_copy_and_tensor_mapping_cover_every_batch_tensor():
    lang = torch.tensor([1, 2])
    b = Batch(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
              lang, lang + 1, 6, 8)
    seen = []
    mapped = _map_tensors(b, lambda t: (seen.append(t.shape), t + 0)[1])
    assert len(seen) == 5 and mapped.n_tgt_tokens == 8 and torch.equal(mapped.tgt_lang, lang + 1)  # the languages too
    (moved,) = HostCopy(torch.device("cpu")).start([b])
    assert torch.equal(moved.src, b.src) and moved.n_src_tokens == 6


def test_close_stops_the_data_loader_workers_at_once(django_shards):
    """A job that ends (or fails mid-fit) closes the stream's iterator: the DataLoader workers exit at
    ``close()``, not when the iterator is garbage-collected (which took 10 s per test module at teardown)."""
    import multiprocessing

    from scaletrain.data.loader import ShardLoader
    from scaletrain.data.shards import load_manifest
    from scaletrain.data.spm_models import load_shard_vocab

    vocab = load_shard_vocab(load_manifest(django_shards).languages, "byte", django_shards)
    stream = ShardLoader(django_shards, "train", num_workers=1, vocab=vocab, max_tokens=600, max_bytes=40)
    pf = Prefetcher(stream, iter(stream), 2, torch.device("cpu"))
    pf.fetch()
    pf.take()
    pf.fetch()
    assert multiprocessing.active_children()  # the worker is running
    pf.close()
    assert multiprocessing.active_children() == []
    assert pf.resume_position() == stream.state_dict()  # nothing read ahead is kept
